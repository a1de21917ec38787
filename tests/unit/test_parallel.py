"""The adaptive limit on requests in flight (dsstage.parallel): the decision, the gate, the runner."""

from __future__ import annotations

import threading
import time

import pytest
from dsstage import parallel
from dsstage.parallel import GAIN, HOLD, Climb, Limiter, climb


def test_a_probe_that_goes_faster_is_kept_and_the_next_follows_at_once():
    s = Climb.start(4, 64)
    s, why = climb(s, 100.0, 64)
    assert (s.limit, s.base) == (8, 4) and "trying 8" in why
    s, why = climb(s, 100.0 * GAIN * 1.01, 64)
    assert (s.limit, s.base) == (16, 8) and "as fast as 4: trying 16" in why


def test_a_probe_that_is_no_faster_goes_back_and_waits_before_the_next():
    s, _ = climb(Climb.start(4, 64), 100.0, 64)
    s, why = climb(s, 105.0, 64)
    assert (s.limit, s.base, s.hold) == (4, 4, HOLD) and "no faster than 4" in why and "back to 4" in why
    for _ in range(HOLD):
        s, why = climb(s, 100.0, 64)
        assert s.limit == 4 and why == ""
    s, why = climb(s, 100.0, 64)
    assert s.limit == 8 and "trying 8" in why


def test_the_bound_is_never_passed():
    s = Climb.start(100, 6)
    assert s.limit == 6
    s, why = climb(Climb.start(4, 6), 10.0, 6)
    assert s.limit == 6
    s, why = climb(s, 100.0, 6)
    assert (s.limit, s.base) == (6, 6) and "bound 6" in why
    for _ in range(3):
        s, why = climb(s, 1000.0, 6)
        assert s.limit == 6 and why == ""


def test_the_limiter_climbs_on_a_source_whose_requests_wait_and_never_passes_the_bound():
    """Requests that each wait 20 ms (a round trip): more in flight go faster, so the
    limit climbs from 2 to the bound of 16, and no more than 16 ever run at once."""
    lim = Limiter(2, 16, "test")
    now = peak = 0
    lock = threading.Lock()

    def request(_i: int) -> int:
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
        time.sleep(0.02)
        with lock:
            now -= 1
        return 1000

    out = parallel.run(list(range(600)), request, lim, size=lambda n: n)
    assert out == [1000] * 600
    assert lim.limit == 16 and peak == 16 and lim.peak == 16
    assert any("trying 16" in c for c in lim.changes)


def test_the_limiter_stays_low_where_more_in_flight_is_no_faster():
    """Requests served one at a time (a disk that serializes them): more in flight is
    no faster, so every probe goes back."""
    lim = Limiter(2, 32, "test")
    serial = threading.Lock()

    def request(_i: int) -> int:
        with serial:
            time.sleep(0.001)
        return 0

    parallel.run(list(range(800)), request, lim)
    assert lim.limit <= 4
    assert any("no faster" in c for c in lim.changes)


def test_run_keeps_order_stops_on_the_first_failure_and_on_request():
    assert parallel.run(list(range(50)), lambda i: i * 2, Limiter(2, 8)) == [i * 2 for i in range(50)]
    assert parallel.run([], lambda i: i, Limiter(2, 8)) == []

    def boom(i: int) -> int:
        if i == 7:
            raise ValueError("file 7")
        return i
    with pytest.raises(ValueError, match="file 7"):
        parallel.run(list(range(1000)), boom, Limiter(4, 4))
    stop = threading.Event()
    seen = []

    def stopping(i: int) -> int:
        seen.append(i)
        if i == 3:
            stop.set()
        return i
    out = parallel.run(list(range(1000)), stopping, Limiter(1, 1), stop=stop)
    assert seen == [0, 1, 2, 3] and out[4:] == [None] * 996
