"""Holding a job on a real Slurm: what each kind of job gets, and where its user reads why.

``CliSlurm.hold`` is tested on its own first (jobs that sleep, held by the test), then
through the Prolog with a dataset whose source is gone and ``on_failure: hold``. The user's
``--comment`` must survive every case; the reason is in AdminComment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsstage.slurm import client as slurm_client
from dsstage.slurm import hold as slurm_hold
from dsstage.slurm import records

pytestmark = pytest.mark.cluster

USER = "nobody"
SLEEP = "sleep 300\n"
GONE_REASON = "is not reachable from this node"


def as_user(argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={USER}", "--regid=nogroup", "--init-groups", "--", *argv]


@pytest.fixture
def client(cluster, monkeypatch) -> slurm_client.CliSlurm:
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    scontrol = shutil.which("scontrol", path=cluster.env["PATH"])  # this cluster's series
    assert scontrol
    c = slurm_client.client(bin_dir=os.path.dirname(scontrol))
    assert isinstance(c, slurm_client.CliSlurm)
    return c


def record(cluster, job_id: str) -> records.Job:
    """The job as dsstage reads it (squeue, no user-controlled field)."""
    out = cluster.run("squeue", "-h", "-t", "all", "-j", job_id, "-O", records.JOB_FORMAT).stdout
    return records.parse_job_records(out)[job_id]


def user_view(cluster, job_id: str) -> str:
    """``scontrol show job`` as the job's user sees it."""
    return cluster.run("scontrol", "show", "job", job_id, user=USER).stdout


def comment_of(cluster, job_id: str) -> str:
    return cluster.run("squeue", "-h", "-t", "all", "-j", job_id, "-O", "Comment:|").stdout.strip().rstrip("|")


def newest_job_id(cluster) -> int:
    return max((int(j) for j in cluster.run("squeue", "-h", "-t", "all", "-o", "%A").stdout.split()), default=0)


