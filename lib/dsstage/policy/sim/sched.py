"""A simple, deterministic, cache-unaware batch scheduler: FIFO with EASY backfill.

It places every job once, before any retention policy runs, so that every policy sees
the same (time, node, dataset) requests. ``project`` is also what the simulated
``squeue --start`` shows: the expected start and the planned nodes of the first pending
jobs, from the running jobs' expected ends (start + time limit).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dsstage.policy.sim.trace import Job


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

    def choose(self, want: int, exclude: set[int] | frozenset[int] = frozenset()) -> tuple[int, ...] | None:
        """The nodes a job would start on now: whole nodes by lowest index; a small job on the
        node with the fewest free slots that hold it (best fit), then the lowest index."""
        count, per = self.shape(want)
        if per == self.slots:
            chosen = [n for n in self.buckets[self.slots] if n not in exclude][:count] if exclude else \
                self.buckets[self.slots][:count]
            return tuple(chosen) if len(chosen) == count else None
        for f in range(per, self.slots + 1):
            for n in self.buckets[f]:
                if n not in exclude:
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
            now: float) -> list[tuple[Job, float, tuple[int, ...]]]:
    """Expected start and planned nodes of ``pending`` (in queue order), from ``running``'s
    (expected end, nodes, slots per node), as if each job ran to its time limit.

    In queue order, each job gets the earliest time, no earlier than the job before it, at
    which it fits once the jobs expected to end by then have ended; it then holds its
    nodes until its own limit. (No backfill within the projection: later jobs are not
    moved ahead.) ``nodes`` is not changed."""
    free = nodes.copy()
    ends = [(max(end, now), i, ns, per) for i, (end, ns, per) in enumerate(running)]
    heapq.heapify(ends)
    seq = len(ends)
    t = now
    out: list[tuple[Job, float, tuple[int, ...]]] = []
    for job in pending:
        while not free.fits(job.slots):
            if not ends:
                return out  # larger than the cluster: nothing after it can be placed either
            t = max(t, ends[0][0])
            while ends and ends[0][0] <= t:
                _, _, ns, per = heapq.heappop(ends)
                free.give(ns, per)
        chosen = free.choose(job.slots)
        assert chosen is not None
        _, per = free.shape(job.slots)
        free.take(chosen, per)
        heapq.heappush(ends, (t + job.limit, seq, chosen, per))
        seq += 1
        out.append((job, t, chosen))
    return out


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


def schedule(jobs: Sequence[Job], nodes: int, slots_per_node: int, backfill_depth: int = 100) -> Schedule:
    """Start every job: at each submission or end, start jobs from the head of the queue
    while they fit; then the head gets a reservation (``project``) and up to
    ``backfill_depth`` later jobs start if they fit now and either end (by their limit)
    before the reservation or keep off its nodes."""
    order = sorted(jobs, key=lambda j: j.submit)  # stable: ties keep trace order
    free = Nodes(nodes, slots_per_node)
    running: dict[int, Run] = {}
    ends: list[tuple[float, int]] = []  # (end, run index)
    runs: list[Run] = []
    queue: list[Job] = []
    backfilled = max_queue = 0
    i = 0

    def start(job: Job, t: float, chosen: tuple[int, ...]) -> None:
        _, per = free.shape(job.slots)
        free.take(chosen, per)
        run = Run(job, t, t + job.runtime, chosen, per)
        running[len(runs)] = run
        heapq.heappush(ends, (run.end, len(runs)))
        runs.append(run)

    while i < len(order) or ends:
        t = min(order[i].submit if i < len(order) else float("inf"), ends[0][0] if ends else float("inf"))
        while ends and ends[0][0] <= t:
            _, k = heapq.heappop(ends)
            r = running.pop(k)
            free.give(r.nodes, r.per_node)
        while i < len(order) and order[i].submit <= t:
            queue.append(order[i])
            i += 1
        max_queue = max(max_queue, len(queue))
        head = 0
        while head < len(queue) and free.fits(queue[head].slots):
            chosen = free.choose(queue[head].slots)
            assert chosen is not None
            start(queue[head], t, chosen)
            head += 1
        del queue[:head]
        if len(queue) < 2:
            continue
        candidates = [j for j in queue[1:backfill_depth + 1] if free.fits(j.slots)]
        if not candidates:
            continue
        plan = project(free, ((r.expected_end, r.nodes, r.per_node) for r in running.values()), queue[:1], t)
        shadow, reserved = (plan[0][1], set(plan[0][2])) if plan else (float("inf"), set())
        started = set()
        for job in candidates:
            if not free.fits(job.slots):
                continue
            chosen = free.choose(job.slots) if t + job.limit <= shadow else free.choose(job.slots, reserved)
            if chosen is not None:
                start(job, t, chosen)
                started.add(id(job))
                backfilled += 1
        if started:
            queue[:] = [j for j in queue if id(j) not in started]
    return Schedule(runs, nodes, slots_per_node, backfilled, max_queue)
