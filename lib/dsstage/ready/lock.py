"""The dataset lock: an flock(2) of ``<tier>/locks/<name>.lock``, its owner recorded beside it.

The kernel drops an flock when its holder dies, even by kill -9, so a crashed stage never
blocks the next one. ``<name>.lock.owner`` says who holds it (host, pid, job, since, what it
does) for ``dsstage status``; it is informative only. The lock file is opened without
following a link and must be a regular file of the caller's (root's); a lock taken on a file
that was replaced by the time the lock was granted is taken again on the new one.

The full stage (dsstage.node.lock.DatasetLock, which waits) and the fast ``verify --full``
(dsstage.cli.fast, which does not) take it here. filelock did the waiting before: it costs
about 30 ms to import, which the fast path cannot pay, and it follows a link at the lock's
name; the 40 lines below are the one implementation both use.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time

from dsstage.errors import UnsafeStore
from dsstage.fs import safe

#: how often a waiting lock tries again (filelock's default poll interval)
POLL = 0.05
OWNER = ".owner"
#: how often a lock file replaced under a try is opened again before the try gives up
ATTEMPTS = 3


def owner_record(job_id: str, action: str) -> dict[str, object]:
    """What the owner file beside a held lock says: host (uname's node name, gethostname()'s
    without socket's import), pid, job, since, and what the holder does."""
    return {"host": os.uname().nodename, "pid": os.getpid(), "job_id": job_id, "since": time.time(),
            "action": action}


def try_lock(locks: int, name: str, *, create: bool = False) -> int | None:
    """The descriptor holding lock file ``name`` of directory ``locks`` (a descriptor), or None
    if another process holds it (or, without ``create``, it does not exist; or it was replaced
    under each of ATTEMPTS tries). Raises OSError if
    it cannot be opened, UnsafeStore if it is not a regular file of this user's."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    for _attempt in range(ATTEMPTS):
        try:
            fd = os.open(name, flags, 0o600, dir_fd=locks)
        except FileNotFoundError:
            if create:
                raise
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise UnsafeStore(f"the lock file {name} is not a regular file of uid {os.geteuid()}: "
                                  "remove it (only the locking process creates it)")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                now = os.stat(name, dir_fd=locks, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed or replaced since it was opened: lock what the name leads to now
        if not create and now is None:
            return None
    return None  # replaced again each time: as if held (a waiter tries again, the fast path leaves it)


def wait_lock(locks: int, name: str, timeout: float) -> int | None:
    """``try_lock`` (creating the file) until it is granted or ``timeout`` seconds have passed
    (None then)."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        fd = try_lock(locks, name, create=True)
        if fd is not None:
            return fd
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(POLL, left))


def note_owner(locks: int, name: str, job_id: str, action: str) -> None:
    """Record who holds lock ``name`` (informative: a failure to write it is ignored)."""
    try:
        safe.write_json_at(locks, name + OWNER, owner_record(job_id, action), fsync=False)
    except OSError:
        pass


def unlock(locks: int, name: str, fd: int) -> None:
    """Give lock ``name`` back: its owner record first, then the lock with its descriptor."""
    try:
        safe.unlink_at(locks, name + OWNER)
    except OSError:
        pass  # informative only
    finally:
        os.close(fd)


def is_held(path: str) -> bool:
    """Whether some process holds the lock at ``path`` right now: a non-blocking flock() probe
    (3 us here; a node's report probes every dataset's lock). A missing file, or a link, is
    not held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
