"""The demand snapshot: built from one queue query, written atomically, read by the hooks."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from dsstage.cluster import manifests_gc, poller, status
from dsstage.config import load, model
from dsstage.policy import demand, retention
from dsstage.slurm.fake import FakeSlurm
from dsstage.slurm.records import Job

NOW = 1_800_000_000.0


def conf(tmp_path: Path, **retention: object) -> model.Config:
    return load.from_dict({"state_dir": str(tmp_path / "state"),
                             "tiers": {"nvme": {"path": str(tmp_path / "nvme"), "capacity": "1GB"}},
                             "datasets": {"coco": {"source": "/data/coco"}}, "retention": retention})


JOBS = [
    Job("10", "ana", "PENDING", ("coco",), partition="gpu", priority=500, start_time=NOW + 1200, sched_nodes="n[1-2]"),
    Job("11", "bo", "PENDING", ("coco", "in22k"), partition="gpu", priority=900),
    Job("12", "ana", "RUNNING", ("coco",), nodes="n3", partition="gpu"),
    Job("13", "cy", "RUNNING", (), nodes="n[4-5]"),
    Job("14", "cy", "COMPLETED", ("coco",), nodes="n4"),
    Job("15", "cy", "COMPLETING", ("in22k",), nodes="n6"),
]


def test_snapshot_lists_each_datasets_jobs_and_every_running_job():
    snap = demand.build(JOBS, NOW, backend="CliSlurm", host="ctl")
    coco = snap.datasets["coco"]
    # pending: known start first, then by priority
    assert [r["job_id"] for r in coco["pending"]] == ["10", "11"]
    assert coco["pending"][0] == {"job_id": "10", "user": "ana", "partition": "gpu", "priority": 500,
                                  "start": NOW + 1200, "nodes": "n[1-2]", "held": False}
    assert coco["running"] == [{"job_id": "12", "user": "ana", "partition": "gpu", "nodes": "n3"}]
    assert [r["job_id"] for r in snap.datasets["in22k"]["running"]] == ["15"]  # its Epilog may still run
    assert snap.running == {"12": "n3", "13": "n[4-5]", "15": "n6"}  # a job without datasets too


def test_snapshot_round_trip_and_the_planners_view(tmp_path):
    state = tmp_path / "state"
    path = demand.write(str(state), demand.build(JOBS, NOW))
    assert oct(os.stat(path).st_mode & 0o777) == "0o644" and json.loads(Path(path).read_text())["format"] == 1
    snap = demand.read(str(state))
    dem = snap.demand(NOW + 30, max_age=300)
    assert not dem.stale and dem.age == 30
    first = dem.wants["coco"][0]
    assert (first.job_id, first.state, first.start, first.nodes, first.priority) == \
        ("10", "pending", NOW + 1200, ("n1", "n2"), 500)
    assert dem.wants["coco"][1].start is None and dem.wants["coco"][1].nodes == ()
    assert [w.nodes for w in dem.wants["coco"] if w.state == "running"] == [("n3",)]
    assert snap.running == {"12": "n3", "13": "n[4-5]", "15": "n6"}


def test_an_old_or_missing_snapshot_is_stale_and_says_why(tmp_path):
    state = tmp_path / "state"
    missing = demand.read(str(state))
    assert missing.demand(NOW, 300).stale and "is `dsstage demand-poller` running?" in missing.problem
    demand.write(str(state), demand.build(JOBS, NOW))
    assert demand.read(str(state)).demand(NOW + 301, 300).stale
    (state / demand.FILE).write_text('{"format": 99}')
    assert "format 99, written by a newer dsstage" in demand.read(str(state)).problem


def test_job_starts_are_counted_once_and_decay_to_the_snapshots_time():
    first = demand.build(JOBS, NOW)  # no previous snapshot: the running 12 and 15 count now
    assert first.uses == {"coco": 1.0, "in22k": 1.0}
    # a week later: 12 and 15 still run (counted already), pending 10 started, 16 appeared running
    later = [replace(JOBS[0], state="RUNNING", nodes="n1"), JOBS[2], JOBS[5],
             Job("16", "dee", "RUNNING", ("coco", "coco"), nodes="n7")]
    second = demand.build(later, NOW + retention.HALF_LIFE, previous=first)
    assert second.uses == {"coco": 0.5 + 2, "in22k": 0.5}
    # a job that ended and one that reappears running after a requeue (pending in between)
    third = demand.build([replace(JOBS[2], state="PENDING")], NOW + retention.HALF_LIFE + 30, previous=second)
    fourth = demand.build([JOBS[2]], NOW + retention.HALF_LIFE + 60, previous=third)
    assert fourth.uses["coco"] == pytest.approx(2.5 + 1, rel=1e-4)


def test_counts_round_trip_and_reach_the_planner_even_from_a_stale_snapshot(tmp_path):
    state = str(tmp_path / "state")
    demand.write(state, demand.Snapshot(time=NOW, uses={"coco": 8.0}))
    snap = demand.read(state)
    assert snap.uses == {"coco": 8.0}
    assert snap.demand(NOW + 30, 300).uses["coco"] == pytest.approx(8.0 * 0.5 ** (30 / retention.HALF_LIFE))
    stale = snap.demand(NOW + retention.HALF_LIFE, 300)
    assert stale.stale and not stale.wants and stale.uses == {"coco": 4.0}
    (tmp_path / "state" / demand.FILE).write_text(json.dumps({"format": 1, "time": NOW}))  # written before uses
    assert demand.read(state).demand(NOW, 300).uses == {}


def test_the_poller_carries_its_counts_from_round_to_round(tmp_path):
    c = conf(tmp_path)
    slurm = FakeSlurm()
    slurm.submit(JOBS[2])
    for t in (NOW, NOW + 30, NOW + 60):
        poller.run(c, slurm, once=True, clock=lambda t=t: t)
    assert demand.read(c.state_dir).uses["coco"] == pytest.approx(1.0, rel=1e-3)  # one job, counted once
    slurm.submit(Job("20", "ana", "RUNNING", ("coco",), nodes="n2"))
    poller.run(c, slurm, once=True, clock=lambda: NOW + 90)
    assert demand.read(c.state_dir).uses["coco"] == pytest.approx(2.0, rel=1e-3)


def test_status_lists_each_job_that_wants_data_once():
    rows = status.queue_rows(demand.build(JOBS, NOW))
    assert [(r["job_id"], r["state"], r["datasets"]) for r in rows] == [
        ("10", "pending", ["coco"]), ("11", "pending", ["coco", "in22k"]),
        ("12", "running", ["coco"]), ("15", "running", ["in22k"])]
    assert rows[0]["start"] == NOW + 1200 and rows[0]["nodes"] == "n[1-2]" and rows[0]["user"] == "ana"


def test_status_asks_slurm_only_without_a_fresh_snapshot(tmp_path):
    c = conf(tmp_path)
    slurm = FakeSlurm()
    for job in JOBS:
        slurm.submit(job)
    assert [q["job_id"] for q in status.collect(c, slurm, clock=lambda: NOW).queue] == ["10", "11", "12", "15"]

    class Refusing(FakeSlurm):
        def queue(self) -> list[Job]:
            raise AssertionError("asked Slurm although the snapshot is fresh")
    demand.write(c.state_dir, demand.build(JOBS[:1], NOW))
    assert [q["job_id"] for q in status.collect(c, Refusing(), clock=lambda: NOW + 5).queue] == ["10"]


def test_poller_once_writes_the_snapshot_and_a_failure_is_exit_1(tmp_path):
    c = conf(tmp_path)
    slurm = FakeSlurm()
    slurm.submit(JOBS[0])
    assert poller.run(c, slurm, once=True, clock=lambda: NOW) == 0
    assert demand.read(c.state_dir).datasets["coco"]["pending"][0]["job_id"] == "10"

    class Down(FakeSlurm):
        def queue(self) -> list[Job]:
            from dsstage.errors import CommandError
            raise CommandError(["squeue"], 1, "", "slurm_load_jobs error: Unable to contact slurm controller")
    assert poller.run(c, Down(), once=True, clock=lambda: NOW) == 1
    assert demand.read(c.state_dir).time == NOW  # the last good snapshot stays


def test_poller_loop_sleeps_the_rest_of_its_interval(tmp_path):
    c = conf(tmp_path, poll_interval="20s")
    t = [NOW]
    slept: list[float] = []

    rounds: list[int] = []

    class Counting(FakeSlurm):
        def queue(self) -> list[Job]:
            rounds.append(len(slept))
            return []

    def sleep(s: float) -> None:  # the wait goes in steps of at most 1 s (it watches for a nudge)
        slept.append(s)
        if len(slept) == 41:
            raise KeyboardInterrupt
        t[0] += s

    with pytest.raises(KeyboardInterrupt):
        poller.run(c, Counting(), clock=lambda: t[0], sleep=sleep)
    assert rounds == [0, 20, 40] and slept == [1.0] * 41  # a round, then 20 s, a round, 20 s, a round


def manifest(state: Path, name: str, digest: str, *, current: bool = False, age: float = 0) -> Path:
    d = state / "manifests" / name
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{digest}.manifest"
    p.write_text("x")
    if current:
        (d / "CURRENT").write_text(digest + "\n")
        t = time.time() - age
        os.utime(d / "CURRENT", (t, t))
    return p


def test_old_manifests_go_once_superseded_long_enough_and_held_by_no_node(tmp_path):
    c = conf(tmp_path, manifest_keep="1d")
    state = Path(c.state_dir)
    held, free, cur = "a" * 64, "b" * 64, "c" * 64
    for digest in (held, free):
        manifest(state, "coco", digest)
    manifest(state, "coco", cur, current=True, age=2 * 86400)
    (state / "nodes").mkdir()
    (state / "nodes" / "n1.json").write_text(json.dumps({"copies": [{"dataset": "coco", "version": held[:16]}]}))
    assert manifests_gc.prune(c, time.time()) == [("coco", free)]
    assert sorted(p.name[:1] for p in (state / "manifests" / "coco").glob("*.manifest")) == ["a", "c"]


def test_recently_superseded_manifests_stay(tmp_path):
    c = conf(tmp_path, manifest_keep="1d")
    state = Path(c.state_dir)
    manifest(state, "coco", "b" * 64)
    manifest(state, "coco", "c" * 64, current=True, age=3600)
    assert manifests_gc.prune(c, time.time()) == []


def test_the_systemd_unit_runs_the_poller_verb():
    from dsstage.cli.main import build_parser
    unit = (Path(__file__).resolve().parents[2] / "packaging" / "systemd" / "dsstage-demand-poller.service")
    [start] = [line.split("=", 1)[1].split() for line in unit.read_text().splitlines() if line.startswith("ExecStart=")]
    args = build_parser().parse_args(start[1:])
    assert args.handler.__name__ == "cmd_demand_poller" and not args.once


def test_of_two_pollers_one_acts_and_the_other_takes_over_when_it_stops(tmp_path):
    """A controller pair runs a poller on each host: one writes the snapshot each round, the
    other stands by, and acts once the first has not renewed its lease for 3 rounds."""
    from dsstage.cluster import leader
    c = conf(tmp_path, poll_interval="20s")
    os.makedirs(c.state_dir)
    t = [NOW]
    rounds: dict[str, int] = {"ctl1": 0, "ctl2": 0}

    class Counting(FakeSlurm):
        def __init__(self, host: str) -> None:
            super().__init__()
            self.host = host

        def queue(self) -> list[Job]:
            rounds[self.host] += 1
            return []

    def one_round(host: str) -> None:
        def stop(_s: float) -> None:
            raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            # the lease's age by this test's clock (leader.server_age is tested on its own below)
            poller.run(c, Counting(host), clock=lambda: t[0], sleep=stop, me=leader.Me(host, 100),
                       lease_age=lambda _d, _me: None)

    for _ in range(3):  # both poll every 20 s; ctl1 started first
        one_round("ctl1")
        one_round("ctl2")
        t[0] += 20
    assert rounds == {"ctl1": 3, "ctl2": 0}
    t[0] += 40  # ctl1 stopped: 60 s (3 rounds of 20 s) after its last round, still its lease
    one_round("ctl2")
    assert rounds["ctl2"] == 0
    t[0] += 1
    one_round("ctl2")
    assert rounds["ctl2"] == 1 and json.loads((tmp_path / "state" / "poller.json").read_text())["host"] == "ctl2"
    t[0] += 20
    one_round("ctl1")  # back: it stands by now
    assert rounds["ctl1"] == 3


@pytest.mark.parametrize("lease, act", [
    ({}, True), ({"host": "a", "pid": "x", "time": NOW}, True),
    ({"host": "me", "pid": 1, "time": NOW - 999}, True),
    ({"host": "other", "pid": 1, "time": NOW - 29}, False), ({"host": "other", "pid": 1, "time": NOW - 31}, True),
    ({"host": "me", "pid": 2, "time": NOW}, False)])  # a second poller on the same host
def test_the_lease_rule(lease, act):
    from dsstage.cluster import leader
    decision = leader.decide(lease, leader.Me("me", 1), NOW, leader.ttl(3))
    assert decision.act is act and decision.reason


def test_a_leases_age_is_the_state_directorys_not_a_comparison_of_two_hosts_clocks(tmp_path):
    """Issue 54: the standby compared the holder's clock (the lease's time) with its own, so a
    controller whose clock ran minutes behind looked stopped and was taken over every round.
    The age is the lease file's, by the state directory's own clock (its mtime against a probe
    touched now); the lease's time is shown, never compared."""
    from dsstage.cluster import leader
    state = str(tmp_path)
    me = leader.Me("ctl2", 7)
    now = time.time()
    # the holder's clock is 10 min behind, but it wrote the lease just now: it acts, stand by
    leader.write_json(leader.path(state), {"format": 1, "host": "ctl1", "pid": 5, "time": now - 600})
    assert leader.server_age(state, me) < 5
    assert leader.round_(state, me, now, leader.ttl(20)).act is False
    # the holder's clock is 10 min ahead, but it has not written for 100 s: taken over
    leader.write_json(leader.path(state), {"format": 1, "host": "ctl1", "pid": 5, "time": now + 600})
    os.utime(leader.path(state), (now - 100, now - 100))
    assert 99 < leader.server_age(state, me) < 110
    decision = leader.round_(state, me, now, leader.ttl(20))
    assert decision.act is True and "taken over" in decision.reason
    assert leader.server_age(str(tmp_path / "absent"), me) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_under_root_squash_the_poller_writes_as_report_user(tmp_path):
    """NFS squashes root: the state directory belongs to report.user, and the poller writes its
    snapshot, summary and lease as that user."""
    import pwd
    import shutil
    import tempfile
    daemon = pwd.getpwnam("daemon")
    top = tempfile.mkdtemp(dir="/var/tmp", prefix="dsstage-squash-")  # pytest's tmp_path is root's only
    os.chmod(top, 0o755)
    try:
        squashed(os.path.join(top, "state"), tmp_path, daemon)
    finally:
        shutil.rmtree(top)


