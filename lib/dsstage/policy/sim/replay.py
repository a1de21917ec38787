"""Replay a schedule's dataset requests through one retention policy, node by node.

Each job, when it starts, requests its dataset on each of its nodes: a hit if a copy is
there (it may still be arriving), else a stage over the node's link (``bandwidth`` bytes
per second, one stage at a time per node). The job holds a lease on that copy until it
ends; a leased copy is never evicted. When the leased copies and the new one together
exceed the tier, the dataset is streamed past the tier (``bypassed``: staged, not kept);
this depends only on the schedule, so it is the same for every policy.

The schedule is fixed: a job's staging wait is counted, not added to its run time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsstage.policy import demand as dm
from dsstage.policy import retention as rt
from dsstage.policy.sim.sched import Nodes, Run, Schedule, project


@dataclass
class Slot:
    """A copy on a node's tier."""

    bytes: int
    last_used: float
    ready: float  # when its stage ends
    leases: list[str] = field(default_factory=list)
    next_use: float = math.inf  # offline policy only: the next request for it on this node


class Tier:
    def __init__(self, name: str, capacity: int):
        self.name = name
        self.capacity = capacity
        self.copies: dict[str, Slot] = {}
        self.used = 0
        self.leased = 0  # bytes of copies that have a lease
        self.evictions = 0
        self.bytes_evicted = 0

    def evict(self, dataset: str) -> None:
        slot = self.copies.pop(dataset)
        assert not slot.leases, f"evicting {dataset} on {self.name} with leases {slot.leases}"
        self.used -= slot.bytes
        self.evictions += 1
        self.bytes_evicted += slot.bytes


@dataclass
class Result:
    """The figures of one policy (see docs/simulation.md for each key)."""

    policy: str
    requests: int = 0  # (job, node) dataset requests
    hits: int = 0  # requests that found a copy on the node
    bytes_staged: int = 0
    bytes_compulsory: int = 0  # the first stage of each (node, dataset) pair
    bypassed: int = 0  # requests streamed past the tier: leased copies leave no room (every policy)
    no_room: int = 0  # requests the policy found no room for although the leases left some
    evictions: int = 0
    bytes_evicted: int = 0
    jobs: int = 0
    jobs_delayed: int = 0  # jobs whose dataset was not on all their nodes at start
    wait_total: float = 0.0  # seconds, summed over jobs: start until the dataset is on all its nodes
    wait_max: float = 0.0
    plan_calls: int = 0  # calls of retention.plan (planner only)
    seconds: float = 0.0  # run time of the replay

    @property
    def bytes_staged_again(self) -> int:
        return self.bytes_staged - self.bytes_compulsory

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def wait_mean(self) -> float:
        return self.wait_total / self.jobs if self.jobs else 0.0


class Policy:
    """What a retention policy decides: room for a stage, and what to drop at job end."""

    name = "?"

    def make_room(self, tier: Tier, node: int, need: int, now: float) -> bool:
        """Evict unleased copies so that ``need`` more bytes fit; False: no room made."""
        raise NotImplementedError

    def job_ended(self, tier: Tier, node: int, dataset: str, now: float) -> None:
        """After a job's lease on ``dataset`` is released on ``node`` (the Epilog)."""

    def requested(self, tier: Tier, node: int, dataset: str, run_index: int, now: float) -> None:
        """After a request is served (the copy is in the tier unless it was bypassed)."""

    # the queue as the scheduler sees it, for policies that read the demand
    def submitted(self, run_index: int, now: float) -> None:
        pass

    def started(self, run_index: int, now: float) -> None:
        pass

    def ended(self, run_index: int, now: float) -> None:
        pass

    def before(self, kind: int, now: float) -> None:
        """Before an event of ``kind`` (END, SUBMIT, START) at ``now`` is handled."""


class Lru(Policy):
    """On need, evict the least recently used unleased copies until the stage fits."""

    name = "lru"

    def make_room(self, tier: Tier, node: int, need: int, now: float) -> bool:
        if tier.used + need <= tier.capacity:
            return True
        order = sorted((s.last_used, -s.bytes, d) for d, s in tier.copies.items() if not s.leases)
        for _, _, d in order:
            tier.evict(d)
            if tier.used + need <= tier.capacity:
                return True
        return False


