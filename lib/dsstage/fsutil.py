"""Small file helpers shared by the store, leases and locks."""

from __future__ import annotations

import os

from .warm import read_json, write_json  # noqa: F401 - one implementation, shared


def write_atomic(path: str, text: str, *, fsync: bool = True) -> None:
    """Write ``text`` so that readers see the old file or the new one, never a part."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
