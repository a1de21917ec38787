"""POSIX access ACLs in the kernel's extended-attribute format (linux/posix_acl_xattr.h):
version 2, then entries (tag u16, permissions u16, id u32), sorted by tag and id. Set on a
descriptor of the object itself (``fsetxattr``), so that no planted link is ever followed.

Used for a restricted dataset's copies and views (several groups: dsstage.node.access) and for
the files the Prolog leaves for one job (readable by the job's user only: dsstage.fs.runfiles).

Imports only the standard library: the warm Prolog writes the job's files.
"""

from __future__ import annotations

import errno
import os

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Iterable

ACCESS = "system.posix_acl_access"
_VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
#: a filesystem without POSIX ACLs says so with these
UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTSUP)


def blob(owner: int, *, users: Iterable[int] = (), groups: Iterable[int] = (), grant: int = 5) -> bytes:
    """An ACL that gives the owner ``owner`` (rwx bits), each of ``users`` and ``groups``
    ``grant``, and the owning group and everyone else nothing."""
    entries = [(USER_OBJ, owner, _NO_ID)]
    entries += [(USER, grant, uid) for uid in sorted(set(users))]
    entries += [(GROUP_OBJ, 0, _NO_ID)]
    entries += [(GROUP, grant, gid) for gid in sorted(set(groups))]
    entries += [(MASK, grant, _NO_ID), (OTHER, 0, _NO_ID)]
    # (int.to_bytes, not struct: the warm Prolog writes the job's files and does not import it)
    return _VERSION.to_bytes(4, "little") + b"".join(
        t.to_bytes(2, "little") + p.to_bytes(2, "little") + i.to_bytes(4, "little") for t, p, i in entries)


def set_on(fd: int, acl: bytes) -> None:
    """Set ``acl`` as the access ACL of the object open at ``fd``; OSError as fsetxattr raises it
    (``errno in UNSUPPORTED``: the filesystem has no POSIX ACLs)."""
    os.setxattr(fd, ACCESS, acl)


def remove(fd: int) -> None:
    try:
        os.removexattr(fd, ACCESS)
    except OSError:
        pass
