"""Who may read a dataset's copies on a node: its top directory's owner, mode and ACL.

``datasets/<name>`` is 0755 for a dataset everyone may use, and 0750 with the dataset's
group as owner for a restricted one; with several groups a POSIX ACL grants each. Every
change is made on a descriptor of the directory itself (fchown, fchmod, fsetxattr), so a
planted link is never followed.
"""

from __future__ import annotations

import errno
import os
import stat
import struct

from dsstage.config.model import Dataset
from dsstage.errors import ConfigError, StoreError
from dsstage.fs.safe import O_DIR, RootDir

# POSIX ACL in the xattr format of linux/posix_acl_xattr.h: version 2, then
# (tag u16, perm u16, id u32) entries sorted by tag and id.
_ACL_VERSION = 2
_USER_OBJ, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
_ACL = "system.posix_acl_access"


def group_id(name: str) -> int:
    import grp
    return grp.getgrnam(name).gr_gid


def apply(tier: RootDir, ds: Dataset, *, origin: str, node: str, top: str = "datasets") -> None:
    """Make the dataset's top directory (in ``top``: its copies', or its views') reachable only
    by its groups (if restricted)."""
    fd = tier.dir(top, ds.name)
    st = os.fstat(fd)
    if ds.groups is None:
        _set(fd, st, 0, 0o755)
        remove_acl(fd)
        return
    gids = []
    for g in ds.groups:
        try:
            gids.append(group_id(g))
        except KeyError:
            raise ConfigError(f"{origin}: datasets.{ds.name}.groups: group {g!r} does not exist "
                              f"on node {node}; fix the name or add the group") from None
    _set(fd, st, gids[0], 0o750)
    if len(gids) > 1:
        set_group_acl(fd, gids, tier.path(top, ds.name))
    else:
        remove_acl(fd)


def _set(fd: int, st: os.stat_result, gid: int, mode: int) -> None:
    if st.st_uid != 0 or st.st_gid != gid:
        os.fchown(fd, 0, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)


def acl_blob(gids: list[int]) -> bytes:
    entries = [(_USER_OBJ, 7, _NO_ID), (_GROUP_OBJ, 0, _NO_ID)]
    entries += [(_GROUP, 5, gid) for gid in sorted(set(gids))]
    entries += [(_MASK, 5, _NO_ID), (_OTHER, 0, _NO_ID)]
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", t, p, i) for t, p, i in entries)


#: a filesystem without POSIX ACLs says so with these: a configuration problem, not a broken disk
_NO_ACL = (errno.EOPNOTSUPP, errno.ENOTSUP)


def set_group_acl(fd: int, gids: list[int], shown: str) -> None:
    """Give each of ``gids`` read and search access to the directory ``fd``, and nobody else.

    A filesystem that has no POSIX ACLs is a configuration problem (ConfigError: the job is
    held with the reason, the node stays up); any other failure is the node's (StoreError)."""
    try:
        os.setxattr(fd, _ACL, acl_blob(gids))
    except OSError as exc:
        if exc.errno in _NO_ACL:
            raise ConfigError(f"cannot restrict {shown} to several groups: its filesystem has no POSIX ACLs "
                              f"({exc.strerror}); mount it with ACL support (mount -o acl) or give the dataset "
                              "a single group") from None
        raise StoreError(f"cannot restrict {shown} to several groups: setting its POSIX ACL failed "
                         f"({exc.strerror}); check the local disk of this node") from None


def acl_problem(root: str) -> str | None:
    """Why the tier at ``root`` cannot hold a dataset restricted to several groups (its
    filesystem refuses POSIX ACLs), or None if it can; tried on a fresh directory of root's that
    is removed again. Raises FileNotFoundError where the tier does not exist on this host."""
    name = f".dsstage-acl-{os.getpid()}"
    with RootDir(root, create=False) as tier:
        os.mkdir(name, 0o700, dir_fd=tier.fd)
        try:
            fd = os.open(name, O_DIR, dir_fd=tier.fd)
            try:
                os.setxattr(fd, _ACL, acl_blob([0]))
            except OSError as exc:
                if exc.errno in _NO_ACL:
                    return (f"{root} is on a filesystem without POSIX ACLs ({exc.strerror}): mount it with ACL "
                            "support (mount -o acl) or give each dataset on this tier a single group")
                raise
            finally:
                os.close(fd)
        finally:
            os.rmdir(name, dir_fd=tier.fd)
    return None


def remove_acl(fd: int) -> None:
    try:
        os.removexattr(fd, _ACL)
    except OSError:
        pass
