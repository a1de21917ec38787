"""`dsstage prolog --dry-run` and `dsstage epilog --dry-run` on a real Slurm: what a job's
hook would decide on a node, from the job Slurm recorded and the node's store, with nothing
changed (no lease, no staging area, no copy, no report)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def files(tag: str, n: int = 12, size: int = 20_000) -> dict[str, bytes]:
    return {f"{tag}/{i:03d}.bin": os.urandom(size) for i in range(n)}


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def test_a_prolog_dry_run_says_what_the_hook_would_do_and_changes_nothing(cluster):
    cluster.add_dataset("dryd", files("dryd"))
    tier = cluster.dir / "nvme" / "n2"
    job = cluster.submit("true\n", "--dataset=dryd", "-w", "n2", "--hold", user="daemon")
    try:
        before = {d: tree(tier / d) for d in ("leases", "ready", "datasets", "staging", "reserved")}
        report = cluster.dir / "dsstage-state" / "nodes" / "n2.json"
        report_before = report.read_bytes() if report.exists() else None
        out = cluster.dsstage("--node", "n2", "prolog", "--dry-run", "--job", job).stdout
        assert f"job {job} (daemon, pending) on n2: the Prolog would" in out, out
        assert "dryd: give " in out and "stage: 12 files" in out and "then: the job runs" in out, out
        assert f"export DSSTAGE_PATH_DRYD={tier}/datasets/dryd/" in out, out
        after = {d: tree(tier / d) for d in before}
        assert after == before, (before, after)  # no lease, no copy, no staging area, no reservation
        assert (report.read_bytes() if report.exists() else None) == report_before
        assert cluster.job(job)["JobState"] == "PENDING"

        # a copy on n2: the dry run reuses it
        cluster.dsstage("--node", "n2", "warm", "dryd")
        data = json.loads(cluster.dsstage("--node", "n2", "prolog", "--dry-run", "--job", job, "--json").stdout)
        assert data["action"] == "run" and data["datasets"][0]["reason"] == "cached", data
        assert any(n.startswith("reuse: a ready copy") for n in data["datasets"][0]["notes"]), data
        assert tree(tier / "leases" / "dryd") == []  # warm keeps no lease; nor did the dry run take one

        # the dataset's source is gone: the dry run says the job would fall back or be held, as its on_failure says
        cluster.add_dataset("drygone", files("drygone", n=2))
        gone = cluster.submit("true\n", "--dataset=drygone", "-w", "n1", "--hold", user="daemon")
        source = cluster.dir / "data" / "drygone"
        source.rename(source.with_name("drygone.away"))
        try:
            out = cluster.dsstage("--node", "n1", "prolog", "--dry-run", "--job", gone).stdout
        finally:
            source.with_name("drygone.away").rename(source)
            cluster.run("scancel", gone, check=False)
        assert "drygone: " in out and ("hold the job" in out or "fall back" in out), out
    finally:
        cluster.run("scancel", job, check=False)


def test_an_epilog_dry_run_names_the_leases_it_would_release_and_keeps_them(cluster):
    cluster.add_dataset("drye", files("drye"))
    flag = cluster.jobs / "flag-dry-epilog"
    job = cluster.submit(f"for i in $(seq 300); do [ -e {flag} ] && break; sleep 0.2; done\n",
                         "--dataset=drye", "-w", "n3", "-t", "2")
    try:
        cluster.state(job, "RUNNING")
        leases = cluster.dir / "nvme" / "n3" / "leases" / "drye"
        deadline = time.monotonic() + 60
        while not tree(leases) and time.monotonic() < deadline:
            time.sleep(0.3)  # RUNNING shows while the Prolog may still stage
        held = tree(leases)
        assert held, "the job's Prolog took no lease"
        out = cluster.dsstage("--node", "n3", "epilog", "--dry-run", "--job", job).stdout
        assert f"job {job} on n3: the Epilog would release drye, then apply retention:" in out, out
        assert "(dry run: no lease released, nothing evicted)" in out
        assert tree(leases) == held
    finally:
        flag.write_text("go")
        cluster.wait(job)
