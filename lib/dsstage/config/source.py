"""A dataset's source as the configuration writes it: a local path, ``host:/path`` over SSH, or
``rsync://host/module/path``.
"""

from __future__ import annotations

import os
import re

from dsstage.config.model import (
    Source,
)
from dsstage.config.names import control_char


def parse_source(raw: str) -> Source:
    """Classify a source string; raises ValueError with the fix for a bad one."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("give a source: /mounted/path, host:/path or rsync://host/module/path")
    problem = control_char(raw)
    if problem:
        raise ValueError(problem)
    if raw.startswith("rsync://"):
        rest = raw[len("rsync://"):]
        host, _, path = rest.partition("/")
        if not host or not path.strip("/"):
            raise ValueError(f"{raw!r} lacks a module: write rsync://host/module/path")
        if any(part in (".", "..") for part in path.split("/")):
            # files are asked for as <path>/./<file> (dsstage.transfer.rsync.files_from): a "."
            # of its own would move where the names rsync recreates begin
            raise ValueError(f"{raw!r} contains '.' or '..': give the module's real path")
        return Source(raw=raw, kind="daemon", path="/" + path)
    if raw.startswith("/"):
        if "/../" in raw + "/":
            raise ValueError(f"{raw!r} contains '..': give the real path")
        return Source(raw=os.path.normpath(raw), kind="local", path=os.path.normpath(raw))
    m = re.match(r"^([^/:\s]+):(.*)$", raw)
    if m:
        if not m.group(2).startswith("/"):
            raise ValueError(f"{raw!r} is relative to a home directory: write host:/absolute/path")
        return Source(raw=raw, kind="ssh", path=m.group(2))
    raise ValueError(f"{raw!r} is a relative path: give an absolute path, host:/path or rsync://host/module/path")
