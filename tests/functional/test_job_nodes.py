"""Decisions that belong to a job on several nodes, not to each node: the dataset's version
(a manifest build landing between two nodes' Prologs), and who asks Slurm to hold the job."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from dsstage.fs import layout, runfiles
from dsstage.hooks import job as hooks
from dsstage.node import jobrecord
from dsstage.slurm.fake import FakeSlurm
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")


def job_env(node: str, job: str, nodes: str, request: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
            "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": nodes, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": request}


def prolog(env: Env, run: Path, slurm: FakeSlurm, node: str, job: str, nodes: str, request: str = "coco") -> int:
    return hooks.prolog(job_env(node, job, nodes, request), run_dir=str(run / node), slurm=slurm,
                        load_config=env.config)


def dataset_dir(run: Path, node: str, job: str) -> str:
    lines = (run / node / node / "jobs" / f"{job}.task").read_text().splitlines()
    return next(line.split("=", 1)[1] for line in lines if line.startswith("export DSSTAGE_DATASET_DIR="))


def test_every_node_of_a_job_stages_the_version_its_first_node_chose(env: Env, tmp_path: Path):
    src = env.add("coco", {"a": b"1" * 1000, "d/b": b"2" * 3000})
    env.cli("manifest", "build", "coco")
    v1 = (env.state / "manifests" / "coco" / "CURRENT").read_text().strip()
    run, slurm = tmp_path / "run", FakeSlurm()
    assert prolog(env, run, slurm, "n1", "70", "n[1-2]") == 0
    assert dataset_dir(run, "n1", "70").endswith(f"/coco/{layout.version_id(v1)}")
    (src / "new").write_bytes(b"3" * 1000)  # a new version (a file added) lands between the two nodes' Prologs
    env.cli("manifest", "build", "coco")
    v2 = (env.state / "manifests" / "coco" / "CURRENT").read_text().strip()
    assert v2 != v1
    assert prolog(env, run, slurm, "n2", "70", "n[1-2]") == 0
    assert dataset_dir(run, "n2", "70").endswith(f"/coco/{layout.version_id(v1)}")  # the job's version
    record = json.loads((env.state / "jobs" / "70.json").read_text())
    assert (record["by"], record["versions"]) == ("n1", {"coco": v1})
    # the Epilog forgets the record; the next job (or this one requeued) takes the new version
    assert hooks.epilog(job_env("n1", "70", "n[1-2]", "coco"), run_dir=str(run / "n1"), load_config=env.config) == 0
    assert not (env.state / "jobs" / "70.json").exists()
    assert prolog(env, run, slurm, "n2", "71", "n[1-2]") == 0
    assert dataset_dir(run, "n2", "71").endswith(f"/coco/{layout.version_id(v2)}")
    # a one-node job writes no record
    assert prolog(env, run, slurm, "n1", "72", "n1") == 0
    assert not (env.state / "jobs" / "72.json").exists()


def test_a_failing_job_on_three_nodes_asks_slurm_once(env: Env, tmp_path: Path):
    src = env.add("gone", {"x": b"x" * 100}, on_failure="hold")
    env.cli("manifest", "build", "gone")
    shutil.rmtree(src)  # the source is down on every node
    slurm = FakeSlurm()
    calls = []
    real = slurm.hold

    def hold(job_id: str, reason: str) -> str:
        calls.append(job_id)
        return real(job_id, reason)
    slurm.hold = hold  # type: ignore[method-assign]
    run = tmp_path / "run"
    for node in ("n1", "n2", "n3"):
        assert prolog(env, run, slurm, node, "80", "n[1-3]", request="gone") == 0  # never a drain
        lines = (run / node / node / "jobs" / "80.task").read_text()
        assert runfiles.HOLD_MARK in lines  # every node's tasks are stopped
    assert calls == ["80"]  # one node told Slurm, not three
    assert json.loads((env.state / "jobs" / "80.hold").read_text())["by"] == "n1"
    # where the claim cannot be trusted (a directory others can write), every node holds
    os.chmod(env.state / "jobs", 0o777)
    try:
        assert prolog(env, run, slurm, "n2", "81", "n[1-3]", request="gone") == 0
        assert calls == ["80", "81"]
    finally:
        os.chmod(env.state / "jobs", 0o755)


def test_a_record_for_other_nodes_is_not_taken(env: Env):
    env.add("coco", {"a": b"1"})
    env.cli("manifest", "build", "coco")
    assert jobrecord.pin(str(env.state), "90", "n[1-2]", "n1", {"coco": "a" * 64}) == {"coco": "a" * 64}
    assert jobrecord.pin(str(env.state), "90", "n[1-2]", "n2", {"coco": "b" * 64}) == {"coco": "a" * 64}
    # job id 90 used again by Slurm for another job on other nodes: its own reading stands
    assert jobrecord.pin(str(env.state), "90", "n[3-4]", "n3", {"coco": "c" * 64}) == {"coco": "c" * 64}


def test_a_link_nfs_reports_as_failed_though_it_made_the_record_still_wins(env: Env, monkeypatch):
    from dsstage.fs import shared
    env.state.mkdir(parents=True, exist_ok=True)
    real = os.link

    def retransmitted(*a, **k):
        real(*a, **k)
        raise FileExistsError(17, "File exists")  # the reply was lost; the retry finds its own link
    monkeypatch.setattr(os, "link", retransmitted)
    assert shared.create_once(str(env.state / "jobs"), "5.hold", b"x", (0,)) is True
    monkeypatch.setattr(os, "link", real)
    assert shared.create_once(str(env.state / "jobs"), "5.hold", b"y", (0,)) is False


def test_a_hold_claim_left_for_other_nodes_is_not_taken(env: Env):
    env.state.mkdir(parents=True, exist_ok=True)
    assert jobrecord.claim_hold(str(env.state), "95", "n[1-2]", "n1") == (True, "n1")
    assert jobrecord.claim_hold(str(env.state), "95", "n[1-2]", "n2") == (False, "n1")
    assert jobrecord.claim_hold(str(env.state), "95", "n[1-2]", "n1") == (True, "n1")  # its own claim
    assert jobrecord.claim_hold(str(env.state), "95", "n[7-8]", "n7") == (True, "n7")  # a job id used again


def test_status_reads_a_jobs_records_as_its_nodes_do(env: Env):
    """One reader of the job records (dsstage.node.jobrecord.recorded): what `status --job`
    shows is what the job's nodes took, and a record nobody but root or report.user could have
    written counts as none there too (before, status read it with no writer check)."""
    env.add("coco", {"a": b"1"})
    env.cli("manifest", "build", "coco")
    assert jobrecord.pin(str(env.state), "91", "n[1-2]", "n1", {"coco": "a" * 64}) == {"coco": "a" * 64}
    assert jobrecord.recorded(str(env.state), "91", ["n1", "n2"]) == ({"coco": "a" * 64}, None)
    forged = env.state / "jobs" / "92.json"
    forged.write_text('{"format": 1, "job": "92", "nodes": "n[1-2]", "versions": {"coco": "' + "f" * 64 + '"}}')
    os.chown(forged, 65534, 65534)  # a user's file in a directory it should not have reached
    assert jobrecord.recorded(str(env.state), "92", ["n1", "n2"]) == ({}, None)
    assert jobrecord.recorded(str(env.state), "../x", ["n1"]) == ({}, None)
