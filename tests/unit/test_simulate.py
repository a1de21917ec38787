"""The retention simulator: traces, scheduler, policies and bound on cases whose outcome is known."""

from __future__ import annotations

import io
import itertools
import json
import random
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from dsstage.cli import main as cli
from dsstage.policy import retention as rt
from dsstage.policy.sim import cli as simulate
from dsstage.policy.sim import trace as tr
from dsstage.policy.sim.bound import lower_bound, pack
from dsstage.policy.sim.planner import Planner, Snapshot
from dsstage.policy.sim.replay import Features, JobEnd, Lru, Offline, Policy, QueueOracle, Result, Setup, Tier
from dsstage.policy.sim.replay import simulate as run_sim
from dsstage.policy.sim.sched import Nodes, Schedule, Scheduler, project, schedule

GB = 10**9


def job(i: int, ds: str, submit: float = 0.0, runtime: float = 100.0, slots: int = 1, limit: float | None = None,
        user: str = "u") -> tr.Job:
    return tr.Job(str(i), submit, runtime, runtime if limit is None else limit, slots, user, ds)


def replay(sched: Schedule, sizes: dict[str, int], capacity: int, bandwidth: float, policy: Policy) -> Result:
    """``policy`` on the jobs of ``sched`` with placement unaware, checking that the simulation
    schedules them as ``schedule`` did: with unaware placement the caches change nothing."""
    res, out = run_sim([r.job for r in sched.runs], sched.nodes, sched.slots_per_node, sizes, capacity, bandwidth,
                        policy)
    assert out.runs == sched.runs
    return res


def serial(datasets: list[str]) -> list[tr.Job]:
    """One job after the other on one node, all submitted at once."""
    return [job(i + 1, d, submit=0.0, runtime=1000.0) for i, d in enumerate(datasets)]


# -- policies on hand-made request sequences ------------------------------------------------------

BELADY = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]  # the textbook string, 3 frames


def test_the_queue_oracle_is_belady_when_the_queue_shows_everything_and_history_when_it_shows_nothing():
    """The textbook string on one node: every job submitted at once, the queue-oracle knows each
    next use and does what the offline policy does (9 misses, Belady's); each job submitted
    only as the one before ends (the queue shows nothing ahead), it can only fall back on the
    history the planner has too (the cluster's decayed start counts, then recency): 13 misses
    here, one more than LRU's 12, against the 9 that knowing the future gives."""
    sizes = {f"p{p}": GB for p in set(BELADY)}
    known = serial([f"p{p}" for p in BELADY])
    sched = schedule(known, nodes=1, slots_per_node=1)
    oracle = replay(sched, sizes, 3 * GB, 2 * GB, QueueOracle(sched.runs))
    offline = replay(sched, sizes, 3 * GB, 2 * GB, Offline(sched.runs))
    assert oracle.bytes_staged // GB == offline.bytes_staged // GB == 9
    late = [job(i + 1, f"p{p}", submit=i * 1000.0, runtime=1000.0) for i, p in enumerate(BELADY)]
    sched = schedule(late, nodes=1, slots_per_node=1)
    assert [r.start for r in sched.runs] == [j.submit for j in late]  # each starts as it is submitted
    blind = replay(sched, sizes, 3 * GB, 2 * GB, QueueOracle(sched.runs))
    assert replay(sched, sizes, 3 * GB, 2 * GB, Lru()).bytes_staged // GB == 12
    assert blind.bytes_staged // GB == 13
    assert replay(sched, sizes, 3 * GB, 2 * GB, Offline(sched.runs)).bytes_staged // GB == 9


