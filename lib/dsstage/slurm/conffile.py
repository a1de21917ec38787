"""Reading slurm.conf as slurmd does: the file, its ``Include`` files (globs, relative to
slurm.conf's directory, nested), and on a configless node the copy slurmd keeps.

A site's slurm.conf is seldom one file: configuration management splits it into
``Include``\\ d parts, and configless nodes (``SlurmctldParameters=enable_configless``) have no
``/etc/slurm/slurm.conf`` at all, only the copy slurmd fetched into ``/run/slurm/conf``.
``dsstage check-config`` must read what Slurm reads, or it checks a file that says nothing.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

#: where slurmd keeps a configless node's copy of slurm.conf (Slurm 22.05 and later)
CONFIGLESS_DIRS = ("/run/slurm/conf",)
#: Include files nested deeper than this are not read (a loop)
MAX_DEPTH = 8
_INCLUDE = re.compile(r"^\s*include\s+(.+?)\s*$", re.I)
#: a Key=Value pair of slurm.conf (a value in double quotes may hold spaces)
_PAIR = re.compile(r'([A-Za-z0-9_.]+)\s*=\s*(?:"([^"]*)"|(\S+))')


@dataclass
class SlurmConf:
    """slurm.conf as read: ``path`` (the main file), ``text`` (it with every Include file's text
    in its place), the files read, and what could not be read."""

    path: str
    text: str
    files: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)  # "path: why"
    configless: bool = False


def locate(path: str, configless_dirs: tuple[str, ...] = CONFIGLESS_DIRS) -> tuple[str, bool]:
    """The slurm.conf to read: ``path`` if it exists, else a configless node's copy (and True)."""
    if os.path.exists(path):
        return path, False
    for d in configless_dirs:
        copy = os.path.join(d, "slurm.conf")
        if os.path.exists(copy):
            return copy, True
    return path, False


def read(path: str, configless_dirs: tuple[str, ...] = CONFIGLESS_DIRS) -> SlurmConf:
    """slurm.conf at ``path`` (or the configless copy) with its Include files in place.
    OSError if the main file cannot be read; an Include that cannot is listed in ``unread``."""
    path, configless = locate(path, configless_dirs)
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    conf = SlurmConf(path=path, text="", files=[path], configless=configless)
    conf.text = _expand(text, os.path.dirname(path), conf, 0)
    return conf


def _expand(text: str, base: str, conf: SlurmConf, depth: int) -> str:
    out = []
    for line in text.replace("\\\n", "").splitlines():
        m = _INCLUDE.match(re.sub(r"(?<!\\)#.*", "", line))
        if not m:
            out.append(line)
            continue
        pattern = m.group(1).strip('"')
        pattern = pattern if os.path.isabs(pattern) else os.path.join(base, pattern)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            conf.unread.append(f"{pattern}: no file matches")
        for inc in matches:
            if depth >= MAX_DEPTH:
                conf.unread.append(f"{inc}: Include nested more than {MAX_DEPTH} deep")
                continue
            try:
                with open(inc, encoding="utf-8", errors="replace") as fh:
                    inner = fh.read()
            except OSError as exc:
                conf.unread.append(f"{inc}: {exc.strerror or exc}")
                continue
            conf.files.append(inc)
            out.append(_expand(inner, base, conf, depth + 1))
    return "\n".join(out)


def values(text: str, key: str) -> list[str]:
    """Every value of ``key`` in slurm.conf ``text``, in order (keys case-insensitive): for
    keys Slurm takes more than once (Prolog, Epilog), where ``setting`` gives the last."""
    out = []
    for line in text.replace("\\\n", "").splitlines():
        line = re.sub(r"(?<!\\)#.*", "", line)
        for m in _PAIR.finditer(line):
            if m.group(1).lower() == key.lower():
                out.append(m.group(2) if m.group(2) is not None else m.group(3))
    return out


def programs(text: str, key: str, base: str) -> tuple[list[str], list[str]]:
    """The programs slurm.conf's ``key`` (Prolog, Epilog, TaskProlog) names: every line, each
    a comma-separated list of paths or globs (relative ones from slurm.conf's directory,
    ``base``); (the files, the patterns that match none)."""
    files, empty = [], []
    for value in values(text, key):
        for item in (v.strip() for v in value.split(",")):
            if not item:
                continue
            pattern = item if os.path.isabs(item) else os.path.join(base, item)
            found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else (
                [pattern] if os.path.exists(pattern) else [])
            files += found
            if not found:
                empty.append(pattern)
    return files, empty