def squashed(state: str, tmp_path: Path, daemon) -> None:
    c = load.from_dict({"state_dir": state,
                        "tiers": {"nvme": {"path": str(tmp_path / "nvme"), "capacity": "1GB"}},
                        "datasets": {"coco": {"source": "/data/coco"}}, "report": {"user": "daemon"}})
    os.makedirs(c.state_dir)
    os.chown(c.state_dir, daemon.pw_uid, daemon.pw_gid)
    os.chmod(c.state_dir, 0o755)

    def stop(_s: float) -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        poller.run(c, FakeSlurm(), clock=lambda: NOW, sleep=stop)
    for name in ("demand.json", "demand-summary.json", "poller.json"):
        assert os.stat(os.path.join(c.state_dir, name)).st_uid == daemon.pw_uid, name


def test_a_pending_job_in_a_bounded_wait_carries_when_it_began():
    """The poller's marker (dsstage.policy.datawait) in AdminComment: ``waiting`` only while
    it waits; a job that waited once, or that has none, has no such field."""
    waits, waited = "dsstage-datasets=coco dsstage-wait=1799999000:n[2-9]", "dsstage-datasets=coco dsstage-waited=1"
    jobs = [Job("20", "ana", "PENDING", ("coco",), admin_comment=waits),
            Job("21", "ana", "PENDING", ("coco",), admin_comment=waited),
            Job("22", "ana", "RUNNING", ("coco",), nodes="n1", admin_comment=waits)]
    coco = demand.build(jobs, NOW).datasets["coco"]
    assert [r.get("waiting") for r in coco["pending"]] == [1799999000, None]
    assert "waiting" not in coco["running"][0]


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as a directory's owner needs root")
def test_old_manifests_are_removed_as_their_directorys_owner(tmp_path):
    """Where NFS squashes root, root may remove nothing in a data owner's manifest directory;
    the poller removes old manifests as that directory's owner. Seen here by a directory its
    owner (nobody) may not write: root alone could remove the file, its owner cannot, and the
    file stays, said in the log; writable by its owner, it goes."""
    import pwd
    c = conf(tmp_path, manifest_keep="1d")
    state = Path(c.state_dir)
    free, cur = "b" * 64, "c" * 64
    manifest(state, "coco", free)
    manifest(state, "coco", cur, current=True, age=2 * 86400)
    d = state / "manifests" / "coco"
    nobody = pwd.getpwnam("nobody")
    for p in (state, state / "manifests"):
        p.chmod(0o755)
    os.chown(d, nobody.pw_uid, nobody.pw_gid)
    from helpers import reachable_above
    with reachable_above(d):
        d.chmod(0o555)
        assert manifests_gc.prune(c, time.time()) == []  # as nobody, who may not write there
        d.chmod(0o755)
        assert manifests_gc.prune(c, time.time()) == [("coco", free)]


