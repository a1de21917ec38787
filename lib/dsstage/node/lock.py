"""The dataset lock of a full stage, a verification or an eviction: waited for, its holder named.

The lock and its owner record are dsstage.ready.lock's (the fast ``verify --full`` takes the
same lock there without waiting); this adds the wait, the error that names the holder, and
the request a stage makes of a prefetch holding the lock to yield.
"""

from __future__ import annotations

import os
import time
from types import TracebackType

from dsstage.errors import LockTimeout, StoreError
from dsstage.fs.safe import read_json, write_json
from dsstage.ready import lock as core
from dsstage.ready.lock import is_held

__all__ = ["YIELD", "DatasetLock", "ask_to_yield", "clear_yield", "is_held", "read_owner", "yield_request"]

#: beside a lock: a stage waiting for it asks the prefetch holding it to yield
YIELD = ".yield"


class DatasetLock:
    def __init__(self, path: str, *, timeout: float, job_id: str = "", what: str = "", action: str = "",
                 bound: str = "") -> None:
        self.path = path
        # what ends the wait, when not lock_timeout: the hook's budget
        self.bound = bound
        self.timeout = timeout
        self.job_id = job_id
        self.what = what or os.path.basename(path)
        self.action = action  # what the holder does (stage, verify, evict): for status
        self._dir, self._name = os.path.split(path)
        self._locks = -1
        self._fd = -1

    def __enter__(self) -> DatasetLock:
        try:
            try:
                self._locks = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:  # a tier opened before (dsstage.node.store.open_tier) has it
                os.makedirs(self._dir, 0o755, exist_ok=True)
                self._locks = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd = core.wait_lock(self._locks, self._name, self.timeout)
            except BaseException:
                os.close(self._locks)
                self._locks = -1
                raise
        except OSError as exc:
            raise StoreError(f"cannot lock {self.path}: {exc.strerror}") from None
        if fd is None:
            os.close(self._locks)
            self._locks = -1
            holder = read_owner(self.path)
            who = f" (held by {holder.get('host')} pid {holder.get('pid')} job {holder.get('job_id') or '-'})" \
                if holder else ""
            if self.bound:
                raise LockTimeout(f"waited {self.timeout:g}s for the lock on {self.what}{who}, all that is left of "
                                  f"{self.bound}; another stage is still running: the job starts as the dataset's "
                                  "on_failure says, and a later job finds the copy")
            raise LockTimeout(f"waited {self.timeout:g}s for the lock on {self.what}{who}; another stage is "
                              "still running: wait for it, or raise lock_timeout in the configuration")
        self._fd = fd
        try:
            core.note_owner(self._locks, self._name, self.job_id, self.action)
        except BaseException:  # never left held by a lock whose __exit__ will not run
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd < 0:
            return
        try:
            core.unlock(self._locks, self._name, self._fd)
        finally:
            os.close(self._locks)
            self._fd = self._locks = -1


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
    return read_json(lock_path + core.OWNER)
