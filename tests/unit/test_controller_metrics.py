"""The controller's metrics: what the acting demand poller writes for node_exporter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dsstage.cluster import controller_metrics, poller
from dsstage.config import load
from dsstage.slurm.fake import FakeSlurm
from dsstage.slurm.records import Job

NOW = 1_800_000_000.0


@pytest.mark.parametrize("reason, kind", [
    ("dsstage: unknown dataset 'cocoa' (did you mean 'coco'?)", "unknown_dataset"),
    ("tier 'nvme' on n1 (1 TiB, 900 GiB in use) cannot make room for 'big'", "no_space"),
    ("the source /data/coco of 'coco' is not readable (No such file or directory)", "source"),
    ("dsstage is misconfigured on n3: /etc/dsstage/dsstage.yaml: tiers: ...", "config"),
    ("something new", "other")])
def test_a_hold_reason_has_a_kind(reason, kind):
    assert controller_metrics.hold_kind(reason) == kind


def test_the_families_count_what_the_queue_wants_and_holds():
    held = Job("9", "ana", "PENDING", ("big",), priority=0,
               admin_comment="dsstage=big dsstage held this job: tier 'nvme' on n1 cannot make room for 'big' -- "
                             "once that is fixed: scontrol release 9")
    jobs = [Job("1", "ana", "PENDING", ("coco",)), Job("2", "bo", "PENDING", ("coco", "big")),
            Job("3", "bo", "RUNNING", ("coco",), nodes="n1"), held]
    fams = {f[0]: f for f in controller_metrics.families(snapshot_time=NOW, catalog_time=NOW - 60, jobs=jobs,
                                                         ready={"coco": 2}, acting=True)}
    assert fams["dsstage_pending_jobs"][4] == [(["big"], 2.0), (["coco"], 2.0)]
    assert fams["dsstage_pending_jobs_not_ready"][4] == [(["big"], 2.0)]
    assert fams["dsstage_held_jobs"][4] == [(["no_space"], 1.0)]
    assert fams["dsstage_catalog_timestamp_seconds"][4] == [([], NOW - 60)]
    assert fams["dsstage_poller_acting"][4] == [([], 1.0)]


def test_the_acting_poller_writes_the_textfile(tmp_path: Path):
    prom = tmp_path / "controller.prom"
    c = load.from_dict({"state_dir": str(tmp_path / "state"), "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
                        "datasets": {"coco": {"source": "/d/c"}}, "metrics": {"controller_textfile": str(prom)}})
    (tmp_path / "state" / "nodes").mkdir(parents=True)
    (tmp_path / "state" / "nodes" / "n1.json").write_text(json.dumps(
        {"format": 2, "node": "n1", "time": NOW, "copies": [{"dataset": "coco", "state": "ready", "current": True}]}))
    slurm = FakeSlurm()
    slurm.submit(Job("1", "ana", "PENDING", ("coco",)))
    assert poller.run(c, slurm, once=True, clock=lambda: NOW) == 0
    text = prom.read_text()
    assert "dsstage_demand_snapshot_timestamp_seconds 1.8e+09" in text, text
    assert 'dsstage_pending_jobs{dataset="coco"} 1.0' in text and "dsstage_pending_jobs_not_ready{" not in text
    assert "dsstage_poller_acting 1.0" in text
