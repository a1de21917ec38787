"""The simulation: the scheduler and the tiers advance together, one instant at a time.

At each instant (a submission or a job's end), the jobs that end release their leases, the
policy hears of it (the Epilog), the jobs submitted join the queue, and the scheduler starts
what it can (dsstage.policy.sim.sched), placing jobs by placement ``unaware`` or ``prefer``:
with ``prefer`` a job starts on free nodes whose ``ds_<dataset>`` feature says they hold its
dataset, as the demand poller last set the features (every ``features_interval`` seconds),
where there are enough of them. Each job that starts requests its dataset on each of its
nodes: a hit if a copy is there (it may still be arriving), else a stage over the node's link
(``bandwidth`` bytes per second, one stage at a time per node). With ``peers`` (dsstage's
peers across jobs: dsstage.node.staging.from_whom), a stage reads from another node whose tier
holds the dataset, ready or still arriving, at the peers' bandwidth and never ahead of that
copy; only a dataset no node holds is read from the source. Every stage counts its bytes as
from the source or from peers. The job holds a lease on that
copy until it ends; a leased copy is never evicted. When the leased copies and the new one
together exceed the tier, the dataset is streamed past the tier (``bypassed``: staged, not
kept).

A job's staging wait is counted, not added to its run time: the schedule depends on the
caches only through placement.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsstage.policy import demand
from dsstage.policy.sim.sched import Clock, Run, Schedule, Scheduler
from dsstage.policy.sim.trace import Job

PLACEMENTS = ("unaware", "prefer")


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
    """The figures of one policy under one placement (see docs/simulation.md for each key)."""

    policy: str
    placement: str = "unaware"
    requests: int = 0  # (job, node) dataset requests
    hits: int = 0  # requests that found a copy on the node
    bytes_staged: int = 0
    bytes_compulsory: int = 0  # the first stage of each (node, dataset) pair
    bytes_first_ever: int = 0  # the first stage of each dataset in the cluster: the least a source serves
    bytes_from_source: int = 0  # of bytes_staged: read from the dataset's source (the shared filesystem)
    bytes_from_peers: int = 0  # of bytes_staged: read from another node's copy (peers)
    peers: bool = False
    bypassed: int = 0  # requests streamed past the tier: leased copies leave no room
    no_room: int = 0  # requests the policy found no room for although the leases left some
    evictions: int = 0
    bytes_evicted: int = 0
    jobs: int = 0
    jobs_delayed: int = 0  # jobs whose dataset was not on all their nodes at start
    wait_total: float = 0.0  # seconds, summed over jobs: start until the dataset is on all its nodes
    wait_max: float = 0.0
    queue_waits: list[float] = field(default_factory=list, repr=False)  # per job: submission to start
    on_preferred: int = 0  # jobs that started on nodes all of which held their dataset's feature
    waited_for_data: int = 0  # jobs that waited for the nodes holding their dataset (wait_for_data)
    stages_evicting: int = 0  # stages that evicted before they could start (the Prolog's make-room)
    plan_calls: int = 0  # calls of retention.plan (planner only)
    seconds: float = 0.0  # run time of the simulation

    @property
    def bytes_staged_again(self) -> int:
        return self.bytes_staged - self.bytes_compulsory

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def wait_mean(self) -> float:
        return self.wait_total / self.jobs if self.jobs else 0.0

    @property
    def queue_wait_mean(self) -> float:
        return sum(self.queue_waits) / len(self.queue_waits) if self.queue_waits else 0.0

    @property
    def queue_wait_p95(self) -> float:
        """The 95th percentile of the queue waits (nearest rank)."""
        if not self.queue_waits:
            return 0.0
        ordered = sorted(self.queue_waits)
        return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class Policy:
    """What a retention policy decides: room for a stage, and what to drop at job end."""

    name = "?"

    def make_room(self, tier: Tier, node: int, need: int, now: float) -> bool:
        """Evict unleased copies so that ``need`` more bytes fit; False: no room made."""
        raise NotImplementedError

    def job_ended(self, tier: Tier, node: int, dataset: str, now: float) -> None:
        """After a job's lease on ``dataset`` is released on ``node`` (the Epilog)."""

    def requested(self, tier: Tier, node: int, dataset: str, run: Run, now: float) -> None:
        """After a request is served (the copy is in the tier unless it was bypassed)."""

    # the cluster as the demand poller sees it, for policies that read the demand
    def attach(self, tiers: Sequence[Tier], features: Features | None) -> None:
        """Before the first instant: the tiers, and the features the scheduler places by."""

    def before(self, now: float) -> None:
        """Before anything happens at the instant ``now``."""

    def settled(self, now: float) -> None:
        """At the instant ``now``, once its jobs have ended and been submitted, before the starts."""

    def submitted(self, job: Job, now: float) -> None:
        pass

    def started(self, run: Run, now: float) -> None:
        pass

    def ended(self, run: Run, now: float) -> None:
        pass


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
        """``runs``: the unaware schedule, in start order (the order requests are served)."""
        nxt: dict[tuple[str, int], float] = {}
        last: dict[tuple[int, str], tuple[str, int]] = {}
        for r in runs:
            for n in r.nodes:
                prev = last.get((n, r.job.dataset))
                if prev is not None:
                    nxt[prev] = r.start
                last[(n, r.job.dataset)] = (r.job.id, n)
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

    def requested(self, tier: Tier, node: int, dataset: str, run: Run, now: float) -> None:
        slot = tier.copies.get(dataset)
        if slot is not None:
            slot.next_use = self.next_use.get((run.job.id, node), math.inf)


