"""tests/latencyfs.c, the emulated network filesystem of the latency benchmarks and tests:
it mirrors its backing directory, delays each request by one round trip, serves many
requests at once, counts them, and shows symlinks as symlinks."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import latencyfs
import pytest
from latencyfs import LatencyFS

DELAY_US = 20_000  # large against the machine's noise: 20 ms per round trip


def together(fn: Callable[[int], object], n: int = 16) -> float:
    """fn(0) ... fn(n - 1), each in its own thread, started at once; the seconds they took."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        start.wait()
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    latencyfs.require()
    root = tmp_path / "backing"
    for i in range(16):
        d = root / f"d{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:02d}").write_bytes(os.urandom(1000 + i * 9000))
    (root / "flat").mkdir()
    for i in range(16):
        (root / "flat" / f"e{i:02d}").write_bytes(b"x")
    (root / "big").write_bytes(os.urandom(3 << 20))
    os.symlink("d0/f00", root / "link")
    os.symlink("/etc/hostname", root / "outside")
    return root


@pytest.fixture
def fs(backing: Path, tmp_path: Path):
    with LatencyFS(backing, tmp_path / "mnt", delay_us=DELAY_US) as fs:
        yield fs
    assert not latencyfs.mounted(tmp_path / "mnt")
    assert fs.final is not None and fs.final["final"] is True  # written at exit


def test_files_read_back_identical(fs: LatencyFS, backing: Path) -> None:
    mnt = Path(fs.mountpoint)
    names = sorted(str(p.relative_to(backing)) for p in backing.rglob("*"))
    assert sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*")) == names
    for p in backing.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert (mnt / p.relative_to(backing)).read_bytes() == p.read_bytes()
    st = (mnt / "big").stat()
    assert st.st_size == 3 << 20 and st.st_ino == (backing / "big").stat().st_ino


def test_read_only(fs: LatencyFS) -> None:
    with pytest.raises(OSError):
        open(Path(fs.mountpoint) / "d0" / "f00", "r+b")
    with pytest.raises(OSError):
        (Path(fs.mountpoint) / "new").write_bytes(b"x")


def test_a_stat_costs_a_round_trip(fs: LatencyFS) -> None:
    t = time.perf_counter()
    os.stat(Path(fs.mountpoint) / "d1" / "f01")  # uncached: lookup d1, lookup f01
    assert time.perf_counter() - t >= 2 * DELAY_US / 1e6


def test_concurrent_opens_overlap_and_are_counted(fs: LatencyFS) -> None:
    mnt = Path(fs.mountpoint)
    for d in range(4):
        os.listdir(mnt / f"d{d}")  # entries cached: what is timed below is the opens and reads
    fs.reset()
    elapsed = together(lambda i: (mnt / f"d{i % 4}" / f"f{i:02d}").read_bytes())
    # each thread: an open and a read, 2 round trips; serially 16 x 2 x 20 ms = 640 ms
    assert elapsed < 16 * DELAY_US / 1e6, elapsed
    s = fs.stats()
    assert s["ops"]["open"] == 16 and s["ops"]["read"] >= 16
    assert s["peak_opens_in_flight"] >= 2 and s["peak_in_flight"] >= 2
    assert s["bytes_read"] == sum(1000 + i * 9000 for i in range(16))
    assert fs.reset()["ops"]["open"] == 0


def test_lookups_in_one_directory_run_concurrently(fs: LatencyFS) -> None:
    """As an NFS client sends many LOOKUPs in one directory at once (the kernel serializes
    them unless the INIT reply says FUSE_PARALLEL_DIROPS, which latencyfs adds)."""
    flat = Path(fs.mountpoint) / "flat"
    flat.stat()
    fs.reset()
    elapsed = together(lambda i: os.stat(flat / f"e{i:02d}"))
    s = fs.stats()
    assert s["ops"]["getattr"] == 16 and s["peak_in_flight"] >= 8, s
    assert elapsed < 8 * DELAY_US / 1e6, elapsed


def test_page_cache_dropped_on_open(fs: LatencyFS) -> None:
    path = Path(fs.mountpoint) / "big"
    path.read_bytes()
    fs.reset()
    path.read_bytes()
    s = fs.stats()
    assert s["ops"]["open"] == 1 and s["bytes_read"] == 3 << 20  # read through again


def test_symlinks_are_symlinks(fs: LatencyFS) -> None:
    mnt = Path(fs.mountpoint)
    assert (mnt / "link").is_symlink() and os.readlink(mnt / "link") == "d0/f00"
    assert (mnt / "outside").is_symlink() and os.readlink(mnt / "outside") == "/etc/hostname"
    assert (mnt / "link").read_bytes() == (mnt / "d0" / "f00").read_bytes()  # followed inside the mount
    with pytest.raises(OSError):
        os.open(mnt / "link", os.O_RDONLY | os.O_NOFOLLOW)


def test_remount_is_cold(fs: LatencyFS) -> None:
    path = Path(fs.mountpoint) / "d2" / "f02"
    path.stat()
    fs.remount()
    fs.reset()
    t = time.perf_counter()
    path.stat()
    assert time.perf_counter() - t >= 2 * DELAY_US / 1e6
    assert fs.stats()["ops"]["getattr"] >= 2


