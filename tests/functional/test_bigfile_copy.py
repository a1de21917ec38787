"""Large files copied as byte ranges by several streams and hashed as the ranges land."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import blake3
import pytest
from dsstage.config.catalog import User
from dsstage.errors import VerifyError
from dsstage.node import staging
from dsstage.transfer import build as transfer_build
from dsstage.transfer import copier
from helpers import Env, copy_verified, write_tree

RANGE = 64 * 1024  # small ranges: the same code paths as 32 MiB ones, on small files


def copy(src: Path, dest: Path, entries, **kw):
    dest.mkdir(exist_ok=True)
    kw.setdefault("split", 1)  # every file that is not empty takes the range path
    return copy_verified(src, dest, entries, range_size=RANGE, **kw)


@pytest.fixture(params=["copy_file_range", "pread"])
def kernel_copy(request, monkeypatch):
    """Both ways a range is copied: in the kernel, and read and written where it is refused."""
    if request.param == "pread":
        def refused(*args, **kw):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(copier.os, "copy_file_range", refused)
    return request.param


def test_ranges_of_a_file_not_a_multiple_of_the_range_and_one_smaller_than_a_range(tmp_path, kernel_copy):
    files = {"big": os.urandom(3 * RANGE + 12345), "small": os.urandom(RANGE - 1), "one": os.urandom(RANGE)}
    src = write_tree(tmp_path / "src", files)
    m = transfer_build.build("ds", str(src)).manifest
    stats, bad = copy(src, tmp_path / "dest", m.entries, threads=3, range_streams=3)
    assert bad == [] and stats.files == 3 and stats.bytes == sum(map(len, files.values()))
    for e in m.entries:
        got = (tmp_path / "dest" / e.path).read_bytes()
        assert got == files[e.path] and blake3.blake3(got).hexdigest() == e.hash
        st = os.lstat(tmp_path / "dest" / e.path)
        assert st.st_mode & 0o777 == 0o444 and st.st_mtime_ns == e.mtime_ns
    assert sorted(os.listdir(tmp_path / "dest")) == ["big", "one", "small"]  # no temporary file left


def test_a_changed_range_a_shorter_and_a_longer_source_publish_nothing(tmp_path, kernel_copy):
    data = os.urandom(3 * RANGE + 12345)
    src = write_tree(tmp_path / "src", {"flipped": data, "short": data, "long": data})
    m = transfer_build.build("ds", str(src)).manifest
    with open(src / "flipped", "r+b") as fh:  # one byte of the third range
        fh.seek(2 * RANGE + 7)
        fh.write(bytes([data[2 * RANGE + 7] ^ 1]))
    os.truncate(src / "short", 2 * RANGE + 5)
    with open(src / "long", "ab") as fh:
        fh.write(b"x")
    stats, bad = copy(src, tmp_path / "dest", m.entries, threads=2, range_streams=2)
    found = {b.path: b.found for b in bad}
    assert found["short"] == f"size {2 * RANGE + 5}" and found["long"] == f"size {len(data) + 1}"
    assert len(found["flipped"]) == 64 and found["flipped"] != m.entries[0].hash
    assert stats.files == 0 and os.listdir(tmp_path / "dest") == []


def test_a_stage_of_a_large_file_with_a_corrupt_range_fails_verification(env: Env, monkeypatch):
    data = os.urandom(5 * RANGE + 99)
    src = env.add("huge", {"shard.bin": data, "meta.json": b"{}"})
    env.cli("manifest", "build", "huge")
    with open(src / "shard.bin", "r+b") as fh:  # after the manifest: the source went bad
        fh.seek(4 * RANGE + 1)
        fh.write(bytes([data[4 * RANGE + 1] ^ 0x80]))
    monkeypatch.setattr(copier, "SPLIT", RANGE)
    monkeypatch.setattr(copier, "RANGE", RANGE)
    ranges = []
    real = copier._Ranges.copy

    def seen(self, off, n):
        ranges.append(off)
        return real(self, off, n)
    monkeypatch.setattr(copier._Ranges, "copy", seen)
    with pytest.raises(VerifyError, match="shard.bin.*nothing was published"):
        staging.stage(env.store(), "huge", staging.StageRequest(user=User.lookup(0), job_id="1"))
    assert 4 * RANGE in ranges  # the file did take the range path (twice: fetched again)
    assert not (env.tier_root() / "ready" / "huge").exists()
    published = env.tier_root() / "datasets" / "huge"
    assert not published.exists() or not any(published.rglob("shard.bin"))
    # repaired source: the same stage succeeds and the copy is the source's
    (src / "shard.bin").write_bytes(data)
    staging.stage(env.store(), "huge", staging.StageRequest(user=User.lookup(0), job_id="2"))
    assert [p.read_bytes() == data for p in published.rglob("shard.bin")] == [True]


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_no_more_streams_than_the_bound_copy_at_once_and_blake3_gets_its_bound(tmp_path, monkeypatch, streams):
    src = write_tree(tmp_path / "src", {"big": os.urandom(12 * RANGE + 1), "a": b"a" * 10, "b": b"b" * 20})
    m = transfer_build.build("ds", str(src)).manifest
    lock = threading.Lock()
    now = peak = 0
    # the first ``streams`` ranges wait for each other (a copier that runs fewer at once
    # fails: the wait times out), then give a range beyond them a moment to start (a
    # copier that runs more at once is caught with one more in flight)
    together = threading.Barrier(streams, timeout=10)
    beyond = threading.Event()
    real = copier._Ranges.copy

    def counted(self, off, n):
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
        try:
            if off < streams * RANGE:
                together.wait()
                beyond.wait(0.5)
            else:
                beyond.set()
            return real(self, off, n)
        finally:
            with lock:
                now -= 1
    monkeypatch.setattr(copier._Ranges, "copy", counted)
    made = []
    real_hasher = copier.hasher

    def hasher(threads=0):
        made.append(threads)
        return real_hasher(threads)
    monkeypatch.setattr(copier, "hasher", hasher)
    stats, bad = copy(src, tmp_path / "dest", m.entries, threads=streams, hash_threads=2, split=10 * RANGE,
                     range_streams=streams + 1)
    assert bad == [] and stats.files == 3
    assert peak == streams and not together.broken
    assert made == [2]  # one hasher for the one large file, with the configured threads
    assert (tmp_path / "dest" / "big").read_bytes() == (src / "big").read_bytes()


def test_verification_hashes_large_files_with_no_more_threads_than_configured(tmp_path, monkeypatch):
    from dsstage.transfer import hashing
    monkeypatch.setattr(hashing, "LARGE", 4096)  # these count as large: memory-mapped, blake3's threads
    files = {f"f{i}": os.urandom(size) for i, size in enumerate([10, 5000, 3000, 70_000, 0, 4096])}
    root = write_tree(tmp_path / "copy", files)
    made = []

    real = blake3.blake3

    class Shim:  # the blake3 module as hashing sees it, noting the threads each hasher may use
        class blake3:
            AUTO = real.AUTO

            def __new__(cls, *args, max_threads=1, **kw):
                made.append((max_threads, threading.current_thread() is threading.main_thread()))
                return real(*args, max_threads=max_threads, **kw)
    monkeypatch.setattr(hashing, "blake3", Shim)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = hashing.hash_many(fd, [*sorted(files), "missing"], threads=3)
    finally:
        os.close(fd)
    assert got == [(len(files[k]), blake3.blake3(files[k]).hexdigest()) for k in sorted(files)] + [None]
    # three small files on the pool, a thread each; then three large ones, one at a time on 3
    assert sorted(made) == [(1, False)] * 3 + [(3, True)] * 3


@pytest.mark.parametrize("mappable", [True, False])
def test_a_tree_on_this_nodes_disk_is_hashed_through_mappings_a_window_at_a_time(tmp_path, monkeypatch, mappable):
    """verify --full's hashing (mapped): the same (size, hash) as plain reads, on sizes around
    the window's, a file that grew past the size it had when opened, and a filesystem that
    refuses mappings (plain reads then)."""
    import mmap

    from dsstage.transfer import hashing
    monkeypatch.setattr(hashing, "LARGE", 4096)
    monkeypatch.setattr(hashing, "WINDOW", 2 * mmap.ALLOCATIONGRANULARITY)
    w = hashing.WINDOW
    files = {f"f{i}": os.urandom(size) for i, size in enumerate([4096, w - 1, w, w + 1, 3 * w + 17, 10])}
    root = write_tree(tmp_path / "copy", files)
    windows = []
    real_mmap = mmap.mmap

    def counted(fd, n, **kw):
        if not mappable:
            raise OSError(19, "No such device")
        windows.append(n)
        return real_mmap(fd, n, **kw)
    monkeypatch.setattr(hashing.mmap, "mmap", counted)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = hashing.hash_many(fd, sorted(files), threads=2, mapped=True)
        listed = os.stat(root / "f4").st_size  # the size the file had when it was opened
        with open(root / "f4", "ab") as grow:  # then it grew: hashed to its end, as a plain read does
            grow.write(b"more")

        class Stale:
            st_size = listed
        monkeypatch.setattr(hashing.os, "fstat", lambda f: Stale)
        f4 = os.open(root / "f4", os.O_RDONLY)
        try:
            grown = hashing.hash_fd(f4, 2, mapped=True)
        finally:
            os.close(f4)
    finally:
        os.close(fd)
    assert got == [(len(files[k]), blake3.blake3(files[k]).hexdigest()) for k in sorted(files)]
    assert grown == (len(files["f4"]) + 4, blake3.blake3(files["f4"] + b"more").hexdigest())
    if mappable:
        assert windows and max(windows) <= w and sum(windows) >= sum(len(v) for v in files.values() if len(v) >= 4096)
    else:
        assert not windows
