"""Per-dataset locks that record who holds them.

The lock itself is an flock(2) through filelock: the kernel drops it when its holder
dies, even by kill -9, so a crashed stage never blocks the next one. Beside it an owner
file records host, pid and job so that ``dsstage status`` can say who is staging.
"""

from __future__ import annotations

import os
import time
from types import TracebackType

from dsstage.errors import LockTimeout, StoreError
from dsstage.fs.safe import read_json, write_json

#: beside a lock: a stage waiting for it asks the prefetch holding it to yield
YIELD = ".yield"


class DatasetLock:
    def __init__(self, path: str, *, timeout: float, job_id: str = "", what: str = "", action: str = "",
                 bound: str = "") -> None:
        self.path = path
        # what ends the wait, when not lock_timeout: the hook's budget
        self.bound = bound
        self.owner_path = path + ".owner"
        self.timeout = timeout
        self.job_id = job_id
        self.what = what or os.path.basename(path)
        self.action = action  # what the holder does (stage, verify, evict): for status
        # imported here: filelock 4 takes about 30 ms to import (python -X importtime), which
        # what only reads the locks' state (is_held, read_owner: a node's report) does not pay
        import filelock
        self._lock = filelock.UnixFileLock(path, timeout=timeout, mode=0o600)
        self._timeout: type[Exception] = filelock.Timeout

    def __enter__(self) -> DatasetLock:
        try:
            self._lock.acquire()
        except self._timeout:
            holder = read_owner(self.path)
            who = f" (held by {holder.get('host')} pid {holder.get('pid')} job {holder.get('job_id') or '-'})" \
                if holder else ""
            if self.bound:
                raise LockTimeout(f"waited {self.timeout:g}s for the lock on {self.what}{who}, all that is left of "
                                  f"{self.bound}; another stage is still running: the job starts as the dataset's "
                                  "on_failure says, and a later job finds the copy") from None
            raise LockTimeout(f"waited {self.timeout:g}s for the lock on {self.what}{who}; another stage is "
                              "still running: wait for it, or raise lock_timeout in the configuration") from None
        except OSError as exc:
            raise StoreError(f"cannot lock {self.path}: {exc.strerror}") from None
        try:
            write_json(self.owner_path, owner_record(self.job_id, self.action), fsync=False)
        except OSError:
            pass  # the owner file is informative only
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            os.unlink(self.owner_path)
        except OSError:
            pass
        self._lock.release()


def owner_record(job_id: str, action: str) -> dict[str, object]:
    """What the owner file beside a held lock says (read_owner; ``dsstage status`` shows it):
    host (uname's node name, gethostname()'s without socket's import), pid, job, since, and
    what the holder does."""
    return {"host": os.uname().nodename, "pid": os.getpid(), "job_id": job_id, "since": time.time(),
            "action": action}


def ask_to_yield(lock_path: str, job_id: str) -> bool:
    """If a prefetch holds the lock at ``lock_path``, ask it to give the lock up: write
    ``<lock>.yield``, which the prefetch watches (dsstage.cluster.prefetch). True if asked."""
    owner = read_owner(lock_path)
    if owner.get("action") != "prefetch" or not is_held(lock_path):
        return False
    try:
        write_json(lock_path + YIELD, {"job_id": job_id, "pid": os.getpid(), "since": time.time()}, fsync=False)
    except OSError:
        return False  # the prefetch then finishes first: the wait is longer, nothing is lost
    return True


def yield_request(lock_path: str) -> dict[str, object] | None:
    """Who asked the prefetch holding ``lock_path`` to yield, or None."""
    try:
        os.stat(lock_path + YIELD)
    except OSError:
        return None
    return read_json(lock_path + YIELD)


def clear_yield(lock_path: str) -> None:
    try:
        os.unlink(lock_path + YIELD)
    except OSError:
        pass


def read_owner(lock_path: str) -> dict[str, object]:
    """Who holds (or last held) the lock at ``lock_path``: host, pid, job id, since, action."""
    return read_json(lock_path + ".owner")


def is_held(path: str) -> bool:
    """Whether some process holds the lock right now: a non-blocking flock() on the file, the
    lock filelock takes (a bare probe: through filelock a probe took 230 us here, this one 3 us,
    and a node's report probes every dataset's lock). A missing file, or a link, is not held."""
    import fcntl
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
