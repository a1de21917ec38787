"""A node's part of a sharded dataset: the shards a job gave it staged as copies of their own,
held by the job's one lease, and shown as one read-only view of exactly those files."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

import pytest
from dsstage.config.catalog import User
from dsstage.node import eviction, sharded
from dsstage.node.lease import LeaseBook
from dsstage.node.staging import StageRequest
from dsstage.node.store import open_tier
from dsstage.ready import lease as ready_lease
from dsstage.shards import views
from helpers import Env, wait_flushed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

FILES = {f"d{i % 3}/train-{i:05d}-of-00018": bytes([65 + i]) * (500 + 7 * i) for i in range(18)}


@pytest.fixture
def big(env: Env) -> dict:
    env.add("big", FILES, shards=6)
    return env.cli_json("manifest", "build", "big")


def test_a_nodes_part_is_its_shards_and_nothing_else(env: Env, big):
    store = env.store()
    index = sharded.shards_of(store, "big", big["digest"])
    mine = [index.shards[i].id for i in (4, 0, 2)]  # given in any order: staged and shown in shard order
    part = sharded.stage_part(store, "big", big["digest"], mine, StageRequest(user=User.lookup(0), job_id="7"))
    assert part.action == "staged" and [s.index for s in part.shards] == [0, 2, 4]
    expected = {p for s in part.shards for p in sorted(FILES)[s.start:s.stop]}
    view = Path(part.view.path)
    seen = {str(p.relative_to(view)) for p in view.rglob("*") if p.is_file()}
    assert seen == expected and all((view / p).read_bytes() == FILES[p] for p in seen)
    listed = views.listing(part.view)
    assert [os.path.relpath(p, view) for p in listed] == [p for s in part.shards for p in sorted(FILES)[s.start:s.stop]]
    assert stat.S_IMODE(os.stat(view).st_mode) == 0o755 and os.stat(view).st_uid == 0
    # one lease holds the three shards; the version itself has no copy
    with open_tier(store.layout("nvme")) as tier:
        (lease,) = LeaseBook(tier).of_job("7")
        assert lease.digest == big["digest"] and sorted(lease.shards) == sorted(s.digest for s in part.shards)
        assert sorted(tier.names("datasets", "big")) == sorted(mine)
    # a second job with the same shards finds them, and the same view
    again = sharded.stage_part(store, "big", big["digest"], mine, StageRequest(user=User.lookup(0), job_id="8"))
    assert again.action == "cached" and again.view == part.view
    # leased shards stay; once released, evicting a shard takes its views with it
    assert {e.action for e in eviction.evict(store, "big", force=True)} == {"kept"}
    store.release_job("7")
    store.release_job("8")
    gone = eviction.evict(store, "big", force=True)
    assert {e.action for e in gone} == {"evicted"} and not view.exists()
    with open_tier(store.layout("nvme")) as tier:
        assert tier.names("views", "big") == []


def test_shards_of_another_version_are_refused(env: Env, big):
    from dsstage.errors import ManifestError
    with pytest.raises(ManifestError, match="are not shards of version"):
        sharded.stage_part(env.store(), "big", big["digest"], ["0123456789abcdef"],
                           StageRequest(user=User.lookup(0), job_id="7"))


def test_a_jobs_nodes_agree_on_one_shard_plan(env: Env, big):
    from dsstage.node import jobrecord
    store = env.store()
    ids = [s.id for s in sharded.shards_of(store, "big", big["digest"]).shards]
    nodes = ["n1", "n2", "n3"]
    assert jobrecord.plan_for(str(env.state), "50", ["n1"], "n1", {"big": ids}) == {"big": {"n1": ids}}
    env.state.mkdir(exist_ok=True)
    first = jobrecord.plan_for(str(env.state), "51", nodes, "n2", {"big": ids})
    assert sorted(s for v in first["big"].values() for s in v) == sorted(ids)
    assert all(len(v) == 2 for v in first["big"].values())
    for node in ("n1", "n3"):  # the others read the first node's plan
        assert jobrecord.plan_for(str(env.state), "51", nodes, node, {"big": ids}) == first
    jobrecord.forget(str(env.state), "51")
    assert not (env.state / "jobs" / "51.shards.json").exists()


def test_more_exports_name_each_dataset_and_the_first():
    from dsstage.errors import StoreError
    from dsstage.fs import runfiles
    assert runfiles.more_exports("image-net", [("FILES", "/x/list"), ("SHARDS", "0,2")], first=True) == [
        "export DSSTAGE_FILES_IMAGE_NET=/x/list", "export DSSTAGE_FILES=/x/list",
        "export DSSTAGE_SHARDS_IMAGE_NET=0,2", "export DSSTAGE_SHARDS=0,2"]
    assert runfiles.more_exports("b", [("FILES", "/y")], first=False) == ["export DSSTAGE_FILES_B=/y"]
    with pytest.raises(StoreError):
        runfiles.more_exports("b", [("FILES", "/y\nexport X=1")], first=False)


def prolog_on(env: Env, node: str, job: str, nodes: str, run: Path) -> list[str]:
    from dsstage.hooks import job as hooks
    from dsstage.slurm.fake import FakeSlurm
    e = {"SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
         "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": nodes, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}
    assert hooks.prolog(e, run_dir=str(run), slurm=FakeSlurm(), load_config=env.config) == 0
    return (run / node / "jobs" / f"{job}.task").read_text().splitlines()


def exported(lines: list[str]) -> dict[str, str]:
    return dict(line[len("export "):].split("=", 1) for line in lines if line.startswith("export "))


def test_a_jobs_nodes_each_see_their_part_and_together_the_whole(env: Env, big, tmp_path, caplog):
    import json
    run = tmp_path / "run"
    parts = {}
    for node in ("n1", "n2", "n3"):
        got = exported(prolog_on(env, node, "60", "n[1-3]", run))
        view = got["DSSTAGE_DATASET_DIR"]
        assert got["DSSTAGE_PATH_BIG"] == view and view.startswith(str(env.tier_root(node) / "views" / "big"))
        listed = Path(got["DSSTAGE_FILES_BIG"]).read_text().splitlines()
        assert got["DSSTAGE_FILES"] == got["DSSTAGE_FILES_BIG"]
        on_disk = sorted(str(p) for p in Path(view).rglob("*") if p.is_file())
        assert sorted(listed) == on_disk and all(Path(p).read_bytes() == FILES[os.path.relpath(p, view)]
                                                 for p in listed)
        assert got["DSSTAGE_SHARD_COUNT_BIG"] == "6" and len(got["DSSTAGE_SHARDS_BIG"].split(",")) == 2
        assert int(got["DSSTAGE_NODE_FILES_BIG"]) == len(listed) >= int(got["DSSTAGE_MIN_FILES_BIG"])
        job_map = json.loads(Path(got["DSSTAGE_SHARD_MAP_BIG"]).read_text())
        assert sorted(job_map["nodes"]) == ["n1", "n2", "n3"] and job_map["shard_count"] == 6
        assert sorted(map(int, got["DSSTAGE_SHARDS_BIG"].split(","))) == job_map["nodes"][node]["shards"]
        parts[node] = {os.path.relpath(p, view) for p in listed}
    assert not parts["n1"] & parts["n2"] and not parts["n2"] & parts["n3"] and not parts["n1"] & parts["n3"]
    assert set().union(*parts.values()) == set(FILES)
    # the Epilog gives the leases back and removes the job's files
    from dsstage.hooks import job as hooks
    for node in ("n1", "n2", "n3"):
        e = {"SLURM_JOB_ID": "60", "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": "n[1-3]",
             "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}
        assert hooks.epilog(e, run_dir=str(run), load_config=env.config) == 0
        assert not list((run / node / "jobs").glob("60.*"))
    # the next job on the same nodes finds every node's part where it was: nothing is staged again
    before = {n: sorted(os.listdir(env.tier_root(n) / "datasets" / "big")) for n in ("n1", "n2", "n3")}
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for node in ("n1", "n2", "n3"):
            prolog_on(env, node, "61", "n[1-3]", run)
    assert {n: sorted(os.listdir(env.tier_root(n) / "datasets" / "big")) for n in ("n1", "n2", "n3")} == before
    done = [r.getMessage() for r in caplog.records if "job 61: big shards" in r.getMessage()]
    assert len(done) == 3 and all(" cached on " in m for m in done), done


def test_a_one_node_job_holds_every_shard(env: Env, big, tmp_path):
    got = exported(prolog_on(env, "n1", "70", "n1", tmp_path / "run"))
    assert got["DSSTAGE_SHARDS"] == "0,1,2,3,4,5" and int(got["DSSTAGE_NODE_FILES"]) == len(FILES)


def test_a_larger_job_reuses_the_shards_a_smaller_one_left(env: Env, big, tmp_path, caplog):
    """A 2-node job, then a 3-node job: the shards stay where they are as far as the quotas
    allow (from the nodes' published reports); only the new node stages, a third of the data."""
    from dsstage.hooks import job as hooks
    run = tmp_path / "run"
    for node in ("n1", "n2"):
        prolog_on(env, node, "80", "n[1-2]", run)
    for node in ("n1", "n2"):
        hooks.epilog({"SLURM_JOB_ID": "80", "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": "n[1-2]",
                      "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}, run_dir=str(run), load_config=env.config)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for node in ("n1", "n2", "n3"):
            prolog_on(env, node, "81", "n[1-3]", run)
    done = {r.getMessage().split(" on ")[1].split()[0]: r.getMessage() for r in caplog.records
            if "job 81: big shards" in r.getMessage()}
    assert " cached on " in done["n1"] and " cached on " in done["n2"] and " staged on " in done["n3"], done
    staged = sum(int(m.split("; ")[1].split()[0]) for m in done.values())
    assert staged <= len(FILES) / 3 + 1, done  # at least 60 % of the files were already on their node


def test_the_user_guides_plain_python_recipe_reads_only_local_files_in_equal_steps(env: Env, big, tmp_path):
    """The recipe in docs/user-guide.md, run as each of two ranks on each node of a 3-node job,
    with what the Prolog exported: every rank reads files of its own node's part only, the
    node's ranks read different files, and every rank of the job takes the same number of steps."""
    import re
    import subprocess
    import sys
    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text()
    recipe = re.search(r"Plain Python.*?```python\n(.*?)```", guide, re.S).group(1)
    run = tmp_path / "run"
    steps = set()
    for node in ("n1", "n2", "n3"):
        got = exported(prolog_on(env, node, "90", "n[1-3]", run))
        read: list[set[str]] = []
        for rank in range(2):
            out = subprocess.run([sys.executable, "-c", recipe + "\nprint('\\n'.join(mine))\n"], text=True,
                                 capture_output=True, check=True,
                                 env={**got, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "PATH": "/usr/bin"})
            files = set(out.stdout.split())
            assert all(f.startswith(got["DSSTAGE_DATASET_DIR"] + "/") and os.path.isfile(f) for f in files)
            read.append(files)
            steps.add(len(files))
        assert not read[0] & read[1]
    assert len(steps) == 1 and steps.pop() > 0


def test_status_shows_a_sharded_datasets_coverage(env: Env, big, tmp_path):
    run = tmp_path / "run"
    for node in ("n1", "n2"):
        prolog_on(env, node, "95", "n[1-2]", run)
    rows = [r for r in env.cli_json("status", "--no-queue")["datasets"] if r["dataset"] == "big"]
    assert [(r["version"], r["state"], r["shards"], r["count"], r["nodes"]) for r in rows] == [
        ("6 shards", "ready", {"count": 6, "of": 6}, 2, "n[1-2]")], rows
    assert "6 ready" in env.cli("status", "--no-queue").stdout


def test_verify_checks_each_shard_the_node_holds(env: Env, big, tmp_path):
    assert env.cli("verify", "big", check=False).returncode == 1  # nothing here yet
    prolog_on(env, "n1", "96", "n[1-3]", tmp_path / "run")  # this node's part: two shards
    quick = env.cli_json("verify", "big")
    assert quick["ok"] and "2 of the version's 6 shards are on this node" in quick["reason"]
    shard = next((env.tier_root() / "datasets" / "big").iterdir())
    victim = next(p for p in shard.rglob("*") if p.is_file())
    os.chmod(victim, 0o644)
    victim.write_bytes(b"rotten")
    full = env.cli_json("verify", "big", "--full")
    assert full["ok"] and full["repaired"] == [str(victim.relative_to(shard))], full
    assert victim.read_bytes() == FILES[str(victim.relative_to(shard))]
    # the job's view links the repaired file, not the rotten one
    got = exported((tmp_path / "run" / "n1" / "jobs" / "96.task").read_text().splitlines())
    in_view = Path(got["DSSTAGE_DATASET_DIR"]) / victim.relative_to(shard)
    assert in_view.read_bytes() == FILES[str(victim.relative_to(shard))]
    assert os.stat(in_view).st_ino == os.stat(victim).st_ino


def test_views_no_job_uses_are_pruned_but_the_newest(env: Env, big):
    store = env.store()
    index = sharded.shards_of(store, "big", big["digest"])
    made = []
    for i, shard in enumerate(index.shards):
        part = sharded.stage_part(store, "big", big["digest"], [shard.id],
                                  StageRequest(user=User.lookup(0), job_id=str(100 + i)))
        made.append(part.view.id)
    for i in range(5):
        store.release_job(str(100 + i))
    # each stage's background flush takes the dataset's lock a moment, and a busy lock defers
    # pruning to the next Epilog: wait for them all (every shard's mark durable)
    import json
    marks = env.tier_root() / "ready" / "big"
    assert len(list(marks.glob("*.json"))) == 6
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(json.loads(m.read_text()).get("durable")
                                                  for m in marks.glob("*.json")):
        time.sleep(0.05)
    eviction.retain(store)
    with open_tier(store.layout("nvme")) as tier:
        left = {e for e in tier.names("views", "big") if not e.endswith((".json", ".files"))}
    assert left == set(made[1:]), (made, left)  # job 105's (leased) and the 4 newest others; the oldest went


def warm_on(env: Env, node: str, job: str, nodes: str, run: Path, request: str = "big") -> int | None:
    from dsstage.hooks import warm
    e = {"SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
         "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": nodes, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": request}
    return warm.prolog(e, str(run), str(env.config_path))


def test_the_warm_path_answers_a_sharded_job_as_the_full_prolog_does(env: Env, big, tmp_path):
    """Once every node holds its part and its view, the next job on the same nodes takes the
    warm path on each: the same plan, the same view, the same exports (its own map), leased."""
    from dsstage.fs.safe import RootDir
    run = tmp_path / "run"
    full = {n: prolog_on(env, n, "60", "n[1-3]", run) for n in ("n1", "n2", "n3")}
    maps = {n: json.loads(Path(exported(full[n])["DSSTAGE_SHARD_MAP"]).read_text()) for n in full}
    from dsstage.hooks import job as hooks
    for node in ("n1", "n2", "n3"):
        hooks.epilog({"SLURM_JOB_ID": "60", "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": "n[1-3]",
                      "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}, run_dir=str(run), load_config=env.config)
    for node in ("n2", "n1", "n3"):  # any node may come first and decide the plan
        assert warm_on(env, node, "61", "n[1-3]", run) == 0, node
        task = (run / node / "jobs" / "61.task").read_text().splitlines()
        assert task == [line.replace("/60.shards-", "/61.shards-") for line in full[node]]
        got = exported(task)
        assert json.loads(Path(got["DSSTAGE_SHARD_MAP"]).read_text()) == maps[node]
        with RootDir(str(env.tier_root(node))) as tier:
            (lease,) = LeaseBook(tier).of_job("61")
        assert lease.digest == big["digest"] and len(lease.shards) == 2
        assert views.view_id([s[:16] for s in lease.shards]) == Path(got["DSSTAGE_DATASET_DIR"]).name
    assert (env.state / "jobs" / "61.shards.json").exists() and (env.state / "jobs" / "61.json").exists()


@pytest.mark.parametrize("case", ["a shard not ready", "no view", "a plan for other nodes"])
def test_the_warm_path_leaves_a_part_it_cannot_answer_to_the_full_prolog(env: Env, big, tmp_path, case):
    from dsstage.fs.safe import RootDir
    from dsstage.hooks import job as hooks
    run = tmp_path / "run"
    full = {n: exported(prolog_on(env, n, "60", "n[1-2]", run)) for n in ("n1", "n2")}
    for node in ("n1", "n2"):
        hooks.epilog({"SLURM_JOB_ID": "60", "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": "n[1-2]",
                      "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}, run_dir=str(run), load_config=env.config)
    view = Path(full["n2"]["DSSTAGE_DATASET_DIR"])
    if case == "a shard not ready":
        wait_flushed(env, "n2")  # else the shard's flush may write back the mark removed here
        shard = sorted((env.tier_root("n2") / "ready" / "big").glob("*.json"))[0]
        shard.unlink()
    elif case == "no view":
        (view.parent / f"{view.name}.json").unlink()
    else:  # job id 61 used before by a job on other nodes, its record left behind
        (env.state / "jobs").mkdir(exist_ok=True)
        (env.state / "jobs" / "61.shards.json").write_text(json.dumps({"job": "61", "nodes": ["n7", "n8"]}))
    assert warm_on(env, "n2", "61", "n[1-2]", run) is None
    with RootDir(str(env.tier_root("n2"))) as tier:
        assert LeaseBook(tier).of_job("61") == []
    assert not (run / "n2" / "jobs" / "61.task").exists()


def test_a_multi_node_job_on_the_warm_path_uses_the_version_its_first_node_chose(env: Env, tmp_path):
    """The versions every node of a job uses are recorded once (dsstage.node.jobrecord.pin),
    on the warm path too: a node whose CURRENT moved on uses what the first node chose."""
    from dsstage.hooks import job as hooks
    from dsstage.node import jobrecord
    from dsstage.slurm.fake import FakeSlurm
    env.add("coco", {"a": b"1" * 10})
    first = env.cli_json("manifest", "build", "coco")["digest"]
    run = tmp_path / "run"
    e = {"SLURM_JOB_ID": "90", "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
         "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n1", "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "coco"}
    assert hooks.prolog(e, run_dir=str(run), slurm=FakeSlurm(), load_config=env.config) == 0  # stages it
    (env.source("coco") / "a").write_bytes(b"2" * 10)
    second = env.cli_json("manifest", "build", "coco")["digest"]
    env.cli("stage", "coco", "--job-id", "1")  # both versions are ready on n1
    jobrecord.pin(str(env.state), "92", "n[1-2]", "n2", {"coco": first})  # n2 came first, before the build
    assert warm_on(env, "n1", "92", "n[1-2]", run, "coco") == 0
    assert exported((run / "n1" / "jobs" / "92.task").read_text().splitlines())["DSSTAGE_DATASET_DIR"].endswith(
        "/" + first[:16])
    assert warm_on(env, "n1", "93", "n[1-2]", run, "coco") == 0  # the first node of job 93: records its reading
    assert json.loads((env.state / "jobs" / "93.json").read_text())["versions"] == {"coco": second}


def test_retention_values_a_shard_by_the_pending_jobs_whose_plan_gives_it_this_node(env: Env, big, tmp_path):
    """n1 holds every shard (a one-node job's); a pending job planned on n1 and n2 will give
    n1 three of them (what n1 holds, its larger share): the retention planner counts that
    job's demand for those three only, and they are the ones its plan gives n1."""
    from dsstage.node import jobrecord
    from dsstage.policy import demand
    from dsstage.slurm.records import Job
    run = tmp_path / "run"
    prolog_on(env, "n1", "70", "n1", run)
    from dsstage.hooks import job as hooks
    hooks.epilog({"SLURM_JOB_ID": "70", "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n1",
                  "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}, run_dir=str(run), load_config=env.config)
    demand.write(str(env.state), demand.build([Job("71", "root", "PENDING", ("big",), partition="gpu", priority=1,
                                                   start_time=time.time() + 60, sched_nodes="n[1-2]")], time.time()))
    store = env.store()
    dem = store.demand()[0]
    with open_tier(store.layout("nvme")) as tier:
        plain = eviction.copies(store, tier, store.config.tiers["nvme"])
        # no pressure: the planner does not work out the job's plan (nothing to decide by it)
        assert all(not d.copy.not_for for d in eviction.plan(store, tier, store.config.tiers["nvme"], dem).decisions)
        # over the high watermark it does (what then goes first: tests/unit/test_retention.py)
        from dsstage.policy import retention
        tight = retention.Space(capacity=sum(c.bytes for c in plain), high=0.9, low=0.5)
        pressed = eviction.plan(store, tier, store.config.tiers["nvme"], dem, space=tight).decisions
        assert sum(1 for d in pressed if d.copy.not_for == frozenset({"71"})) == 3
    copies = eviction.with_shard_demand(store, plain, dem)
    assert len(copies) == 6
    spare = {c.version for c in copies if c.not_for == frozenset({"71"})}
    assert len(spare) == 3 and all(not c.not_for for c in copies if c.version not in spare)
    ids = [s.id for s in sharded.shards_of(store, "big", big["digest"]).shards]
    plan = jobrecord.plan_for(str(env.state), "71", ["n1", "n2"], "n1", {"big": ids})["big"]
    assert set(plan["n1"]) == {c.version for c in copies} - spare
    decisions = retention.plan(copies, dem, retention.Space(10**12), time.time(), node="n1").decisions
    reasons = {d.copy.version: d.reason for d in decisions}
    assert all("wanted by pending job 71" in reasons[v] for v in plan["n1"]) and \
        not any("wanted by pending job 71" in reasons[v] for v in spare), reasons


def test_status_job_shows_a_running_jobs_shard_map_and_a_pending_jobs_plan(env: Env, big, tmp_path):
    """`status --job` for a running 3-node job: its recorded map, by node; for a pending one
    planned on two nodes: the plan its first node would make now (the shards n1 and n2 hold)."""
    from dsstage.cluster import shardmaps, status
    from dsstage.policy import demand
    from dsstage.slurm.fake import FakeSlurm
    from dsstage.slurm.records import Job
    run = tmp_path / "run"
    parts = {n: exported(prolog_on(env, n, "97", "n[1-3]", run))["DSSTAGE_SHARDS"] for n in ("n1", "n2", "n3")}
    now = time.time()
    demand.write(str(env.state), demand.build([
        Job("97", "root", "RUNNING", ("big",), partition="gpu", priority=1, nodes="n[1-3]"),
        Job("98", "root", "PENDING", ("big",), partition="gpu", priority=1, start_time=now + 60,
            sched_nodes="n[1-2]")], now))
    conf = env.config()
    st = status.collect(conf, FakeSlurm())
    job, nodes = status.job_of(st, "97")
    maps = shardmaps.for_job(conf, job, nodes)
    assert maps["big"]["recorded"] and {n: ",".join(map(str, v)) for n, v in maps["big"]["nodes"].items()} == parts
    text = status.explain_job(st, "97", maps)
    assert "big's shards by node: " in text and all(f"{n} {shardmaps._ranges(list(map(int, p.split(','))))}" in text
                                                    for n, p in parts.items()), text
    job, nodes = status.job_of(st, "98")
    pending = shardmaps.for_job(conf, job, nodes)["big"]
    assert not pending["recorded"] and sorted(pending["nodes"]) == ["n1", "n2"]
    assert sorted(i for v in pending["nodes"].values() for i in v) == list(range(6))
    held = {n: set(map(int, parts[n].split(","))) for n in ("n1", "n2")}
    assert all(held[n] <= set(pending["nodes"][n]) for n in held)  # each keeps what it holds
    assert "as its plan would be if it started now" in status.explain_job(st, "98", {"big": pending})
    out = env.cli_json("status", "--job", "97")
    assert out["shard_maps"]["big"]["nodes"] == maps["big"]["nodes"]


def test_a_multi_node_job_on_two_sharded_datasets_plans_both_in_one_record(env: Env, big, tmp_path):
    """One record holds the job's plan for all its sharded datasets, whichever a node stages
    first: the full Prolog on each node, then the warm path for the next job."""
    env.add("big2", {f"e/{i:03d}": bytes([i]) * 700 for i in range(12)}, shards=4)
    env.cli("manifest", "build", "big2")
    run = tmp_path / "run"
    from dsstage.hooks import job as hooks
    from dsstage.slurm.fake import FakeSlurm
    for node in ("n1", "n2"):
        e = {"SLURM_JOB_ID": "130", "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
             "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": "n[1-2]",
             "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big,big2"}
        assert hooks.prolog(e, run_dir=str(run), slurm=FakeSlurm(), load_config=env.config) == 0
        got = exported((run / node / "jobs" / "130.task").read_text().splitlines())
        assert "DSSTAGE_SHARDS_BIG" in got and "DSSTAGE_SHARDS_BIG2" in got, got
        hooks.epilog(e, run_dir=str(run), load_config=env.config)
    for node in ("n2", "n1"):
        assert warm_on(env, node, "131", "n[1-2]", run, "big,big2") == 0, node
    record = json.loads((env.state / "jobs" / "131.shards.json").read_text())["shards"]
    assert sorted(record) == ["big", "big2"]


def test_pruning_a_view_gives_it_back_to_a_lease_taken_meanwhile(env: Env, big):
    store = env.store()
    index = sharded.shards_of(store, "big", big["digest"])
    part = sharded.stage_part(store, "big", big["digest"], [index.shards[0].id],
                              StageRequest(user=User.lookup(0), job_id="140"))
    with open_tier(store.layout("nvme")) as tier:
        # a Prolog leased it between the prune's first reading of the leases and its record's removal
        assert not views.retire(tier, "big", part.view.id, lambda: {part.view.id})
        assert views.find(tier, "big", [index.shards[0].id]) == part.view
        assert views.retire(tier, "big", part.view.id, set)
        assert views.find(tier, "big", [index.shards[0].id]) is None and not Path(part.view.path).exists()


def test_the_warm_path_gives_its_leases_back_when_it_cannot_finish(env: Env, big, tmp_path, monkeypatch):
    from dsstage.fs.safe import RootDir
    from dsstage.hooks import job as hooks
    from dsstage.hooks import warm
    run = tmp_path / "run"
    prolog_on(env, "n1", "150", "n1", run)
    hooks.epilog({"SLURM_JOB_ID": "150", "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n1",
                  "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}, run_dir=str(run), load_config=env.config)
    monkeypatch.setattr(ready_lease, "still_ready", lambda p: False)  # an eviction came first
    assert warm_on(env, "n1", "151", "n1", run) is None
    monkeypatch.undo()

    def broken(*_a, **_k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(warm.runfiles, "write_task_file", broken)
    assert warm_on(env, "n1", "152", "n1", run) is None
    with RootDir(str(env.tier_root("n1"))) as tier:
        assert LeaseBook(tier).of_job("151") == [] and LeaseBook(tier).of_job("152") == []


def test_the_nodes_of_a_job_wait_for_the_plan_of_the_node_that_claimed_it(env: Env, big, monkeypatch):
    """M nodes starting at once must not each read the M nodes' reports: the first claims
    the making of the plan, the others wait for its record; if none comes in time, a node
    makes one itself (the first record written is the plan)."""
    import threading

    from dsstage.node import jobrecord
    ids = [s.id for s in sharded.shards_of(env.store(), "big", big["digest"]).shards]
    nodes = ["n1", "n2", "n3"]
    env.state.mkdir(exist_ok=True)
    made = []
    real = jobrecord.plan
    monkeypatch.setattr(jobrecord, "plan", lambda *a: made.append(a) or real(*a))
    first = jobrecord.plan_for(str(env.state), "160", nodes, "n1", {"big": ids})
    # n2 and n3 come while n1 would still be planning: n1's claim is there, its record not yet
    record = env.state / "jobs" / "160.shards.json"
    data = record.read_bytes()
    record.unlink()
    threading.Timer(0.5, record.write_bytes, [data]).start()
    got = [jobrecord.plan_for(str(env.state), "160", nodes, n, {"big": ids}) for n in ("n2", "n3")]
    assert got == [first, first] and len(made) == 1  # only n1 read the reports
    # a claim whose record never comes: after PLAN_WAIT the node plans itself
    monkeypatch.setattr(jobrecord, "PLAN_WAIT", 0.3)
    (env.state / "jobs" / "161.shards.claim").write_text("n9")
    assert jobrecord.plan_for(str(env.state), "161", nodes, "n2", {"big": ids}) == first
    assert len(made) == 2
    jobrecord.forget(str(env.state), "161")
    assert not list((env.state / "jobs").glob("161.*"))


def test_a_file_name_with_a_newline_stays_one_line_of_the_files_list(env: Env, tmp_path):
    """A data owner's file named ``x\\n/etc/shadow`` (issue 51) is one escaped line of the
    view's list, never a line ``/etc/shadow``; the user guide's recipe reads it back as the
    file it is."""
    import re
    import subprocess
    import sys
    odd = {"x\n/etc/shadow": b"n" * 10, "back\\slash\tand tab": b"b" * 20, "plain": b"p" * 30}
    env.add("odd", odd, shards=2)
    env.cli("manifest", "build", "odd")
    run = tmp_path / "run"
    from dsstage.hooks import job as hooks
    from dsstage.slurm.fake import FakeSlurm
    e = {"SLURM_JOB_ID": "70", "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
         "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n1", "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "odd"}
    assert hooks.prolog(e, run_dir=str(run), slurm=FakeSlurm(), load_config=env.config) == 0
    got = exported((run / "n1" / "jobs" / "70.task").read_text().splitlines())
    raw = Path(got["DSSTAGE_FILES"]).read_bytes().decode("utf-8", "surrogateescape").split("\n")[:-1]
    assert len(raw) == 3 and "/etc/shadow" not in raw and not any(line.endswith("/etc/shadow") and
                                                                     "\\n" not in line for line in raw), raw
    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text()
    recipe = re.search(r"Plain Python.*?```python\n(.*?)```", guide, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", recipe + "\nimport json; print(json.dumps(node_files))\n"], text=True,
                         capture_output=True, check=True, env={**got, "PATH": "/usr/bin"})
    view = got["DSSTAGE_DATASET_DIR"]
    assert sorted(os.path.relpath(p, view) for p in json.loads(out.stdout)) == sorted(odd)
    assert all(Path(p).read_bytes() == odd[os.path.relpath(p, view)] for p in json.loads(out.stdout))


def test_a_restricted_view_is_never_open_to_others_while_it_is_made(env: Env, big, monkeypatch):
    """Issue 51: the view of a group-only dataset was made in a 0755 directory under a 0755
    ``views/<name>`` and restricted only afterwards, so a user who opened it meanwhile kept
    reading through the descriptor. Now ``views/<name>`` carries the group's access before any
    view is made in it, and the view's directory is 0700 until it is renamed into place."""
    import grp
    group = grp.getgrgid(os.getgid()).gr_name
    env.datasets["big"]["groups"] = [group]
    env.write()
    store = env.store()
    seen: list[tuple[int, int]] = []
    real_link = os.link

    def watching(src, dst, *a, **kw):  # every link made into the view: who could enter it then
        top = Path(env.tier_root()) / "views" / "big"
        making = [p for p in top.iterdir() if p.name.startswith(".dsstage-")]
        assert len(making) == 1, making
        seen.append((stat.S_IMODE(os.stat(top).st_mode), stat.S_IMODE(os.lstat(making[0]).st_mode)))
        return real_link(src, dst, *a, **kw)
    monkeypatch.setattr(os, "link", watching)
    index = sharded.shards_of(store, "big", big["digest"])
    part = sharded.stage_part(store, "big", big["digest"], [index.shards[0].id],
                              StageRequest(user=User.lookup(0), job_id="9"))
    assert seen and all(top == 0o750 for top, _ in seen), seen  # restricted before the first link
    assert stat.S_IMODE(os.stat(Path(part.view.path).parent).st_mode) == 0o750
    assert all(mode == 0o700 for _, mode in seen), seen  # the view's own directory: 0700 while it is made
    assert stat.S_IMODE(os.stat(part.view.path).st_mode) == 0o755  # and open to the group once in place



def _recipe_reads(got: dict[str, str], rank: int, size: int) -> list[str]:
    """What the user guide's plain Python recipe reads as one rank with the job's exports."""
    import re
    import subprocess
    import sys
    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text()
    recipe = re.search(r"Plain Python.*?```python\n(.*?)```", guide, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", recipe + "\nprint('\\n'.join(mine))\n"], text=True,
                         capture_output=True, check=True,
                         env={**got, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size), "PATH": "/usr/bin"})
    return out.stdout.split()


def _parts_of_a_job(env: Env, job: str, run: Path) -> dict[str, dict[str, str]]:
    return {node: exported(prolog_on(env, node, job, "n[1-3]", run)) for node in ("n1", "n2", "n3")}


def _assert_one_job_reads_each_file_once(env: Env, got: dict[str, dict[str, str]]) -> None:
    """Every node of the job has its part (staged or at the source), the parts are disjoint and
    together the dataset, and every rank of the recipe takes the same number of steps."""
    parts, steps = {}, set()
    src = str(env.source("big"))
    for node, exports in got.items():
        listed = Path(exports["DSSTAGE_FILES_BIG"]).read_text().splitlines()
        root = exports["DSSTAGE_PATH_BIG"]
        assert all(p.startswith(root + "/") for p in listed)
        parts[node] = {os.path.relpath(p, root) for p in listed}
        assert int(exports["DSSTAGE_NODE_FILES_BIG"]) == len(listed)
        assert len({e["DSSTAGE_MIN_FILES_BIG"] for e in got.values()}) == 1
        for rank in range(2):
            read = _recipe_reads(exports, rank, 2)
            assert all(os.path.isfile(f) and Path(f).read_bytes() == FILES[os.path.relpath(f, root)] for f in read)
            steps.add(len(read))
    assert sum(len(p) for p in parts.values()) == len(FILES) and set().union(*parts.values()) == set(FILES)
    assert len(steps) == 1 and steps.pop() > 0
    assert any(e["DSSTAGE_PATH_BIG"] == src for e in got.values())  # the case under test: one at the source


def test_a_node_outside_the_pilot_reads_its_own_part_of_the_jobs_plan_at_the_source(env: Env, big, tmp_path):
    """A 3-node job whose third node is outside rollout.nodes: n1 and n2 stage their parts, n3
    reads its part at the source with the same variables (the user guide's recipe runs as is,
    every file read once by the job, every rank the same number of steps), never the whole
    dataset and never another node's list."""
    import yaml
    data = yaml.safe_load(env.config_path.read_text())
    data["rollout"] = {"nodes": "n[1-2]"}
    env.config_path.write_text(yaml.safe_dump(data))
    got = _parts_of_a_job(env, "95", tmp_path / "run")
    assert got["n1"]["DSSTAGE_PATH_BIG"].startswith(str(env.tier_root("n1") / "views" / "big"))
    assert got["n3"]["DSSTAGE_PATH_BIG"] == str(env.source("big"))
    _assert_one_job_reads_each_file_once(env, got)
    assert not (env.tier_root("n3") / "datasets").exists()  # nothing staged where dsstage does not act


def test_a_node_whose_part_fails_to_stage_falls_back_to_its_part_at_the_source(env: Env, big, tmp_path, monkeypatch):
    """on_failure: fallback on a sharded dataset: the node that cannot stage its part (here its
    stage fails as a full tier does) reads that part at the source, with every variable the
    recipe needs; where its part cannot be told, the job is held instead."""
    from dsstage.errors import NoSpace, StateError
    from dsstage.hooks import shardjob as shardjob_mod
    real = sharded.stage_part

    def full_on_n2(store, *a, **kw):
        if store.node == "n2":
            raise NoSpace("tier nvme on n2 is full (a test)")
        return real(store, *a, **kw)
    monkeypatch.setattr(sharded, "stage_part", full_on_n2)
    run = tmp_path / "run"
    got = _parts_of_a_job(env, "96", run)
    assert got["n2"]["DSSTAGE_PATH_BIG"] == str(env.source("big"))
    _assert_one_job_reads_each_file_once(env, got)
    task = (run / "n2" / "jobs" / "96.task").read_text()
    assert "could not stage 'big'" in task and "DSSTAGE_FILES_BIG lists its files there" in task

    def no_part(*a, **kw):
        raise StateError("the shard index is gone (a test)")
    monkeypatch.setattr(shardjob_mod, "from_source", no_part)
    from dsstage.hooks import job as hooks
    from dsstage.slurm.fake import FakeSlurm
    e = {"SLURM_JOB_ID": "97", "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
         "SLURMD_NODENAME": "n2", "SLURM_JOB_NODELIST": "n[1-3]", "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "big"}
    slurm = FakeSlurm()
    assert hooks.prolog(e, run_dir=str(run), slurm=slurm, load_config=env.config) == 0
    task = (run / "n2" / "jobs" / "97.task").read_text()
    assert "DSSTAGE_PATH_BIG" not in task and "# dsstage: hold" in task and "cannot be told" in task
    assert "97" in slurm.held
