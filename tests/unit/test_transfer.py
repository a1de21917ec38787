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
