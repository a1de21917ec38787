"""Who may read a dataset's copies on a node: its top directory's owner, mode and ACL.

``datasets/<name>`` is 0755 for a dataset everyone may use, and 0750 with the dataset's
group as owner for a restricted one; with several groups a POSIX ACL grants each. Every
change is made on a descriptor of the directory itself (fchown, fchmod, fsetxattr), so a
planted link is never followed.
"""

from __future__ import annotations

import os
import stat
import struct

from dsstage.config.model import Dataset
from dsstage.errors import ConfigError, StoreError
from dsstage.fs.safe import RootDir

# POSIX ACL in the xattr format of linux/posix_acl_xattr.h: version 2, then
# (tag u16, perm u16, id u32) entries sorted by tag and id.
_ACL_VERSION = 2
_USER_OBJ, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
_ACL = "system.posix_acl_access"


def group_id(name: str) -> int:
    import grp
    return grp.getgrnam(name).gr_gid


def apply(tier: RootDir, ds: Dataset, *, origin: str, node: str) -> None:
    """Make the dataset's top directory reachable only by its groups (if restricted)."""
    fd = tier.dir("datasets", ds.name)
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
        set_group_acl(fd, gids, tier.path("datasets", ds.name))
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


def set_group_acl(fd: int, gids: list[int], shown: str) -> None:
    """Give each of ``gids`` read and search access to the directory ``fd``, and nobody else."""
    try:
        os.setxattr(fd, _ACL, acl_blob(gids))
    except OSError as exc:
        raise StoreError(f"cannot restrict {shown} to several groups: the filesystem refused a POSIX ACL "
                         f"({exc.strerror}); mount it with ACL support or give the dataset a single group") from None


def remove_acl(fd: int) -> None:
    try:
        os.removexattr(fd, _ACL)
    except OSError:
        pass
