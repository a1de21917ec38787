"""Retention from the queue on a real Slurm: what the Epilog keeps and evicts (for the queue, and
for what the whole cluster uses), how a Prolog makes room, which leases are reclaimed, and what
the demand poller reads from the queue.

The tests use a tier of their own (``small``, on n1) with datasets of 400 kB, so that
the other cluster tests' data never count, and an admin's lowered capacity puts the tier under
pressure (the hooks read the configuration afresh). ``retention.min_keep`` is 0: a copy the
ending job used a moment ago is not protected by its recent use. The demand snapshot is
taken (``dsstage demand-poller --once``) at the moment each test says; the hooks only read it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dsstage.config import manifest

pytestmark = pytest.mark.cluster

NODE = "n1"
TIER = "small"
DATASETS = ("rx", "ry", "rz")
SIZE = 400_000  # bytes per dataset: four files of 100 kB
ROOMY = "2MB"  # all three fit well below the high watermark (90%)


# -- the module's tier and datasets --------------------------------------------------------

def write_config(cluster, conf: dict[str, Any] | str) -> None:
    """The configuration, replaced atomically (a hook may read it at any moment), root's, 0644."""
    path = cluster.etc / "dsstage.yaml"
    tmp = path.with_name(".dsstage.yaml.tmp")
    tmp.write_text(conf if isinstance(conf, str) else yaml.safe_dump(conf))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def read_config(cluster) -> dict[str, Any]:
    return yaml.safe_load((cluster.etc / "dsstage.yaml").read_text())