def test_with_peers_the_poller_writes_which_nodes_hold_each_version_and_the_nodes_read_it(tmp_path):
    """The poller reads the nodes' published reports once per round and writes, per dataset and
    version, the nodes that show it ready and current (stale reports, staging copies and old
    versions left out); a node's planner gets them only with peers on."""
    from dsstage.node import report
    c = conf(tmp_path, poll_interval="20s")
    c = replace(c, peers=replace(c.peers, enabled=True))
    os.makedirs(os.path.join(c.state_dir, report.NODES))
    rows = {"n1": [{"dataset": "coco", "version": "aaaa", "state": "ready", "current": True}],
            "n2": [{"dataset": "coco", "version": "aaaa", "state": "ready", "current": True},
                   {"dataset": "in22k", "version": "bbbb", "state": "staging", "current": True},
                   {"dataset": "in22k", "version": "cccc", "state": "ready", "current": False}],
            "n3": [{"dataset": "coco", "version": "aaaa", "state": "ready", "current": True}]}
    for node, copies in rows.items():
        when = NOW - (10_000 if node == "n3" else 5)  # n3's report is stale
        Path(report.published_path(c.state_dir, node)).write_text(
            json.dumps({"node": node, "time": when, "copies": copies}))
    Path(report.published_path(c.state_dir, "n9")).write_text(  # hostile: a hostlist for a name, rows of junk
        json.dumps({"node": "x[1-200000]", "time": NOW, "copies": [{"dataset": "coco", "version": "aaaa",
                                                                     "state": "ready", "leases": 5}, 7]}))
    Path(report.published_path(c.state_dir, "n8")).write_text(  # n8's file claiming to be n1: n1 holds nothing more
        json.dumps({"node": "n1", "time": NOW, "copies": [{"dataset": "in22k", "version": "bbbb", "state": "ready"}]}))
    slurm = FakeSlurm()
    slurm.submit(JOBS[0])
    assert poller.run(c, slurm, once=True, clock=lambda: NOW) == 0
    snap = demand.read(c.state_dir)
    assert snap.copies == {"coco": {"aaaa": "n[1-2]"}, "in22k": {"cccc": "n2"}}  # an old version too
    assert snap.demand(NOW, 300, copies=True).copies == {"coco": {"aaaa": frozenset({"n1", "n2"})},
                                                         "in22k": {"cccc": frozenset({"n2"})}}
    assert snap.demand(NOW, 300).copies == {}
    off = replace(c, peers=replace(c.peers, enabled=False))
    assert poller.run(off, slurm, once=True, clock=lambda: NOW + 20) == 0
    assert demand.read(c.state_dir).copies == {}
    assert "copies" not in json.loads(Path(demand.path(c.state_dir)).read_text())
