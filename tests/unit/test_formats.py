"""Files one dsstage version writes and another reads carry a format; a reader takes its own
and the one before, and a newer writer's extra keys never make a record look damaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dsstage.cluster import leader
from dsstage.fs import formats
from dsstage.fs.safe import RootDir
from dsstage.node import rollout
from dsstage.node.lease import Lease, LeaseBook
from dsstage.policy import demand


def test_a_reader_takes_its_format_and_the_one_before_and_names_a_newer_writer():
    ours = formats.CURRENT["node-report"]
    assert formats.readable("node-report", {"format": ours}) and formats.readable("node-report", {"format": ours - 1})
    assert not formats.readable("node-report", {"format": ours + 1})
    assert formats.readable("lease", {})  # from before formats: format 0, the one before 1
    assert "written by a newer dsstage" in formats.problem("demand", {"format": 2}, "x")
    assert "much older dsstage, or damaged" in formats.problem("demand", {"format": "one"}, "x")


def test_the_demand_snapshot_of_a_newer_poller_is_said_not_misread(tmp_path: Path):
    (tmp_path / "demand.json").write_text(
        json.dumps({"format": formats.CURRENT["demand"] + 1, "time": 1.0, "datasets": {}}))
    snap = demand.read(str(tmp_path))
    assert snap.time == 0 and "written by a newer dsstage" in snap.problem
    (tmp_path / "demand.json").write_text(json.dumps({"time": 5.0, "datasets": {}}))  # format 0: the one before
    assert demand.read(str(tmp_path)).time == 5.0


def test_a_lease_with_keys_a_newer_version_added_is_still_a_lease(tmp_path: Path):
    """Read as damaged, a lease would be removed by reclaim and its copy evicted under a job."""
    with RootDir(str(tmp_path / "tier")) as tier:
        book = LeaseBook(tier)
        book.take(Lease(dataset="coco", digest="d" * 64, job_id="7", user="ana", node="n1", taken=1.0))
        path = tmp_path / "tier" / "leases" / "coco" / "7.json"
        record = json.loads(path.read_text())
        assert record["format"] == formats.CURRENT["lease"]
        path.write_text(json.dumps({**record, "format": record["format"] + 1, "shard": 3}))
        assert [x.job_id for x in book.of_dataset("coco")] == ["7"]


@pytest.mark.parametrize("kind, write, name", [
    ("poller-lease", lambda d: leader.round_(d, leader.Me("h", 1), 10.0, 30.0), "poller.json"),
    ("switch", lambda d: rollout.write_switch(d, {"reason": "r"}), "disabled.json"),
    ("demand", lambda d: demand.write(d, demand.build([], 1.0)), "demand.json"),
    ("demand-summary", lambda d: demand.write(d, demand.build([], 1.0)), "demand-summary.json")])
def test_every_shared_file_is_written_with_its_format(tmp_path: Path, kind, write, name):
    write(str(tmp_path))
    assert json.loads((tmp_path / name).read_text())["format"] == formats.CURRENT[kind]