def test_with_peers_a_dataset_is_read_from_the_source_once_and_a_peer_never_runs_ahead_of_its_copy():
    """Two nodes: a 2-node job on a cold dataset reads it from the source on one node and from
    that node on the other, which cannot finish before the copy it reads (1 GB/s source,
    4 GB/s peers: both ready at 10 s); the next jobs, one on a second dataset (no node holds
    it: the source) and one on the first (still on its node), read nothing more from it."""
    jobs = [job(1, "a", submit=0.0, runtime=100.0, slots=2), job(2, "b", submit=0.0, runtime=100.0),
            job(3, "a", submit=0.0, runtime=100.0)]
    sizes = {"a": 10 * GB, "b": 10 * GB}
    off, _ = run_sim(jobs, 2, 1, sizes, 10 * GB, GB, Lru())
    on, sched = run_sim(jobs, 2, 1, sizes, 10 * GB, GB, Lru(), Setup(peer_bandwidth=4 * GB))
    assert (off.bytes_from_source, off.bytes_from_peers) == (off.bytes_staged, 0)
    assert on.bytes_staged == off.bytes_staged
    first = sched.runs[0]
    assert first.job.id == "1" and on.wait_max >= 10.0
    assert (on.bytes_staged, on.bytes_from_source, on.bytes_from_peers) == (30 * GB, 20 * GB, 10 * GB)
    # first stages: a on both nodes and b on one (per node); a and b once each (per cluster)
    assert (on.bytes_compulsory, on.bytes_first_ever) == (off.bytes_compulsory, off.bytes_first_ever) == \
        (30 * GB, 20 * GB)
    assert off.wait_max == on.wait_max == 10.0  # the peer's 2.5 s transfer waits for the copy it reads


def test_lru_and_belady_on_the_textbook_string():
    jobs = serial([f"p{p}" for p in BELADY])
    sizes = {f"p{p}": GB for p in set(BELADY)}
    sched = schedule(jobs, nodes=1, slots_per_node=1)
    assert [r.job.id for r in sched.runs] == [j.id for j in jobs]
    misses = {}
    for policy in (Lru(), Offline(sched.runs), JobEnd()):
        res = replay(sched, sizes, 3 * GB, 2 * GB, policy)
        misses[policy.name] = res.bytes_staged // GB
        assert res.requests == len(BELADY)
        assert res.bytes_compulsory == len(sizes) * GB
    assert misses == {"lru": 12, "offline": 9, "job-end": len(BELADY)}
    # equal sizes: the relaxation is integral, so the bound is the optimum, which Belady reaches
    assert lower_bound(sched, sizes, 3 * GB).bytes_staged == 9 * GB


def test_job_end_stages_again_every_time_lru_once():
    sched = schedule(serial(["a"] * 5), nodes=1, slots_per_node=1)
    sizes = {"a": 100 * GB}
    end = replay(sched, sizes, 1000 * GB, 2 * GB, JobEnd())
    lru = replay(sched, sizes, 1000 * GB, 2 * GB, Lru())
    assert (end.bytes_staged_again, end.hits) == (400 * GB, 0)
    assert (lru.bytes_staged_again, lru.hits, lru.hit_ratio) == (0, 4, 0.8)
    # 100 GB at 2 GB/s: each stage makes its job wait 50 s
    assert end.wait_total == pytest.approx(250.0) and lru.wait_total == pytest.approx(50.0)


def test_job_end_keeps_a_copy_another_running_job_holds():
    # two 1-slot jobs share a 2-slot node; the first ends while the second still runs
    jobs = [job(1, "a", runtime=100.0), job(2, "a", runtime=300.0), job(3, "a", submit=200.0)]
    sched = schedule(jobs, nodes=1, slots_per_node=2)
    res = replay(sched, {"a": GB}, 10 * GB, GB, JobEnd())
    assert res.hits == 2 and res.bytes_staged == GB


def test_planner_keeps_what_a_pending_job_planned_here_wants():
    # a [0, 1000), b [1000, 2000); c at 3000 needs room; d (pending, planned here next) wants a
    jobs = [job(1, "a", runtime=1000.0), job(2, "b", submit=1.0, runtime=1000.0),
            job(3, "c", submit=3000.0, runtime=1000.0), job(4, "a", submit=3000.0, runtime=1000.0)]
    sizes = {"a": 100, "b": 150, "c": 200}
    sched = schedule(jobs, nodes=1, slots_per_node=1)
    assert [r.start for r in sched.runs] == [0.0, 1000.0, 3000.0, 4000.0]
    lru = replay(sched, sizes, 400, 1.0, Lru())
    planner = Planner(sched.nodes, sched.slots_per_node, 400)
    res = replay(sched, sizes, 400, 1.0, planner)
    assert lru.hits == 0  # LRU dropped a, the least recently used
    assert res.hits == 1 and res.evictions == 1  # the planner dropped b, which nothing wants
    assert planner.calls == 1


