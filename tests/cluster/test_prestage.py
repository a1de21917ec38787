"""Data before the job starts, on a real Slurm: a pending job's dataset prefetched on the
node backfill planned for it (its Prolog then takes the warm path), and a job placed on
the node that holds its data when two are free (node features and --prefer).

The devcluster runs backfill every 5 s (bf_interval) with ignore_prefer_validation; the
tests call the demand poller and the prefetch themselves (`--once`) at the moment they
say, as their services would every interval.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def files(tag: str, n: int = 20, size: int = 50_000) -> dict[str, bytes]:
    return {f"{tag}/{i:03d}.bin": os.urandom(size) for i in range(n)}


class Jobs:
    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.ids: list[str] = []
        self.flags: list[Path] = []

    def flag(self) -> Path:
        p = self.cluster.jobs / f"flag-prestage-{time.monotonic_ns()}"
        self.flags.append(p)
        return p

    def submit(self, script: str, *opts: str, user: str | None = None) -> str:
        job = self.cluster.submit(script, *opts, user=user)
        self.ids.append(job)
        return job

    def blocker(self, node: str, limit: int = 2) -> Path:
        """A job holding ``node`` until the returned flag file exists (time limit ``limit`` min)."""
        flag = self.flag()
        job = self.submit(f"for i in $(seq 3000); do [ -e {flag} ] && break; sleep 0.2; done\n", "-w", node,
                          "--exclusive", "-t", str(limit))
        self.cluster.state(job, "RUNNING")
        return flag

    def planned(self, job: str, node: str, timeout: float = 60) -> dict[str, str]:
        """Wait until backfill has planned pending ``job`` on ``node`` with a start time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.cluster.run("squeue", "-h", "-j", job, "-O", "State:|,SchedNodes:|,StartTime:|").stdout
            state, sched, start = (out.strip().split("|") + ["", "", ""])[:3]
            if state == "PENDING" and sched == node and start not in ("", "N/A"):
                return {"state": state, "sched": sched, "start": start}
            time.sleep(0.5)
        raise AssertionError(f"job {job} was never planned on {node}: {self.cluster.job(job)}")

    def finish(self) -> None:
        for f in self.flags:
            f.write_text("go")
        self.cluster.cancel_active(self.ids)


@pytest.fixture
def jobs(cluster) -> Iterator[Jobs]:
    j = Jobs(cluster)
    try:
        yield j
    finally:
        j.finish()


def hook_log(cluster, job: str) -> list[str]:
    text = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
    return [line for line in text.splitlines() if f"job {job}: " in line]


def ready_on(cluster, node: str, name: str) -> bool:
    d = cluster.dir / "nvme" / node / "ready" / name
    return d.is_dir() and any(d.iterdir())


def test_a_pending_jobs_dataset_is_prefetched_on_its_planned_node(cluster, jobs):
    cluster.add_dataset("pfa", files("pfa"))
    go = jobs.blocker("n2")
    job = jobs.submit('head -c 10 "$DSSTAGE_PATH_PFA/pfa/000.bin" | wc -c\n', "--dataset=pfa", "-w", "n2",
                      "--exclusive", "-t", "1")
    jobs.planned(job, "n2")
    cluster.dsstage("demand-poller", "--once")
    dry = json.loads(cluster.dsstage("--node", "n2", "prefetch", "--dry-run", "--json").stdout)
    assert [(c["dataset"], c["job_id"]) for c in dry["prefetch"]] == [("pfa", job)]
    assert not json.loads(cluster.dsstage("--node", "n1", "prefetch", "--dry-run", "--json").stdout)["prefetch"]

    res = cluster.dsstage("--node", "n2", "prefetch", "--once")
    assert f"staged pfa for job {job}" in res.stderr
    assert ready_on(cluster, "n2", "pfa") and not ready_on(cluster, "n1", "pfa")
    assert cluster.job(job)["JobState"] == "PENDING", "the data arrived before the job started"
    report = json.loads((cluster.dir / "dsstage-state" / "nodes" / "n2.json").read_text())
    assert {"dataset": "pfa", "job_id": job, "action": "staged"}.items() <= report["prefetch"][-1].items()

    go.write_text("go")
    assert cluster.wait(job)["JobState"] == "COMPLETED"
    assert cluster.output(job).strip() == "10"
    lines = hook_log(cluster, job)
    # ready: a hit (the warm path, or the full Prolog when the configuration changed since
    # the node's last Prolog, as add_dataset just did): nothing staged
    assert any("pfa cached at" in line for line in lines), lines
    assert not any("pfa staged" in line for line in lines), lines


