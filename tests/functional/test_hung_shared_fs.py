"""A shared filesystem that stops answering (latencyfs ``hang``: every request blocks, as on a
hard NFS mount whose server is gone) never keeps the Prolog or the Epilog past its budget:
the hook's work runs in a child the hook leaves behind (dsstage.hooks.bounded), the dataset
gets its ``on_failure``, the node is never drained, and the next job stages as usual."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dsstage.config.model import DEFAULT_PROLOG_BUDGET
from dsstage.fs import runfiles
from dsstage.hooks import __main__ as hook_main
from dsstage.hooks import abandoned, bounded
from dsstage.hooks.job import JobContext
from dsstage.node import metrics
from dsstage.slurm.fake import FakeSlurm
from helpers import Env, write_tree
from helpers import run_hook as hook
from latencyfs import LatencyFS, require

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

BUDGET = 12  # seconds: the hook gives up on its work after bounded.wait_limit(12) = 7 s
FILES = {"a": b"1" * 5000, "d/b": b"2" * 70000, "d/c": b"3" * 10}


def log(env: Env) -> str:
    return (env.tmp / "hooks.log").read_text()


@pytest.fixture
def hung_source(env: Env, tmp_path: Path):
    require()
    write_tree(tmp_path / "backing", FILES)
    with LatencyFS(tmp_path / "backing", tmp_path / "mnt", delay_us=0) as fs:
        env.extra["prolog_budget"] = BUDGET
        env.add("coco", None, source=fs.mountpoint, on_failure="fallback")
        env.cli("manifest", "build", "coco")
        yield fs


def test_a_source_that_stops_answering_falls_back_within_the_budget(env: Env, hung_source: LatencyFS):
    hung_source.hang()
    rc, took, lines = hook(env, "prolog", "5")
    assert rc == 0, log(env)  # never a drain
    assert took < BUDGET, (took, log(env))
    assert f"export DSSTAGE_DATASET_DIR={hung_source.mountpoint}" in lines, lines  # on_failure: fallback
    assert any("did not finish within prolog_budget (12s)" in line for line in lines), lines
    assert "stopped answering" in log(env)
    rc, took, _ = hook(env, "epilog", "5")
    assert rc == 0 and took < BUDGET, log(env)
    counted = metrics.counters(str(env.run), env.node)
    assert counted["counters"]["hooks_abandoned"] == {"prolog": 1, "epilog": 0}  # the Epilog did not touch the source
    assert {h[1] for h in metrics.histograms(counted)} == {("prolog",), ("epilog",)}
    # once the source answers again, the next job stages it: nothing the killed work left is in the way
    hung_source.answer()
    rc, _, lines = hook(env, "prolog", "6")
    assert rc == 0, log(env)
    path = next(line.split("=", 1)[1] for line in lines if line.startswith("export DSSTAGE_DATASET_DIR="))
    assert path.startswith(str(env.tier_root())), lines
    assert {str(p.relative_to(path)): p.read_bytes() for p in Path(path).rglob("*") if p.is_file()} == FILES
    assert not os.listdir(env.tier_root() / "reserved")  # the killed stage's reservation is reclaimed


def test_a_hung_source_trips_its_breaker_and_later_prologs_spend_a_probe_at_most(env: Env, hung_source: LatencyFS):
    """The first job pays the budget and its hook trips the source's breaker; the next Prolog
    probes the source (bounded by PROBE_TIMEOUT) and decides, one that comes while a probe is
    under way decides at once, and `dsstage status` shows the source; once the source answers,
    the next stage probes it, closes the breaker and stages."""
    from dsstage.node import breaker
    state = str(env.state)
    hung_source.hang()
    rc, took, _ = hook(env, "prolog", "5")
    assert rc == 0 and took < BUDGET, log(env)
    record = breaker.read(state, "dataset.coco")
    assert record and record["by"] == env.node and "did not finish within prolog_budget" in record["reason"], \
        (record, log(env))
    rc, took, lines = hook(env, "prolog", "6")
    assert rc == 0 and took < breaker.PROBE_TIMEOUT + 3, (took, log(env))  # not the budget again
    assert f"export DSSTAGE_DATASET_DIR={hung_source.mountpoint}" in lines, lines
    assert any("the breaker of dataset.coco is open" in line and "probed again now" in line for line in lines), lines
    breaker.write(state, "dataset.coco", {**breaker.read(state, "dataset.coco"), "probe_after": time.time() + 60,
                                          "probe_by": "n9"})
    rc, took, lines = hook(env, "prolog", "7")
    assert rc == 0 and took < 3, (took, log(env))  # someone else probes: at once
    assert any("node n9 is probing it now" in line for line in lines), lines
    shown = env.cli("status", "--no-queue")
    assert "Sources not answering" in shown.stdout and "dataset.coco" in shown.stdout, shown.stdout
    status = json.loads(env.cli("status", "--no-queue", "--json").stdout)
    assert status["sources_not_answering"]["dataset.coco"]["by"] == "n9" or \
        status["sources_not_answering"]["dataset.coco"]["by"] == env.node
    hung_source.answer()
    breaker.write(state, "dataset.coco", {**breaker.read(state, "dataset.coco"), "probe_after": 0})
    rc, _, lines = hook(env, "prolog", "8")
    assert rc == 0 and any(line.startswith(f"export DSSTAGE_DATASET_DIR={env.tier_root()}") for line in lines), \
        (lines, log(env))
    assert breaker.read(state, "dataset.coco") is None


def test_a_restricted_dataset_is_not_given_away_when_its_stage_hangs(env: Env, hung_source: LatencyFS, monkeypatch):
    """The hook's own decision keeps the catalog's rules: a user outside the dataset's groups
    gets a hold, never the source's path; an unknown name is held too."""
    env.datasets["coco"]["groups"] = ["daemon"]
    env.write()
    slurm = FakeSlurm()
    monkeypatch.setattr(abandoned, "_slurm", lambda *a: slurm)
    nobody = {"SLURM_JOB_ID": "8", "SLURM_JOB_UID": "65534", "SLURM_JOB_GID": "65534", "SLURM_JOB_USER": "nobody",
              "SLURMD_NODENAME": env.node, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "coco,cocoa",
              "DSSTAGE_LOG": str(env.tmp / "hooks.log")}
    ctx = JobContext.from_env(nobody)
    why = abandoned.what_happened("prolog", None, BUDGET)
    assert abandoned.decide_without(ctx, why, True, nobody, str(env.run), env.config()) == 0
    lines = (env.run / env.node / "jobs" / "8.task").read_text().splitlines()
    assert runfiles.HOLD_MARK in lines and not any(line.startswith("export") for line in lines), lines
    assert "restricted to group(s) daemon" in slurm.held["8"] and "cocoa" in slurm.held["8"]


