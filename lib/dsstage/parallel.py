"""Requests in flight against a source: as many as it sustains, never more than the site allows.

On a network filesystem every open, stat and directory listing is a round trip, and one
thread waiting for each in turn is slow however fast the network is; many requests in
flight hide the round trips. How many pay off depends on the source (a local disk is
fastest with a few, NFS or Lustre with dozens) and a site may need to protect a shared
filesystem from too many. So the work runs on up to ``bound`` threads
(``transfer.max_parallel``), of which a gate lets ``limit`` work at once; the limit starts
small and climbs while more in flight measurably goes faster:

- after every sample (enough completions to mean something, at least 4 per request in
  flight), a probe doubles the limit;
- a probe that is at least GAIN faster is kept, and the next probe follows at once;
- one that is not goes back to the limit it came from, and the next probe waits HOLD
  samples (the source may get faster, or busier, later).

The decision is ``climb``, a pure function that also says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

log = logging.getLogger(__name__)

#: a probe must be this much faster than the limit it came from to be kept
GAIN = 1.15
#: samples to wait after a failed probe before probing again
HOLD = 8
#: completions in a sample, per request in flight (and at least MIN_SAMPLE)
PER_SLOT = 4
MIN_SAMPLE = 16
#: a file counts as this many bytes of work besides its own bytes (its round trips)
FILE_COST = 256 * 1024

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Climb:
    """Where the limit stands: ``limit`` in flight now; ``base`` the limit known good and
    ``base_rate`` its measured rate (work per second); ``hold`` samples before the next
    probe."""

    limit: int
    base: int
    base_rate: float = 0.0
    hold: int = 0

    @classmethod
    def start(cls, limit: int, bound: int) -> Climb:
        limit = max(1, min(limit, bound))
        return cls(limit=limit, base=limit)


def climb(state: Climb, rate: float, bound: int) -> tuple[Climb, str]:
    """The next state after a sample measured ``rate`` at ``state.limit``, and why."""
    if state.limit > state.base:  # a probe
        if rate >= state.base_rate * GAIN:
            kept = Climb(limit=state.limit, base=state.limit, base_rate=rate)
            if kept.limit < bound:
                return (replace(kept, limit=min(bound, kept.limit * 2)),
                        f"{state.limit} in flight went {rate / max(state.base_rate, 1e-9):.2f}x as fast as "
                        f"{state.base}: trying {min(bound, kept.limit * 2)}")
            return kept, f"{state.limit} in flight went faster than {state.base}: staying at the bound {bound}"
        return (Climb(limit=state.base, base=state.base, base_rate=state.base_rate, hold=HOLD),
                f"{state.limit} in flight were no faster than {state.base} "
                f"({rate / max(state.base_rate, 1e-9):.2f}x): back to {state.base}")
    # at the known-good limit: refresh its rate (the source's speed changes), probe if due
    base_rate = rate if state.base_rate == 0 else (state.base_rate + rate) / 2
    if state.hold > 0 or state.limit >= bound:
        return replace(state, base_rate=base_rate, hold=max(0, state.hold - 1)), ""
    up = min(bound, state.limit * 2)
    return replace(state, limit=up, base_rate=base_rate), f"trying {up} in flight (from {state.limit})"


class Limiter:
    """A gate for at most ``limit`` requests at once, the limit adjusted by ``climb`` from
    what completes."""

    def __init__(self, start: int, bound: int, what: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bound = max(1, bound)
        self.state = Climb.start(start, self.bound)
        self.what = what
        self.clock = clock
        self.cond = threading.Condition()
        self.active = 0
        self.peak = 0
        self.changes: list[str] = []
        self._begin = clock()
        self._done = 0
        self._work = 0.0

    @property
    def limit(self) -> int:
        return self.state.limit

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self.cond:
            while self.active >= self.state.limit:
                self.cond.wait()
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            yield
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify()

    def done(self, nbytes: int = 0) -> None:
        """One request completed, having moved ``nbytes``."""
        with self.cond:
            self._done += 1
            self._work += FILE_COST + nbytes
            if self._done < max(MIN_SAMPLE, PER_SLOT * self.state.limit):
                return
            now = self.clock()
            elapsed = now - self._begin
            if elapsed <= 0:
                return
            self.state, why = climb(self.state, self._work / elapsed, self.bound)
            self._begin, self._done, self._work = now, 0, 0.0
            if why:
                self.changes.append(why)
                log.debug("%s: %s", self.what or "requests", why)
            self.cond.notify_all()


def run(items: Sequence[T], fn: Callable[[T], R], gate: Limiter, *,
        size: Callable[[R], int] = lambda _r: 0, stop: threading.Event | None = None) -> list[R | None]:
    """``fn`` of every item, in order, on up to ``gate.bound`` threads, as many at once as
    ``gate`` lets through; ``size(result)`` is the bytes an item moved. The first exception
    stops the rest and is raised; ``stop`` set stops handing out items (theirs stay None).
    One gate may serve several runs in turn, which then start where the last one left it."""
    results: list[R | None] = [None] * len(items)
    if not items:
        return results
    nxt = iter(range(len(items)))
    take = threading.Lock()
    failed = threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        while not failed.is_set() and not (stop is not None and stop.is_set()):
            with take:
                i = next(nxt, None)
            if i is None:
                return
            try:
                with gate.slot():
                    results[i] = r = fn(items[i])
                gate.done(size(r))
            except BaseException as exc:
                errors.append(exc)
                failed.set()
                with gate.cond:
                    gate.cond.notify_all()
                return

    n = min(gate.bound, len(items))
    if n == 1:
        worker()
    else:
        threads = [threading.Thread(target=worker, name=f"{gate.what or 'work'}-{k}", daemon=True) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return results