def features(cluster) -> dict[str, set[str]]:
    out = cluster.run("sinfo", "-h", "-N", "-o", "%N|%f").stdout
    return {n: {f for f in feats.split(",") if f and f != "(null)"}
            for n, feats in (line.split("|") for line in out.split())}


def test_a_job_starts_where_its_data_is(cluster, jobs):
    cluster.add_dataset("plc", files("plc"))
    cluster.dsstage("--node", "n3", "warm", "plc")  # publishes n3's report
    for node in ("n1", "n2"):
        cluster.dsstage("--node", node, "report")  # the other nodes' reports are current too
    cluster.dsstage("demand-poller", "--once")
    feats = features(cluster)
    assert "ds_plc" in feats["n3"] and "ds_plc" not in feats["n1"] | feats["n2"]
    assert json.loads(cluster.dsstage("status", "--json", "--dataset", "plc").stdout)  # status still reads

    # every node is free: without a preference Slurm takes n1, with --dataset=plc it prefers n3
    plain = jobs.submit("true\n", "--exclusive")
    assert cluster.wait(plain)["NodeList"] == "n1"
    job = jobs.submit('ls "$DSSTAGE_PATH_PLC/plc" | wc -l\n', "--dataset=plc", "--exclusive")
    info = cluster.wait(job)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n3", info
    assert "ds_plc" in info.values(), info  # job_submit set --prefer=ds_plc
    assert any("plc cached at" in line for line in hook_log(cluster, job))

    # the user's constraint holds: Slurm's --prefer overrides --constraint where it can, so the
    # preference carries it (gpu&ds_plc): n1 has the admin's gpu feature, n3 the data
    own = ",".join(sorted(feats["n1"] | {"gpu"}))
    cluster.run("scontrol", "update", "NodeName=n1", f"AvailableFeatures={own}", f"ActiveFeatures={own}")
    gpu = jobs.submit("true\n", "--dataset=plc", "-C", "gpu", "--exclusive", "--hold")
    assert cluster.job(gpu).get("Prefer") == "gpu&ds_plc"  # Slurm drops Prefer once the job runs
    cluster.run("scontrol", "release", gpu)
    info = cluster.wait(gpu)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n1", info

    # a job that names its nodes gets no preference: on 24.11 and later -w n2 with a preference
    # n2 cannot meet leaves it BadConstraints while n2 is busy, at times for good
    busy = jobs.submit("sleep 8\n", "-w", "n2", "--exclusive")
    cluster.state(busy, "RUNNING")
    named = jobs.submit("true\n", "--dataset=plc", "-w", "n2", "--hold")
    assert cluster.job(named).get("Prefer") in (None, "(null)"), cluster.job(named)
    cluster.run("scontrol", "release", named)
    info = cluster.wait(named, timeout=90)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n2", info

    # a dataset no node holds yet: accepted (ignore_prefer_validation), runs anywhere
    cluster.add_dataset("plnone", files("plnone", n=2))
    other = jobs.submit("true\n", "--dataset=plnone", "--exclusive")
    assert cluster.wait(other)["JobState"] == "COMPLETED"

    # scontrol reconfigure drops run-time features; the next poll puts them back
    cluster.run("scontrol", "reconfigure")
    deadline = time.monotonic() + 30
    while "ds_plc" in features(cluster)["n3"] and time.monotonic() < deadline:
        time.sleep(0.5)
    cluster.dsstage("demand-poller", "--once")
    assert "ds_plc" in features(cluster)["n3"]


def excluded(cluster, job: str) -> set[str]:
    from dsstage.hostlist import expand_nodes

    out = cluster.run("squeue", "-h", "-j", job, "-o", "%x").stdout.strip()
    return set(expand_nodes(out)) if out not in ("", "(null)") else set()


