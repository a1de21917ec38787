"""Small file helpers shared by the store, leases and locks."""

from __future__ import annotations

import json
import os


def read_json(path: str) -> dict[str, object]:
    """A JSON object from ``path``, or {} if it is missing, unreadable or not an object."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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


def write_json(path: str, data: dict[str, object], *, fsync: bool = True) -> None:
    write_atomic(path, json.dumps(data, sort_keys=True), fsync=fsync)