def test_planner_sees_the_queue_as_of_its_last_snapshot():
    # as above, but d is submitted at 3010, after the snapshot tick at 3000 that c's Prolog (3020) reads
    jobs = [job(1, "a", runtime=1000.0), job(2, "b", submit=1.0, runtime=2020.0),
            job(3, "c", submit=3000.0, runtime=1000.0), job(4, "a", submit=3010.0, runtime=1000.0)]
    sizes = {"a": 100, "b": 150, "c": 200}
    sched = schedule(jobs, nodes=1, slots_per_node=1)
    assert [r.start for r in sched.runs] == [0.0, 1000.0, 3020.0, 4020.0]
    hits = {}
    for interval in (30.0, 0.0):
        planner = Planner(sched.nodes, sched.slots_per_node, 400, policy=rt.Policy(min_keep=0),
                          snapshot=Snapshot(interval=interval))
        hits[interval] = replay(sched, sizes, 400, 1.0, planner).hits
    assert hits == {30.0: 0, 0.0: 1}


def test_planner_counts_the_job_starts_a_poller_would_see():
    # 1 and 2 run 100 s each, one after the other; 3 runs 5 s, between the snapshots at 210 and 240
    jobs = [job(1, "a", runtime=100.0), job(2, "a", runtime=100.0), job(3, "b", submit=211.0, runtime=5.0),
            job(4, "c", submit=300.0, runtime=100.0)]
    sched = schedule(jobs, nodes=1, slots_per_node=1)
    assert [r.start for r in sched.runs] == [0.0, 100.0, 211.0, 300.0]
    seen = []

    class Watching(Planner):
        def demand(self, now: float) -> rt.Demand:
            d = super().demand(now)
            seen.append((now, dict(d.uses)))
            return d
    planner = Watching(sched.nodes, 1, 100, snapshot=Snapshot(interval=30.0), shortcut=False)
    replay(sched, {"a": 10, "b": 10, "c": 10}, 100, 1.0, planner)
    # at 300 (c's Prolog) the snapshot is the one taken at 300: before c started; b was never seen
    at = dict(seen)
    assert set(at[300.0]) == {"a"} and at[300.0]["a"] == pytest.approx(2.0, rel=1e-3)
    assert at[400.0].keys() == {"a", "c"}  # c's Epilog: the snapshot at 390 saw c running


def test_bound_holds_on_shared_nodes():
    rng = random.Random(11)
    jobs = [job(i, f"d{rng.randrange(6)}", submit=i * 40.0, runtime=rng.choice([50.0, 200.0, 900.0]),
                slots=rng.choice([1, 1, 2, 3, 4])) for i in range(1, 120)]
    sizes = {f"d{i}": 20 + i * 14 for i in range(6)}
    sched = schedule(jobs, nodes=3, slots_per_node=2)
    bound = lower_bound(sched, sizes, 100)
    bypassed = set()
    for policy in (Lru(), Offline(sched.runs), JobEnd(), Planner(3, 2, 100, policy=rt.Policy(min_keep=0))):
        res = replay(sched, sizes, 100, 1.0, policy)
        assert res.no_room == 0 and res.bytes_staged >= bound.bytes_staged, policy.name
        bypassed.add(res.bypassed)
    assert len(bypassed) == 1 and bypassed.pop() > 0  # the same for every policy


def test_planner_shortcut_changes_nothing():
    trace = tr.generate(jobs=150, nodes=4, draws=tr.Draws(datasets=12, seed=3))
    sched = schedule(trace.jobs, trace.nodes, 1)
    cap = int(0.3 * trace.working_set())
    fast = Planner(sched.nodes, sched.slots_per_node, cap)
    slow = Planner(sched.nodes, sched.slots_per_node, cap, shortcut=False)
    a = replay(sched, trace.sizes, cap, 2 * GB, fast)
    b = replay(sched, trace.sizes, cap, 2 * GB, slow)
    assert slow.calls > fast.calls > 0
    a.seconds = b.seconds = 0.0
    a.plan_calls = b.plan_calls = 0
    assert a == b


