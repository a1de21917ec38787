"""A simple, deterministic batch scheduler: FIFO with EASY backfill, cache-unaware or preferring
the nodes that hold a job's dataset.

``Scheduler`` is incremental: the simulation (dsstage.policy.sim.replay) submits jobs, ends
runs and asks it, at each instant, which jobs start and where. With ``prefer`` (what Slurm
does with the ``--prefer=ds_<dataset>`` job_submit.lua gives every job) a job starts on free
nodes whose features say they hold its dataset when there are enough of them, anywhere
otherwise; the features are the caches as the demand poller last saw them, so the schedule
and the caches evolve together. Without it the schedule depends on the trace alone, and
``schedule`` computes it once: the offline figures need every request known in advance.

``project`` is what the simulated ``squeue --start`` shows: the expected start and the
planned nodes of the first pending jobs, from the running jobs' expected ends (start +
time limit).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from dsstage.policy.sim.trace import Job

#: the nodes a job prefers (its dataset's feature), or none
Prefer = Callable[[Job], Collection[int]]


@dataclass(frozen=True)
class Run:
    """Where and when the scheduler ran a job."""

    job: Job
    start: float
    end: float
    nodes: tuple[int, ...]
    per_node: int  # slots it holds on each of its nodes

    @property
    def expected_end(self) -> float:
        return self.start + self.job.limit


class Nodes:
    """Free slots per node, with the nodes bucketed by free slots (each bucket sorted) so that
    "does it fit" costs O(slots) and a choice O(nodes it takes)."""

    def __init__(self, count: int, slots: int):
        self.slots = slots
        self.free = [slots] * count
        self.buckets: list[list[int]] = [[] for _ in range(slots + 1)]
        self.buckets[slots] = list(range(count))

    def copy(self) -> Nodes:
        other = Nodes.__new__(Nodes)
        other.slots = self.slots
        other.free = list(self.free)
        other.buckets = [list(b) for b in self.buckets]
        return other

    def shape(self, want: int) -> tuple[int, int]:
        """(nodes, slots on each) for a job of ``want`` slots: a small one shares a node, a
        larger one takes whole nodes."""
        if want <= self.slots:
            return 1, want
        return -(-want // self.slots), self.slots

    def fits(self, want: int) -> bool:
        count, per = self.shape(want)
        if per == self.slots:
            return len(self.buckets[self.slots]) >= count
        return any(self.buckets[f] for f in range(per, self.slots + 1))

    def fits_on(self, want: int, only: Collection[int]) -> bool:
        """Whether a job of ``want`` slots fits now on ``only`` (a hard constraint)."""
        return self.choose(want, only=only) is not None

    def choose(self, want: int, exclude: Collection[int] = frozenset(),
               prefer: Collection[int] = frozenset(), only: Collection[int] | None = None) -> tuple[int, ...] | None:
        """The nodes a job would start on now: whole nodes by lowest index; a small job on the
        node with the fewest free slots that hold it (best fit), then the lowest index.
        ``prefer``: the same choice among these nodes alone if enough of them are free (Slurm's
        ``--prefer``), else as without it. ``only``: among these nodes alone, or none (a hard
        constraint)."""
        if only is not None:
            return self._choose(want, exclude, only)
        if prefer:
            chosen = self._choose(want, exclude, prefer)
            if chosen is not None:
                return chosen
        return self._choose(want, exclude, None)

    def _choose(self, want: int, exclude: Collection[int], only: Collection[int] | None) -> tuple[int, ...] | None:
        count, per = self.shape(want)
        if per == self.slots:
            whole = self.buckets[self.slots]
            if exclude or only is not None:
                chosen = [n for n in whole if n not in exclude and (only is None or n in only)][:count]
            else:
                chosen = whole[:count]
            return tuple(chosen) if len(chosen) == count else None
        for f in range(per, self.slots + 1):
            for n in self.buckets[f]:
                if n not in exclude and (only is None or n in only):
                    return (n,)
        return None

    def take(self, nodes: Iterable[int], per: int) -> None:
        for n in nodes:
            self._move(n, self.free[n] - per)

    def give(self, nodes: Iterable[int], per: int) -> None:
        for n in nodes:
            self._move(n, self.free[n] + per)

    def _move(self, n: int, to: int) -> None:
        self.buckets[self.free[n]].remove(n)
        bisect.insort(self.buckets[to], n)
        self.free[n] = to


def project(nodes: Nodes, running: Iterable[tuple[float, tuple[int, ...], int]], pending: Sequence[Job],
            now: float, prefer: Prefer | None = None,
            only: Callable[[Job], Collection[int] | None] | None = None) -> list[tuple[Job, float, tuple[int, ...]]]:
    """Expected start and planned nodes of ``pending`` (in queue order), from ``running``'s
    (expected end, nodes, slots per node), as if each job ran to its time limit.

    In queue order, each job gets the earliest time, no earlier than the job before it, at
    which it fits once the jobs expected to end by then have ended; it then holds its
    nodes until its own limit. (No backfill within the projection: later jobs are not
    moved ahead.) ``prefer``: as in ``Nodes.choose``; ``only``: the nodes a job must run on
    (it waits for its data, ``Scheduler``), or None. ``nodes`` is not changed."""
    free = nodes.copy()
    ends = [(max(end, now), i, ns, per) for i, (end, ns, per) in enumerate(running)]
    heapq.heapify(ends)
    seq = len(ends)
    t = now
    out: list[tuple[Job, float, tuple[int, ...]]] = []
    for job in pending:
        must = only(job) if only else None
        while not (free.fits(job.slots) if must is None else free.fits_on(job.slots, must)):
            if not ends:
                return out  # larger than the cluster: nothing after it can be placed either
            t = max(t, ends[0][0])
            while ends and ends[0][0] <= t:
                _, _, ns, per = heapq.heappop(ends)
                free.give(ns, per)
        chosen = free.choose(job.slots, prefer=prefer(job) if prefer else (), only=must)
        assert chosen is not None
        _, per = free.shape(job.slots)
        free.take(chosen, per)
        heapq.heappush(ends, (t + job.limit, seq, chosen, per))
        seq += 1
        out.append((job, t, chosen))
    return out


class Scheduler:
    """The queue and the nodes, advanced by the simulation: ``submit`` and ``end`` change them,
    ``starts`` starts what it can at an instant.

    At each instant, it starts jobs from the head of the queue while they fit; then the head
    gets a reservation (``project``) and up to ``backfill_depth`` later jobs start if they fit
    now and either end (by their limit) before the reservation or keep off its nodes.

    ``wait`` (seconds, with ``prefer``): a job waits for the nodes that hold its dataset
    when enough of them do, not enough are free, and enough are free or expected to be
    free (by their running jobs' limits) within ``wait`` seconds: it runs only there, as a
    job that the demand poller excluded from the other nodes does (dsstage.policy.datawait,
    placement.wait_for_data). It gets the head's reservation on those nodes like any head,
    and the jobs behind it may start elsewhere meanwhile. As on a cluster, only a job
    pending at the poller's last round (``prefer.tick``) waits: Slurm starts a job that
    finds a free node as it is submitted, before any poller sees it; and a job waits at
    most ``wait`` from the instant it first waited."""

    def __init__(self, nodes: int, slots_per_node: int, backfill_depth: int = 100, wait: float = 0.0):
        self.free = Nodes(nodes, slots_per_node)
        self.backfill_depth = backfill_depth
        self.wait = wait
        self.queue: list[Job] = []
        self.running: dict[str, Run] = {}  # by job id
        self.on_node: list[list[Run]] = [[] for _ in range(nodes)]
        self.backfilled = 0
        self.max_queue = 0
        self.waited: set[str] = set()  # jobs that waited for their data's nodes at some instant
        self.first_wait: dict[str, float] = {}  # job id -> the instant it first waited

    def submit(self, job: Job) -> None:
        self.queue.append(job)

    def end(self, run: Run) -> None:
        del self.running[run.job.id]
        for n in run.nodes:
            self.on_node[n].remove(run)
        self.free.give(run.nodes, run.per_node)

    def waits_for(self, job: Job, t: float, prefer: Prefer | None) -> Collection[int] | None:
        """The nodes ``job`` waits for at ``t`` (see the class), or None: it may start anywhere."""
        if not self.wait or prefer is None:
            return None
        if job.submit > getattr(prefer, "tick", t):
            return None  # submitted since the poller's last round: no poller has seen it yet
        first = self.first_wait.get(job.id)
        if first is not None and t - first >= self.wait:
            return None  # it waited its time (dsstage.policy.datawait lifts the wait then)
        holders = prefer(job)
        count, per = self.free.shape(job.slots)
        if len(holders) < count or self.free.fits_on(job.slots, holders):
            return None
        by = t + self.wait
        soon = [n for n in holders
                if self.free.free[n] + sum(r.per_node for r in self.on_node[n] if r.expected_end <= by) >= per]
        if len(soon) < count:
            return None
        self.first_wait.setdefault(job.id, t)
        return holders

    def starts(self, t: float, prefer: Prefer | None = None) -> list[Run]:
        """Start what can start at ``t``; the runs, in start order."""
        self.max_queue = max(self.max_queue, len(self.queue))
        free, queue = self.free, self.queue
        out: list[Run] = []
        head = 0
        waiting: Collection[int] | None = None
        while head < len(queue) and free.fits(queue[head].slots):
            waiting = self.waits_for(queue[head], t, prefer)
            if waiting is not None:
                self.waited.add(queue[head].id)
                break
            run = self._start(queue[head], t, (), prefer)
            assert run is not None
            out.append(run)
            head += 1
        del queue[:head]
        if len(queue) < 2:
            return out
        candidates = [j for j in queue[1:self.backfill_depth + 1] if free.fits(j.slots)]
        if not candidates:
            return out
        plan = project(free, ((r.expected_end, r.nodes, r.per_node) for r in self.running.values()), queue[:1], t,
                       prefer, (lambda job: waiting) if waiting is not None else None)
        shadow, reserved = (plan[0][1], set(plan[0][2])) if plan else (float("inf"), set())
        started: set[str] = set()
        for job in candidates:
            if not free.fits(job.slots):
                continue
            if self.waits_for(job, t, prefer) is not None:
                self.waited.add(job.id)
                continue
            run = self._start(job, t, () if t + job.limit <= shadow else reserved, prefer)
            if run is not None:
                out.append(run)
                started.add(job.id)
                self.backfilled += 1
        if started:
            queue[:] = [j for j in queue if j.id not in started]
        return out

    def _start(self, job: Job, t: float, exclude: Collection[int], prefer: Prefer | None) -> Run | None:
        """Start ``job`` at ``t`` off ``exclude``; None if it does not fit there."""
        chosen = self.free.choose(job.slots, exclude, prefer(job) if prefer else ())
        if chosen is None:
            return None
        _, per = self.free.shape(job.slots)
        self.free.take(chosen, per)
        run = Run(job, t, t + job.runtime, chosen, per)
        self.running[job.id] = run
        for n in chosen:
            self.on_node[n].append(run)
        return run


@dataclass
class Schedule:
    runs: list[Run]  # in start order
    nodes: int
    slots_per_node: int
    backfilled: int  # jobs started ahead of an earlier job
    max_queue: int

    def mean_wait(self) -> float:
        return sum(r.start - r.job.submit for r in self.runs) / len(self.runs) if self.runs else 0.0

    def utilisation(self) -> float:
        if not self.runs:
            return 0.0
        span = max(r.end for r in self.runs) - min(r.job.submit for r in self.runs)
        used = sum((r.end - r.start) * len(r.nodes) * r.per_node for r in self.runs)
        return used / (span * self.nodes * self.slots_per_node) if span > 0 else 0.0


class Clock:
    """The instants of a simulation over ``jobs``: each submission and each end of a run that
    ``started`` was told of. At one instant, the runs that end come first (their nodes are
    free for the starts), then the submissions, then the starts."""

    def __init__(self, jobs: Sequence[Job]):
        self.order = sorted(jobs, key=lambda j: j.submit)  # stable: ties keep trace order
        self.i = 0
        self.ends: list[tuple[float, int, Run]] = []
        self.seq = 0

    def started(self, run: Run) -> None:
        heapq.heappush(self.ends, (run.end, self.seq, run))
        self.seq += 1

    def next(self) -> tuple[float, list[Run], list[Job]] | None:
        """(time, the runs that end then, the jobs submitted then); None at the end."""
        order, ends = self.order, self.ends
        if self.i >= len(order) and not ends:
            return None
        t = min(order[self.i].submit if self.i < len(order) else float("inf"), ends[0][0] if ends else float("inf"))
        ended = []
        while ends and ends[0][0] <= t:
            ended.append(heapq.heappop(ends)[2])
        submitted = []
        while self.i < len(order) and order[self.i].submit <= t:
            submitted.append(order[self.i])
            self.i += 1
        return t, ended, submitted


def schedule(jobs: Sequence[Job], nodes: int, slots_per_node: int, backfill_depth: int = 100) -> Schedule:
    """The cache-unaware schedule of ``jobs``: what every policy sees with placement
    ``unaware``, known before any policy runs."""
    sch = Scheduler(nodes, slots_per_node, backfill_depth)
    clock = Clock(jobs)
    runs: list[Run] = []
    while (instant := clock.next()) is not None:
        t, ended, submitted = instant
        for run in ended:
            sch.end(run)
        for job in submitted:
            sch.submit(job)
        for run in sch.starts(t):
            clock.started(run)
            runs.append(run)
    return Schedule(runs, nodes, slots_per_node, sch.backfilled, sch.max_queue)
