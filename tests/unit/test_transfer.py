from pathlib import Path

from dsstage.config.manifest import Entry
from dsstage.transfer.rsync import parse_stats, plan_streams

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
