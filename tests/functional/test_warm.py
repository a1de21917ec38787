"""The warm Prolog path against a real store, and its agreement with the full path."""

from __future__ import annotations

import json
import os
from dataclasses import fields

import pytest
from dsstage.fs import formats, runfiles, safe
from dsstage.hooks import job as hooks
from dsstage.hooks import warm
from dsstage.hooks.__main__ import main as hook_main
from dsstage.node.lease import Lease, LeaseBook
from dsstage.slurm.fake import FakeSlurm
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")


def prolog_env(env: Env, request: str, job: str = "77", uid: int = 0, user: str = "root") -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_UID": str(uid), "SLURM_JOB_GID": "0", "SLURM_JOB_USER": user,
            "SLURMD_NODENAME": env.node, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": request}


@pytest.fixture
def ready(env: Env):
    env.add("coco", {"a": b"1" * 10, "b/c": b"2"})
    env.add("secret", {"s": b"s"}, groups=["daemon"])
    for name in ("coco", "secret"):
        env.cli("manifest", "build", name)
        env.cli("stage", name, "--job-id", "1")
    run = env.tmp / "run"
    # the full Prolog leaves the configuration cache the warm path needs
    assert hooks.prolog(prolog_env(env, "coco", job="2"), run_dir=str(run), slurm=FakeSlurm(),
                        load_config=env.config) == 0
    return run


def test_warm_path_leases_and_exports(env: Env, ready):
    rc = warm.prolog(prolog_env(env, "coco"), str(ready), str(env.config_path))
    assert rc == 0
    with safe.RootDir(str(env.tier_root())) as tier:
        lease = LeaseBook(tier).of_dataset("coco")
    assert "77" in {x.job_id for x in lease}
    task = (ready / env.node / "jobs" / "77.task").read_text().splitlines()
    full = (ready / env.node / "jobs" / "2.task").read_text().splitlines()
    assert task == full  # the same lines as the full Prolog wrote for job 2
    report = json.loads((env.state / "nodes" / f"{env.node}.json").read_text())
    row = next(r for r in report["copies"] if r["dataset"] == "coco")
    assert {"2", "77"} <= {x["job_id"] for x in row["leases"]}  # status shows the warm path's job too
    assert row["decision"] == {"action": "keep", "reason": "leased by job 77"}
    local = json.loads((ready / "reports" / f"{env.node}.json").read_text())
    assert local == report  # the node-local report and its published copy
    assert task[0].startswith("export DSSTAGE_PATH_COCO=" + str(env.tier_root() / "datasets" / "coco"))


@pytest.mark.parametrize("case", ["not ready", "config changed", "forbidden", "unknown", "malformed", "full verify"])
def test_warm_path_defers_to_the_full_prolog(env: Env, ready, case):
    request, uid, user = "coco", 0, "root"
    if case == "not ready":
        for mark in (env.tier_root() / "ready" / "coco").iterdir():
            mark.unlink()
    elif case == "config changed":
        os.utime(env.config_path, None)
    elif case == "forbidden":
        request, uid, user = "secret", 65534, "nobody"
    elif case == "unknown":
        request = "cocoa"
    elif case == "malformed":
        request = "coco,../x"
    elif case == "full verify":
        env.datasets["coco"]["verify"] = "full"
        env.write()
        hooks.write_config_cache(str(ready), env.config())
    assert warm.prolog(prolog_env(env, request, uid=uid, user=user), str(ready), str(env.config_path)) is None
    with safe.RootDir(str(env.tier_root())) as tier:
        assert "77" not in {x.job_id for x in LeaseBook(tier).of_dataset("coco")}


def test_a_cache_not_written_by_root_is_ignored(env: Env, ready):
    os.chmod(ready / runfiles.CONFIG_CACHE, 0o666)
    assert warm.prolog(prolog_env(env, "coco"), str(ready), str(env.config_path)) is None


def test_lease_record_is_what_lease_reads():
    """The warm paths and LeaseBook.take write a lease through the one writer
    (dsstage.ready.lease.record), format included, and Lease reads every field back."""
    from dsstage.node.lease import record
    from dsstage.ready import lease as ready_lease
    holder = ready_lease.Holder("5", "alice", "n1", 0, host="h", taken=1.0)
    rec = ready_lease.record("coco", "d" * 64, holder, ["e" * 64])
    assert set(rec) == {f.name for f in fields(Lease)} | {"format"} and rec["format"] == formats.CURRENT["lease"]
    lease = Lease(**{k: v for k, v in rec.items() if k != "format"})
    assert lease.shards == ("e" * 64,) and lease.host == "h" and lease.taken == 1.0
    assert json.loads(json.dumps(record(lease))) == json.loads(json.dumps(rec))


def test_main_falls_through_to_the_full_prolog(env: Env, tmp_path, monkeypatch):
    env.add("coco", {"a": b"1"})
    env.cli("manifest", "build", "coco")
    for k, v in {**prolog_env(env, "coco"), "DSSTAGE_CONFIG": str(env.config_path),
                 "DSSTAGE_RUN_DIR": str(tmp_path / "run"), "DSSTAGE_LOG": str(tmp_path / "log")}.items():
        monkeypatch.setenv(k, v)
    assert hook_main(["prolog"]) == 0  # cold: the full Prolog staged it
    assert "coco staged" in (tmp_path / "log").read_text()
    assert hook_main(["prolog"]) == 0  # now warm
    assert "(warm path)" in (tmp_path / "log").read_text().splitlines()[-1]
    cache = json.loads((tmp_path / "run" / runfiles.CONFIG_CACHE).read_text())
    assert cache["origin"] == str(env.config_path)


def test_the_warm_prolog_imports_nothing_heavy(env: Env, ready):
    """The real hook process (``python -c CODE prolog``, as prolog/dsstage-prolog runs it)
    answered by the warm path imports none of what tests/unit/test_warm_imports.py keeps out."""
    import subprocess
    import sys

    from helpers import WARM_HEAVY as HEAVY
    hook_env = {**os.environ, **prolog_env(env, "coco", job="78"), "DSSTAGE_CONFIG": str(env.config_path),
                "DSSTAGE_RUN_DIR": str(ready), "DSSTAGE_LOG": str(env.tmp / "hook.log")}
    from dsstage.hooks.__main__ import CODE
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", CODE, "prolog"], env=hook_env,
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "(warm path)" in (env.tmp / "hook.log").read_text().splitlines()[-1]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "dsstage.hooks.warm" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