def test_the_thread_bound_caps_concurrency(backing: Path, tmp_path: Path) -> None:
    with LatencyFS(backing, tmp_path / "mnt2", delay_us=DELAY_US, threads=2) as fs:
        mnt = Path(fs.mountpoint)
        for d in range(4):
            os.listdir(mnt / f"d{d}")
        fs.reset()
        together(lambda i: (mnt / f"d{i % 4}" / f"f{i:02d}").read_bytes(), 8)
        assert fs.stats()["peak_in_flight"] <= 2


def test_bytes_read_counts_what_read_replies_deliver(fs: LatencyFS, backing: Path) -> None:
    """bytes_read is the sum of the read replies: what a reader got through the mount. Each
    open drops the file's page cache, and a remount drops everything, so a file read again
    is counted again."""
    mnt = Path(fs.mountpoint)
    sizes = {"empty": 0, "one": 1, "odd": 4096 * 3 + 17, "mid": (1 << 20) + 5}
    for name, size in sizes.items():
        (backing / name).write_bytes(os.urandom(size))
    fs.reset()
    got = sum(len((mnt / name).read_bytes()) for name in sizes)
    assert got == sum(sizes.values())
    s = fs.stats()
    assert s["bytes_read"] == got and s["ops"]["open"] == len(sizes), s
    fs.remount()
    assert fs.stats()["bytes_read"] == 0  # a new process: counted from the mount
    with open(mnt / "mid", "rb") as fh:
        assert len(fh.read()) == sizes["mid"]
    assert fs.stats()["bytes_read"] == sizes["mid"]
    assert fs.reset()["bytes_read"] == 0


def test_rate_caps_the_bandwidth_of_all_readers_together(backing: Path, tmp_path: Path) -> None:
    """rate=N: the read replies of all threads together deliver at most N bytes a second,
    so two readers of 10 MiB each at 20 MiB/s take about 1 s between them, not 0.5 s each.
    Only a lower bound is asserted: a slow machine may take longer."""
    rate, size = 20 << 20, 10 << 20
    for i in range(2):
        (backing / f"r{i}").write_bytes(os.urandom(size))
    with LatencyFS(backing, tmp_path / "mnt3", delay_us=1000, rate=rate) as fs:
        mnt = Path(fs.mountpoint)
        for i in range(2):
            (mnt / f"r{i}").stat()
        assert fs.reset()["rate"] == rate
        got = [0, 0]

        def read(i: int) -> None:
            with open(mnt / f"r{i}", "rb", buffering=0) as fh:
                while chunk := fh.read(4 << 20):  # large reads are paced too, not let through in a burst
                    got[i] += len(chunk)
        elapsed = together(read, 2)
        s = fs.stats()
    assert got == [size, size]
    assert s["bytes_read"] == 2 * size, s
    assert elapsed >= 0.8 * 2 * size / rate, elapsed
    assert s["ops"]["read"] >= 2 * size // (1 << 20), s  # the kernel splits reads (128 KiB to 1 MiB each)


def test_rate_zero_is_unlimited(fs: LatencyFS) -> None:
    assert fs.rate == 0 and fs.stats()["rate"] == 0


def test_uncached_readers_of_one_mount_never_share_a_read(backing: Path, tmp_path: Path) -> None:
    """uncached (direct_io): two readers with the file open at once, standing for two nodes,
    each get every byte from the filesystem, as two NFS clients would."""
    size = 3 << 20
    (backing / "shared").write_bytes(os.urandom(size))
    with LatencyFS(backing, tmp_path / "mnt4", delay_us=0, extra_options="uncached") as fs:
        path = Path(fs.mountpoint) / "shared"
        path.stat()
        fs.reset()
        with open(path, "rb", buffering=0) as a, open(path, "rb", buffering=0) as b:
            assert len(a.read(size + 1)) == size
            assert len(b.read(size + 1)) == size
        assert fs.stats()["bytes_read"] == 2 * size


def test_requests_are_counted_by_area(fs: LatencyFS, backing: Path) -> None:
    """by_area: the operations by the first component of their path, cut at its first dot
    after the first character (where in a shared directory the requests go), summing to the
    counts by kind; a reset zeroes them."""
    (backing / "demand.json").write_text("{}")
    (backing / ".clock.n001").write_text("")
    mnt = Path(fs.mountpoint)
    fs.reset()
    (mnt / "d1" / "f01").read_bytes()
    (mnt / "d1" / "f05").read_bytes()
    (mnt / "demand.json").read_text()
    (mnt / ".clock.n001").stat()
    sorted(os.listdir(mnt / "flat"))
    s = fs.stats()
    areas = s["by_area"]
    assert areas["d1"]["open"] == 2 and areas["d1"]["read"] >= 2, areas
    assert areas["demand"]["open"] == 1 and "open" not in areas.get(".clock", {}), areas
    assert areas[".clock"]["getattr"] >= 1 and areas["flat"]["opendir"] == 1, areas
    assert "d0" not in areas or not areas["d0"], areas
    for kind, n in s["ops"].items():
        assert sum(a.get(kind, 0) for a in areas.values()) == n, (kind, s)
    assert not any(fs.reset()["by_area"].values())
