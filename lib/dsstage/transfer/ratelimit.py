"""A bandwidth limit shared by the threads of one copy (``transfer.bwlimit``, the prefetch's
lower one): each thread waits for its share before it writes.
"""

from __future__ import annotations

import threading
import time


class RateLimit:
    """At most ``rate`` bytes per second over all threads (0: no limit)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
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
