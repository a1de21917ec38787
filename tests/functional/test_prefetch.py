"""Pre-staging on a real store: `dsstage prefetch` stages what pending jobs planned on this
node need, yields to a Prolog, spares what sooner jobs need, and gives up when the plan
changes (see dsstage.cluster.prefetch)."""

from __future__ import annotations

import json
import os
import pwd
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from dsstage.config.catalog import User
from dsstage.node import report, staging, standalone, verifying
from dsstage.node.lock import read_owner
from dsstage.policy import demand
from dsstage.slurm.records import Job

from tests.helpers import Env

ME = pwd.getpwuid(os.getuid()).pw_name


def pending(job_id: str, name: str, *, nodes: str = "n1", start_in: float = 60.0) -> Job:
    return Job(job_id, ME, "PENDING", (name,), partition="gpu", priority=100, start_time=time.time() + start_in,
               sched_nodes=nodes)


def snapshot(env: Env, *jobs: Job) -> None:
    demand.write(str(env.state), demand.build(jobs, time.time()))


@pytest.fixture
def env(tmp_path: Path) -> Env:
    e = Env(tmp_path)
    e.extra = {"prefetch": {"horizon": "10m", "interval": "1s"}, "retention": {"min_keep": 0}}
    for name in ("x", "y"):
        e.add(name, {f"{i}.bin": (name * 1000).encode() + bytes([i]) for i in range(8)})
        e.cli("manifest", "build", name)
    return e


def ready(env: Env, name: str) -> bool:
    d = env.tier_root() / "ready" / name
    return d.is_dir() and any(d.iterdir())


def events(env: Env) -> list[dict]:
    return report.local(str(env.run), env.node).get("prefetch") or []


def test_stages_what_a_job_planned_here_needs_and_nothing_else(env: Env) -> None:
    snapshot(env, pending("11", "x"), pending("12", "y", nodes="n2"))
    dry = env.cli_json("prefetch", "--dry-run")
    assert [c["dataset"] for c in dry["prefetch"]] == ["x"]
    assert dry["prefetch"][0]["reason"].startswith("pending job 11 planned on n1, expected in")

    res = env.cli("prefetch", "--once")
    assert "staged x for job 11" in res.stderr
    assert ready(env, "x") and not ready(env, "y")
    mark = json.loads(next((env.tier_root() / "ready" / "x").iterdir()).read_text())
    assert mark["prefetched_for"] == "11"
    assert not any((env.tier_root() / "leases").rglob("*.json")), "a prefetch keeps no lease"
    [event] = events(env)
    assert event["action"] == "staged" and event["job_id"] == "11" and event["bytes"] > 0
    published = json.loads((env.state / "nodes" / "n1.json").read_text())
    assert published["prefetch"][-1]["dataset"] == "x"
    assert [c["prefetched_for"] for c in published["copies"] if c["dataset"] == "x"] == ["11"]
    # the job's Prolog then takes the warm path: nothing left to stage
    result = staging.stage(env.store(), "x", staging.StageRequest(user=User.lookup(os.getuid()), job_id="11"))
    assert result.action == "cached"


def test_beyond_the_horizon_or_stale_snapshot_nothing(env: Env) -> None:
    snapshot(env, pending("21", "x", start_in=3600))
    dry = env.cli_json("prefetch", "--dry-run")
    assert dry["prefetch"] == [] and "beyond the horizon" in dry["skipped"][0]["reason"]
    demand.write(str(env.state), demand.build([pending("22", "x")], time.time() - 3600))
    res = env.cli("prefetch", "--once")
    assert "stale or missing" in res.stderr
    assert not ready(env, "x")