class Allocation:
    """``salloc`` or ``srun`` run by the user with the test's job name; its terminal kept."""

    def __init__(self, cluster, argv: list[str], name: str) -> None:
        self.cluster, self.name = cluster, name
        self.after = newest_job_id(cluster)
        self.proc = subprocess.Popen(as_user([argv[0], "-J", name, *argv[1:]]), env=cluster.env,
                                     cwd=str(cluster.jobs), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def job_id(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # by name alone (each test's own): squeue and scancel of 26.05 refuse `-u nobody`
            out = self.cluster.run("squeue", "-h", "-t", "all", "-n", self.name, "-o", "%A").stdout
            ids = [int(j) for j in out.split() if int(j) > self.after]
            if ids:
                return str(max(ids))
            time.sleep(0.2)
        self.stop()
        out, err = self.proc.communicate()
        raise AssertionError(f"no job named {self.name}: {self.proc.args} said:\n{out}\n{err}")

    def finish(self, timeout: float = 90) -> tuple[int, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            out, err = self.proc.communicate()
            raise AssertionError(f"{self.proc.args} did not end:\n{out}\n{err}") from None
        return self.proc.returncode, out + err

    def stop(self) -> None:
        """Cancel the allocation (a killed salloc would leave it) and end the client."""
        if self.proc.poll() is None:
            self.cluster.run("scancel", "-n", self.name, check=False)
            self.proc.kill()


# -- CliSlurm.hold on its own -------------------------------------------------------------------

def test_hold_requeues_and_holds_a_running_batch_job(cluster, client):
    job = cluster.submit(SLEEP, "--comment=mine", "-J", "hold-batch", "-w", "n1", user=USER)
    cluster.state(job, "RUNNING")
    try:
        assert client.hold(job, "source /x is\ngone \x1b[31m") == slurm_hold.HELD
        info = cluster.state(job, "PENDING")
        assert info["Reason"] == "job_requeued_in_held_state"
        assert comment_of(cluster, job) == "mine"
        message = f"dsstage held this job: source /x is gone [31m -- once that is fixed: scontrol release {job}"
        assert record(cluster, job).admin_comment == message
        # where the user reads it: scontrol show job (AdminComment) and squeue's reason
        assert f"AdminComment={message}" in user_view(cluster, job)
        reason = cluster.run("squeue", "-h", "-j", job, "-o", "%r", user=USER).stdout.strip()
        assert reason == "job requeued in held state"
        # a second node's Prolog: the job is left as it is, one message
        assert client.hold(job, "source /x is gone") == slurm_hold.ALREADY_HELD
        assert record(cluster, job).admin_comment.count("dsstage held this job") == 1
        # the user may release it
        cluster.run("scontrol", "release", job, user=USER)
        cluster.start_now(job, "n1")  # not in the kill's second: see start_now
        cluster.state(job, "RUNNING", timeout=90)
    finally:
        cluster.run("scancel", job, check=False)


def test_hold_keeps_the_admin_comment_it_finds(cluster, client):
    job = cluster.submit(SLEEP, "-w", "n2", user=USER)
    cluster.state(job, "RUNNING")
    try:
        cluster.run("scontrol", "update", f"JobId={job}", "AdminComment=site=a|b dsstage=sample")
        assert client.hold(job, "gone") == slurm_hold.HELD
        rec = record(cluster, job)
        assert rec.admin_comment.startswith("site=a|b dsstage=sample dsstage held this job: gone")
        assert rec.datasets == ("sample",)
    finally:
        cluster.run("scancel", job, check=False)


def test_hold_leaves_a_no_requeue_batch_job_running(cluster, client):
    job = cluster.submit(SLEEP, "--no-requeue", "--comment=mine", "-w", "n2", user=USER)
    cluster.state(job, "RUNNING")
    try:
        assert client.hold(job, "gone") == slurm_hold.NOT_REQUEUED
        assert cluster.job(job)["JobState"] == "RUNNING"
        assert record(cluster, job).admin_comment == \
            "dsstage stopped this job: gone (it was submitted with --no-requeue)"
        assert comment_of(cluster, job) == "mine"
    finally:
        cluster.run("scancel", job, check=False)


def test_hold_cancels_an_allocation_and_tells_its_terminal(cluster, client):
    # a step of the allocation (salloc of 24.11 and later leaves its local command running when
    # the allocation is revoked; the step ends with it)
    alloc = Allocation(cluster, ["salloc", "--comment=mine", "-w", "n3", "srun", "sleep", "300"], "hold-salloc")
    try:
        job = alloc.job_id()
        cluster.state(job, "RUNNING")
        assert client.hold(job, "source /x is gone") == slurm_hold.CANCELLED
        rc, terminal = alloc.finish()
    finally:
        alloc.stop()
    message = "dsstage cancelled this job: source /x is gone (an interactive allocation cannot be requeued)"
    assert rc != 0
    assert f"salloc: {message}" in terminal and "has been revoked" in terminal
    cluster.state(job, "CANCELLED")
    assert record(cluster, job).admin_comment == message and comment_of(cluster, job) == "mine"


def test_hold_of_a_finished_job_does_nothing(cluster, client):
    job = cluster.submit("true\n", "-w", "n1", user=USER)
    cluster.wait(job)
    assert client.hold(job, "gone") == slurm_hold.GONE
    assert client.hold("999999", "gone") == slurm_hold.GONE
    assert record(cluster, job).admin_comment == ""


# -- through the Prolog: a dataset whose source is gone, on_failure: hold ----------------------

@pytest.fixture
def gone_source(cluster) -> Iterator[str]:
    """A dataset ``holdme`` (on_failure: hold) whose source is away while the test runs."""
    src = cluster.add_dataset("holdme", {"x/1.bin": b"1" * 1000}, on_failure="hold")
    away = Path(str(src) + ".away")
    src.rename(away)
    try:
        yield "holdme"
    finally:
        away.rename(src)


def test_prolog_holds_a_batch_job_and_keeps_its_comment(cluster, gone_source):
    job = cluster.submit(f"#SBATCH --dataset={gone_source}\necho RAN\n", "--comment=mine", "-N", "2", user=USER)
    try:
        info = cluster.wait(job, held=True)
        assert info["JobState"] == "PENDING" and info["Reason"] == "job_requeued_in_held_state"
        assert comment_of(cluster, job) == "mine"
        admin = record(cluster, job).admin_comment
        assert admin.startswith(f"dsstage={gone_source} dsstage held this job: ")
        assert GONE_REASON in admin and admin.endswith(f"scontrol release {job}")
        assert admin.count("dsstage held this job") == 1  # both nodes' Prologs held it
        assert f"AdminComment={admin}" in user_view(cluster, job)
        assert not (cluster.jobs / f"{job}.out").exists() or "RAN" not in cluster.output(job)
        assert not any("drain" in cluster.node_state(n) for n in ("n1", "n2", "n3"))
    finally:
        cluster.run("scancel", job, check=False)


def test_prolog_fails_a_no_requeue_batch_job_with_the_reason_in_its_output(cluster, gone_source):
    job = cluster.submit(f"#SBATCH --dataset={gone_source}\necho RAN\n", "--no-requeue", "--comment=mine",
                         "-w", "n1", user=USER)
    assert cluster.wait(job)["JobState"] == "FAILED"
    out = cluster.output(job)
    assert "dsstage: error: " in out and GONE_REASON in out and "RAN" not in out
    assert record(cluster, job).admin_comment.startswith(f"dsstage={gone_source} dsstage stopped this job: ")
    assert comment_of(cluster, job) == "mine"


@pytest.mark.parametrize("argv", [
    ["salloc", "--comment=mine", "-w", "n2", "srun", "echo", "RAN"],
    ["srun", "--comment=mine", "-w", "n3", "echo", "RAN"],
], ids=["salloc", "srun"])
def test_prolog_cancels_an_interactive_allocation_with_the_reason_on_its_terminal(cluster, gone_source, argv):
    alloc = Allocation(cluster, [argv[0], f"--dataset={gone_source}", *argv[1:]], f"hold-prolog-{argv[0]}")
    try:
        rc, terminal = alloc.finish()
    finally:
        alloc.stop()
    assert rc != 0 and "RAN" not in terminal
    assert f"{argv[0]}: dsstage cancelled this job: " in terminal and GONE_REASON in terminal
    job = alloc.job_id()
    cluster.state(job, "CANCELLED")
    assert record(cluster, job).admin_comment.startswith(f"dsstage={gone_source} dsstage cancelled this job: ")
    assert comment_of(cluster, job) == "mine"
