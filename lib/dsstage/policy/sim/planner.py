"""dsstage's own policy in the simulation: ``retention.plan`` where the product calls it, with
the demand snapshot the poller would have written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dsstage.config.model import HIGH_WATERMARK, LOW_WATERMARK
from dsstage.policy import demand as dm
from dsstage.policy import retention as rt
from dsstage.policy.sim.replay import Features, Policy, Tier, node_name, ready_at
from dsstage.policy.sim.sched import Nodes, Run, project
from dsstage.policy.sim.trace import Job


@dataclass(frozen=True)
class Snapshot:
    """The demand snapshot as the poller makes it: every ``interval`` seconds (0: at each
    call), the first ``depth`` pending jobs placed, stale after ``max_age``; with ``copies``,
    which nodes hold each dataset (the poller's ``copies``, written with peers on), and the
    planner keeps the last copy in the cluster first."""

    interval: float = 30.0
    depth: int = 100
    max_age: float = 300.0
    copies: bool = False


class Planner(Policy):
    """``retention.plan`` in the Epilog of every job on each of its nodes, and in the Prolog of
    a stage that needs room (``Space.need``), with the demand snapshot as a poller would have
    taken it: every ``interval`` seconds of simulated time (0: at each call), the pending
    jobs in queue order (the first ``depth`` with the expected start and planned nodes of
    ``sched.project``, placed as the scheduler places them, the others unplaced) and the
    running jobs; and the counts of job starts, as the poller keeps them
    (``demand.count_starts``): a job counts once, at the first snapshot that shows it
    running (one that starts and ends between two snapshots is never seen), for the whole
    cluster.

    A call the planner would answer "keep everything" (the tier at or below the high
    watermark after a job, within the capacity with a stage, and ``max_idle`` 0: no rule but
    pressure can evict a current, ready copy) is skipped;
    ``shortcut=False`` makes every call, for the test that they agree."""

    name = "planner"

    def __init__(self, nodes: int, slots_per_node: int, capacity: int, *, high: float = HIGH_WATERMARK,
                 low: float = LOW_WATERMARK, policy: rt.Policy = rt.Policy(), snapshot: Snapshot = Snapshot(),
                 shortcut: bool = True):
        """``snapshot``: the demand snapshot it decides from (Snapshot)."""
        self.space = rt.Space(capacity, high=high, low=low)
        self.policy = policy
        self.interval = snapshot.interval
        self.depth = snapshot.depth
        self.max_age = snapshot.max_age
        copies = snapshot.copies
        self.shortcut = shortcut and policy.max_idle == 0
        self.names = [node_name(n) for n in range(nodes)]
        self.free = Nodes(nodes, slots_per_node)
        self.features: Features | None = None
        self.tiers: Sequence[Tier] = ()
        self.copies = copies
        self._held: dict[str, dict[str, frozenset[str]]] = {}
        self.queue: dict[str, Job] = {}  # pending jobs by id, in submission order
        self.running: dict[str, Run] = {}
        self.pending_want: dict[str, rt.Want] = {}
        self.running_want: dict[str, rt.Want] = {}
        self.calls = 0
        self.window = -1
        self._frozen: tuple[float, Nodes, list[Job], list[Run], dict[str, frozenset[int]]] | None = None
        self._demand: tuple[float, dict[str, list[rt.Want]]] | None = None
        self.uses: dict[str, float] = {}  # as of uses_time, the last snapshot
        self.uses_time = 0.0
        self.counted: set[str] = set()  # running at the last snapshot: already counted
        #: for the report: how often a started job's nodes were the ones last planned for it
        self.last_planned: dict[str, tuple[int, ...]] = {}
        self.planned_jobs = 0
        self.planned_nodes_right = 0.0

    def attach(self, tiers: Sequence[Tier], features: Features | None) -> None:
        self.features = features
        self.tiers = tiers

    # the queue --------------------------------------------------------------------
    def before(self, now: float) -> None:
        """The first instant after a tick: the state now is the state at the tick."""
        if self.interval > 0 and int(now // self.interval) != self.window and now % self.interval:
            self._tick(now)

    def settled(self, now: float) -> None:
        """An instant on a tick: the round sees its ends and submissions, not its starts."""
        if self.interval > 0 and int(now // self.interval) != self.window:
            self._tick(now)

    def _tick(self, now: float) -> None:
        self.window = int(now // self.interval)
        tick = self.window * self.interval
        self._freeze(tick, self.free.copy(), [j for j in self.queue.values() if j.submit <= tick])

    def _freeze(self, tick: float, free: Nodes, queue: list[Job]) -> None:
        self._frozen = (tick, free, queue, list(self.running.values()), self.features.held if self.features else {})
        self._demand = None
        self._count(tick)
        if self.copies:  # the poller's copies: the ready copies the nodes' reports show at the tick
            self._held = {ds: {"1": frozenset(self.names[n] for n in ns)}
                          for ds, ns in ready_at(self.tiers, tick).items()}

    def submitted(self, job: Job, now: float) -> None:
        self.queue[job.id] = job
        self.pending_want[job.id] = rt.Want(job.id, "pending")

    def started(self, run: Run, now: float) -> None:
        jid = run.job.id
        del self.queue[jid]  # its Wants stay: a frozen snapshot may still show it
        self.running[jid] = run
        self.free.take(run.nodes, run.per_node)
        self.running_want[jid] = rt.Want(jid, "running", nodes=tuple(self.names[n] for n in run.nodes))
        planned = self.last_planned.pop(jid, None)
        if planned is not None:
            self.planned_jobs += 1
            self.planned_nodes_right += len(set(planned) & set(run.nodes)) / len(run.nodes)

    def ended(self, run: Run, now: float) -> None:
        del self.running[run.job.id]
        self.free.give(run.nodes, run.per_node)

    def demand(self, now: float) -> rt.Demand:
        if self.interval <= 0:
            self._freeze(now, self.free, list(self.queue.values()))
        if self._demand is None:
            assert self._frozen is not None
            self._demand = (self._frozen[0], self._build(*self._frozen))
        taken, wants = self._demand
        age = now - taken
        return rt.Demand(wants, stale=age > self.max_age, age=age, uses=dm.decay(self.uses, self.uses_time, now),
                         copies=self._held)

    def _count(self, tick: float) -> None:
        """The snapshot's counts of job starts at ``tick``, from the previous snapshot's."""
        running = set(self.running)
        started = [(self.running[j].job.dataset,) for j in sorted(running - self.counted)]
        self.uses = dm.count_starts(self.uses, self.uses_time, tick, started)
        self.uses_time, self.counted = tick, running

    def _build(self, tick: float, free: Nodes, queue: list[Job], running: list[Run],
               held: dict[str, frozenset[int]]) -> dict[str, list[rt.Want]]:
        placed = project(free, ((r.expected_end, r.nodes, r.per_node) for r in running), queue[:self.depth], tick,
                         (lambda job: held.get(job.dataset, frozenset())) if self.features is not None else None)
        wants: dict[str, list[rt.Want]] = {}
        for job, start, nodes in placed:
            self.last_planned[job.id] = nodes
            wants.setdefault(job.dataset, []).append(
                rt.Want(job.id, "pending", start=start, nodes=tuple(self.names[n] for n in nodes)))
        for job in queue[len(placed):]:
            wants.setdefault(job.dataset, []).append(self.pending_want[job.id])
        for r in running:
            wants.setdefault(r.job.dataset, []).append(self.running_want[r.job.id])
        return wants

    # the decisions ------------------------------------------------------------------
    def _plan(self, tier: Tier, node: int, need: int, now: float) -> rt.Plan:
        self.calls += 1
        copies = [rt.Copy(d, "1", s.bytes, s.last_used, leases=tuple(s.leases)) for d, s in tier.copies.items()]
        p = rt.plan(copies, self.demand(now), replace(self.space, need=need), now, policy=self.policy,
                    node=self.names[node])
        for d in p.decisions:
            if d.evict:
                tier.evict(d.copy.dataset)
        return p

    def make_room(self, tier: Tier, node: int, need: int, now: float) -> bool:
        if self.shortcut and not replace(self.space, need=need).over(tier.used):
            return True
        return self._plan(tier, node, need, now).fits

    def job_ended(self, tier: Tier, node: int, dataset: str, now: float) -> None:
        if self.shortcut and not self.space.over(tier.used):
            return
        self._plan(tier, node, 0, now)
