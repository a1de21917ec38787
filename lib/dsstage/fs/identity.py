"""Whose identity reads a mounted source.

Root reads everything, so a source read as root could publish what its owner could not
read (another user's 0600 file in a shared project directory); and on NFS with
``root_squash`` root reads as nobody anyway. With ``source_user`` set, dsstage opens source
files and lists source directories with that user's file-system identity (fsuid, fsgid
and supplementary groups), so the source's own permissions are the boundary. The switch
is per thread (setfsuid/setfsgid and a raw setgroups system call, which glibc would
otherwise apply to every thread): the copier's threads open a source file as the source
user and create the staged file as root.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dsstage.errors import ConfigError

TYPE_CHECKING = False  # not typing's: importing typing costs what this module saves on ctypes
if TYPE_CHECKING:
    from typing import Any

#: setgroups(2) numbers, for the per-thread call (glibc's wrapper changes every thread)
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159, "ppc64le": 81, "s390x": 206}
_LIBC: list[Any] = []  # ctypes' handle on the C library, made when an identity is first taken
_ROOT_GROUPS = os.getgroups() if os.geteuid() == 0 else []
_local = threading.local()


@dataclass(frozen=True)
class Identity:
    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def lookup(user: str, key: str = "source_user") -> Identity:
    """The identity of ``user`` (configured as ``key``) on this node; ConfigError if it does
    not exist here."""
    import pwd
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(f"{key} {user!r} does not exist on this node: create it, or remove "
                          f"{key} from the configuration") from None
    if pw.pw_uid == 0:
        raise ConfigError(f"{key} must not be root: it is there to act with less than root's rights")
    if os.uname().machine not in _SYS_SETGROUPS:
        raise ConfigError(f"{key} is not supported on {os.uname().machine} yet: remove it")
    return Identity(user, pw.pw_uid, pw.pw_gid, tuple(os.getgrouplist(user, pw.pw_gid)))


def _libc() -> Any:
    """The C library through ctypes, loaded on first use: importing ctypes costs every
    command about 5 ms (and platform, which it once came with, 9 ms) that most never use."""
    if not _LIBC:
        import ctypes
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def _setgroups(groups: tuple[int, ...] | list[int]) -> None:
    import ctypes
    arr = (ctypes.c_uint * max(1, len(groups)))(*groups)
    if _libc().syscall(_SYS_SETGROUPS[os.uname().machine], len(groups), arr) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setgroups: {os.strerror(err)}")


def _setfs(uid: int, gid: int) -> None:
    libc = _libc()
    libc.setfsgid(gid)
    libc.setfsuid(uid)
    # both calls return the previous value; a second call tells whether the switch took
    if libc.setfsuid(uid) != uid or libc.setfsgid(gid) != gid:
        raise PermissionError(f"cannot take the file-system identity {uid}:{gid} (not root?)")


@contextmanager
def acting_as(ident: Identity | None) -> Iterator[None]:
    """Within the block, this thread opens files as ``ident`` (nothing changes for None,
    or when not root)."""
    if ident is None or os.geteuid() != 0 or getattr(_local, "active", False):
        yield
        return
    _setgroups(ident.groups)
    try:
        _setfs(ident.uid, ident.gid)
        _local.active = True
        try:
            yield
        finally:
            _local.active = False
            _setfs(0, 0)
    finally:
        _setgroups(_ROOT_GROUPS)


@contextmanager
def writing_as(user: str | None, key: str = "report.user") -> Iterator[None]:
    """Write in the shared state directory as ``user`` where set (NFS squashes root), else
    as root."""
    if not user:
        yield
        return
    with acting_as(lookup(user, key)):
        yield


def creates_as_root(mode: int) -> bool:
    """Whether a file this process creates with ``mode`` (outside acting_as) is root's, group
    0, with exactly ``mode``: it runs as root with group 0 and its umask takes none of
    ``mode``'s bits. A set-group-ID directory, which gives its files its own group, is the
    caller's to check. The copier's files are then sealed as they are made
    (TransferStats.sealed), and the seal need not look at them again."""
    if os.geteuid() != 0 or os.getegid() != 0:
        return False
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            umask = next((int(line.split()[1], 8) for line in fh if line.startswith("Umask:")), None)
    except (OSError, ValueError, IndexError):
        return False
    return umask is not None and not umask & mode
