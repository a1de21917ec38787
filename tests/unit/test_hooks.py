"""The Prolog/Epilog decisions and their exit codes: the mapping that decides draining."""

import os

import pytest
from dsstage.config import load
from dsstage.errors import (
    AccessDenied,
    ConfigError,
    LockTimeout,
    ManifestError,
    NoSpace,
    SourceError,
    StoreError,
    UnknownDataset,
    VerifyError,
)
from dsstage.fs import runfiles
from dsstage.hooks import job as hooks
from dsstage.hooks.job import JobContext, Verdict
from dsstage.slurm.fake import FakeSlurm
from dsstage.slurm.records import Job

CONF = load.from_dict({
    "state_dir": "/s", "tiers": {"nvme": {"path": "/l/{node}", "capacity": "1TB"}},
    "datasets": {"coco": {"source": "/data/coco"},
                 "strict": {"source": "/data/strict", "on_failure": "hold"},
                 "remote": {"source": "fs01:/export/remote"}}})


@pytest.mark.parametrize("error,action", [
    (StoreError("disk gone"), "drain"),
    (SourceError("down"), "fallback"),
    (VerifyError("mismatch"), "fallback"),
    (ManifestError("no manifest"), "fallback"),
    (NoSpace("full"), "fallback"),
    (LockTimeout("slow"), "fallback"),
    (AccessDenied("no"), "hold"),
    (UnknownDataset("typo"), "hold"),
    (ConfigError("broken"), "hold"),
])
def test_failure_outcomes(error, action):
    out = hooks.on_failure("coco", CONF.datasets["coco"], error)
    assert out.action == action
    if action == "fallback":
        assert out.path == "/data/coco" and "reading /data/coco directly" in out.reason


def test_hold_policy_and_remote_sources_never_fall_back():
    assert hooks.on_failure("strict", CONF.datasets["strict"], SourceError("down")).action == "hold"
    out = hooks.on_failure("remote", CONF.datasets["remote"], SourceError("down"))
    assert out.action == "hold" and "not mounted here" in out.reason
    assert hooks.on_failure("nope", None, UnknownDataset("x")).action == "hold"


def test_job_action_and_task_lines():
    local = Verdict("coco", "local", "/l/n1/datasets/coco/abc", "staged")
    fb = Verdict("imagenet-22k", "fallback", "/data/in", "could not stage\nit")
    assert hooks.job_action([local, fb]) == "run"
    assert hooks.task_lines([local, fb]) == [
        "export DSSTAGE_PATH_COCO=/l/n1/datasets/coco/abc",
        "export DSSTAGE_PATH_IMAGENET_22K=/data/in",
        "export DSSTAGE_DATASET_DIR=/l/n1/datasets/coco/abc",
        "print dsstage: warning: could not stage it",
    ]
    held = Verdict("strict", "hold", None, "source down")
    assert hooks.job_action([local, held]) == "hold"
    lines = hooks.task_lines([local, held])
    assert runfiles.HOLD_MARK in lines and "print dsstage: error: source down" in lines
    assert hooks.job_action([held, Verdict("x", "drain", None, "disk")]) == "drain"


def env_for(job="42", request="coco", node="n1"):
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
           "SLURMD_NODENAME": node}
    if request is not None:
        env["SPANK__SLURM_SPANK_OPTION_dsstage_dataset"] = request
    return env


def test_prolog_without_datasets_does_nothing(tmp_path):
    def explode():
        raise AssertionError("config must not be read")
    assert hooks.prolog(env_for(request=None), run_dir=str(tmp_path), slurm=FakeSlurm(), load_config=explode) == 0
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="the TaskProlog's file goes into a root-owned run directory: run as root")
def test_prolog_with_broken_config_holds_and_does_not_drain(tmp_path):
    slurm = FakeSlurm()

    def broken():
        raise ConfigError("/etc/dsstage/dsstage.yaml: tiers: missing")
    assert hooks.prolog(env_for(), run_dir=str(tmp_path), slurm=slurm, load_config=broken) == 0
    assert "misconfigured" in slurm.held["42"]
    task = (tmp_path / "n1" / "jobs" / "42.task").read_text()
    assert runfiles.HOLD_MARK in task


def test_prolog_with_forged_value_holds(tmp_path):
    slurm = FakeSlurm()
    rc = hooks.prolog(env_for(request="coco;rm -rf /"), run_dir=str(tmp_path), slurm=slurm,
                      load_config=lambda: CONF)
    assert rc == 0 and "is not allowed" in slurm.held["42"]


def test_prolog_drains_only_for_a_broken_store(tmp_path):
    conf = load.from_dict({"state_dir": str(tmp_path / "state"),
                             "tiers": {"nvme": {"path": "/proc/dsstage-cannot-exist/{node}", "capacity": "1TB"}},
                             "datasets": {"coco": {"source": str(tmp_path)}}})
    os.makedirs(tmp_path / "state" / "manifests" / "coco")
    (tmp_path / "state" / "manifests" / "coco" / "CURRENT").write_text("a" * 64)
    slurm = FakeSlurm()
    assert hooks.prolog(env_for(), run_dir=str(tmp_path / "run"), slurm=slurm, load_config=lambda: conf) == 1
    assert slurm.held == {}