def test_a_leased_copy_is_never_evicted_and_what_cannot_fit_is_streamed():
    # two jobs share a node; their datasets together exceed the tier: the second streams
    jobs = [job(1, "a", runtime=500.0), job(2, "b", runtime=500.0)]
    sched = schedule(jobs, nodes=1, slots_per_node=2)
    for policy in (Lru(), Offline(sched.runs), JobEnd(), Planner(sched.nodes, sched.slots_per_node, 100)):
        res = replay(sched, {"a": 60, "b": 60}, 100, 1.0, policy)
        assert (res.bypassed, res.no_room, res.bytes_staged) == (1, 0, 120)


def test_every_policy_stays_above_the_bound():
    trace = tr.generate(jobs=300, nodes=4, draws=tr.Draws(datasets=15, seed=5))
    sched = schedule(trace.jobs, trace.nodes, 1)
    cap = int(0.33 * trace.working_set())
    bound = lower_bound(sched, trace.sizes, cap)
    staged = {}
    for policy in (Lru(), Offline(sched.runs), JobEnd(), Planner(sched.nodes, sched.slots_per_node, cap)):
        res = replay(sched, trace.sizes, cap, 2 * GB, policy)
        assert res.bytes_compulsory == bound.bytes_compulsory
        staged[policy.name] = res.bytes_staged
    assert bound.bytes_staged <= min(staged.values())
    assert staged["offline"] <= staged["lru"] <= staged["job-end"]


def test_pack_is_optimal_on_small_instances():
    rng = random.Random(7)
    for _ in range(60):
        segments = rng.randint(1, 4)
        capacity = [rng.randint(0, 3) for _ in range(segments)]
        gaps = []
        for _ in range(rng.randint(1, 4)):
            lo = rng.randrange(segments)
            gaps.append((lo, rng.randint(lo - 1, segments - 1), rng.randint(1, 3)))
        best = 0
        for ys in itertools.product(*[range(s + 1) for _, _, s in gaps]):
            load = [sum(y for (lo, hi, _), y in zip(gaps, ys) if lo <= i <= hi) for i in range(segments)]
            if all(x <= c for x, c in zip(load, capacity)):
                best = max(best, sum(ys))
        assert pack(capacity, gaps) == best, (capacity, gaps)


# -- the scheduler -------------------------------------------------------------------------

def test_backfill_keeps_off_the_head_reservation():
    jobs = [job(1, "a", runtime=100.0, slots=1),          # node 0 until 100
            job(2, "a", submit=1.0, runtime=50.0, slots=2),  # head: needs both nodes, reserved at 100
            job(3, "a", submit=2.0, runtime=500.0, slots=1),  # too long to backfill onto the reservation
            job(4, "a", submit=3.0, runtime=90.0, slots=1)]  # ends before 100: backfills
    sched = schedule(jobs, nodes=2, slots_per_node=1)
    starts = {r.job.id: (r.start, r.nodes) for r in sched.runs}
    assert starts["1"] == (0.0, (0,))
    assert starts["4"] == (3.0, (1,))
    assert starts["2"] == (100.0, (0, 1))
    assert starts["3"][0] == 150.0
    assert sched.backfilled == 1


def test_projection_plans_nodes_that_free_first():
    free = Nodes(3, 1)
    free.take((0, 1, 2), 1)
    running = [(500.0, (0,), 1), (200.0, (2,), 1), (900.0, (1,), 1)]
    plan = project(free, running, [job(1, "a", slots=1, limit=100.0), job(2, "a", slots=2, limit=50.0)], 0.0)
    assert [(start, nodes) for _, start, nodes in plan] == [(200.0, (2,)), (500.0, (0, 2))]
    assert free.free == [0, 0, 0]


def test_small_jobs_share_a_node_large_ones_take_whole_nodes():
    nodes = Nodes(3, 4)
    assert nodes.shape(3) == (1, 3) and nodes.shape(9) == (3, 4)
    nodes.take((0,), 3)
    assert nodes.choose(1) == (0,)  # best fit
    assert nodes.choose(8) == (1, 2)
    assert not nodes.fits(12)


