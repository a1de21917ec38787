"""A site's two controllers (issue 54, item 4): the primary slurmctld fails with a queue of
dataset jobs, the backup takes over (packaging/devcluster with DEVCLUSTER_BACKUP=1: ctl1 and
ctl2, each slurmctld and demand poller in a namespace of its own that gives it its host name).

What must hold across the failover: submissions keep working (a dataset job, a job without
one), an unknown dataset is refused for being unknown (the catalog is read on the backup as
on the primary: never "catalog missing"), the queued dataset jobs run with their dataset, and
the demand poller's lease (dsstage.cluster.leader) is the surviving controller's.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import Cluster

pytestmark = pytest.mark.cluster


def controllers(c: Cluster) -> dict[str, str]:
    """``scontrol ping``: each controller's name -> UP or DOWN."""
    out = c.run("scontrol", "ping", check=False).stdout
    found = {}
    for line in out.splitlines():  # "Slurmctld(primary) at ctl1 is UP"
        words = line.split()
        if "at" in words and words[-1] in ("UP", "DOWN"):
            found[words[words.index("at") + 1]] = words[-1]
    return found


def lease(c: Cluster) -> dict:
    try:
        return json.loads((c.dir / "dsstage-state" / "poller.json").read_text())
    except (OSError, ValueError):
        return {}


def until(what: str, check, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def stop(pid: int) -> None:
    """SIGKILL ``pid`` and its process group if it leads one (a service with what it
    started; a daemon leads none), as a host that dies; wait for it to go."""
    leads = os.getpgid(pid) == pid  # (before the kill: once dead, init may reap it at once)
    if leads:
        os.killpg(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGKILL)
    until(f"pid {pid} to go", lambda: not Path(f"/proc/{pid}").exists()
          or Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"), 30)


def test_the_backup_controller_takes_over_submissions_dataset_jobs_and_the_poller(another_devcluster):
    with another_devcluster("dsstage-failover-test", 29817, sample_files=20, services=True, backup=True) as c:
        assert until("both controllers up", lambda: controllers(c) == {"ctl1": "UP", "ctl2": "UP"} or None, 60)
        assert until("ctl1's poller to hold the lease", lambda: lease(c).get("host") == "ctl1", 60)
        # a queue of dataset jobs: more than the three nodes run at once
        script = 'echo "path=$DSSTAGE_PATH_SAMPLE"; test -s "$DSSTAGE_PATH_SAMPLE/labels.txt"; sleep 8\n'
        queued = [c.submit(script, "--dataset=sample", "-N1") for _ in range(5)]
        # slurmctld saves the queue to StateSaveLocation a moment after a change (what a
        # controller killed before that had not saved is lost, dsstage or not): the failure
        # comes once the queue is saved
        submitted = time.time()
        saved = c.dir / "state" / "ctld" / "job_state"
        until("the queue to be saved", lambda: saved.exists() and saved.stat().st_mtime > submitted + 0.1, 60)

        # the primary's host fails: its slurmctld and its poller die at once
        run = c.dir / "run"
        primary = int((run / "ctl.ctl1" / "slurmctld.pid").read_text())
        stop(primary)
        stop(int((run / "poller.ctl1.pid").read_text()))
        failed_at = time.monotonic()

        ctl2_log = c.dir / "log" / "slurmctld.ctl2.log"
        until("ctl2 to take over", lambda: "taking over" in ctl2_log.read_text(), 90)
        until("ctl2 to answer as the controller", lambda: controllers(c).get("ctl1") == "DOWN"
              and c.run("squeue", "-h", check=False).returncode == 0, 90)
        took = time.monotonic() - failed_at

        # submissions keep working on the backup: with a dataset, without one; an unknown
        # dataset is refused as unknown (the catalog is there), not for a missing catalog
        after = c.submit(script, "--dataset=sample", "-N1")
        plain = c.submit("echo plain\n", "-N1")
        bad = c.sbatch("true\n", "--dataset=samplex", check=False)
        assert bad.returncode != 0 and "unknown dataset 'samplex'" in bad.stderr, bad.stderr
        assert "is missing" not in bad.stderr, bad.stderr

        for job in [*queued, after, plain]:
            info = c.wait(job, timeout=240)
            assert info["JobState"] == "COMPLETED", (job, info)
        for job in [*queued, after]:
            out = c.output(job)
            assert "path=" in out and "path=\n" not in out, (job, out)

        # the poller's lease is the surviving controller's, and it acts: its rounds go on
        moved = until("ctl2's poller to take the lease", lambda: lease(c).get("host") == "ctl2" and lease(c), 120)
        first = moved.get("time")
        until("ctl2's poller to act again", lambda: lease(c).get("time") != first, 60)
        print(f"failover: the backup answered {took:.1f} s after the primary died")