def idle(cluster, node: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while cluster.run("sinfo", "-h", "-n", node, "-o", "%T").stdout.strip() != "idle":
        assert time.monotonic() < deadline, f"{node} never became idle"
        time.sleep(0.3)


def test_a_pending_job_waits_for_the_busy_node_that_holds_its_data(cluster, jobs, request):
    """placement.wait_for_data (off by default; 30 min here, as a site turns it on): the poller
    excludes a pending job from the nodes without its data while a node with it is expected
    free in time; a free node without the data stays unused by it; the wait ends when the
    holder is drained."""
    before = cluster.configure(placement={"wait_for_data": "30m"})
    request.addfinalizer(lambda: cluster.configure(**before))
    cluster.add_dataset("pwd", files("pwd"))
    cluster.dsstage("--node", "n3", "warm", "pwd")
    for node in ("n1", "n2"):
        cluster.dsstage("--node", node, "report")
    cluster.dsstage("demand-poller", "--once")
    assert "ds_pwd" in features(cluster)["n3"]

    def queued() -> tuple[str, Path]:
        # n1 is expected free first (2 min), n3, which holds pwd, next (3 min), n2 last (10 min)
        go = {"n1": jobs.blocker("n1", 2), "n2": jobs.blocker("n2", 10), "n3": jobs.blocker("n3", 3)}
        job = jobs.submit('ls "$DSSTAGE_PATH_PWD/pwd" | wc -l\n', "--dataset=pwd", "--exclusive", "-t", "1")
        jobs.planned(job, "n1")  # --prefer alone: it would start on n1 and stage pwd there
        res = cluster.dsstage("demand-poller", "--once")
        assert f"job {job} waits for its data: starts waiting for n3, which hold pwd" in res.stderr, res.stderr
        assert excluded(cluster, job) == {"n1", "n2"}
        assert "dsstage-wait=" in cluster.job(job)["AdminComment"]
        go["n1"].write_text("go")  # n1 frees: the job does not take it
        idle(cluster, "n1")
        time.sleep(12)  # two backfill passes (bf_interval=5) and the main scheduler's
        assert cluster.job(job)["JobState"] == "PENDING", cluster.job(job)
        return job, go

    job, go = queued()
    cluster.dsstage("demand-poller", "--once")  # the next round changes nothing
    assert excluded(cluster, job) == {"n1", "n2"}
    explained = " ".join(cluster.dsstage("status", "--job", job).stdout.split())
    assert "for nodes that hold its data (placement.wait_for_data)" in explained, explained
    go["n3"].write_text("go")
    info = cluster.wait(job)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n3", info
    assert cluster.output(job).strip() == "20"
    assert any("pwd cached at" in line for line in hook_log(cluster, job))
    go["n2"].write_text("go")
    idle(cluster, "n2")

    # the node that holds the data goes away: the wait ends, the job runs where it can
    job, _ = queued()
    cluster.run("scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=test: a holder drained")
    try:
        res = cluster.dsstage("demand-poller", "--once")
        assert f"job {job} no longer waits for its data: 0 node(s) up hold pwd, it needs 1" in res.stderr, \
            res.stderr
        assert excluded(cluster, job) == set()
        assert "dsstage-waited=" in cluster.job(job)["AdminComment"]
        info = cluster.wait(job)
        assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n1", info
        assert cluster.output(job).strip() == "20"
    finally:
        cluster.run("scontrol", "update", "NodeName=n3", "State=RESUME", check=False)


def test_a_burst_buffer_directive_is_validated_and_staged(cluster, jobs):
    # Slurm refuses burst buffers to root: the jobs are daemon's
    cluster.add_dataset("bbd", files("bbd", n=5))
    res = cluster.sbatch("#BB_LUA dataset=bbx\ntrue\n", check=False, user="daemon")
    assert res.returncode != 0 and "dsstage: unknown dataset 'bbx' (did you mean 'bbd'?)" in res.stderr, res.stderr
    res = cluster.sbatch("#BB_LUA dataset=bbd capacity=1TB\ntrue\n", check=False, user="daemon")
    assert res.returncode != 0 and "#BB_LUA capacity=1TB: unknown option" in res.stderr, res.stderr

    # accepted and recorded like --dataset: the demand snapshot (and so the prefetch) sees it;
    # pre_run records it for the Prolog, which stages it; the Epilog releases, teardown forgets
    job = jobs.submit('#BB_LUA dataset=bbd\necho "bb=$DSSTAGE_BB_DATASETS"\n'
                      'echo "path=$DSSTAGE_PATH_BBD"\nls "$DSSTAGE_PATH_BBD/bbd" | wc -l\n', user="daemon")
    info = cluster.wait(job)
    assert info["JobState"] == "COMPLETED", info
    assert "dsstage=bbd" in info.get("AdminComment", ""), info
    out = cluster.output(job).split()
    assert out[0] == "bb=bbd", out  # slurm_bb_paths
    node = info["NodeList"]
    assert out[1].startswith(f"path={cluster.dir}/nvme/{node}/"), out  # the TaskProlog, from the Prolog
    assert out[2] == "5", out  # the job read its staged copy
    log = hook_log(cluster, job)
    assert any("#BB_LUA request bbd" in line for line in log), log
    assert any("bbd staged at" in line for line in log), log
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any("released bbd" in line for line in hook_log(cluster, job)):
        time.sleep(0.5)
    assert any("released bbd" in line for line in hook_log(cluster, job)), hook_log(cluster, job)
    record = cluster.dir / "dsstage-state" / "bb" / job
    while time.monotonic() < deadline and record.exists():
        time.sleep(0.5)
    assert not record.exists(), "teardown left the job's #BB_LUA record"
    stat = cluster.bbstat("dataset", "bbd", user="root")
    assert "bbd" in stat.split("Tiers")[0], stat


def test_a_burst_buffer_job_on_a_node_that_cannot_see_its_request_fails_with_what_to_set(cluster, jobs):
    """/etc/default/dsstage without DSSTAGE_BB_REQUESTS: the Prolog cannot find a #BB_LUA job's
    request, so it stages nothing. The job must not run without its data: its TaskProlog stops
    it with a line that says what the admins must set."""
    cluster.add_dataset("bbm", files("bbm", n=3))
    defaults = cluster.etc / "defaults"
    kept = defaults.read_text()
    assert "DSSTAGE_BB_REQUESTS=" in kept
    defaults.write_text("".join(line for line in kept.splitlines(keepends=True)
                                if not line.startswith("DSSTAGE_BB_REQUESTS=")))
    try:
        job = jobs.submit("#BB_LUA dataset=bbm\necho RAN\n", user="daemon")
        info = cluster.wait(job)
    finally:
        defaults.write_text(kept)
    assert info["JobState"] == "FAILED", info
    out = cluster.output(job)
    assert "RAN" not in out, out
    assert ("dsstage: error: this job asked for bbm with #BB_LUA but no Prolog staged it on "
            f"{info['NodeList']}: the admins must set DSSTAGE_BB_REQUESTS in {defaults}") in out, out



def features_of(cluster, node: str) -> tuple[set[str], set[str]]:
    """(available, active) features of ``node`` as sinfo shows them."""
    out = cluster.run("sinfo", "-h", "-N", "-n", node, "-o", "%f|%b").stdout.split()[0]
    available, active = ({f for f in part.split(",") if f and f != "(null)"} for part in out.split("|"))
    return available, active


def ours(feats: set[str]) -> set[str]:
    return {f for f in feats if f.startswith("ds_")}


def site_features(cluster, node: str) -> tuple[set[str], set[str]]:
    available, active = features_of(cluster, node)
    return available - ours(available), active - ours(active)


def test_the_poller_changes_only_its_own_features(cluster, jobs):
    """The admin's features stay as they were, available and active alike, also where they
    differ (as a NodeFeaturesPlugins node's do): dsstage adds and removes only its own."""
    cluster.add_dataset("plf", files("plf", n=2))
    available, active = features_of(cluster, "n2")
    cluster.run("scontrol", "update", "NodeName=n2",
                "AvailableFeatures=" + ",".join(["gpu", "bigmem", *ours(available)]),
                "ActiveFeatures=" + ",".join(["gpu", *ours(active)]))
    try:
        cluster.dsstage("--node", "n2", "warm", "plf")
        for node in ("n1", "n3"):
            cluster.dsstage("--node", node, "report")
        cluster.dsstage("demand-poller", "--once")
        assert site_features(cluster, "n2") == ({"gpu", "bigmem"}, {"gpu"}), features_of(cluster, "n2")
        available, active = features_of(cluster, "n2")
        assert "ds_plf" in available & active
        cluster.dsstage("--node", "n2", "evict", "plf")
        cluster.dsstage("--node", "n2", "report")
        cluster.dsstage("demand-poller", "--once")
        assert site_features(cluster, "n2") == ({"gpu", "bigmem"}, {"gpu"}), features_of(cluster, "n2")
        available, active = features_of(cluster, "n2")
        assert "ds_plf" not in available | active
    finally:  # the site's features gone again, dsstage's as they are
        available, active = features_of(cluster, "n2")
        cluster.run("scontrol", "update", "NodeName=n2", "AvailableFeatures=" + ",".join(sorted(ours(available))),
                    "ActiveFeatures=" + ",".join(sorted(ours(active))))