# -- placement: Slurm's --prefer for the nodes that hold the job's dataset --------------------------------

def placed(jobs: list[tr.Job], nodes: int, placement: str, interval: float = 30.0,
           wait: float = 0.0) -> tuple[Result, dict[str, tuple]]:
    res, sched = run_sim(jobs, nodes, 1, {"a": 10, "b": 10, "x": 10, "y": 10}, 100, 1000.0, Lru(),
                          Setup(placement, features_interval=interval, wait_for_data=wait))
    return res, {r.job.id: (r.start, r.nodes) for r in sched.runs}


def test_prefer_starts_a_job_where_its_data_is():
    # b lands on node 0, a on node 1; both end at 100; a second job on a at 200
    jobs = [job(1, "b", runtime=100.0), job(2, "a", runtime=100.0), job(3, "a", submit=200.0)]
    res, at = placed(jobs, 3, "unaware")
    assert at["3"] == (200.0, (0,)) and res.hits == 0  # the lowest free node: staged again
    res, at = placed(jobs, 3, "prefer")
    assert at["3"] == (200.0, (1,)) and res.hits == 1 and res.on_preferred == 1


def test_prefer_does_not_delay_a_job_whose_data_nodes_are_busy():
    # a's copy is on node 1, which runs a long job on a; a second job on a starts at once elsewhere
    jobs = [job(1, "b", runtime=100.0), job(2, "a", runtime=1000.0), job(3, "a", submit=200.0)]
    res, at = placed(jobs, 3, "prefer")
    assert at["3"] == (200.0, (0,))
    assert res.queue_waits == [0.0, 0.0, 0.0] and res.on_preferred == 0


def test_prefer_takes_whole_node_jobs_only_where_enough_nodes_hold_the_data():
    # a is on node 2 only; a 2-node job on a goes where the scheduler would put it anyway
    jobs = [job(1, "x", runtime=100.0), job(2, "y", runtime=100.0), job(3, "a", runtime=100.0),
            job(4, "a", submit=200.0, slots=2)]
    _, at = placed(jobs, 3, "prefer")
    assert at["4"] == (200.0, (0, 1))


def test_the_features_lag_the_caches_by_the_pollers_round():
    # a's copy arrives on node 2 at 185, after the poller's round at 180; its job ends at 190
    jobs = [job(1, "x", runtime=1000.0), job(2, "y", runtime=187.0), job(3, "a", submit=185.0, runtime=5.0),
            job(4, "a", submit=200.0)]
    _, lagged = placed(jobs, 3, "prefer", interval=30.0)
    _, fresh = placed(jobs, 3, "prefer", interval=0.0)
    assert lagged["3"][1] == (2,)
    assert lagged["4"] == (200.0, (1,))  # the round at 180 did not see a on node 2
    assert fresh["4"] == (200.0, (2,))


# a's copy is on node 1 (job 2); job 3 runs there on a until 550 (its limit); jobs 5 and 6 keep
# nodes 0 and 2 until 300; job 4 on a comes at 200 and finds no free node: the poller's round at
# 210 sees it pending, and at 300 nodes 0 and 2 free
WAITING = [job(1, "b", runtime=100.0), job(2, "a", runtime=100.0), job(3, "a", submit=150.0, runtime=400.0),
           job(5, "x", submit=150.0, runtime=150.0), job(6, "y", submit=150.0, runtime=150.0),
           job(4, "a", submit=200.0)]


def test_a_job_waits_for_its_data_node_when_that_frees_within_the_wait():
    res, at = placed(WAITING, 3, "prefer", wait=400.0)
    assert at["3"] == (150.0, (1,)) and {at["5"][1], at["6"][1]} == {(0,), (2,)}
    assert at["4"] == (550.0, (1,))  # waited 250 s for node 1 rather than stage a on node 0
    assert res.waited_for_data == 1 and res.hits == 2


def test_a_job_does_not_wait_beyond_the_wait_nor_without_it():
    for wait in (0.0, 200.0):  # at 300 node 1 is expected free in 250 s
        res, at = placed(WAITING, 3, "prefer", wait=wait)
        assert at["4"] == (300.0, (0,)), wait
        assert res.waited_for_data == 0
    _, at = placed(WAITING, 3, "unaware", wait=400.0)  # only with prefer
    assert at["4"][0] == 300.0


