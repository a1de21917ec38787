"""The dataset lock (dsstage.ready.lock, and dsstage.node.lock.DatasetLock waiting on it), as an
ordinary user on tmp_path: who holds it, what a waiter hears, links and replaced files, and
the report's probe (``is_held``)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dsstage.errors import LockTimeout, StoreError, UnsafeStore
from dsstage.node.lock import DatasetLock, is_held, read_owner
from dsstage.ready import lock

HOLD = ("import os, sys\nfrom dsstage.ready import lock\n"
        "d = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        "fd = lock.wait_lock(d, sys.argv[2], 10)\nlock.note_owner(d, sys.argv[2], '77', 'stage')\n"
        "print('held' if fd is not None else 'not', flush=True)\nsys.stdin.read()\n")


def holder(tmp_path: Path, name: str = "x.lock") -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), name], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_is_held_sees_another_process_holding_the_lock_and_never_blocks(tmp_path: Path):
    path = str(tmp_path / "x.lock")
    assert not is_held(path)  # no file: nothing holds it, and the probe creates nothing
    assert not os.path.exists(path)
    with DatasetLock(path, timeout=5, what="x"):
        assert is_held(path)
    assert not is_held(path) and not os.path.exists(path + ".owner")
    p = holder(tmp_path)
    try:
        assert is_held(path)
        assert is_held(path)  # probing does not take it over
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=10)
    assert not is_held(path)
    with DatasetLock(path, timeout=5, what="x"):  # the probe left the lock free to take
        pass


def test_a_waiter_times_out_naming_the_holder_and_a_killed_holder_frees_the_lock(tmp_path: Path):
    path = str(tmp_path / "x.lock")
    p = holder(tmp_path)
    try:
        with pytest.raises(LockTimeout, match=r"waited 0.2s for the lock on dataset x \(held by .* job 77\)"), \
                DatasetLock(path, timeout=0.2, what="dataset x"):
            pass
        assert read_owner(path)["action"] == "stage"
        fd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert lock.try_lock(fd, "x.lock") is None  # the fast path does not wait
        finally:
            os.close(fd)
    finally:
        p.send_signal(signal.SIGKILL)  # kill -9: the kernel drops its flock
        p.wait(timeout=10)
    with DatasetLock(path, timeout=5, job_id="8", action="verify"):
        assert read_owner(path)["job_id"] == "8" and read_owner(path)["action"] == "verify"


def test_a_link_or_another_users_file_at_the_locks_name_is_refused(tmp_path: Path, monkeypatch):
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, tmp_path / "x.lock")
    assert not is_held(str(tmp_path / "x.lock"))
    with pytest.raises(StoreError, match="cannot lock"):
        with DatasetLock(str(tmp_path / "x.lock"), timeout=1):
            pass
    fd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as err:
            lock.try_lock(fd, "x.lock")
        assert err.value.errno == errno.ELOOP
        (tmp_path / "y.lock").write_text("")
        real = os.geteuid()
        monkeypatch.setattr(lock.os, "geteuid", lambda: real + 1)  # the file is then another user's
        with pytest.raises(UnsafeStore, match="not a regular file of uid"):
            lock.try_lock(fd, "y.lock")
    finally:
        os.close(fd)


def test_a_lock_file_replaced_before_the_flock_is_granted_is_locked_anew(tmp_path: Path, monkeypatch):
    fd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    real_flock, swapped = lock.fcntl.flock, []

    def flock(f: int, op: int) -> None:
        if not swapped:  # another process removes and recreates the file between the open and the flock
            swapped.append(True)
            os.unlink(tmp_path / "x.lock")
            (tmp_path / "x.lock").write_text("")
        real_flock(f, op)
    monkeypatch.setattr(lock.fcntl, "flock", flock)
    try:
        held = lock.try_lock(fd, "x.lock", create=True)
        assert held is not None
        assert os.fstat(held).st_ino == os.stat(tmp_path / "x.lock").st_ino  # the file the name leads to now
        monkeypatch.undo()
        assert is_held(str(tmp_path / "x.lock"))
        lock.unlock(fd, "x.lock", held)
        assert not is_held(str(tmp_path / "x.lock"))
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to an ordinary user: run as root (CI does)")
def test_the_cores_unit_tests_pass_as_an_ordinary_user(tmp_path: Path):
    """Issue 52: the ready-copy core's tests need no root. This file's other tests, run again as
    uid 65534 (keeping only the capability to read this checkout wherever it is, as
    tests/functional/test_ordinary_user.py does), all pass."""
    base = tmp_path / "as-user"
    base.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chown(base, 65534, 65534)
    here = Path(__file__)
    res = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+dac_read_search",
         "--ambient-caps=+dac_read_search", "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--basetemp={base / 'bt'}", str(here), "-k", "not ordinary_user"],
        cwd=here.parents[2], env={**os.environ, "HOME": str(base)}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "4 passed" in res.stdout and "skipped" not in res.stdout, \
        res.stdout[-2000:] + res.stderr[-2000:]