@pytest.fixture
def hung_state(env: Env, tmp_path: Path):
    """``state_dir`` on a latencyfs mount of ``tmp_path/state-backing`` (read-only: what the
    hooks write there fails and is said), with ``coco`` staged and warm on the node."""
    require()
    backing = tmp_path / "state-backing"
    env.extra["prolog_budget"] = BUDGET
    env.add("coco", FILES, on_failure="fallback")
    env.state = backing  # the manifest is built on the backing directory itself
    env.write()
    env.cli("manifest", "build", "coco")
    with LatencyFS(backing, tmp_path / "state-mnt", delay_us=0) as fs:
        env.state = Path(fs.mountpoint)
        env.write()
        rc, _, lines = hook(env, "prolog", "1")  # the full Prolog stages it, and leaves the warm cache
        assert rc == 0 and any(line.startswith(f"export DSSTAGE_DATASET_DIR={env.tier_root()}") for line in lines), \
            (lines, log(env))
        assert hook(env, "epilog", "1")[0] == 0
        cache = json.loads((env.run / runfiles.CONFIG_CACHE).read_text())
        assert cache["prolog_budget"] == BUDGET
        yield fs


def test_a_state_dir_that_stops_answering_bounds_the_warm_prolog_and_the_epilog(env: Env, hung_state: LatencyFS):
    hung_state.hang()
    rc, took, lines = hook(env, "prolog", "2")
    assert rc == 0 and took < BUDGET, (rc, took, log(env))
    assert f"export DSSTAGE_DATASET_DIR={env.source('coco')}" in lines, lines  # the source, with the reason
    assert any("did not finish within prolog_budget" in line for line in lines), lines
    rc, took, _ = hook(env, "epilog", "2")
    assert rc == 0 and took < BUDGET, (rc, took, log(env))
    assert "epilog did not finish within prolog_budget" in log(env)
    hung_state.answer()
    rc, _, lines = hook(env, "prolog", "3")  # warm again
    assert rc == 0 and any(line.startswith(f"export DSSTAGE_DATASET_DIR={env.tier_root()}") for line in lines), \
        (lines, log(env))