def test_a_job_no_poller_has_seen_pending_does_not_wait():
    """Slurm starts a job on a free node as it is submitted: the demand poller, which makes a
    job wait, only acts on jobs pending at its round."""
    jobs = [j for j in WAITING if j.id not in ("5", "6")]  # node 0 and 2 are free at 200
    res, at = placed(jobs, 3, "prefer", wait=400.0)
    assert at["4"] == (200.0, (0,)) and res.waited_for_data == 0


def test_a_job_waits_at_most_the_wait_from_its_first_wait():
    sch = Scheduler(2, 1, wait=400.0)
    sch.submit(job(9, "x", runtime=5000.0))
    sch.submit(job(3, "a", runtime=300.0))
    assert [r.nodes for r in sch.starts(0.0)] == [(0,), (1,)]
    prefer = Features([Tier("n0", 100), Tier("n1", 100)], 0.0)
    prefer.held, prefer.tick = {"a": frozenset({1})}, 1000.0
    waiting = job(4, "a", submit=10.0)
    assert sch.waits_for(waiting, 100.0, prefer) == frozenset({1})  # node 1 is free by 300
    assert sch.waits_for(waiting, 499.0, prefer) == frozenset({1})
    assert sch.waits_for(waiting, 500.0, prefer) is None  # 400 s since it first waited
    assert sch.waits_for(job(5, "a", submit=1001.0), 1001.0, prefer) is None  # not seen pending yet


def test_a_job_waits_by_its_limit_and_starts_when_its_data_node_frees_early():
    jobs = [j if j.id != "3" else job(3, "a", submit=150.0, runtime=200.0, limit=400.0) for j in WAITING]
    _, at = placed(jobs, 3, "prefer", wait=400.0)
    assert at["4"] == (350.0, (1,))  # job 3 ended at 350, not at its limit (550)


def test_while_a_job_waits_for_its_data_the_jobs_behind_it_use_the_free_nodes():
    jobs = WAITING + [job(7, "x", submit=210.0, runtime=50.0), job(8, "y", submit=220.0, runtime=1000.0)]
    _, at = placed(jobs, 3, "prefer", wait=400.0)
    assert at["4"] == (550.0, (1,))
    assert {at["7"], at["8"]} == {(300.0, (0,)), (300.0, (2,))}  # the nodes job 4 does not wait for


def test_unaware_placement_is_the_same_for_every_policy():
    trace = tr.generate(jobs=200, nodes=6, draws=tr.Draws(datasets=10, seed=4))
    cap = int(0.3 * trace.working_set())
    fixed = schedule(trace.jobs, trace.nodes, 1)
    for policy in (Lru(), JobEnd(), Planner(trace.nodes, 1, cap)):
        _, sched = run_sim(trace.jobs, trace.nodes, 1, trace.sizes, cap, 2 * GB, policy)
        assert sched.runs == fixed.runs, policy.name
    # with prefer the caches steer the schedule: LRU and job-end keep different caches
    runs = [run_sim(trace.jobs, trace.nodes, 1, trace.sizes, cap, 2 * GB, p, Setup("prefer"))[1].runs
            for p in (Lru(), JobEnd())]
    assert runs[0] != runs[1]


def test_queue_wait_percentile_is_the_nearest_rank():
    r = Result("x", queue_waits=[float(i) for i in range(1, 101)])
    assert (r.queue_wait_mean, r.queue_wait_p95) == (50.5, 95.0)
    assert Result("x").queue_wait_p95 == 0.0


# -- traces --------------------------------------------------------------------------------

SWF = """\
; Version: 2.2
; MaxProcs: 8
; MaxNodes: 8
    1      0   5   100   2  -1 -1   2   200  -1  1  3  1 -1 -1 1 -1 -1
    2     10   0     0   1  -1 -1   1   100  -1  0  3  1 -1 -1 1 -1 -1
    3     20   0    50  -1  -1 -1   6    -1  -1  1  4  1 -1 -1 1 -1 -1
    4     30   0    50   4  -1 -1   4   100  -1  5  4  1 -1 -1 1 -1 -1
    5     40   0    70  16  -1 -1  16   100  -1  1  4  1 -1 -1 1 -1 -1
    6     50   0    70   1  -1 -1   1   100  -1  1  3  1 -1 -1 1 -1 -1
"""


