"""Switches for a rollout: a pilot (rollout.partitions, rollout.nodes) and the cluster-wide
switch (`dsstage disable` / `enable`). Where dsstage does not act, a job that asked for a
dataset runs against its source with a warning, never held; the warm path defers to that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from dsstage.hooks import job as hooks
from dsstage.node import rollout
from dsstage.slurm.fake import FakeSlurm
from helpers import Env


@pytest.fixture
def coco(env: Env) -> Path:
    src = env.add("coco", {"a": b"1" * 1000})
    env.cli("manifest", "build", "coco")
    return src


def prolog(env: Env, run: Path, job: str = "42", partition: str = "gpu") -> tuple[int, list[str], FakeSlurm]:
    slurm = FakeSlurm()
    e = {"SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
         "SLURMD_NODENAME": env.node, "SLURM_JOB_PARTITION": partition,
         "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "coco"}
    rc = hooks.prolog(e, run_dir=str(run), slurm=slurm, load_config=env.config)
    lines = (run / env.node / "jobs" / f"{job}.task").read_text().splitlines()
    return rc, lines, slurm


def configure(env: Env, **rollout_spec: object) -> None:
    data = yaml.safe_load(env.config_path.read_text())
    data["rollout"] = rollout_spec
    env.config_path.write_text(yaml.safe_dump(data))


def test_the_cluster_wide_switch_sends_jobs_to_their_sources_and_back(env: Env, coco: Path, tmp_path):
    run = tmp_path / "run"
    rc, lines, _ = prolog(env, run, "1")  # staged: the warm path's cache and a ready copy exist now
    assert rc == 0 and any("datasets/coco/" in line for line in lines)
    out = env.cli("disable", "--reason", "NVMe firmware update until 14:00").stdout
    assert "disabled on every node" in out
    record = json.loads((env.state / rollout.SWITCH).read_text())
    assert record["reason"] == "NVMe firmware update until 14:00" and record["by"]
    rc, lines, slurm = prolog(env, run, "2")
    assert rc == 0 and slurm.held == {}
    assert f"export DSSTAGE_PATH_COCO={coco}" in lines, lines  # the warm path deferred: the source, not the copy
    assert any(line.startswith("print dsstage: warning: dsstage is disabled on the whole cluster by ")
               and "NVMe firmware update until 14:00" in line for line in lines), lines
    assert "enabled again" in env.cli("enable").stdout
    rc, lines, _ = prolog(env, run, "3")
    assert any("datasets/coco/" in line for line in lines), lines
    assert "was not disabled" in env.cli("enable").stdout
    res = env.cli("disable", check=False)
    assert res.returncode != 0 and "--reason" in res.stderr


def test_a_pilot_stages_only_in_its_partitions_and_on_its_nodes(env: Env, coco: Path, tmp_path):
    run = tmp_path / "run"
    configure(env, partitions=["pilot"])
    rc, lines, slurm = prolog(env, run, "1", partition="gpu")
    assert rc == 0 and slurm.held == {} and f"export DSSTAGE_PATH_COCO={coco}" in lines
    assert any("not enabled for partition gpu (rollout.partitions: pilot)" in line for line in lines), lines
    rc, lines, _ = prolog(env, run, "2", partition="pilot")
    assert any("datasets/coco/" in line for line in lines), lines
    configure(env, nodes="n[7-9]")  # this node is n1
    rc, lines, _ = prolog(env, run, "3", partition="pilot")
    assert f"export DSSTAGE_PATH_COCO={coco}" in lines
    assert any(f"not enabled on node {env.node} (rollout.nodes)" in line for line in lines), lines


def test_a_disabled_node_prefetches_nothing(env: Env, coco: Path):
    env.cli("disable", "--reason", "maintenance")
    dry = env.cli_json("prefetch", "--dry-run")
    assert dry["prefetch"] == [] and "maintenance: nothing is prefetched" in dry["skipped"][0]["reason"], dry


@pytest.mark.parametrize("spec, message", [({"partitions": "gpu"}, "a list of partition names"),
                                           ({"nodes": "n[1-"}, "a Slurm hostlist"),
                                           ({"zones": 1}, "zones")])
def test_a_wrong_rollout_is_a_config_error(env: Env, coco: Path, spec, message):
    configure(env, **spec)
    res = env.cli("check-config", check=False)
    assert res.returncode != 0 and message in res.stderr, res.stderr


@pytest.mark.parametrize("switch, partitions, nodes, partition, node, off", [
    (None, None, None, "gpu", "n1", None),
    ({"reason": "r", "by": "ana"}, None, None, "gpu", "n1", "disabled on the whole cluster by ana: r"),
    (None, ("a", "b"), None, "b", "n1", None),
    (None, ("a",), None, "b", "n1", "not enabled for partition b"),
    (None, None, {"n1"}, "b", "n2", "not enabled on node n2"),
])
def test_the_rule(switch, partitions, nodes, partition, node, off):
    got = rollout.off_reason(switch, partitions, nodes, partition, node)
    assert (got is None) if off is None else (off in got)