@pytest.fixture(scope="module")
def small(cluster) -> Iterator[Path]:
    """Tier ``small`` ({node} under $DIR/small) with rx, ry and rz on it; the configuration,
    the catalog and the demand snapshot are put back as they were at the end."""
    path = cluster.etc / "dsstage.yaml"
    original = path.read_text()
    snap = snapshot(cluster)
    original_snap = snap.read_bytes() if snap.exists() else None
    conf = yaml.safe_load(original)
    # with two tiers every dataset must name its own
    for spec in conf["datasets"].values():
        spec.setdefault("tier", next(iter(conf["tiers"])))
    conf["tiers"][TIER] = {"path": str(cluster.dir / TIER / "{node}"), "capacity": ROOMY,
                           "high_watermark": "90%", "low_watermark": "50%", "root_filesystem": True}
    conf["retention"] = {"min_keep": 0}
    write_config(cluster, conf)
    try:
        for name in DATASETS:
            cluster.add_dataset(name, {f"{i}.bin": os.urandom(SIZE // 4) for i in range(4)}, tier=TIER)
        yield cluster.dir / TIER / NODE
    finally:
        write_config(cluster, original)
        cluster.dsstage("export-catalog", "-o", str(cluster.etc / "dsstage_catalog.lua"))
        if original_snap is None:
            snap.unlink(missing_ok=True)
        else:
            snap.write_bytes(original_snap)


def snapshot(cluster) -> Path:
    return cluster.dir / "dsstage-state" / "demand.json"


class Lab:
    """The cluster, the small tier of n1, and the jobs and flag files of one test."""

    def __init__(self, cluster, root: Path, name: str) -> None:
        self.cluster = cluster
        self.root = root
        self.name = name
        self.jobs: list[str] = []
        self.flags: list[Path] = []

    # -- jobs ------------------------------------------------------------------------

    def flag(self, what: str) -> Path:
        """A flag file; ``wait_for(flag)`` in a job's script keeps it running until it exists."""
        path = self.cluster.jobs / f"flag-{self.name}-{what}-{time.monotonic_ns()}"
        self.flags.append(path)
        return path

    @staticmethod
    def wait_for(flag: Path) -> str:
        return f"for i in $(seq 600); do [ -e {flag} ] && break; sleep 0.2; done\n"  # at most 2 minutes

    def submit(self, script: str, *opts: str) -> str:
        job = self.cluster.submit(script, "-w", NODE, *opts)
        self.jobs.append(job)
        return job

    def state(self, job: str, state: str, timeout: float = 60) -> dict[str, str]:
        return self.cluster.state(job, state, timeout)

    def running(self, job: str, *datasets: str, timeout: float = 60) -> None:
        """Wait until the job runs and its Prolog leased ``datasets`` on n1 (a job shows
        RUNNING while its Prolog may still be at work)."""
        self.state(job, "RUNNING", timeout)
        deadline = time.monotonic() + timeout
        while not all(job in self.leases(name) for name in datasets):
            assert time.monotonic() < deadline, f"job {job} holds no lease on {datasets}: {self.log(job)}"
            time.sleep(0.1)

    def done(self, job: str) -> dict[str, str]:
        """Wait for the job's end: COMPLETED comes after its Epilog (PrologFlags=Alloc)."""
        info = self.cluster.wait(job, timeout=90)
        assert info["JobState"] == "COMPLETED", info
        return info

    def finish(self) -> None:
        for f in self.flags:
            f.write_text("go")
        self.cluster.cancel_active(self.jobs)

    # -- dsstage -------------------------------------------------------------------------

    def poll(self) -> dict[str, Any]:
        """Take the demand snapshot now; return it."""
        self.cluster.dsstage("demand-poller", "--once")
        return json.loads(snapshot(self.cluster).read_text())

    def capacity(self, value: str) -> None:
        conf = read_config(self.cluster)
        conf["tiers"][TIER]["capacity"] = value
        write_config(self.cluster, conf)

    def plan(self) -> dict[str, dict[str, Any]]:
        """``dsstage evict --dry-run --json`` on n1: the small tier's copies by dataset."""
        rows = json.loads(self.cluster.dsstage("--node", NODE, "evict", "--dry-run", "--json").stdout)
        return {r["dataset"]: r for r in rows if r["tier"] == TIER}

    def version(self, name: str) -> str:
        return manifest.Catalog(str(self.cluster.dir / "dsstage-state")).require_current(name)[:16]

    def copies(self, name: str) -> list[str]:
        """The version directories of ``name`` on n1."""
        d = self.root / "datasets" / name
        return sorted(os.listdir(d)) if d.is_dir() else []

    def leases(self, name: str) -> dict[str, dict[str, Any]]:
        d = self.root / "leases" / name
        return {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")} if d.is_dir() else {}

    def age_lease(self, name: str, job: str, seconds: float) -> None:
        """Set the ``taken`` time of a lease back (as an admin editing it as root could)."""
        p = self.root / "leases" / name / f"{job}.json"
        record = json.loads(p.read_text())
        record["taken"] = time.time() - seconds
        p.write_text(json.dumps(record))

    def log(self, job: str) -> list[str]:
        """The hook log's lines about ``job`` (its Prolog's and Epilog's, and a hook's crash)."""
        text = (self.cluster.dir / "log" / "dsstage-hooks.log").read_text()
        return [line for line in text.splitlines() if f"job {job}: " in line or line.endswith(f"for job {job}")]

    def clean(self) -> None:
        """No lease, no copy and nothing in the trash in the small tier of n1; the tier roomy;
        no demand snapshot."""
        self.capacity(ROOMY)
        snapshot(self.cluster).unlink(missing_ok=True)
        for p in (self.root / "leases").glob("*/*.json"):
            p.unlink()
        for name in DATASETS:
            if self.copies(name):
                self.cluster.dsstage("--node", NODE, "evict", name, "--force")
            assert not self.copies(name)
        deadline = time.monotonic() + 30
        while (any((self.root / "trash").iterdir()) if (self.root / "trash").is_dir() else False):
            assert time.monotonic() < deadline, "the trash of the small tier was not purged"
            time.sleep(0.1)


@pytest.fixture
def lab(cluster, small, request) -> Iterator[Lab]:
    lab = Lab(cluster, small, request.node.name.split("[")[0])
    lab.clean()
    try:
        yield lab
    finally:
        lab.finish()
        lab.capacity(ROOMY)


def evicted(lines: list[str], name: str) -> list[str]:
    return [line for line in lines if f": evicted {name} " in line]


# -- 1, 2: the Epilog keeps what the queue wants, and only that --------------------------------

def test_epilog_keeps_a_dataset_a_pending_job_wants_and_evicts_an_unwanted_one(lab):
    """Job A used rx and ry on n1; job B, pending for n1 (exclusive, while job H holds a CPU
    there), wants rx. When A ends under pressure, its Epilog evicts ry and keeps rx, saying
    why; B then runs from the copy A left."""
    go_a, go_h = lab.flag("a"), lab.flag("h")
    a = lab.submit("#SBATCH --dataset=rx,ry\n" + lab.wait_for(go_a))
    h = lab.submit(lab.wait_for(go_h))
    lab.running(a, "rx", "ry")
    lab.running(h)
    b = lab.submit("#SBATCH --dataset=rx\necho DIR=$DSSTAGE_PATH_RX\n", "--exclusive")
    assert lab.cluster.job(b)["JobState"] == "PENDING"
    snap = lab.poll()
    assert [r["job_id"] for r in snap["datasets"]["rx"]["pending"]] == [b]
    assert not snap["datasets"]["ry"]["pending"]
    rx, ry = lab.version("rx"), lab.version("ry")
    assert lab.copies("rx") == [rx] and lab.copies("ry") == [ry]
    # pressure: 800 kB of copies, high watermark 90% of 600 kB (540 kB), low 50% (300 kB)
    lab.capacity("600KB")
    go_a.write_text("go")
    lab.done(a)

    lines = lab.log(a)
    assert evicted(lines, "ry") and "over high watermark" in evicted(lines, "ry")[0], lines
    assert not evicted(lines, "rx"), lines
    assert lab.copies("rx") == [rx] and lab.copies("ry") == []
    assert lab.cluster.job(b)["JobState"] == "PENDING"
    kept = lab.plan()["rx"]
    assert kept["action"] == "kept" and kept["reason"].startswith(f"wanted by pending job {b} ("), kept

    go_h.write_text("go")
    lab.done(b)
    assert f"DIR={lab.root}/datasets/rx/{rx}\n" in lab.cluster.output(b)
    assert any("rx cached" in line for line in lab.log(b)), lab.log(b)
    assert lab.copies("ry") == []  # nobody staged it again


def test_epilog_evicts_a_dataset_nothing_wants_over_the_high_watermark(lab):
    """Job G used rx on n1; nothing in the queue wants rx. G's Epilog keeps it while the tier
    has room, and evicts it once an admin lowered the capacity under what rx takes."""
    go_1, go_2 = lab.flag("g1"), lab.flag("g2")
    g1 = lab.submit("#SBATCH --dataset=rx\n" + lab.wait_for(go_1))
    lab.running(g1, "rx")
    lab.poll()
    go_1.write_text("go")
    lab.done(g1)
    assert lab.copies("rx") == [lab.version("rx")]  # no pressure: kept
    assert not evicted(lab.log(g1), "rx")

    g2 = lab.submit("#SBATCH --dataset=rx\n" + lab.wait_for(go_2))
    lab.running(g2, "rx")
    snap = lab.poll()
    assert not snap["datasets"]["rx"]["pending"]
    lab.capacity("300KB")  # 400 kB of copies, high watermark 270 kB
    go_2.write_text("go")
    lab.done(g2)
    lines = evicted(lab.log(g2), "rx")
    assert lines and "over high watermark (90% of " in lines[0], lab.log(g2)
    assert lab.copies("rx") == []


# -- 2b: what the whole cluster uses ---------------------------------------------------------

def test_epilog_keeps_the_dataset_the_cluster_uses_over_the_one_used_last_here(lab):
    """A decision only the cluster-aware rule makes. ry was used on n1 and then by jobs on n2
    and n3; rx was used on n1 after all of them, by one job. Nothing in the queue wants
    either when that job ends under pressure (850 kB: high watermark 765 kB, low 425 kB, so
    one copy of 400 kB must go). Its Epilog evicts rx, the copy used last on n1, and keeps
    ry, which three jobs in the cluster started with (the poller's counts of job starts):
    LRU, or any rule that reads n1's history alone, would have evicted ry. The devcluster
    runs with peers on, where a copy other nodes hold goes before the one the cluster keeps
    (retention.keeper): ry's copies on n2 and n3 are evicted first, so that n1 holds the
    last copy of both and the counts decide."""
    others = ("n2", "n3")
    try:
        go = lab.flag("ry-n1")
        first = lab.submit("#SBATCH --dataset=ry\n" + lab.wait_for(go))
        lab.running(first, "ry")
        lab.poll()  # the poller counts a job once, when a snapshot shows it running
        go.write_text("go")
        lab.done(first)

        go = lab.flag("ry-others")
        elsewhere = [lab.cluster.submit("#SBATCH --dataset=ry\n" + lab.wait_for(go), "-w", node) for node in others]
        lab.jobs.extend(elsewhere)
        for job in elsewhere:
            lab.state(job, "RUNNING")
        lab.poll()
        go.write_text("go")
        for job in elsewhere:
            lab.done(job)
        for node in others:
            lab.cluster.dsstage("--node", node, "evict", "ry", "--force")

        go = lab.flag("rx")
        last = lab.submit("#SBATCH --dataset=rx\n" + lab.wait_for(go))
        lab.running(last, "rx")
        snap = lab.poll()
        # nothing pending wants either, and the jobs on n2 and n3 have ended
        assert [r["job_id"] for r in snap["datasets"]["rx"]["running"]] == [last], snap
        assert not snap["datasets"]["rx"]["pending"] and "ry" not in snap["datasets"], snap
        assert round(snap["uses"]["ry"]) == 3 and round(snap["uses"]["rx"]) == 1, snap["uses"]
        rx, ry = lab.version("rx"), lab.version("ry")
        assert lab.copies("rx") == [rx] and lab.copies("ry") == [ry]
        lab.capacity("850KB")  # 800 kB of copies
        go.write_text("go")
        lab.done(last)

        lines = lab.log(last)
        assert evicted(lines, "rx"), lines
        assert "no demand; used by 1 job in the cluster" in evicted(lines, "rx")[0], lines
        assert not evicted(lines, "ry"), lines
        assert lab.copies("rx") == [] and lab.copies("ry") == [ry]
        kept = lab.plan()["ry"]
        assert kept["action"] == "kept" and kept["reason"].startswith(
            "the last copy in the cluster; used by 3 jobs in the cluster"), kept
    finally:
        for node in others:
            lab.cluster.dsstage("--node", node, "evict", "ry", "--force")


# -- 3: a lease holds against any pressure ------------------------------------------------

def test_a_leased_dataset_survives_pressure(lab):
    """Job L holds rx on n1 while job E, which used ry there, ends with the tier far over its
    capacity: E's Epilog evicts ry and leaves rx, which is leased."""
    go_l, go_e = lab.flag("l"), lab.flag("e")
    holder = lab.submit("#SBATCH --dataset=rx\n" + lab.wait_for(go_l))
    e = lab.submit("#SBATCH --dataset=ry\n" + lab.wait_for(go_e))
    lab.running(holder, "rx")
    lab.running(e, "ry")
    lab.poll()
    lab.capacity("300KB")  # 800 kB of copies: even rx alone is over the capacity
    go_e.write_text("go")
    lab.done(e)
    lines = lab.log(e)
    assert evicted(lines, "ry"), lines
    assert not evicted(lines, "rx"), lines
    assert lab.copies("rx") == [lab.version("rx")] and lab.copies("ry") == []
    assert set(lab.leases("rx")) == {holder}
    row = lab.plan()["rx"]
    assert (row["action"], row["reason"]) == ("kept", f"leased by job {holder}")
    out = lab.cluster.dsstage("--node", NODE, "evict", "rx", "--force").stdout
    assert f"kept: leased by job {holder}" in out and lab.copies("rx") == [lab.version("rx")]


# -- 4: a Prolog that needs room --------------------------------------------------------------

def test_prolog_makes_room_by_evicting_an_unwanted_copy(lab):
    """ry is on n1 and nothing wants it; the tier (600 kB) cannot take rx beside it below its
    high watermark. The Prolog of a job for rx evicts ry, and the job reads rx's local copy."""
    first = lab.submit("#SBATCH --dataset=ry\ntrue\n")
    lab.done(first)
    assert lab.copies("ry") == [lab.version("ry")] and not lab.leases("ry")
    lab.poll()
    lab.capacity("600KB")
    job = lab.submit("#SBATCH --dataset=rx\necho DIR=$DSSTAGE_PATH_RX\n")
    lab.done(job)
    rx = lab.version("rx")
    out = lab.cluster.output(job)
    assert f"DIR={lab.root}/datasets/rx/{rx}\n" in out and "dsstage: warning" not in out, out
    assert lab.copies("rx") == [rx] and lab.copies("ry") == []
    staged = [line for line in lab.log(job) if "rx staged" in line]
    assert staged, lab.log(job)
    # the same Prolog process (lines carry dsstage-<pid>:) made the room
    prolog = re.search(r"dsstage-\d+", staged[0]).group(0)
    log = (lab.cluster.dir / "log" / "dsstage-hooks.log").read_text()
    assert (f"{prolog}: INFO: job {job}: making room for rx on {NODE}: evicted ry {lab.version('ry')} "
            "(room for the stage in progress") in log, log[-3000:]


def test_a_stage_takes_the_headroom_and_the_next_epilog_gives_it_back(lab):
    """ry is on n1 and nothing wants it; the tier (850 kB, high watermark 765 kB) takes rx
    beside it above the high watermark but within its capacity. The Prolog of a job for rx
    stages it without evicting anything (no eviction on the job's path); that job's Epilog
    finds the tier above the high watermark and evicts ry, the copy nothing wants and used
    least recently, down to the low watermark (425 kB)."""
    first = lab.submit("#SBATCH --dataset=ry\ntrue\n")
    lab.done(first)
    lab.poll()
    lab.capacity("850KB")
    go = lab.flag("rx")
    job = lab.submit("#SBATCH --dataset=rx\n" + lab.wait_for(go))
    lab.running(job, "rx")
    assert lab.copies("rx") == [lab.version("rx")] and lab.copies("ry") == [lab.version("ry")]
    assert not [line for line in lab.log(job) if "making room" in line], lab.log(job)
    go.write_text("go")
    lab.done(job)
    assert lab.copies("ry") == [] and lab.copies("rx") == [lab.version("rx")], lab.log(job)
    assert any(f": evicted ry {lab.version('ry')} (over high watermark (90% of " in line
               for line in lab.log(job)), lab.log(job)


def test_prolog_that_cannot_make_room_falls_back_and_says_what_holds_the_space(lab):
    """Job L holds ry on n1; the tier (600 kB) cannot take rx as well, and ry may not go. The
    Prolog of a job for rx (on_failure: fallback) lets it run from the source, with a warning
    in its output that names the leased copy that holds the space; the node stays up."""
    go_l = lab.flag("l")
    holder = lab.submit("#SBATCH --dataset=ry\n" + lab.wait_for(go_l))
    lab.running(holder, "ry")
    lab.poll()
    lab.capacity("600KB")
    job = lab.submit("#SBATCH --dataset=rx\necho DIR=$DSSTAGE_PATH_RX\n")
    lab.done(job)
    out = lab.cluster.output(job)
    src = lab.cluster.dir / "data" / "rx"
    assert f"DIR={src}\n" in out, out
    warning = [line for line in out.splitlines() if line.startswith("dsstage: warning: could not stage 'rx'")]
    assert warning, out
    assert "cannot make room for 'rx'" in warning[0], warning
    assert f"it is held by ry {lab.version('ry')} (390.6 KiB: leased by job {holder})" in warning[0], warning
    assert f"reading {src} directly" in warning[0], warning
    assert lab.copies("rx") == [] and lab.copies("ry") == [lab.version("ry")]
    assert "drain" not in lab.cluster.node_state(NODE)


# -- 5: stale leases --------------------------------------------------------------------------

def test_epilog_reclaims_the_lease_of_a_gone_job_and_never_a_live_one(lab):
    """A lease of a job that ended without its Epilog: made with ``dsstage stage ry --job-id
    DEAD --node n1`` for a job DEAD that has ended, its ``taken`` set 10 minutes back (editing
    the lease file as root). A live lease: job L, running on n1 with rx, whose lease is set
    back as far. The Epilog of job E on n1, with a snapshot taken while L ran, reclaims DEAD's
    lease only."""
    dead = lab.submit("true\n")
    lab.done(dead)
    lab.cluster.dsstage("--node", NODE, "stage", "ry", "--job-id", dead)
    lab.age_lease("ry", dead, 600)
    go_l, go_e = lab.flag("l"), lab.flag("e")
    holder = lab.submit("#SBATCH --dataset=rx\n" + lab.wait_for(go_l))
    e = lab.submit("#SBATCH --dataset=rz\n" + lab.wait_for(go_e))
    lab.running(holder, "rx")
    lab.running(e, "rz")
    lab.age_lease("rx", holder, 600)
    assert lab.plan()["ry"]["reason"] == f"leased by job {dead}"
    snap = lab.poll()
    assert holder in snap["running"] and dead not in snap["running"]
    go_e.write_text("go")
    lab.done(e)
    lines = lab.log(e)
    assert f"job {e}: reclaimed the lease of job {dead} on ry: the job is gone" in "\n".join(lines), lines
    assert not any(f"reclaimed the lease of job {holder}" in line for line in lines), lines
    assert dead not in lab.leases("ry")
    assert set(lab.leases("rx")) == {holder}
    # ry is now free to go; rx is not
    plan = lab.plan()
    assert not plan["ry"]["reason"].startswith("leased"), plan["ry"]
    assert plan["rx"]["reason"] == f"leased by job {holder}"


# -- 6: the tag after the site's own text in admin_comment ----------------------------------

def test_a_job_whose_admin_comment_has_text_before_the_tag_counts_in_the_demand(lab):
    """An admin put a note before job_submit.lua's ``dsstage=rz`` in a held job's
    AdminComment: the poller still reads the job's request, and status shows it."""
    job = lab.submit("#SBATCH --dataset=rz\ntrue\n", "--hold")
    lab.cluster.run("scontrol", "update", f"JobId={job}", "AdminComment=site note: a=b dsstage=rz")
    admin = lab.cluster.run("squeue", "-h", "-j", job, "-O", "admin_comment:|").stdout.strip()
    assert admin == "site note: a=b dsstage=rz|"
    snap = lab.poll()
    assert [r["job_id"] for r in snap["datasets"].get("rz", {}).get("pending", [])] == [job], snap
    st = json.loads(lab.cluster.dsstage("status", "--json").stdout)
    jobs = {q["job_id"]: q for q in st["queue"]["jobs"]}
    assert job in jobs and jobs[job]["datasets"] == ["rz"] and jobs[job]["state"] == "pending", st["queue"]