def test_parse_swf_header_and_records():
    header, records = tr.parse_swf(io.StringIO(SWF))
    assert header["MaxProcs"] == "8"
    recs = list(records)
    assert [r.job for r in recs] == [1, 2, 3, 4, 5, 6]
    assert (recs[2].allocated, recs[2].requested, recs[2].limit, recs[3].status) == (-1, 6, -1.0, 5)


def test_read_swf_rules(tmp_path: Path):
    path = tmp_path / "t.swf"
    path.write_text(SWF)
    t = tr.read_swf(str(path), cores_per_node=2, draws=tr.Draws(datasets=5))
    assert t.nodes == 4 and t.slots_per_node == 2
    assert [j.id for j in t.jobs] == ["1", "3", "6"]
    assert t.skipped == {"no run time": 1, "cancelled": 1, "larger than the cluster": 1}
    j3 = t.jobs[1]
    assert (j3.slots, j3.limit, j3.runtime) == (6, 50.0, 50.0)  # requested processors; limit = run time
    assert any("left out: 1 cancelled" in r or "1 cancelled" in r for r in t.rules)
    window = tr.read_swf(str(path), cores_per_node=2, draws=tr.Draws(datasets=5), start=2, limit=1)
    assert [j.id for j in window.jobs] == ["3"] and window.jobs[0].dataset == j3.dataset
    with pytest.raises(tr.TraceError):
        tr.read_swf(str(tmp_path / "missing.swf"))


def test_dataset_rule_is_deterministic_for_a_seed():
    recs = [tr.SwfRecord(job=i, submit=i, wait=0, runtime=10, allocated=1, requested=1, limit=10, status=1,
                         user=i % 7) for i in range(300)]
    names = tr.dataset_names(40)

    def assign(seed: int, rs: list[tr.SwfRecord]) -> list[str]:
        return [d for _, d in tr.assign_datasets(rs, names=names, zipf_s=1.0, seed=seed, other=0.1)]

    a = assign(1, recs)
    assert a == assign(1, recs)
    assert a != assign(2, recs)
    assert assign(1, recs[150:]) == a[150:]  # a window gets what the whole log would
    by_user: dict[int, list[str]] = {}
    for r, d in zip(recs, a):
        by_user.setdefault(r.user, []).append(d)
    for ds in by_user.values():  # mostly the user's home dataset
        assert max(ds.count(d) for d in set(ds)) >= 0.75 * len(ds)
    assert tr.dataset_sizes(40, 1) == tr.dataset_sizes(40, 1)
    assert all(50 * GB <= s <= 4000 * GB for s in tr.dataset_sizes(40, 1).values())


def test_generated_trace_is_deterministic():
    a = tr.generate(jobs=50, nodes=4, draws=tr.Draws(seed=9))
    assert a.jobs == tr.generate(jobs=50, nodes=4, draws=tr.Draws(seed=9)).jobs
    assert a.jobs != tr.generate(jobs=50, nodes=4, draws=tr.Draws(seed=10)).jobs
    assert all(j.slots <= 4 for j in a.jobs)


# -- the command ---------------------------------------------------------------------------