def slow(env: Env, size: int = 3_000_000) -> None:
    """Dataset ``big`` of ``size`` bytes, and prefetches limited to 256 kB/s (12 s for it)."""
    env.add("big", {f"{i}.bin": os.urandom(size // 6) for i in range(6)})
    env.cli("manifest", "build", "big")
    env.extra["prefetch"]["bwlimit"] = "256kB"
    env.write()


def wait_for_prefetch_lock(env: Env, name: str) -> None:
    lock = str(env.tier_root() / "locks" / f"{name}.lock")
    for _ in range(200):
        if read_owner(lock).get("action") == "prefetch" and (env.tier_root() / "staging").exists() \
                and any((env.tier_root() / "staging").iterdir()):
            return
        time.sleep(0.05)
    raise AssertionError("the prefetch never took the lock")


def while_prefetching(env: Env, name: str, action: Callable[[], Any]) -> tuple[Any, str]:
    """Run ``action`` once `dsstage prefetch --once` holds the lock of ``name`` and stages;
    its result, and the prefetch's log."""
    proc = env.popen("prefetch", "--once")
    try:
        wait_for_prefetch_lock(env, name)
        result = action()
    finally:
        _out, err = proc.communicate(timeout=60)
    return result, err


def test_a_prolog_takes_the_stage_over(env: Env) -> None:
    slow(env)
    snapshot(env, pending("31", "big"))
    job = staging.StageRequest(user=User.lookup(os.getuid()), job_id="31")
    result, err = while_prefetching(env, "big", lambda: staging.stage(env.store(), "big", job))
    assert result.action == "staged"
    assert "yielded big for job 31: job 31 needs it now" in err
    assert events(env)[-1]["action"] == "yielded"
    assert verifying.verify(env.store(), "big", full=True).ok
    assert not (env.tier_root() / "locks" / "big.lock.yield").exists()


def test_gives_up_when_the_plan_changes(env: Env) -> None:
    slow(env)
    snapshot(env, pending("41", "big"))
    _, err = while_prefetching(env, "big", lambda: snapshot(env, pending("41", "big", nodes="n2")))  # plan moved
    assert "abandoned big for job 41: no pending job wants big on n1" in err
    assert "its staging area was removed" in err
    assert not ready(env, "big")
    assert not any((env.tier_root() / "staging").iterdir())


def test_spares_what_a_sooner_job_needs(env: Env) -> None:
    # the tier holds two of x, y, z: x is ready and wanted sooner here, z later
    env.add("z", {f"{i}.bin": b"z" * 1000 + bytes([i]) for i in range(8)})
    env.cli("manifest", "build", "z")
    data = yaml.safe_load(env.config_path.read_text())
    data["tiers"]["nvme"].update(capacity=17000, high_watermark="100%", low_watermark="50%")
    env.config_path.write_text(yaml.safe_dump(data))
    standalone.warm(env.store(), "x", user=User.lookup(os.getuid()))
    standalone.warm(env.store(), "y", user=User.lookup(os.getuid()))
    snapshot(env, pending("51", "x", start_in=30), pending("52", "z", start_in=120))
    res = env.cli("prefetch", "--once")
    # y (no demand) may go for z; x (job 51, sooner) may not
    assert "staged z for job 52" in res.stderr
    assert ready(env, "x") and ready(env, "z") and not ready(env, "y")

    standalone.warm(env.store(), "y", user=User.lookup(os.getuid()))  # the Prolog's make_room evicts z (no demand)
    snapshot(env, pending("53", "x", start_in=30), pending("54", "y", start_in=20), pending("55", "z", start_in=600))
    res = env.cli("prefetch", "--once")
    assert "skipped z for job 55" in res.stderr and "which pending job" in res.stderr
    assert ready(env, "x") and ready(env, "y")


def job_stage_while_prefetching(env: Env, capacity: int, name: str, *, job: str,
                                prefetched_for: str | None = None) -> tuple[Any, str]:
    """A tier of ``capacity`` bytes; while the prefetch stages big for a pending job, a
    job's stage of ``name``: its result, and the prefetch's log."""
    slow(env)
    data = yaml.safe_load(env.config_path.read_text())
    data["tiers"]["nvme"].update(capacity=capacity, high_watermark="100%")
    env.config_path.write_text(yaml.safe_dump(data))
    snapshot(env, pending(prefetched_for or job, "big"))
    return while_prefetching(env, "big",
                             lambda: staging.stage(env.store(), name,
                                                   staging.StageRequest(user=User.lookup(os.getuid()), job_id=job)))


def test_a_stage_resuming_an_interrupted_one_counts_its_space_once(env: Env) -> None:
    # a tier that holds big once (3 MB of 3.4 MB): the interrupted stage's reservation is
    # the one the resuming stage takes over, not more space on top of it
    result, err = job_stage_while_prefetching(env, 3_400_000, "big", job="61")
    assert result.action == "staged" and "yielded big for job 61" in err


def test_a_prolog_for_another_dataset_stops_a_prefetch_that_holds_the_room(env: Env) -> None:
    # a tier that holds big (3 MB) or x, not both while big stages: the job allocated here
    # now (x) outweighs the pending one (big) whose prefetch reserved the room
    result, err = job_stage_while_prefetching(env, 3_005_000, "x", job="72", prefetched_for="71")
    assert result.action == "staged" and ready(env, "x")
    assert "yielded big for job 71: job 72 needs it now" in err
    assert not ready(env, "big") and not any((env.tier_root() / "staging").iterdir())
    assert not list((env.tier_root() / "reserved").iterdir())  # the prefetch's reservation went with it
    assert not (env.tier_root() / "locks" / "big.lock.yield").exists()


def test_a_running_prefetch_follows_the_configuration_file(env: Env) -> None:
    """A dataset added to the configuration while the prefetch runs is staged by its next
    round (it used to keep the configuration it started with, and its reports lacked tiers
    added since)."""
    from dsstage.cluster.prefetch import Prefetcher
    env.write()
    pre = Prefetcher(env.config(), env.node, run_dir=str(env.run))
    env.add("z", {"0.bin": b"z" * 1000})
    env.write()
    env.cli("manifest", "build", "z")
    snapshot(env, pending("13", "z"))
    assert "z" not in pre.conf.datasets
    pre.follow_config()
    assert "z" in pre.conf.datasets
    cands, _skips, _dem = pre.candidates()
    assert [c.dataset for c in cands] == ["z"]


@pytest.mark.parametrize("shift", [0, 1, 2])  # other files, other shard digests, other rendezvous
def test_a_sharded_dataset_prefetches_the_part_the_jobs_plan_will_give_this_node(env: Env, tmp_path: Path,
                                                                                shift: int) -> None:
    """A pending 3-node job on a sharded dataset: this node stages only the shards the job's
    plan will give it (not the whole version), and when the job starts its plan gives this
    node exactly those, found ready with their view: the warm path answers."""
    from dsstage.hooks import job as hooks
    from dsstage.hooks import warm
    files = {f"part-{i:03d}": bytes([i + shift]) * (300 + i) for i in range(12)}
    env.add("big", files, shards=6)
    env.cli("manifest", "build", "big")
    snapshot(env, pending("41", "big", nodes="n[1-3]"))
    res = env.cli("prefetch", "--once")
    assert "staged big for job 41" in res.stderr, res.stderr
    held = sorted(os.listdir(env.tier_root() / "datasets" / "big"))
    assert len(held) == 2, held  # a third of the 6 shards, not the version
    assert not any((env.tier_root() / "leases").rglob("*.json")), "a prefetch keeps no lease"
    dry = env.cli_json("prefetch", "--dry-run")  # the next round has nothing to do for it
    assert dry["prefetch"] == [] and {(s["dataset"], s["reason"]) for s in dry["skipped"]} == {
        ("big", "its part for the job is ready here already")}, dry
    # the job starts: n1's Prolog (its first node) makes the plan from the published reports
    run = tmp_path / "run"
    e = {"SLURM_JOB_ID": "41", "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid()),
         "SLURM_JOB_USER": ME, "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n[1-3]",
         "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}
    hooks.write_config_cache(str(run), env.config())  # what the full Prolog leaves for the warm path
    assert warm.prolog(e, str(run), str(env.config_path)) == 0
    task = (run / "n1" / "jobs" / "41.task").read_text()
    plan = json.loads((env.state / "jobs" / "41.shards.json").read_text())["shards"]["big"]
    assert sorted(plan["n1"]) == held and "DSSTAGE_SHARDS_BIG=" in task
    assert sorted(os.listdir(env.tier_root() / "datasets" / "big")) == held  # nothing more was staged
    views = [v for v in os.listdir(env.tier_root() / "views" / "big") if not v.endswith((".json", ".files"))]
    assert len(views) == 1 and f"/views/big/{views[0]}" in task  # the view the prefetch made


def test_stage_and_warm_of_a_sharded_dataset_stage_this_nodes_part(env: Env) -> None:
    files = {f"part-{i:03d}": bytes([i]) * (300 + i) for i in range(12)}
    env.add("big", files, shards=6)
    env.cli("manifest", "build", "big")
    out = env.cli_json("stage", "big", "--with", "n[1-2]", "--job-id", "7")
    assert out["action"] == "staged" and "/views/big/" in out["path"]
    assert len(os.listdir(env.tier_root() / "datasets" / "big")) == 3  # half of the shards
    listed = sorted(str(p.relative_to(out["path"])) for p in Path(out["path"]).rglob("*") if p.is_file())
    assert len(listed) == 6 and all((Path(out["path"]) / p).read_bytes() == files[p] for p in listed)
    # alone (no job's nodes): every shard; dsstage warm the same, without a lease
    assert len(os.listdir(Path(env.cli_json("stage", "big", "--job-id", "8")["path"]))) == 12
    assert env.cli_json("warm", "big")["action"] == "cached"
    with pytest.raises(Exception, match="sharded"):
        staging.stage(env.store(), "big", staging.StageRequest(user=User.lookup(os.getuid()), job_id="9"))


def test_a_ready_sharded_part_is_not_worked_out_again_every_round(env: Env, monkeypatch) -> None:
    """Working out a pending job's part reads each of its nodes' published reports: once found
    ready, the prefetch takes it as ready for PART_READY_TTL, then looks again."""
    from dsstage.cluster import prefetch
    env.add("big", {f"part-{i:03d}": bytes([i]) * (300 + i) for i in range(12)}, shards=6)
    env.cli("manifest", "build", "big")
    snapshot(env, pending("42", "big", nodes="n[1-3]"))
    assert "staged big for job 42" in env.cli("prefetch", "--once").stderr  # n1's part
    now = [time.time()]
    pre = prefetch.Prefetcher(env.config(), env.node, run_dir=str(env.run), clock=lambda: now[0])
    looks = []
    real = prefetch.standalone.part_ready
    monkeypatch.setattr(prefetch.standalone, "part_ready", lambda *a: looks.append(a) or real(*a))
    for _ in range(3):
        cands, skips, _dem = pre.candidates()
        assert cands == [] and [s.reason for s in skips] == ["its part for the job is ready here already"]
    assert len(looks) == 1  # the first round after the stage looked; the next two did not
    now[0] += prefetch.PART_READY_TTL + 1
    later = pending("42", "big", nodes="n[1-3]", start_in=now[0] - time.time() + 60)
    demand.write(str(env.state), demand.build([later], now[0]))  # the poller's snapshot of that moment
    cands, skips, _dem = pre.candidates()
    assert cands == [] and len(looks) == 2, skips  # looked again, and found it ready


def test_warm_on_nodes_stages_each_nodes_part_of_a_sharded_dataset(env: Env) -> None:
    """`dsstage warm NAME --nodes HOSTLIST` runs `dsstage warm NAME --with HOSTLIST` on each
    node for a sharded dataset: each node stages the part a job on those nodes would get."""
    from dsstage.cli.node import warm_argv
    env.add("big", {f"part-{i:03d}": bytes([i]) * (300 + i) for i in range(12)}, shards=6)
    env.cli("manifest", "build", "big")
    assert warm_argv(env.config(), "big", "n[1-2]") == ["warm", "big", "--with", "n[1-2]"]
    assert warm_argv(env.config(), "x", "n[1-2]") == ["warm", "x"]
    out = env.cli_json("warm", "big", "--with", "n[1-2]")
    assert out["action"] == "staged" and out["job_id"] == ""
    assert len(os.listdir(env.tier_root() / "datasets" / "big")) == 3  # half of the 6 shards
    assert not any((env.tier_root() / "leases").rglob("*.json")), "warm keeps no lease"
