from pathlib import Path

from dsstage.config.manifest import Entry
from dsstage.transfer.rsync import cannot_hold, parse_stats, plan_streams

DATA = Path(__file__).resolve().parent.parent / "data"


def test_plan_streams_balances_bytes():
    entries = [Entry(f"f{i}", size, 0, "h") for i, size in enumerate([100, 90, 80, 30, 20, 10, 5, 5] * 10)]
    lists = plan_streams(entries, 4)
    loads = [sum(e.size for e in lst) for lst in lists]
    assert len(lists) == 4
    assert sorted(e.path for lst in lists for e in lst) == sorted(e.path for e in entries)
    assert max(loads) - min(loads) <= 100
    assert all(lst == sorted(lst, key=lambda e: e.path) for lst in lists)


def test_plan_streams_few_files():
    assert len(plan_streams([Entry("a", 1, 0, "h")], 8)) == 1
    assert plan_streams([], 4) == []


def test_plan_streams_spreads_empty_files():
    lists = plan_streams([Entry(f"e{i}", 0, 0, "h") for i in range(8)], 4)
    assert [len(lst) for lst in lists] == [2, 2, 2, 2]


def test_parse_stats_on_saved_rsync_output():
    stats = parse_stats((DATA / "rsync-stats.txt").read_text())
    assert stats.files == 12
    assert stats.bytes == 7_800_000


def test_after_a_failed_rsync_a_full_tier_is_told_by_statvfs_not_by_rsyncs_text(tmp_path):
    (tmp_path / "here").write_bytes(b"x" * 10)
    arrived = Entry("here", 10, 0, "0" * 64)
    assert not cannot_hold(str(tmp_path), [arrived])  # nothing missing
    assert not cannot_hold(str(tmp_path), [arrived, Entry("small", 1000, 0, "0" * 64)])
    assert cannot_hold(str(tmp_path), [arrived, Entry("huge", 2**60, 0, "0" * 64)])  # no filesystem holds 1 EiB
    assert not cannot_hold(str(tmp_path / "gone"), [Entry("x", 2**60, 0, "0" * 64)])  # cannot tell: not full


def test_a_daemon_is_asked_from_its_modules_root_with_the_relative_marker():
    """rsync 3.5.0's daemon with ``use chroot = no`` serves ``--files-from`` names only from
    the module's root (issue 57): ``rsync://h/mod/a/b`` becomes ``rsync://h/mod/`` and
    ``a/b/./<path>``; an ssh source or a module's root is asked as it is."""
    from dsstage.transfer.rsync import files_from
    assert files_from("rsync://u@h:8873/mod/a//b/", ["x", "d/y\nz"]) == \
        ("rsync://u@h:8873/mod/", b"a/b/./x\0a/b/./d/y\nz\0")
    assert files_from("rsync://h/mod", ["x"]) == ("rsync://h/mod/", b"x\0")
    assert files_from("rsync://h/mod/", []) == ("rsync://h/mod/", b"")
    assert files_from("host:/export/coco", ["x", "y"]) == ("host:/export/coco/", b"x\0y\0")


def test_a_source_that_says_every_file_vanished_is_the_sources_error_not_the_manifests(tmp_path, monkeypatch):
    """What rsync 3.5.0 printed for every file of a ``use chroot = no`` module (issue 57):
    a SourceError naming the daemon's module, not a mismatch that asks for a new manifest."""
    import os

    import pytest
    from dsstage.config.model import Transfer
    from dsstage.config.source import parse_source
    from dsstage.errors import SourceError
    from dsstage.transfer.rsync import fetch
    fake = tmp_path / "bin" / "rsync"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor f in a b; do echo "file has vanished: \\"/dir/$f\\" (in m)" >&2; done\n'
                    'echo "rsync warning: some files vanished before they could be transferred (code 24)" >&2\n'
                    'exit 24\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    entries = [Entry("a", 1, 0, "0" * 64), Entry("b", 1, 0, "0" * 64)]
    with pytest.raises(SourceError) as err:
        fetch(parse_source("rsync://h/m/dir"), str(tmp_path / "dest"), entries, Transfer(streams=1))
    assert "every one of the 2 file(s) asked for has vanished" in str(err.value)
    assert "daemon's module" in str(err.value)
    (tmp_path / "dest").mkdir()
    fake.write_text('#!/bin/sh\necho "file has vanished: \\"/dir/a\\" (in m)" >&2\nexit 24\n')
    assert fetch(parse_source("rsync://h/m/dir"), str(tmp_path / "dest"), entries, Transfer(streams=1)).files == 0


def test_one_rate_reaches_rsync_and_the_copier_alike():
    """transfer.bwlimit (rsync's KiB/s per stream) and a prefetch's bytes/s are one Rate: the
    copier spreads it over its threads, rsync gets its share per stream (at least 1 KiB/s), and
    an Area with no rate of its own takes the transfer's."""
    from dsstage.config.model import Transfer
    from dsstage.transfer.ratelimit import Rate
    from dsstage.transfer.transport import Area
    assert Rate.of_rsync(8000, 2) == Rate(8000 * 1024 * 2)
    assert Rate.of_rsync(8000, 2).rsync_kib(2) == 8000
    assert Rate(256_000).rsync_kib(4) == 62 and Rate(1000).rsync_kib(4) == 1
    assert not Rate() and Rate().rsync_kib(4) == 0 and not Rate.of_rsync(0, 4)
    assert Area(0, "/x", Transfer(bwlimit=100, streams=3)).limit == Rate(100 * 1024 * 3)
    assert Area(0, "/x", Transfer(bwlimit=100, streams=3), rate=Rate(5000)).limit == Rate(5000)
    assert Area(0, "/x", Transfer()).limit == Rate()
