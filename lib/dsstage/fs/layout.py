"""The store's layout on a tier: names a dataset, version or job may have, the directories of a
tier, ready marks and what makes a copy ready, a dataset's current version in the state directory
(a lease's record is dsstage.ready.lease's).

Imports only the standard library and dsstage.fs.safe: the warm Prolog uses it.
"""

from __future__ import annotations

import os

from dsstage.fs import safe, untrusted
from dsstage.fs.safe import RootDir, read_json_at

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from typing import Any

VERSION_LEN = 16
NAME_MAX = 64
_FIRST = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_NAME = _FIRST | frozenset("._-")
_JOB = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-")


#: a ``--dataset`` value: at most this long, names separated by commas, these blanks around a
#: name ignored (C's isspace in the C locale, Lua's %s): dsstage.ready.request and the full
#: Prolog's dsstage.config.catalog.parse_request, the SPANK plugin and dsstage_submit.lua alike
REQUEST_MAX = 1024
BLANKS = " \t\n\r\v\f"


def name_ok(name: str) -> bool:
    """A dataset or tier name: ``[a-z0-9][a-z0-9._-]*``, at most 64 characters."""
    return 0 < len(name) <= NAME_MAX and name[0] in _FIRST and all(c in _NAME for c in name)


def job_id_ok(job_id: str) -> bool:
    return 0 < len(job_id) <= 64 and all(c in _JOB for c in job_id) and job_id not in (".", "..")


def env_var(name: str) -> str:
    """``DSSTAGE_PATH_<NAME>``: upper case, every other character as ``_``."""
    return "DSSTAGE_PATH_" + "".join(c if c.isalnum() and c.isascii() else "_" for c in name.upper())


def version_id(digest: str) -> str:
    return digest[:VERSION_LEN]


def digest_ok(digest: object) -> bool:
    """Whether ``digest`` is a version digest (64 lowercase hex digits): safe in a path."""
    return isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


#: ``CURRENT`` holds a digest and a newline; anything longer is not one
CURRENT_MAX = 200


def read_current(state_dir: str, name: str) -> str | None:
    """The digest in ``<state_dir>/manifests/<name>/CURRENT``; None if there is none.
    Raises ValueError if the file is damaged or not a regular file of at most a few bytes
    (its data owner writes it: dsstage.fs.untrusted), OSError if the state directory fails."""
    path = os.path.join(state_dir, "manifests", name, "CURRENT")
    data = untrusted.read_bytes(path, CURRENT_MAX)
    if data is None:
        return None
    digest = data.decode("ascii", "replace").strip()
    if not digest_ok(digest):
        raise ValueError(f"{path} does not hold a digest")
    return digest


def boot_id() -> str:
    """This boot of the node (changes at every restart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


class Layout:
    """Paths of one tier on one node, as shown to people and jobs, and the lock files
    (the store reaches everything else through a RootDir)."""

    __slots__ = ("root", "tier", "root_filesystem")

    def __init__(self, root: str, tier: str = "", root_filesystem: bool = True) -> None:
        self.root = root
        #: the tier's name, and whether it may be on the root filesystem (Tier.root_filesystem);
        #: a Layout made from a root alone opens what exists, and is not asked to create it
        self.tier = tier
        self.root_filesystem = root_filesystem

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def __repr__(self) -> str:
        return f"Layout({self.root!r})"

    def version_dir(self, name: str, digest: str) -> str:
        return os.path.join(self.root, "datasets", name, version_id(digest))

    def lock(self, name: str) -> str:
        return os.path.join(self.root, "locks", name + ".lock")


def staging_name(name: str, digest: str) -> str:
    return f"{name}.{version_id(digest)}"


#: the suffix of the directory beside a staging area where rsync keeps interrupted files
PARTIAL = ".partial"


def partial_dir(staging_path: str) -> str:
    """Where rsync keeps a file cut short while filling ``staging_path``: beside it, never
    inside it, so that no name in a dataset can collide with it."""
    return staging_path.rstrip("/") + PARTIAL


def staging_of(entry: str) -> str:
    """The staging area an entry of the staging directory belongs to (itself, or the one
    whose partial directory it is)."""
    return entry[:-len(PARTIAL)] if entry.endswith(PARTIAL) else entry


def mark_name(digest: str) -> str:
    return version_id(digest) + ".json"


def read_mark(tier: RootDir, name: str, digest: str) -> dict[str, Any]:
    return read_json_at(tier.has_dir("ready", name), mark_name(digest))


#: what a quick verification says of a ready copy
READY = "ready mark matches the current manifest"


def not_ready(tier: RootDir, name: str, digest: str) -> str | None:
    """None if the copy of ``digest`` is ready, else why not. Its cost does not depend on the
    dataset's size: the mark names this digest and the inode of the copy, the copy is
    root-owned and read-only, and it is on disk (flushed, or written since the last boot)."""
    mark = read_mark(tier, name, digest)
    if not mark:
        return "no ready copy on this node"
    if mark.get("digest") != digest:
        return "the ready mark names another version"
    if mark.get("bad"):
        return f"the copy is known to be damaged ({mark.get('bad')})"
    if not mark.get("durable") and mark.get("boot") != boot_id():
        return "the copy was still being written to disk when this node restarted"
    parent = tier.has_dir("datasets", name)
    try:
        if parent is None:
            raise FileNotFoundError
        st = os.stat(version_id(digest), dir_fd=parent, follow_symlinks=False)
    except OSError:
        return "the ready mark exists but the copy is gone"
    if [st.st_ino, st.st_dev] != [mark.get("ino"), mark.get("dev")]:
        return "the copy was replaced after it was marked ready"
    if (st.st_mode & 0o170000) != 0o040000 or not safe.sealed(st):
        return "the copy is no longer root-owned and read-only"
    return None
