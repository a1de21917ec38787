"""A lower bound on the bytes any retention policy must stage for a schedule.

The model is the replay's: a job's dataset is on each of its nodes while it runs (unless
the leased copies leave no room for it, in which case it is streamed past the tier, for
every policy alike), and a tier never holds more than its capacity. Between two uses of a
dataset on a node there is a *gap*: keeping the copy through the gap saves one stage of
its bytes, and occupies them for the gap's length. A policy chooses which gaps to keep
under the capacity left by the leased copies at each instant.

Relaxation: allow keeping part of a copy through a gap (a fraction of its bytes, saving
that fraction). This is the fractional form of the flow model of Berger, Beckmann and
Harchol-Balter ("Practical Bounds on Optimal Caching with Variable Object Sizes",
SIGMETRICS 2018) with the byte-miss cost; with one cost per byte it reduces to packing
intervals on a line, which the greedy below solves exactly: gaps by increasing end, each
kept as much as the least free capacity along it allows (an exchange argument: some
optimum keeps as much as possible of the gap that ends first). Its value is at most that
of any integral policy, hence a lower bound on the optimum (OPT) and on every policy the
simulator replays (but for requests a policy found no room for, counted as no_room).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dsstage.policy.sim.sched import Run, Schedule

END, START = 0, 1


def events(runs: Sequence[Run]) -> list[tuple[float, int, int]]:
    """(time, kind, run index): at one instant, ends first (their nodes are free for the starts)."""
    return sorted([(r.end, END, i) for i, r in enumerate(runs)] + [(r.start, START, i) for i, r in enumerate(runs)])


@dataclass
class Bound:
    bytes_staged: int
    bytes_compulsory: int
    gaps: int  # gaps that keeping a copy could bridge
    gap_bytes_kept: int  # bytes the relaxation keeps through them

    @property
    def bytes_staged_again(self) -> int:
        return self.bytes_staged - self.bytes_compulsory


class _MinTree:
    """Range add, range min over a fixed array (segment tree with lazy adds)."""

    def __init__(self, values: Sequence[int]):
        self.n = max(1, len(values))
        self.mn = [0] * (4 * self.n)
        self.lz = [0] * (4 * self.n)
        if values:
            self._build(1, 0, self.n - 1, values)

    def _build(self, k: int, lo: int, hi: int, v: Sequence[int]) -> None:
        if lo == hi:
            self.mn[k] = v[lo]
            return
        mid = (lo + hi) // 2
        self._build(2 * k, lo, mid, v)
        self._build(2 * k + 1, mid + 1, hi, v)
        self.mn[k] = min(self.mn[2 * k], self.mn[2 * k + 1])

    def min(self, lo: int, hi: int) -> float:
        """Min over [lo, hi] (inclusive); +inf if empty."""
        return math.inf if lo > hi else self._min(1, 0, self.n - 1, lo, hi)

    def _min(self, k: int, a: int, b: int, lo: int, hi: int) -> float:
        if hi < a or b < lo:
            return math.inf
        if lo <= a and b <= hi:
            return self.mn[k]
        mid = (a + b) // 2
        return self.lz[k] + min(self._min(2 * k, a, mid, lo, hi), self._min(2 * k + 1, mid + 1, b, lo, hi))

    def add(self, lo: int, hi: int, delta: int) -> None:
        if lo <= hi:
            self._add(1, 0, self.n - 1, lo, hi, delta)

    def _add(self, k: int, a: int, b: int, lo: int, hi: int, delta: int) -> None:
        if hi < a or b < lo:
            return
        if lo <= a and b <= hi:
            self.mn[k] += delta
            self.lz[k] += delta
            return
        mid = (a + b) // 2
        self._add(2 * k, a, mid, lo, hi, delta)
        self._add(2 * k + 1, mid + 1, b, lo, hi, delta)
        self.mn[k] = self.lz[k] + min(self.mn[2 * k], self.mn[2 * k + 1])


def pack(capacity: Sequence[int], gaps: Sequence[tuple[int, int, int]]) -> int:
    """The most bytes that ``gaps`` (first segment, last segment inclusive, bytes) can keep
    when segment ``i`` has ``capacity[i]`` bytes free: greedy by increasing last segment."""
    tree = _MinTree(capacity)
    kept = 0
    for lo, hi, size in sorted(gaps, key=lambda g: (g[1], g[0])):
        y = min(size, tree.min(lo, hi))
        if y > 0:
            kept += int(y)
            tree.add(lo, hi, -int(y))
    return kept


def lower_bound(sched: Schedule, sizes: dict[str, int], capacity: int) -> Bound:
    """The relaxation's bytes staged for ``sched`` on tiers of ``capacity`` bytes."""
    runs = sched.runs
    leases: dict[tuple[int, str], int] = {}  # resident copies' lease counts
    leased = [0] * sched.nodes
    released: dict[tuple[int, str], float] = {}  # when a resident copy lost its last lease
    seen: set[tuple[int, str]] = set()
    staged = compulsory = 0
    changes: list[list[tuple[float, int]]] = [[] for _ in range(sched.nodes)]  # (time, leased bytes after)
    node_gaps: list[list[tuple[float, float, int]]] = [[] for _ in range(sched.nodes)]
    for t, kind, i in events(runs):
        run = runs[i]
        ds = run.job.dataset
        size = sizes[ds]
        for n in run.nodes:
            key = (n, ds)
            if kind == END:
                if key in leases:
                    leases[key] -= 1
                    if not leases[key]:
                        del leases[key]
                        leased[n] -= size
                        changes[n].append((t, leased[n]))
                        released[key] = t
                continue
            if key in leases:  # a lease hit for every policy
                leases[key] += 1
                continue
            staged += size
            if key not in seen:
                seen.add(key)
                compulsory += size
            if leased[n] + size > capacity:  # streamed past the tier: nothing kept before or after
                released.pop(key, None)
                continue
            since = released.pop(key, None)
            if since is not None:
                node_gaps[n].append((since, t, size))
            leases[key] = 1
            leased[n] += size
            changes[n].append((t, leased[n]))
    gaps = kept = 0
    for n in range(sched.nodes):
        if not node_gaps[n]:
            continue
        times = sorted({t for t, _ in changes[n]})
        level = dict(changes[n])  # the last change at each instant holds
        free = [capacity - level[t] for t in times]
        segs = []
        for since, until, size in node_gaps[n]:
            lo = bisect.bisect_left(times, since)  # segment i covers [times[i], times[i + 1])
            hi = bisect.bisect_left(times, until) - 1
            segs.append((lo, hi, size))
        gaps += len(segs)
        kept += pack(free, segs)
    return Bound(staged - kept, compulsory, gaps, kept)
