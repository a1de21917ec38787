"""Bandwidth limits: ``Rate``, the one type every limit is given as (``transfer.bwlimit``,
which the configuration gives as rsync's KiB/s per stream, and the prefetch's lower
``prefetch.bwlimit``, bytes/s for the whole prefetch), and ``RateLimit``, a rate shared by the
threads of one copy: each thread waits for its share before it writes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    """A bandwidth limit: bytes per second for one whole transfer, all its streams and threads
    together (0: no limit)."""

    bytes_per_s: float = 0.0

    @classmethod
    def of_rsync(cls, kib_per_stream: int, streams: int) -> Rate:
        """The rate of rsync's ``--bwlimit`` (KiB/s, each of ``streams`` rsync processes)."""
        return cls(kib_per_stream * 1024 * max(1, streams))

    def __bool__(self) -> bool:
        return self.bytes_per_s > 0

    def rsync_kib(self, streams: int) -> int:
        """rsync's ``--bwlimit`` for each of ``streams`` processes (0: none; at least 1 KiB/s)."""
        return max(1, int(self.bytes_per_s // 1024 // max(1, streams))) if self else 0


class RateLimit:
    """At most ``rate`` over all threads."""

    def __init__(self, rate: Rate) -> None:
        self.rate = rate.bytes_per_s
        self.start = time.monotonic()
        self.done = 0
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            self.done += n
            ahead = self.done / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)