class QueueOracle(Policy):
    """Belady's rule with only the queue known: on need, evict first the unleased copies that no
    job submitted so far will use on this node (the least used in the cluster first, by the
    planner's own history: job starts counted and decayed as the demand poller counts them;
    then the least recently used), then those whose next use by a submitted job is farthest
    away. Each submitted job's start and nodes are
    known as they will happen, nothing of jobs not yet submitted: what
    a planner could do that reads the queue perfectly (a pending job's expected start and
    planned nodes, dsstage.policy.demand). A feasible policy, so its bytes staged are an upper
    bound on what the best queue-aware policy stages (that one stages at most this), the
    target for the planner; not a proof that no queue-aware policy does better."""

    name = "queue-oracle"

    def __init__(self, runs: Sequence[Run]):
        """``runs``: the schedule as it will happen (the unaware one; with placement prefer,
        which depends on the caches, the replay's own, found by replaying until it repeats:
        dsstage.policy.sim.cli), in start order."""
        uses: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for r in runs:
            for n in r.nodes:
                uses.setdefault((n, r.job.dataset), []).append((r.start, r.job.submit))
        self.queue = uses
        self.starts = {k: [start for start, _ in v] for k, v in uses.items()}
        # the earliest submission among each use and those after it: a scan stops where no later
        # use was submitted yet (else a dataset with thousands of uses ahead is read to its end)
        self.later_submit: dict[tuple[int, str], list[float]] = {}
        for k, v in uses.items():
            low, out = math.inf, [0.0] * len(v)
            for i in range(len(v) - 1, -1, -1):
                low = min(low, v[i][1])
                out[i] = low
            self.later_submit[k] = out
        self.uses: dict[str, float] = {}  # decayed job starts per dataset, as of self.since
        self.since: float | None = None  # no start seen yet

    def started(self, run: Run, now: float) -> None:
        if self.since is not None:  # (not demand.count_starts: it reads a "since" of 0 as no history)
            self.uses = demand.decay(self.uses, self.since, now)
        self.uses[run.job.dataset] = self.uses.get(run.job.dataset, 0.0) + 1.0
        self.since = now

    def next_known(self, node: int, dataset: str, now: float) -> float:
        """The next use of ``dataset`` on ``node`` at or after ``now`` by a job submitted by
        ``now``; inf if the queue shows none."""
        uses = self.queue.get((node, dataset))
        if not uses:
            return math.inf
        later = self.later_submit[(node, dataset)]
        for i in range(bisect.bisect_left(self.starts[(node, dataset)], now), len(uses)):
            if later[i] > now:
                break
            if uses[i][1] <= now:
                return uses[i][0]
        return math.inf

    def make_room(self, tier: Tier, node: int, need: int, now: float) -> bool:
        if tier.used + need <= tier.capacity:
            return True
        order = []
        used = demand.decay(self.uses, self.since, now) if self.since is not None else {}
        for d, s in tier.copies.items():
            if s.leases:
                continue
            nxt = self.next_known(node, d, now)
            order.append((0, used.get(d, 0.0), s.last_used, d) if nxt == math.inf else (1, -nxt, -s.bytes, d))
        for *_, d in sorted(order):
            tier.evict(d)
            if tier.used + need <= tier.capacity:
                return True
        return False