class JobEnd(Policy):
    """The last job on a node cleans up: at job end, evict the dataset unless another running
    job on the node holds it."""

    name = "job-end"

    def make_room(self, tier: Tier, node: int, need: int, now: float) -> bool:
        return tier.used + need <= tier.capacity  # only leased copies remain

    def job_ended(self, tier: Tier, node: int, dataset: str, now: float) -> None:
        slot = tier.copies.get(dataset)
        if slot is not None and not slot.leases:
            tier.evict(dataset)


class Offline(Policy):
    """Belady's rule with the future known: on need, evict the unleased copies whose next
    request on this node is farthest away (never again first; ties: the larger) until the
    stage fits. Optimal for equal sizes; for variable sizes a feasible offline heuristic,
    hence an upper bound on the optimum's bytes staged."""

    name = "offline"

    def __init__(self, runs: Sequence[Run]):
        nxt: dict[tuple[int, int], float] = {}
        last: dict[tuple[int, str], tuple[int, int]] = {}
        for i, r in enumerate(runs):  # runs are in start order: the order the replay serves them
            for n in r.nodes:
                prev = last.get((n, r.job.dataset))
                if prev is not None:
                    nxt[prev] = r.start
                last[(n, r.job.dataset)] = (i, n)
        self.next_use = nxt

    def make_room(self, tier: Tier, node: int, need: int, now: float) -> bool:
        if tier.used + need <= tier.capacity:
            return True
        order = sorted((-s.next_use, -s.bytes, d) for d, s in tier.copies.items() if not s.leases)
        for _, _, d in order:
            tier.evict(d)
            if tier.used + need <= tier.capacity:
                return True
        return False

    def requested(self, tier: Tier, node: int, dataset: str, run_index: int, now: float) -> None:
        slot = tier.copies.get(dataset)
        if slot is not None:
            slot.next_use = self.next_use.get((run_index, node), math.inf)


END, SUBMIT, START = 0, 1, 2


def events(runs: Sequence[Run]) -> list[tuple[float, int, int]]:
    """(time, kind, run index), in the order the replay handles them: at one instant, ends
    first (their nodes are free for the starts), then submissions, then starts."""
    ev = [(r.end, END, i) for i, r in enumerate(runs)]
    ev += [(r.job.submit, SUBMIT, i) for i, r in enumerate(runs)]
    ev += [(r.start, START, i) for i, r in enumerate(runs)]
    ev.sort()
    return ev


def replay(sched: Schedule, sizes: dict[str, int], capacity: int, bandwidth: float, policy: Policy,
           ev: list[tuple[float, int, int]] | None = None) -> Result:
    """Serve every request of ``sched`` with ``policy`` deciding what the tiers keep."""
    t0 = time.perf_counter()
    runs = sched.runs
    ev = events(runs) if ev is None else ev
    tiers = [Tier(node_name(n), capacity) for n in range(sched.nodes)]
    link = [0.0] * sched.nodes  # when each node's link is free
    seen: set[tuple[int, str]] = set()
    res = Result(policy.name, jobs=len(runs))
    for t, kind, i in ev:
        policy.before(kind, t)
        run = runs[i]
        job = run.job
        if kind == SUBMIT:
            policy.submitted(i, t)
            continue
        ds = job.dataset
        if kind == END:
            for n in run.nodes:
                tier = tiers[n]
                slot = tier.copies.get(ds)
                if slot is not None and job.id in slot.leases:
                    slot.leases.remove(job.id)
                    slot.last_used = t
                    if not slot.leases:
                        tier.leased -= slot.bytes
                policy.job_ended(tier, n, ds, t)
            policy.ended(i, t)
            continue
        size = sizes[ds]
        ready = t
        for n in run.nodes:
            tier = tiers[n]
            res.requests += 1
            slot = tier.copies.get(ds)
            if slot is not None:
                res.hits += 1
            else:
                res.bytes_staged += size
                if (n, ds) not in seen:
                    seen.add((n, ds))
                    res.bytes_compulsory += size
                begin = max(t, link[n])
                link[n] = begin + size / bandwidth
                if tier.leased + size > capacity:
                    res.bypassed += 1
                    ready = max(ready, link[n])
                    policy.requested(tier, n, ds, i, t)
                    continue
                if not policy.make_room(tier, n, size, t) or tier.used + size > capacity:
                    res.no_room += 1
                    ready = max(ready, link[n])
                    policy.requested(tier, n, ds, i, t)
                    continue
                slot = tier.copies[ds] = Slot(size, t, link[n])
                tier.used += size
            if not slot.leases:
                tier.leased += slot.bytes
            slot.leases.append(job.id)
            slot.last_used = t
            ready = max(ready, slot.ready)
            policy.requested(tier, n, ds, i, t)
        wait = ready - t
        if wait > 0:
            res.jobs_delayed += 1
            res.wait_total += wait
            res.wait_max = max(res.wait_max, wait)
        policy.started(i, t)
    for tier in tiers:
        res.evictions += tier.evictions
        res.bytes_evicted += tier.bytes_evicted
    res.plan_calls = getattr(policy, "calls", 0)
    res.seconds = time.perf_counter() - t0
    return res


