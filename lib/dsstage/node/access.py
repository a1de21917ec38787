"""Who may read a dataset's copies on a node: its top directory's owner, mode and ACL.

``datasets/<name>`` is 0755 for a dataset everyone may use, and 0750 with the dataset's
group as owner for a restricted one; with several groups a POSIX ACL grants each. Every
change is made on a descriptor of the directory itself (fchown, fchmod, fsetxattr), so a
planted link is never followed.
"""

from __future__ import annotations

import os
import stat

from dsstage.config.model import Dataset
from dsstage.errors import ConfigError, StoreError
from dsstage.fs import acl, safe
from dsstage.fs.safe import O_DIR, RootDir


def group_id(name: str) -> int:
    import grp
    return grp.getgrnam(name).gr_gid


def apply(tier: RootDir, ds: Dataset, *, origin: str, node: str, top: str = "datasets") -> None:
    """Make the dataset's top directory (in ``top``: its copies', or its views') reachable only
    by its groups (if restricted). A directory made here is made 0700 and opened up only by
    this call: nobody can enter it, nor keep a descriptor of it, before its access is right."""
    fd = tier.dir(top, ds.name, mode=0o700)
    st = os.fstat(fd)
    if ds.groups is None:
        _set(fd, st, 0, 0o755)
        acl.remove(fd)
        return
    gids = []
    for g in ds.groups:
        try:
            gids.append(group_id(g))
        except KeyError:
            raise ConfigError(f"{origin}: datasets.{ds.name}.groups: group {g!r} does not exist "
                              f"on node {node}; fix the name or add the group") from None
    # the ACL first: a group taken out of it loses access before the owner and mode change
    if len(gids) > 1:
        set_group_acl(fd, gids, tier.path(top, ds.name))
    else:
        acl.remove(fd)
    _set(fd, os.fstat(fd), gids[0], 0o750)


def reapply(tier: RootDir, ds: Dataset, *, origin: str, node: str) -> None:
    """``apply`` to the dataset's copies and views that exist on this tier, creating nothing:
    a change of ``groups:`` reaches what nodes cached before it (the report refresh calls it)."""
    for top in ("datasets", "views", "live"):
        if tier.has_dir(top, ds.name) is not None:
            apply(tier, ds, origin=origin, node=node, top=top)


def _set(fd: int, st: os.stat_result, gid: int, mode: int) -> None:
    uid, gid = safe.owner(gid)
    if st.st_uid != uid or st.st_gid != gid:
        os.fchown(fd, uid, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)


def acl_blob(gids: list[int]) -> bytes:
    """A restricted copy's directory: root's, and read and search for each group."""
    return acl.blob(7, groups=gids, grant=5)


def set_group_acl(fd: int, gids: list[int], shown: str) -> None:
    """Give each of ``gids`` read and search access to the directory ``fd``, and nobody else.

    A filesystem that has no POSIX ACLs is a configuration problem (ConfigError: the job is
    held with the reason, the node stays up); any other failure is the node's (StoreError)."""
    try:
        acl.set_on(fd, acl_blob(gids))
    except OSError as exc:
        if exc.errno in acl.UNSUPPORTED:
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
                acl.set_on(fd, acl_blob([0]))
            except OSError as exc:
                if exc.errno in acl.UNSUPPORTED:
                    return (f"{root} is on a filesystem without POSIX ACLs ({exc.strerror}): mount it with ACL "
                            "support (mount -o acl) or give each dataset on this tier a single group")
                raise
            finally:
                os.close(fd)
        finally:
            os.rmdir(name, dir_fd=tier.fd)
    return None