def test_epilog_without_datasets_and_with_broken_config_exit_zero(tmp_path):
    def broken():
        raise ConfigError("broken")
    assert hooks.epilog(env_for(request=None), run_dir=str(tmp_path), load_config=broken) == 0
    assert hooks.epilog(env_for(), run_dir=str(tmp_path), load_config=broken) == 0


def test_job_context_prefers_the_option_variable():
    ctx = JobContext.from_env({**env_for(request="a"), "SPANK_DSSTAGE_DATASETS": "b"})
    assert ctx.request == "a" and ctx.uid == 0 and ctx.node == "n1"
    assert JobContext.from_env({"SPANK_DSSTAGE_DATASETS": "b"}).request == "b"


def test_fake_slurm_tracks_jobs():
    s = FakeSlurm()
    s.submit(Job("1", "alice", "RUNNING", ("coco",)))
    assert s.job_alive("1") and not s.job_alive("2")
    s.finish("1")
    assert not s.job_alive("1")


def test_what_a_hook_decides_when_its_work_did_not_answer():
    """dsstage.hooks.abandoned: each dataset gets its on_failure, as for a failed stage; an
    unknown, malformed or forbidden request and an unreadable #BB_LUA record are held."""
    from dsstage.config.catalog import User
    from dsstage.errors import OutOfTime
    from dsstage.hooks import abandoned
    why = abandoned.what_happened("prolog", None, 300)
    assert "did not finish within prolog_budget (300s)" in why and "stopped answering" in why
    assert "signal 9" in abandoned.what_happened("prolog", -9, 300)
    user = User("ann", 1000, frozenset({"ann"}))
    got = abandoned.verdicts("coco,strict,remote,cocoa", False, CONF, user, OutOfTime(why))
    assert [(v.dataset, v.action, v.path) for v in got] == [
        ("coco", "fallback", "/data/coco"), ("strict", "hold", None), ("remote", "hold", None), ("cocoa", "hold", None)]
    assert "cocoa" in got[3].reason
    assert [v.action for v in abandoned.verdicts("../x", False, CONF, user, OutOfTime(why))] == ["hold"]
    assert [v.action for v in abandoned.verdicts("coco", False, CONF, None, OutOfTime(why))] == ["hold"]
    bb = abandoned.verdicts(None, True, CONF, user, OutOfTime(why))
    assert [(v.action, v.dataset) for v in bb] == [("hold", hooks.BB_REQUEST)]
    restricted = load.from_dict({"state_dir": "/s", "tiers": {"nvme": {"path": "/l/{node}", "capacity": "1TB"}},
                                 "datasets": {"coco": {"source": "/data/coco", "groups": ["vision"]}}})
    assert [v.action for v in abandoned.verdicts("coco", False, restricted, user, OutOfTime(why))] == ["hold"]
    assert [v.action for v in abandoned.verdicts("coco", False, restricted, User("bob", 1001, frozenset({"vision"})),
                                                 OutOfTime(why))] == ["fallback"]


@pytest.mark.parametrize("err,action,rc", [
    (OSError(24, "Too many open files"), "hold", 0),  # too few descriptors: the site's, never a drain
    (OSError(28, "No space left on device"), "hold", 0),  # a full run directory: the site's
    (OSError(5, "Input/output error"), "drain", 1),  # the node's own disk fails: drain
])
def test_a_task_file_that_cannot_be_written_drains_only_for_the_nodes_own_fault(monkeypatch, tmp_path, err, action,
                                                                               rc):
    """Issue 52: ``decide`` drained the node for any OSError writing the task file (EMFILE
    included), deciding by exception type; it now follows the error's ``blame``."""
    from dsstage.hooks import job
    from dsstage.hooks.decisions import Verdict
    from dsstage.slurm.fake import FakeSlurm

    def failing(*_a, **_k):
        raise err
    monkeypatch.setattr(job.runfiles, "write_task_file", failing)
    slurm = FakeSlurm()
    ctx = job.JobContext(job_id="5", uid=0, gid=0, user="root", node="n1", request="coco")
    got = job.decide(ctx, [Verdict("coco", "local", "/x", "ready")], run_dir=str(tmp_path), slurm=slurm)
    assert got == rc
    assert ("5" in slurm.held or "5" in slurm.notified) == (action == "hold")
    assert ("n1" in slurm.drained) == (action == "drain")


def test_a_sharded_dataset_whose_stage_stopped_answering_is_held_not_given_whole():
    """The hook decides without its work (dsstage.hooks.abandoned) when the source or the state
    directory hangs; this node's part of the job's plan is in the state directory, so a
    sharded dataset is held there: a fallback would give this rank the whole dataset and no
    DSSTAGE_FILES. A dataset without shards still falls back to its mounted source."""
    import pwd

    from dsstage.config import catalog as cat
    from dsstage.errors import OutOfTime
    from dsstage.hooks import abandoned
    conf = load.from_dict({"state_dir": "/s", "tiers": {"nvme": {"path": "/l", "capacity": "1TB"}},
                           "datasets": {"big": {"source": "/d/big", "shards": 4}, "coco": {"source": "/d/coco"}}})
    root = cat.User(name="root", uid=0, groups=frozenset({pwd.getpwuid(0).pw_name}))
    out = {v.dataset: v for v in abandoned.verdicts("big,coco", False, conf, root, OutOfTime("hung"))}
    assert out["big"].action == "hold" and "part of 'big' cannot be told now" in out["big"].reason
    assert out["coco"].action == "fallback" and out["coco"].path == "/d/coco"