def run_main(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = simulate.main(argv)
    return code, out.getvalue()


def test_json_keys():
    code, out = run_main(["--jobs", "120", "--nodes", "4", "--datasets", "10", "--json"])
    assert code == 0
    rep = json.loads(out)
    assert set(rep) == {"trace", "cluster", "scheduler", "planner", "rows", "offline_method", "queue_oracle_method",
                        "bound", "goal", "seconds"}
    # offline only on the unaware schedule: its known future is that schedule's
    one = [("planner", "unaware"), ("lru", "unaware"), ("job-end", "unaware"), ("queue-oracle", "unaware"),
           ("offline", "unaware"), ("planner", "prefer"), ("lru", "prefer"), ("job-end", "prefer"),
           ("queue-oracle", "prefer")]
    assert [(r["policy"], r["placement"], r["peers"]) for r in rep["rows"]] == \
        [(*k, "off") for k in one] + [(*k, "on") for k in one]
    keys = {"policy", "placement", "peers", "bytes_staged", "bytes_from_source", "bytes_from_peers",
            "bytes_staged_again", "bytes_compulsory", "bytes_first_ever", "requests", "hits",
            "hit_ratio", "wait_mean_s", "wait_p95_s", "stage_wait_total_s", "stage_wait_mean_s", "stage_wait_max_s",
            "jobs_delayed", "jobs_on_preferred_nodes", "stages", "stages_evicting", "evictions", "bytes_evicted",
            "bypassed", "no_room", "seconds"}
    for r in rep["rows"]:
        assert keys <= set(r)
        assert (r["jobs_on_preferred_nodes"] is None) == (r["placement"] == "unaware")
        assert r["bytes_from_source"] + r["bytes_from_peers"] == r["bytes_staged"]
        assert r["bytes_from_peers"] == 0 or r["peers"] == "on"
        assert r["bytes_first_ever"] <= r["bytes_compulsory"] and r["bytes_first_ever"] <= r["bytes_from_source"]
    oracle = next(r for r in rep["rows"] if r["policy"] == "queue-oracle")
    assert oracle["bound_on_queue_aware_optimum"] == "upper" and oracle["replays"] == 1
    assert oracle["future_as_it_happened"] is True  # unaware: the schedule is the trace's alone
    assert {"planner_unaware_gap_closed", "planner_prefer_gap_closed",
            "planner_prefer_peers_source_vs_baseline", "planner_prefer_peers_source_vs_first_ever"} <= set(rep["goal"])
    offline = next(r for r in rep["rows"] if r["policy"] == "offline")
    assert offline["bound_on_optimum"] == "upper"
    assert rep["bound"]["bound_on_optimum"] == "lower"
    planner = [r for r in rep["rows"] if r["policy"] == "planner"]
    assert all({"plan_calls", "planned_jobs", "planned_nodes_right"} <= set(r) for r in planner)
    assert {"planner_prefer_vs_baseline", "planner_prefer_wait_vs_baseline", "lru_prefer_vs_baseline",
            "planner_prefer_vs_bound"} <= set(rep["goal"])
    assert rep["goal"]["lru_unaware_vs_baseline"] == 1.0
    assert rep["cluster"]["capacity_fraction"] == 0.33
    assert rep["trace"]["rules"]


def test_one_placement_only():
    code, out = run_main(["--jobs", "60", "--nodes", "4", "--datasets", "6", "--placement", "prefer", "--json",
                          "--policies", "planner,offline"])
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [(r["policy"], r["placement"], r["peers"]) for r in rows] == [("planner", "prefer", "off"),
                                                                        ("planner", "prefer", "on")]


def test_text_report_says_what_the_offline_figures_are():
    code, out = run_main(["--jobs", "80", "--nodes", "4", "--datasets", "8", "--capacity", "2TB"])
    assert code == 0
    assert "UPPER bound" in out and "LOWER bound" in out and "tier 2.0 TB" in out


def test_dsstage_simulate_runs_the_simulator(capsys):
    assert cli.main(["simulate", "--jobs", "80", "--nodes", "4", "--datasets", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["policy"] for r in rows} == {"planner", "lru", "job-end", "queue-oracle", "offline"}


@pytest.mark.parametrize("argv", [["--policies", "fifo"], ["--capacity", "lots"], ["--high", "0.5"],
                                  ["--placement", "anywhere"], ["--peers", "maybe"], ["--peer-bandwidth", "fast"],
                                  ["--trace", "/nonexistent.swf"]])
def test_bad_options_end_in_one_line(argv, capsys):
    assert simulate.main(argv) != 0
    err = capsys.readouterr().err
    assert err.startswith("dsstage simulate: error:") and err.count("\n") == 1


def test_capacity_fraction_or_size():
    assert simulate.capacity_of("0.33", 1000) == (330, 0.33)
    assert simulate.capacity_of("3.5TB", 7 * 10**12) == (3_500_000_000_000, 0.5)