def node_name(n: int) -> str:
    return f"n{n:03d}"


# -- the planner ------------------------------------------------------------------------

class Planner(Policy):
    """dsstage's own: ``retention.plan`` in the Epilog of every job on each of its nodes, and in
    the Prolog of a stage that needs room (``Space.need``), with the demand snapshot as a
    poller would have taken it: every ``interval`` seconds of simulated time (0: at each
    call), the pending jobs in queue order (the first ``depth`` with the expected start and
    planned nodes of ``sched.project``, the others unplaced) and the running jobs; and the
    counts of job starts, as the poller keeps them (``demand.count_starts``): a job counts
    once, at the first snapshot that shows it running (one that starts and ends between two
    snapshots is never seen), for the whole cluster.

    A call the planner would answer "keep everything" (tier at or below the high watermark
    with ``max_idle`` 0: no rule but pressure can evict a current, ready copy) is skipped;
    ``shortcut=False`` makes every call, for the test that they agree."""

    name = "planner"

    def __init__(self, sched: Schedule, capacity: int, *, high: float = 0.9,
                 low: float = 0.75, policy: rt.Policy = rt.Policy(), interval: float = 30.0, depth: int = 100,
                 max_age: float = 300.0, shortcut: bool = True):
        self.runs = sched.runs
        self.space = rt.Space(capacity, high=high, low=low)
        self.policy = policy
        self.interval = interval
        self.depth = depth
        self.max_age = max_age
        self.shortcut = shortcut and policy.max_idle == 0
        self.names = [node_name(n) for n in range(sched.nodes)]
        self.free = Nodes(sched.nodes, sched.slots_per_node)
        self.queue: dict[int, None] = {}  # pending run indexes, in submission order
        self.running: dict[int, None] = {}
        self.pending_want: dict[int, rt.Want] = {}
        self.running_want: dict[int, rt.Want] = {}
        self.calls = 0
        self.window = -1
        self._frozen: tuple[float, Nodes, list[int], list[int]] | None = None
        self._demand: tuple[float, dict[str, list[rt.Want]]] | None = None
        self.uses: dict[str, float] = {}  # as of uses_time, the last snapshot
        self.uses_time = 0.0
        self.counted: set[int] = set()  # running at the last snapshot: already counted
        #: for the report: how often a started job's nodes were the ones last planned for it
        self.last_planned: dict[int, tuple[int, ...]] = {}
        self.planned_jobs = 0
        self.planned_nodes_right = 0.0

    # the queue --------------------------------------------------------------------
    def before(self, kind: int, now: float) -> None:
        if kind == SUBMIT or self.interval <= 0:
            return
        window = int(now // self.interval)
        if window != self.window:
            # the first start or end in this window: the state now is the state at its tick,
            # but for the jobs submitted since (the tail of the queue)
            self.window = window
            tick = window * self.interval
            self._frozen = (tick, self.free.copy(), [i for i in self.queue if self.runs[i].job.submit <= tick],
                            list(self.running))
            self._demand = None
            self._count(tick)

    def submitted(self, run_index: int, now: float) -> None:
        self.queue[run_index] = None
        job = self.runs[run_index].job
        self.pending_want[run_index] = rt.Want(job.id, "pending")

    def started(self, run_index: int, now: float) -> None:
        run = self.runs[run_index]
        del self.queue[run_index]  # its Wants stay: a frozen snapshot may still show it
        self.running[run_index] = None
        self.free.take(run.nodes, run.per_node)
        self.running_want[run_index] = rt.Want(run.job.id, "running", nodes=tuple(self.names[n] for n in run.nodes))
        planned = self.last_planned.pop(run_index, None)
        if planned is not None:
            self.planned_jobs += 1
            self.planned_nodes_right += len(set(planned) & set(run.nodes)) / len(run.nodes)

    def ended(self, run_index: int, now: float) -> None:
        run = self.runs[run_index]
        del self.running[run_index]
        self.free.give(run.nodes, run.per_node)

    def demand(self, now: float) -> rt.Demand:
        if self.interval <= 0:
            self._frozen = (now, self.free, list(self.queue), list(self.running))
            self._demand = None
            self._count(now)
        if self._demand is None:
            assert self._frozen is not None
            self._demand = (self._frozen[0], self._build(*self._frozen))
        taken, wants = self._demand
        age = now - taken
        return rt.Demand(wants, stale=age > self.max_age, age=age, uses=dm.decay(self.uses, self.uses_time, now))

    def _count(self, tick: float) -> None:
        """The snapshot's counts of job starts at ``tick``, from the previous snapshot's."""
        running = set(self.running)
        started = [(self.runs[i].job.dataset,) for i in sorted(running - self.counted)]
        self.uses = dm.count_starts(self.uses, self.uses_time, tick, started)
        self.uses_time, self.counted = tick, running

    def _build(self, tick: float, free: Nodes, queue: list[int], running: list[int]) -> dict[str, list[rt.Want]]:
        runs = self.runs
        head = [runs[i].job for i in queue[:self.depth]]
        placed = project(free, ((runs[i].expected_end, runs[i].nodes, runs[i].per_node) for i in running), head,
                         tick)
        wants: dict[str, list[rt.Want]] = {}
        for k, (job, start, nodes) in enumerate(placed):
            self.last_planned[queue[k]] = nodes
            wants.setdefault(job.dataset, []).append(
                rt.Want(job.id, "pending", start=start, nodes=tuple(self.names[n] for n in nodes)))
        for i in queue[len(placed):]:
            wants.setdefault(runs[i].job.dataset, []).append(self.pending_want[i])
        for i in running:
            wants.setdefault(runs[i].job.dataset, []).append(self.running_want[i])
        return wants

    # the decisions ------------------------------------------------------------------
    def _plan(self, tier: Tier, node: int, need: int, now: float) -> rt.Plan:
        self.calls += 1
        copies = [rt.Copy(d, "1", s.bytes, s.last_used, leases=tuple(s.leases)) for d, s in tier.copies.items()]
        space = rt.Space(self.space.capacity, high=self.space.high, low=self.space.low, need=need)
        p = rt.plan(copies, self.demand(now), space, now, policy=self.policy, node=self.names[node])
        for d in p.decisions:
            if d.evict:
                tier.evict(d.copy.dataset)
        return p

    def make_room(self, tier: Tier, node: int, need: int, now: float) -> bool:
        if self.shortcut and tier.used + need <= self.space.high * self.space.capacity:
            return True
        return self._plan(tier, node, need, now).fits

    def job_ended(self, tier: Tier, node: int, dataset: str, now: float) -> None:
        if self.shortcut and tier.used <= self.space.high * self.space.capacity:
            return
        self._plan(tier, node, 0, now)
