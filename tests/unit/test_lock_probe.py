"""``lock.is_held``: the report's probe of a dataset's lock, against a lock another process holds
through filelock (as a stage or a verification does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dsstage.node.lock import DatasetLock, is_held


def test_is_held_sees_another_process_holding_the_lock_and_never_blocks(tmp_path: Path):
    path = str(tmp_path / "x.lock")
    assert not is_held(path)  # no file: nothing holds it, and the probe creates nothing
    assert not os.path.exists(path)
    with DatasetLock(path, timeout=5, what="x"):
        pass
    assert not is_held(path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import filelock, sys, time\n"
         f"lock = filelock.UnixFileLock({path!r}); lock.acquire(); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert is_held(path)
        assert is_held(path)  # probing does not take it over
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=10)
    assert not is_held(path)
    with DatasetLock(path, timeout=5, what="x"):  # the probe left the lock free to take
        pass


def test_is_held_does_not_follow_a_link(tmp_path: Path):
    target = tmp_path / "elsewhere.lock"
    target.write_text("")
    os.symlink(target, tmp_path / "x.lock")
    assert not is_held(str(tmp_path / "x.lock"))