def ready_at(tiers: Sequence[Tier], tick: float) -> dict[str, frozenset[int]]:
    """dataset -> the nodes whose tier holds it ready at ``tick``: what the nodes' reports show
    a poller round at that time (the features it sets, the copies it writes)."""
    held: dict[str, set[int]] = {}
    for n, tier in enumerate(tiers):
        for ds, slot in tier.copies.items():
            if slot.ready <= tick:
                held.setdefault(ds, set()).add(n)
    return {ds: frozenset(ns) for ds, ns in held.items()}


class Features:
    """The ``ds_<dataset>`` features the demand poller keeps (dsstage.cluster.features): the
    nodes whose tier holds a ready copy of the dataset, as of the poller's last round, every
    ``interval`` seconds of simulated time on a fixed grid (0: at every instant)."""

    def __init__(self, tiers: Sequence[Tier], interval: float):
        self.tiers = tiers
        self.interval = interval
        self.window = -1
        self.tick = -math.inf  # the time of the poller's last round
        self.held: dict[str, frozenset[int]] = {}

    def before(self, now: float) -> None:
        """Called before anything changes at ``now``: the tiers are as they were at the tick."""
        window = int(now // self.interval) if self.interval > 0 else -2
        if window == self.window and window != -2:
            return
        self.window = window
        tick = self.tick = window * self.interval if self.interval > 0 else now
        self.held = ready_at(self.tiers, tick)

    def __call__(self, job: Job) -> frozenset[int]:
        return self.held.get(job.dataset, frozenset())


@dataclass
class Cluster:
    """The nodes' tiers and links as a stage sees them: the source's ``bandwidth`` per node,
    and with ``peer_bandwidth`` (peers on) the other nodes' copies."""

    tiers: list[Tier]
    capacity: int
    bandwidth: float
    peer_bandwidth: float | None = None
    link: list[float] = field(default_factory=list)  # when each node's link is free
    seen: set[tuple[int, str]] = field(default_factory=set)  # (node, dataset) pairs staged once
    seen_anywhere: set[str] = field(default_factory=set)  # datasets staged once on any node

    def holder(self, dataset: str, node: int) -> Slot | None:
        """With peers, the copy of ``dataset`` on another node that is ready first (it may be
        still arriving: a peer serves it as it lands); None without peers or holder."""
        if self.peer_bandwidth is None:
            return None
        slots = [t.copies[dataset] for m, t in enumerate(self.tiers) if m != node and dataset in t.copies]
        return min(slots, key=lambda s: s.ready) if slots else None


@dataclass(frozen=True)
class Setup:
    """How a replay places jobs and serves their data. ``placement``: one of PLACEMENTS, with
    the nodes' features read every ``features_interval`` seconds and backfill looking
    ``backfill_depth`` jobs deep; ``wait_for_data``: with ``prefer``, the seconds a job may
    wait for the nodes that hold its dataset (``sched.Scheduler``'s ``wait``);
    ``peer_bandwidth``: peers on, a stage reads from a node holding the dataset at this many
    bytes per second; ``features_of``: a Features class that places by something else than
    the caches (bench/sim_noise.py, a control)."""

    placement: str = "unaware"
    features_interval: float = 30.0
    backfill_depth: int = 100
    wait_for_data: float = 0.0
    peer_bandwidth: float | None = None
    features_of: type[Features] | None = None


def simulate(jobs: Sequence[Job], nodes: int, slots_per_node: int, sizes: dict[str, int], capacity: int,
             bandwidth: float, policy: Policy, setup: Setup = Setup()) -> tuple[Result, Schedule]:
    """Schedule ``jobs`` and serve their requests with ``policy`` deciding what the tiers keep,
    as ``setup`` says (Setup); the figures, and the schedule as it came out."""
    placement, features_interval, backfill_depth = setup.placement, setup.features_interval, setup.backfill_depth
    wait_for_data, peer_bandwidth, features_of = setup.wait_for_data, setup.peer_bandwidth, setup.features_of
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: one of {', '.join(PLACEMENTS)}")
    t0 = time.perf_counter()
    sch = Scheduler(nodes, slots_per_node, backfill_depth, wait_for_data if placement == "prefer" else 0.0)
    clock = Clock(jobs)
    tiers = [Tier(node_name(n), capacity) for n in range(nodes)]
    cl = Cluster(tiers, capacity, bandwidth, peer_bandwidth, [0.0] * nodes)
    res = Result(policy.name, placement, jobs=len(jobs), peers=peer_bandwidth is not None)
    features = (features_of or Features)(tiers, features_interval) if placement == "prefer" else None
    policy.attach(tiers, features)
    runs: list[Run] = []
    while (instant := clock.next()) is not None:
        t, ended, submitted = instant
        if features is not None:
            features.before(t)
        policy.before(t)
        for run in ended:
            _release(tiers, run, policy, t)
            policy.ended(run, t)
            sch.end(run)
        for job in submitted:
            sch.submit(job)
            policy.submitted(job, t)
        policy.settled(t)
        for run in sch.starts(t, features):
            clock.started(run)
            runs.append(run)
            res.queue_waits.append(t - run.job.submit)
            if features is not None and set(run.nodes) <= features(run.job):
                res.on_preferred += 1
            _serve(cl, run, sizes[run.job.dataset], policy, res, t)
            policy.started(run, t)
    for tier in tiers:
        res.evictions += tier.evictions
        res.bytes_evicted += tier.bytes_evicted
    res.plan_calls = getattr(policy, "calls", 0)
    res.waited_for_data = len(sch.waited)
    res.seconds = time.perf_counter() - t0
    return res, Schedule(runs, nodes, slots_per_node, sch.backfilled, sch.max_queue)


def _release(tiers: list[Tier], run: Run, policy: Policy, t: float) -> None:
    """A job's end: its leases go, and the policy runs on each of its nodes (the Epilog)."""
    ds, jid = run.job.dataset, run.job.id
    for n in run.nodes:
        tier = tiers[n]
        slot = tier.copies.get(ds)
        if slot is not None and jid in slot.leases:
            slot.leases.remove(jid)
            slot.last_used = t
            if not slot.leases:
                tier.leased -= slot.bytes
        policy.job_ended(tier, n, ds, t)


def _serve(cl: Cluster, run: Run, size: int, policy: Policy, res: Result, t: float) -> None:
    """A job's start: its dataset on each of its nodes, a hit or a stage (the Prolog)."""
    ds = run.job.dataset
    ready = t
    for n in run.nodes:
        tier = cl.tiers[n]
        res.requests += 1
        slot = tier.copies.get(ds)
        if slot is not None:
            res.hits += 1
        else:
            done = _stage(cl, n, ds, size, res, t)
            if tier.leased + size > cl.capacity:
                res.bypassed += 1
                ready = max(ready, done)
                policy.requested(tier, n, ds, run, t)
                continue
            before = tier.evictions
            room = policy.make_room(tier, n, size, t)
            res.stages_evicting += tier.evictions > before
            if not room or tier.used + size > cl.capacity:
                res.no_room += 1
                ready = max(ready, done)
                policy.requested(tier, n, ds, run, t)
                continue
            slot = tier.copies[ds] = Slot(size, t, done)
            tier.used += size
        if not slot.leases:
            tier.leased += slot.bytes
        slot.leases.append(run.job.id)
        slot.last_used = t
        ready = max(ready, slot.ready)
        policy.requested(tier, n, ds, run, t)
    wait = ready - t
    if wait > 0:
        res.jobs_delayed += 1
        res.wait_total += wait
        res.wait_max = max(res.wait_max, wait)


def _stage(cl: Cluster, n: int, ds: str, size: int, res: Result, t: float) -> float:
    """A stage of ``ds`` onto node ``n`` at ``t``: counted, its source chosen; when it ends."""
    res.bytes_staged += size
    if (n, ds) not in cl.seen:
        cl.seen.add((n, ds))
        res.bytes_compulsory += size
    if ds not in cl.seen_anywhere:
        cl.seen_anywhere.add(ds)
        res.bytes_first_ever += size
    begin = max(t, cl.link[n])
    holder = cl.holder(ds, n)
    if holder is not None and cl.peer_bandwidth:
        res.bytes_from_peers += size
        done = max(begin + size / cl.peer_bandwidth, holder.ready)  # never ahead of the copy it reads
    else:
        res.bytes_from_source += size
        done = begin + size / cl.bandwidth
    cl.link[n] = done
    return done


def node_name(n: int) -> str:
    return f"n{n:03d}"
