"""Requests in flight against a source: as many as it sustains, never more than the site allows.

On a network filesystem every open, stat and directory listing is a round trip, and one
thread waiting for each in turn is slow however fast the network is; many requests in
flight hide the round trips. How many pay off depends on the source (a local disk is
fastest with a few, NFS or Lustre with dozens) and a site may need to protect a shared
filesystem from too many. So the work runs on ``limit`` threads, never more than ``bound``
(``transfer.max_parallel``), the limit moved by measuring:

- a sample is enough completions to mean something (at least 4 per request in flight)
  over at least SAMPLE_SECONDS (shorter ones measured noise, not the source), and starts
  only once as many requests as were or are now in flight have completed since the
  limit moved (so a probe measures the new limit, not the change to it);
- a probe doubles the limit; it is kept if it is at least GAIN faster, and the next
  probe up follows at once;
- one that is not goes back, and the next probe halves the limit: fewer in flight that
  go about as fast (KEEP) are kept (less contention here, less load on the source), and
  the next probe down follows at once;
- once neither way pays, the limit holds for HOLD samples, then probes again (the source
  may have got faster, or busier).

Measured on this project's benchmarks (docs/benchmarks.md), the throughput of a source is
flat past a knee that moves with the machine's load (1 ms round trips: 16 to 128 files in
flight within 5 % in one series; 32 and 64 within 10 %, and 16 30 % slower, in another)
and falls steeply below it (8: 1.7 times as long as 16), while a local disk is fastest
with a few and 20-30 % slower with dozens: so the limit climbs quickly and comes down
only where fewer are measurably as fast.

Threads are started as the limit rises and leave as it falls, so that no thread waits
for a turn: a gate of parked threads measured 6 % slower than as many threads as the
limit. The decision is ``climb``, a pure function that also says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

log = logging.getLogger(__name__)

#: requests in flight at first against a source: between a local disk's best (4 on a
#: 2-core machine with a virtio disk) and a network filesystem's knee (16 at 1 ms), where
#: a probe either way is cheap
START = 8
#: a probe up must be this much faster than the limit it came from to be kept
GAIN = 1.15
#: a probe down is kept if it goes at least this fraction as fast
KEEP = 0.95
#: samples to hold the limit once neither way paid, before probing again
HOLD = 8
#: completions in a sample, per request in flight (and at least MIN_SAMPLE)
PER_SLOT = 4
MIN_SAMPLE = 16
#: a sample lasts at least this long
SAMPLE_SECONDS = 0.05
#: a file counts as this many bytes of work besides its own bytes (its round trips)
FILE_COST = 256 * 1024

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Climb:
    """Where the limit stands: ``limit`` in flight now; ``base`` the limit known good and
    ``base_rate`` its measured rate (work per second); ``hold`` samples before the next
    probe, which goes down if ``down`` (else up)."""

    limit: int
    base: int
    base_rate: float = 0.0
    hold: int = 0
    down: bool = False

    @classmethod
    def start(cls, limit: int, bound: int) -> Climb:
        limit = max(1, min(limit, bound))
        return cls(limit=limit, base=limit)


def climb(state: Climb, rate: float, bound: int) -> tuple[Climb, str]:
    """The next state after a sample measured ``rate`` at ``state.limit``, and why."""
    ratio = rate / max(state.base_rate, 1e-9)
    if state.limit > state.base:  # a probe up
        if ratio >= GAIN:
            kept = Climb(limit=state.limit, base=state.limit, base_rate=rate)
            if kept.limit < bound:
                up = min(bound, kept.limit * 2)
                return (replace(kept, limit=up),
                        f"{state.limit} in flight went {ratio:.2f}x as fast as {state.base}: trying {up}")
            return kept, f"{state.limit} in flight went faster than {state.base}: staying at the bound {bound}"
        return (replace(state, limit=state.base, hold=1, down=True),
                f"{state.limit} in flight were no faster than {state.base} ({ratio:.2f}x): back to {state.base}")
    if state.limit < state.base:  # a probe down
        if ratio >= KEEP:
            kept = Climb(limit=state.limit, base=state.limit, base_rate=rate, down=True)
            why = f"{state.limit} in flight went as fast as {state.base} ({ratio:.2f}x)"
            if kept.limit > 1:
                return replace(kept, limit=kept.limit // 2), f"{why}: trying {kept.limit // 2}"
            return kept, f"{why}: keeping 1"
        return (replace(state, limit=state.base, hold=HOLD, down=False),
                f"{state.limit} in flight were slower than {state.base} ({ratio:.2f}x): back to {state.base}")
    # at the known-good limit: refresh its rate (the source's speed changes), probe if due
    base_rate = rate if state.base_rate == 0 else (state.base_rate + rate) / 2
    if state.hold > 0:
        return replace(state, base_rate=base_rate, hold=state.hold - 1), ""
    if state.down and state.limit > 1:
        to = max(1, state.limit // 2)
    elif not state.down and state.limit < bound:
        to = min(bound, state.limit * 2)
    else:  # the way due is closed (at 1, or at the bound): hold, then try the other way
        return replace(state, base_rate=base_rate, hold=HOLD, down=not state.down), ""
    return replace(state, limit=to, base_rate=base_rate), f"trying {to} in flight (from {state.limit})"


class Limiter:
    """How many requests may be in flight, adjusted by ``climb`` from what completes."""

    @classmethod
    def for_source(cls, workers: int, max_parallel: int, what: str = "") -> Limiter:
        """Work against a source: ``workers`` at once (one per CPU, say) if the site allows
        no more (``max_parallel``), else from START (or ``workers``, if more) up to
        ``max_parallel``."""
        bound = max(workers, max_parallel)
        return cls(max(workers, START) if bound > workers else workers, bound, what)

    def __init__(self, start: int, bound: int, what: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bound = max(1, bound)
        self.state = Climb.start(start, self.bound)
        self.what = what
        self.clock = clock
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.changes: list[str] = []
        self._begin = clock()
        self._done = 0
        self._work = 0.0
        self._settle = 0  # completions to let pass before the next sample starts

    @property
    def limit(self) -> int:
        return self.state.limit

    def begin(self) -> None:
        """A request starts."""
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)

    def done(self, nbytes: int = 0) -> None:
        """A request completed, having moved ``nbytes``."""
        with self.lock:
            self.active -= 1
        self.completed(1, FILE_COST + nbytes)

    def completed(self, count: int, work: float) -> None:
        """``count`` requests completed, ``work`` between them (FILE_COST each and their
        bytes): one at a time from ``done``, or as reported by a helper process that does
        the requests itself (dsstage.transfer.native)."""
        why = ""
        with self.lock:
            if self._settle:  # the requests of the last limit still finishing, the new ones starting
                settled = min(self._settle, count)
                self._settle -= settled
                if not self._settle:
                    self._begin = self.clock()
                if settled == count:
                    return
                work *= (count - settled) / count
                count -= settled
            self._done += count
            self._work += work
            if self._done < max(MIN_SAMPLE, PER_SLOT * self.state.limit):
                return
            now = self.clock()
            elapsed = now - self._begin
            if elapsed < SAMPLE_SECONDS:
                return
            before = self.state.limit
            self.state, why = climb(self.state, self._work / elapsed, self.bound)
            self._begin, self._done, self._work = now, 0, 0.0
            if self.state.limit != before:
                self._settle = max(before, self.state.limit)
        if why:
            self.changes.append(why)
            log.debug("%s: %s", self.what or "requests", why)


def run(items: Sequence[T], fn: Callable[[T], R], gate: Limiter, *,
        size: Callable[[R], int] = lambda _r: 0, stop: threading.Event | None = None) -> list[R | None]:
    """``fn`` of every item, in order, on as many threads at once as ``gate`` allows (never
    more than ``gate.bound``); ``size(result)`` is the bytes an item moved. The first
    exception stops the rest and is raised; ``stop`` set stops handing out items (theirs
    stay None). One gate may serve several runs in turn, which then start where the last
    one left it."""
    results: list[R | None] = [None] * len(items)
    if not items:
        return results
    mutex = threading.Condition()
    nxt = 0
    workers = 0
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    def grow() -> None:
        """Start workers up to the gate's limit (called holding ``mutex``)."""
        nonlocal workers
        while workers < min(gate.limit, len(items) - nxt):
            workers += 1
            t = threading.Thread(target=worker, name=f"{gate.what or 'work'}-{len(threads)}", daemon=True)
            threads.append(t)
            t.start()

    def take() -> int | None:
        """The next item's index, or None: this worker leaves (the work is done or
        stopped, or the limit fell below the workers there are)."""
        nonlocal nxt, workers
        with mutex:
            if errors or (stop is not None and stop.is_set()) or nxt >= len(items) or workers > gate.limit:
                workers -= 1
                mutex.notify_all()
                return None
            nxt += 1
            return nxt - 1

    def worker() -> None:
        while (i := take()) is not None:
            gate.begin()
            try:
                results[i] = r = fn(items[i])
            except BaseException as exc:
                gate.done()
                with mutex:
                    errors.append(exc)
                continue  # take() sees the error and leaves
            before = gate.limit
            gate.done(size(r))
            if gate.limit > before:
                with mutex:
                    grow()

    with mutex:
        grow()
        while workers:
            mutex.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
