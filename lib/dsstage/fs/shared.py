"""Records in the shared state directory that root acts on.

Such a record is written by root or by one named writer (SlurmUser for ``#BB_LUA`` requests,
``report.user`` where NFS squashes root), and it is trusted only if nobody else could have
written it: its directory and the file belong to root or that writer, neither is writable by
group or others, and neither is a symbolic link. ``create_once`` makes a record only if there
is none yet (a fresh temporary file, then link(2), which is atomic on NFS too), so of the nodes
of one job exactly one wins.

Imports only the standard library and dsstage.fs.safe: the warm Prolog may use it.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from dsstage.errors import UnsafeStore
from dsstage.fs import safe

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

#: the largest record read
MAX = 64 * 1024


def problem(st: os.stat_result, writers: Sequence[int], what: str) -> str | None:
    """Why ``st`` (of a record or its directory) is not to be trusted, or None."""
    if st.st_uid not in writers:
        return f"{what} belongs to uid {st.st_uid}, not root or the configured writer"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def refuse(path: str, why: str) -> UnsafeStore:
    return UnsafeStore(f"{path}: {why}: dsstage will not act on it as root; make {os.path.dirname(path)} "
                       "writable only by root or the configured writer")


def _open_dir(where: str, writers: Sequence[int]) -> int | None:
    try:
        dfd = os.open(where, safe.O_DIR)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise refuse(where, "is a symbolic link or not a directory") from None
        raise
    why = problem(os.fstat(dfd), writers, "the directory")
    if why:
        os.close(dfd)
        raise refuse(where, why)
    return dfd


def read(where: str, name: str, writers: Sequence[int]) -> bytes | None:
    """The bytes of record ``name`` in directory ``where``, or None if there is none. Raises
    UnsafeStore for a record or directory others could have written."""
    dfd = _open_dir(where, writers)
    if dfd is None:
        return None
    try:
        try:
            fd = os.open(name, safe.O_READ, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise refuse(os.path.join(where, name), f"cannot be opened safely ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else problem(st, writers, "it")
            if why:
                raise refuse(os.path.join(where, name), why)
            return os.read(fd, MAX + 1)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def create_once(where: str, name: str, data: bytes, writers: Sequence[int]) -> bool:
    """Make record ``name`` in ``where`` (created, mode 0755, if missing) holding ``data``,
    unless it exists already; True if this call made it. The caller acts as the writer."""
    try:
        os.mkdir(where, 0o755)
        os.chmod(where, 0o755)  # whatever the umask
    except FileExistsError:
        pass
    dfd = _open_dir(where, writers)
    if dfd is None:
        raise FileNotFoundError(errno.ENOENT, "removed while in use", where)
    try:
        tmp = safe.temp_name()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        try:
            try:
                safe.write_all(fd, data)
                os.fchmod(fd, 0o644)  # whatever the umask: root reads it where NFS squashes root
                os.fsync(fd)
            finally:
                os.close(fd)
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            return True
        except FileExistsError:
            # over NFS a retransmitted link(2) can say EEXIST although it succeeded: then the
            # temporary file has two links, and this call made the record
            return os.stat(tmp, dir_fd=dfd, follow_symlinks=False).st_nlink == 2
        finally:
            safe.unlink_at(dfd, tmp)
    finally:
        os.close(dfd)


def touch_time(path: str) -> float:
    """The time now by the clock of the filesystem ``path`` is on: the file (created, 0644,
    never through a link) touched with no time given, which its server sets, and its
    modification time read back. Raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        os.utime(fd, None)
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)


#: seconds a measured offset between this host's clock and a shared directory's is used
OFFSET_TTL = 300.0
#: filesystem (a directory's st_dev) -> (this host's monotonic time when measured, the
#: filesystem's time then), for this process: its clock runs on from it by the monotonic
#: clock, so a step of this host's wall clock (NTP) meanwhile does not move it. One
#: filesystem has one clock (its server's): the state directory's ``nodes/``, ``staging/``
#: and ``budget/`` share one probe, not one each per cold stage
_offsets: dict[int, tuple[float, float]] = {}
#: directory -> its filesystem, for this process
_devs: dict[str, int] = {}
_said: set[str] = set()


def _measured(where: str) -> tuple[float, float] | None:
    """(monotonic time, the filesystem's time then) of the filesystem ``where`` is on: its
    last measure if younger than OFFSET_TTL, else ``touch_time`` of a probe per host,
    ``.clock.<host>``, in ``where`` (one metadata write, not one per reading); None where the
    probe cannot be written (said once per process and directory), which leaves another
    directory on the same filesystem free to try (it may be written as another user)."""
    dev = _devs.get(where)
    if dev is None:
        try:
            dev = _devs[where] = os.stat(where).st_dev
        except OSError:
            dev = -1  # the probe says why
    seen = _offsets.get(dev)
    if seen is not None and time.monotonic() - seen[0] < OFFSET_TTL:
        return seen
    try:
        before = time.monotonic()
        server = touch_time(os.path.join(where, f".clock.{os.uname().nodename}"))
        # the server set the time somewhere within the round trip: its middle
        at = (before + time.monotonic()) / 2
    except OSError as exc:
        if where not in _said:
            _said.add(where)
            import logging
            logging.getLogger(__name__).warning("%s: cannot read the shared directory's clock (%s): this host's is "
                                                "used, and other nodes' clocks may disagree with it", where,
                                                exc.strerror or exc)
        return None
    if dev != -1:
        _offsets[dev] = (at, server)
    return at, server


def server_offset(where: str) -> float | None:
    """How far the clock of the filesystem ``where`` is on from this host's (see ``_measured``);
    None where it cannot be read."""
    seen = _measured(where)
    return None if seen is None else seen[1] + (time.monotonic() - seen[0]) - time.time()


def server_clock(where: str) -> Callable[[], float] | None:
    """A clock for times the nodes write into a shared directory and compare: the time of the
    filesystem ``where`` is on (this host's time and the measured ``server_offset``), so that
    a node whose clock is off neither takes another's record for expired early nor keeps a
    dead one's late. None where that clock cannot be read (the caller uses its own, and must
    not compare it with files' times)."""
    seen = _measured(where)
    if seen is None:
        return None
    at, server = seen
    return lambda: server + (time.monotonic() - at)


def mtime(where: str, name: str) -> float | None:
    """The modification time of ``name`` in ``where`` (its server's clock), or None."""
    try:
        return os.stat(os.path.join(where, name), follow_symlinks=False).st_mtime
    except OSError:
        return None


def writers(user: str | None) -> tuple[int, ...]:
    """Who may have written a record: root, and ``user`` (``report.user``) where set and known."""
    if not user:
        return (0,)
    import pwd
    try:
        return (0, pwd.getpwnam(user).pw_uid)
    except KeyError:
        return (0,)


def remove(where: str, name: str, writers: Sequence[int] = (0,)) -> bool:
    """Remove record ``name`` from a directory that passes the same checks as ``read``;
    False if there was none."""
    dfd = _open_dir(where, writers)
    if dfd is None:
        return False
    try:
        return safe.unlink_at(dfd, name)
    finally:
        os.close(dfd)
