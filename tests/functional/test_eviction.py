"""Retention on a real store: the Epilog's plan, the Prolog making room, stale leases,
``dsstage evict``, and the trash surviving a cut-short purge."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from dsstage.config.catalog import User
from dsstage.errors import NoSpace
from dsstage.hooks import job as hooks
from dsstage.node import background, eviction, staging
from dsstage.policy import demand
from dsstage.policy.retention import keeper_of
from dsstage.slurm.records import Job

from tests.helpers import Env, wait_flushed

SIZE = 3000  # bytes per dataset


@pytest.fixture
def env(tmp_path: Path) -> Env:
    e = Env(tmp_path)
    for name in ("x", "y", "z"):
        e.add(name, {"f": name.encode() * SIZE})
    # 10 000 bytes; above 9 000 evict down to 4 000; nothing is "recent"
    e.extra = {"retention": {"min_keep": 0}}
    data = yaml.safe_load(e.write().read_text())
    data["tiers"]["nvme"].update(capacity=10000, high_watermark="90%", low_watermark="40%")
    e.config_path.write_text(yaml.safe_dump(data))
    for name in ("x", "y", "z"):
        e.cli("manifest", "build", name)
    return e


def user() -> User:
    return User.lookup(os.getuid())


def snapshot(env: Env, *jobs: Job, age: float = 0) -> None:
    demand.write(str(env.state), demand.build(jobs, time.time() - age))


def on_node(env: Env) -> list[str]:
    root = env.tier_root()
    return sorted(p.name for p in (root / "datasets").iterdir() if any((root / "datasets" / p.name).iterdir()))


def epilog(env: Env, job: str, request: str, caplog: pytest.LogCaptureFixture) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rc = hooks.epilog({"SLURM_JOB_ID": job, "SLURMD_NODENAME": env.node, "SPANK_DSSTAGE_DATASETS": request},
                          run_dir=str(env.tmp / "run"), load_config=env.config)
    assert rc == 0
    return caplog.text


def wait_trash_empty(env: Env) -> None:
    deadline = time.monotonic() + 30
    while any((env.tier_root() / "trash").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any((env.tier_root() / "trash").iterdir())
    assert not [r for r in os.listdir(env.tier_root() / "reserved") if r.startswith("trash-")]


def test_epilog_keeps_what_a_pending_job_wants_and_evicts_the_rest(env: Env, caplog):
    store = env.store()
    staging.stage(store, "y", staging.StageRequest(user=user(), job_id="1"))  # staged first: the least recently used
    staging.stage(store, "x", staging.StageRequest(user=user(), job_id="2"))
    staging.stage(store, "z",
                  staging.StageRequest(user=user(), job_id="3"))  # 9 000 bytes: at the high watermark, not above
    store.release("y", "1")
    store.release("z", "3")
    snapshot(env, Job("9", "u", "PENDING", ("x",), sched_nodes=env.node, start_time=time.time() + 600))
    wait_flushed(env)
    store2 = env.store()
    log = epilog(env, "2", "x", caplog)
    assert "released x" in log
    assert on_node(env) == ["x", "y", "z"]  # 9 000 is not above 90 %
    from dsstage.node import space
    from dsstage.node.store import open_tier
    with open_tier(store2.layout("nvme")) as tier:
        space.hold(tier, "stage-other.json", 500, "a stage in progress")
    log = epilog(env, "2", "x", caplog)
    # y and z have no demand: they go (y, the least recently used, first); x is wanted
    assert on_node(env) == ["x"], log
    assert "evicted y" in log and "evicted z" in log and "over high watermark" in log
    wait_trash_empty(env)


def test_stale_snapshot_keeps_what_it_cannot_judge_and_says_so(env: Env, caplog):
    store = env.store()
    for i, name in enumerate(("x", "y", "z")):
        staging.stage(store, name, staging.StageRequest(user=user(), job_id=str(i + 1)))
    store.release("x", "1")
    snapshot(env, Job("9", "u", "PENDING", ("x",)), age=3600)
    log = epilog(env, "2", "y", caplog)
    assert "the demand snapshot is 3600s old (bound 300s): retention decides without the queue's demand" in log
    assert on_node(env) == ["x", "y", "z"]  # no pressure: nothing goes on a guess
    log = epilog(env, "3", "z", caplog)
    assert on_node(env) == ["x", "y", "z"]


def test_epilog_without_snapshot_says_the_poller_is_missing(env: Env, caplog):
    staging.stage(env.store(), "x", staging.StageRequest(user=user(), job_id="1"))
    log = epilog(env, "1", "x", caplog)
    assert "no demand snapshot at" in log and "is `dsstage demand-poller` running?" in log
    assert on_node(env) == ["x"]


def test_leased_copies_survive_pressure(env: Env, caplog):
    store = env.store()
    for i, name in enumerate(("x", "y", "z")):
        staging.stage(store, name, staging.StageRequest(user=user(), job_id=str(i + 1)))
    from dsstage.node import space
    from dsstage.node.store import open_tier
    with open_tier(store.layout("nvme")) as tier:
        space.hold(tier, "stage-other.json", 900, "a stage in progress")
    snapshot(env, Job("1", "u", "RUNNING", ("x",), nodes=env.node), Job("2", "u", "RUNNING", ("y",), nodes=env.node),
             Job("3", "u", "RUNNING", ("z",), nodes=env.node))
    log = epilog(env, "77", "x", caplog)
    assert on_node(env) == ["x", "y", "z"], log


def test_prolog_makes_room_through_the_planner(env: Env):
    store = env.store()
    staging.stage(store, "x", staging.StageRequest(user=user(), job_id="1"))
    staging.stage(store, "y", staging.StageRequest(user=user(), job_id="2"))
    store.release("x", "1")
    store.release("y", "2")
    snapshot(env, Job("9", "u", "PENDING", ("y",), sched_nodes=env.node))
    with open(env.tier_root() / "nvme-filler", "wb"):
        pass
    # z needs 3 000 more: 9 000 is not above 90 %... add a reservation so that it is
    from dsstage.node import space
    from dsstage.node.store import open_tier
    with open_tier(store.layout("nvme")) as tier:
        space.hold(tier, "stage-other.json", 2000, "a stage in progress")
    wait_flushed(env)
    result = staging.stage(store, "z", staging.StageRequest(user=user(), job_id="3"))
    assert result.action == "staged"
    assert on_node(env) == ["y", "z"]  # x had no demand; y is wanted by job 9


def test_a_stage_takes_the_headroom_and_the_epilog_gives_it_back(env: Env, caplog):
    store = env.store()
    staging.stage(store, "x", staging.StageRequest(user=user(), job_id="1"))
    staging.stage(store, "y", staging.StageRequest(user=user(), job_id="2"))
    store.release("x", "1")
    store.release("y", "2")
    from dsstage.node import space
    from dsstage.node.store import open_tier
    with open_tier(store.layout("nvme")) as tier:
        space.hold(tier, "stage-other.json", 500, "a stage in progress")
    snapshot(env)
    wait_flushed(env)
    # 6 500 in use; z's 3 000 more make 9 500: above the high watermark (9 000), within the capacity
    assert staging.stage(store, "z", staging.StageRequest(user=user(), job_id="3")).action == "staged"
    assert on_node(env) == ["x", "y", "z"]  # the Prolog evicted nothing
    log = epilog(env, "3", "z", caplog)
    assert on_node(env) == ["z"], log  # the Epilog freed down to the low watermark (4 000)
    assert "over high watermark (90% of " in log


def test_prolog_that_cannot_make_room_says_what_holds_the_space(env: Env):
    store = env.store()
    staging.stage(store, "x", staging.StageRequest(user=user(), job_id="1"))
    staging.stage(store, "y", staging.StageRequest(user=user(), job_id="2"))
    from dsstage.node import space
    from dsstage.node.store import open_tier
    with open_tier(store.layout("nvme")) as tier:
        space.hold(tier, "stage-other.json", 2000, "a stage in progress")
    with pytest.raises(NoSpace) as exc:
        staging.stage(store, "z", staging.StageRequest(user=user(), job_id="3"))
    msg = str(exc.value)
    assert "cannot make room for 'z', which needs 2.9 KiB more" in msg
    assert "leased by job 1" in msg and "leased by job 2" in msg and "reserved by stages in progress" in msg
    assert on_node(env) == ["x", "y"]  # nothing was evicted for a stage that could not fit anyway


def test_stale_leases_are_reclaimed_from_the_snapshot_never_a_live_one(env: Env, caplog):
    store = env.store()
    old = env.store(clock=lambda: time.time() - 600)
    staging.stage(old, "x", staging.StageRequest(user=user(), job_id="101"))  # killed without an Epilog
    staging.stage(store, "x", staging.StageRequest(user=user(), job_id="102"))  # running here
    staging.stage(store, "x",
                  staging.StageRequest(user=user(), job_id="103"))  # running on another node too (multi-node job)
    snapshot(env, Job("102", "u", "RUNNING", ("x",), nodes=env.node), Job("103", "u", "RUNNING", ("x",), nodes="n9"))
    staging.stage(store, "x",
                  staging.StageRequest(user=user(), job_id="104"))  # started after the snapshot: not in it yet
    log = epilog(env, "50", "y", caplog)
    assert "reclaimed the lease of job 101 on x: the job is gone" in log
    leases = sorted(p.stem for p in (env.tier_root() / "leases" / "x").iterdir())
    assert leases == ["102", "103", "104"]


def test_no_lease_is_reclaimed_on_a_stale_snapshot(env: Env, caplog):
    staging.stage(env.store(), "x", staging.StageRequest(user=user(), job_id="101"))
    snapshot(env, age=3600)
    epilog(env, "50", "y", caplog)
    assert (env.tier_root() / "leases" / "x" / "101.json").exists()


def test_evict_refuses_a_wanted_copy_without_force_and_dry_run_changes_nothing(env: Env):
    env.cli("stage", "x", "--job-id", "1")
    env.cli("release", "x", "--job-id", "1")
    snapshot(env, Job("9", "u", "PENDING", ("x",), partition="gpu"))
    [row] = env.cli_json("evict", "x")
    assert row["action"] == "kept" and row["reason"].startswith("wanted by pending job 9 (partition gpu")
    assert row["reason"].endswith("not evicted without --force")
    [row] = env.cli_json("evict", "x", "--force", "--dry-run")
    assert row["action"] == "would evict" and on_node(env) == ["x"]
    [row] = env.cli_json("evict", "x", "--force")
    assert row["action"] == "evicted" and on_node(env) == []
    wait_trash_empty(env)


def test_evict_without_a_name_shows_the_plan(env: Env):
    env.cli("stage", "x", "--job-id", "1")
    env.cli("stage", "y", "--job-id", "2")
    env.cli("release", "y", "--job-id", "2")
    snapshot(env)
    out = env.cli("evict", "--dry-run").stdout
    assert "nvme x " in out and "kept: leased by job 1" in out
    assert "nvme y " in out and "kept: no demand, idle" in out
    # and without --dry-run applies it, as the Epilog does: no pressure, so both stay
    out = env.cli("evict").stdout
    assert "kept: leased by job 1" in out and "kept: no demand, idle" in out
    assert (env.tier_root() / "ready" / "x").exists() and (env.tier_root() / "ready" / "y").exists()


def test_a_purge_cut_short_is_restarted_by_the_next_retention_pass(env: Env, monkeypatch, caplog):
    store = env.store()
    staging.stage(store, "x", staging.StageRequest(user=user(), job_id="1"))
    store.release("x", "1")
    monkeypatch.setattr(background, "purge_later", lambda layout: None)  # the node "reboots" before it runs
    eviction.evict(store, "x")
    assert any((env.tier_root() / "trash").iterdir())
    monkeypatch.undo()
    epilog(env, "5", "y", caplog)
    wait_trash_empty(env)


def test_with_peers_evict_dry_run_says_which_copy_is_the_last_in_the_cluster(env: Env):
    """With peers.enabled the snapshot's copies (the poller reads every node's report) reach
    the node's plan: of two unwanted copies the cluster has used, the one no other node holds
    is "the last copy in the cluster"; the other, held on a node the cluster keeps it on
    (retention.keeper_of picks it), is not."""
    data = yaml.safe_load(env.config_path.read_text())
    data["peers"] = {"enabled": True}
    env.config_path.write_text(yaml.safe_dump(data))
    for i, name in enumerate(("x", "y")):
        env.cli("stage", name, "--job-id", str(i + 1))
        env.cli("release", name, "--job-id", str(i + 1))
    version = {name: env.cli_json("stage", name, "--job-id", "7")["digest"][:16] for name in ("x", "y")}
    env.cli("release", "x", "--job-id", "7")
    env.cli("release", "y", "--job-id", "7")
    other = next(f"a{i}" for i in range(100) if keeper_of("y", version["y"], (env.node, f"a{i}")) != env.node)
    snap = demand.build((), time.time(), copies={"x": {version["x"]: env.node},
                                                  "y": {version["y"]: f"{env.node},{other}"}})
    demand.write(str(env.state), replace(snap, uses={"x": 2.0, "y": 2.0}))
    out = env.cli("evict", "--dry-run").stdout
    line = {n: next(ln for ln in out.splitlines() if f"nvme {n} " in ln) for n in ("x", "y")}
    assert "kept: the last copy in the cluster; used by 2 jobs in the cluster" in line["x"], out
    assert "cluster keeps" not in line["y"] and "last copy" not in line["y"], out
    assert "kept: no demand; used by 2 jobs" in line["y"], out