def test_the_hook_waits_for_work_that_answers(tmp_path: Path, capfd):
    """bounded.run: the work's exit code and what it told the hook when it ends in time, its
    output passed on; None when it does not end in time, and the work is killed then."""
    assert bounded.run(lambda: 0, 30).code == 0
    assert bounded.run(lambda: 1, 30).code == 1
    assert bounded.run(lambda: 1 // 0, 30).code == bounded.CRASHED
    assert "ZeroDivisionError" in capfd.readouterr().err  # the child's traceback reaches the hook's stderr

    def says() -> int:
        bounded.tell("decided hold the source is down")
        print("to stdout")
        bounded.tell("held")
        return 0
    out = bounded.run(says, 30)
    assert out.said == ["decided hold the source is down", "held"] and out.last("decided ") == "hold the source is down"
    assert "to stdout" in "".join(capfd.readouterr())  # (pytest's sys.stdout in the child, fd 1 in a hook)
    pid_file = tmp_path / "pid"

    def stuck() -> int:
        pid_file.write_text(str(os.getpid()))
        bounded.tell("decided run")
        time.sleep(600)
        return 0
    t = time.monotonic()
    out = bounded.run(stuck, 1.0)
    assert out.code is None and out.said == ["decided run"]
    assert time.monotonic() - t < 30
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # this test is its parent: reap it
        except ChildProcessError:
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_decision_written_before_the_stop_stands(env: Env, tmp_path: Path, monkeypatch):
    """The work wrote the job's TaskProlog file and was stopped later (publishing its report
    to a hung state_dir): the hook keeps that decision, and asks Slurm for a hold the work
    had decided but not asked for yet."""
    env.add("coco", FILES)
    run = tmp_path / "run"
    job = {"SLURM_JOB_ID": "9", "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
           "SLURMD_NODENAME": env.node, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "coco",
           "DSSTAGE_LOG": str(tmp_path / "log")}
    kept = ["export DSSTAGE_DATASET_DIR=/the/work/s/decision"]
    (run / env.node / "jobs").mkdir(parents=True)
    (run / env.node / "jobs" / "9.task").write_text("\n".join(kept) + "\n")
    said = bounded.Outcome(None, ["decided run "])
    assert abandoned.finish("prolog", said, BUDGET, time.monotonic(), job, str(run), env.config()) == 0
    assert (run / env.node / "jobs" / "9.task").read_text().splitlines() == kept
    marker = tmp_path / "held"
    monkeypatch.setattr(abandoned, "hold_only", lambda ctx, reason, conf: marker.write_text(reason) and 0)
    said = bounded.Outcome(None, ["decided hold the source is down"])
    assert abandoned.finish("prolog", said, BUDGET, time.monotonic(), job, str(run), env.config()) == 0
    assert marker.read_text() == "the source is down"
    said = bounded.Outcome(None, ["decided hold the source is down", "held"])
    marker.unlink()
    assert abandoned.finish("prolog", said, BUDGET, time.monotonic(), job, str(run), env.config()) == 0
    assert not marker.exists()  # held already: not asked again
    assert abandoned.finish("prolog", bounded.Outcome(None, ["decided drain "]), BUDGET, time.monotonic(), job,
                            str(run), env.config()) == 1


def test_the_hook_stops_waiting_before_its_budget_ends():
    for budget in (12, 60, 300, 3600):
        assert bounded.stage_deadline(budget) < bounded.wait_limit(budget) < budget
    assert hook_main.DEFAULT_BUDGET == DEFAULT_PROLOG_BUDGET  # without a configuration, the same bound


def test_the_hook_script_does_not_wait_on_a_hung_bb_record(env: Env, hung_state: LatencyFS, tmp_path: Path):
    """A #BB_LUA site: the script looks for the job's record in state_dir, which stops
    answering. It gives up after 5 s without waiting for the stuck look, and the Python hook
    holds the job (its request cannot be read) within the budget."""
    defaults = tmp_path / "defaults"
    defaults.write_text(f"DSSTAGE_PYTHON={sys.executable}\nDSSTAGE_CONFIG={env.config_path}\n"
                        f"DSSTAGE_RUN_DIR={env.run}\nDSSTAGE_LOG={env.tmp / 'hooks.log'}\n"
                        f"DSSTAGE_BB_REQUESTS={hung_state.mountpoint}/bb\n")
    script = Path(__file__).resolve().parents[2] / "prolog" / "dsstage-prolog"
    job = {"PATH": "/usr/bin:/bin", "DSSTAGE_DEFAULTS": str(defaults), "SLURM_JOB_ID": "20", "SLURM_JOB_UID": "0",
           "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root", "SLURMD_NODENAME": env.node}
    hung_state.hang()
    t = time.monotonic()
    res = subprocess.run([str(script)], env=job, cwd="/", capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t
    assert res.returncode == 0, (res.stderr, log(env))
    assert took < 5 + BUDGET, (took, log(env))
    lines = (env.run / env.node / "jobs" / "20.task").read_text().splitlines()
    assert runfiles.HOLD_MARK in lines and any("#BB_LUA request could not be read" in line for line in lines), lines
