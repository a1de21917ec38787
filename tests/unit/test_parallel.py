"""The adaptive limit on requests in flight (dsstage.transfer.parallel): the decision, the gate, the runner."""

from __future__ import annotations

import threading
import time

import pytest
from dsstage.transfer import parallel
from dsstage.transfer.parallel import GAIN, HOLD, KEEP, Climb, Limiter, climb


def test_a_probe_that_goes_faster_is_kept_and_the_next_follows_at_once():
    s = Climb.start(4, 64)
    s, why = climb(s, 100.0, 64)
    assert (s.limit, s.base) == (8, 4) and "trying 8" in why
    s, why = climb(s, 100.0 * GAIN * 1.01, 64)
    assert (s.limit, s.base) == (16, 8) and "as fast as 4: trying 16" in why


def test_a_probe_up_that_is_no_faster_goes_back_and_the_next_probe_goes_down():
    s, _ = climb(Climb.start(8, 64), 100.0, 64)
    s, why = climb(s, 105.0, 64)
    assert (s.limit, s.base) == (8, 8) and "no faster than 8" in why and "back to 8" in why
    s, why = climb(s, 100.0, 64)  # one sample at the known-good limit
    assert s.limit == 8 and why == ""
    s, why = climb(s, 100.0, 64)
    assert s.limit == 4 and "trying 4 in flight (from 8)" in why


def test_fewer_in_flight_as_fast_are_kept_and_slower_go_back_and_hold():
    s = Climb(limit=4, base=8, base_rate=100.0, down=True)
    s, why = climb(s, 100.0 * KEEP, 64)  # as fast with half: kept, and half again at once
    assert (s.limit, s.base) == (2, 4) and "as fast as 8" in why and "trying 2" in why
    s, why = climb(s, 100.0 * KEEP * 0.9, 64)
    assert (s.limit, s.base, s.hold) == (4, 4, HOLD) and "slower than 4" in why
    for _ in range(HOLD):
        s, why = climb(s, 95.0, 64)
        assert s.limit == 4 and why == ""
    s, why = climb(s, 95.0, 64)  # then up again: the source may have got faster
    assert s.limit == 8 and "trying 8" in why


@pytest.mark.parametrize("state, bound, down_after, probe", [
    (Climb(limit=1, base=1, base_rate=50.0, down=True), 64, False, 2),  # at 1: no way down, so up
    (Climb(limit=6, base=6, base_rate=50.0), 6, True, 3),  # at the bound: no way up, so down
], ids=["at one", "at the bound"])
def test_at_one_and_at_the_bound_the_closed_way_holds_and_the_other_is_tried(state, bound, down_after, probe):
    s, why = climb(state, 50.0, bound)
    assert (s.limit, s.hold, s.down) == (state.limit, HOLD, down_after) and why == ""
    for _ in range(HOLD):
        s, _ = climb(s, 50.0, bound)
    s, why = climb(s, 50.0, bound)
    assert s.limit == probe and f"trying {probe}" in why


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
    assert lim.state.base == 16 and peak == 16 and lim.peak == 16
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
    assert lim.limit <= 4 and lim.state.base <= 2
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


def test_threads_leave_when_the_limit_falls_and_start_when_it_rises(monkeypatch):
    """No thread waits for a turn: when the limit falls the extra threads leave, when it
    rises new ones start; what runs at once follows the limit."""
    monkeypatch.setattr(parallel, "SAMPLE_SECONDS", 0)
    plan = iter([1, 1, 1, 1, 4])  # the first sample drops the limit to 1, the fifth raises it to 4

    def forced(state, rate, bound):
        to = next(plan, state.limit)
        return (state, "") if to == state.limit else (Climb(limit=to, base=to, base_rate=rate), f"to {to}")
    monkeypatch.setattr(parallel, "climb", forced)
    lim = Limiter(8, 8, "test")
    lock = threading.Lock()
    now = 0
    seen: list[tuple[int, int, set[str]]] = []  # (index, in flight, threads alive of this run)

    def request(i: int) -> int:
        nonlocal now
        with lock:
            now += 1
            seen.append((i, now, {t.name for t in threading.enumerate() if t.name.startswith("test-")}))
        time.sleep(0.002)
        with lock:
            now -= 1
        return i

    assert parallel.run(list(range(200)), request, lim) == list(range(200))
    assert lim.changes == ["to 1", "to 4"]
    # after the drop (the first sample: 32 completions) and its stragglers, one at a time
    # until the rise (four samples of 16 later)
    one = [(n, len(alive)) for i, n, alive in seen[48:90]]
    assert all(n == 1 for n, _ in one) and min(alive for _, alive in one) == 1
    # after the rise (the next sample: 16 completions at 1), four at once on four threads
    assert max(n for _i, n, _a in seen[-40:]) == 4
    assert max(len(alive) for _i, _n, alive in seen[-40:]) <= 4


def test_work_against_a_source_starts_at_start_where_the_site_allows_more_than_the_workers():
    got = {args: (g.limit, g.bound) for args in [(2, 0), (2, 64), (2, 3), (16, 64), (4, 4)]
           for g in [Limiter.for_source(*args)]}
    assert got == {(2, 0): (2, 2), (2, 64): (parallel.START, 64), (2, 3): (3, 3), (16, 64): (16, 64), (4, 4): (4, 4)}


def test_completions_reported_in_batches_move_the_limit_as_completions_one_by_one_do():
    """A helper process reports its completions in batches (dsstage.transfer.native): fed
    to the limiter with ``completed``, they move the limit as the same completions passed
    one at a time through ``done`` do: up to the bound where the rate grows with the
    requests in flight, and back down where it does not."""
    def drive(batched: bool, scales: bool) -> list[int]:
        clock = [0.0]
        lim = Limiter(4, 32, clock=lambda: clock[0])
        limits = []
        for _ in range(100):
            n = 8 * lim.limit if scales else 64  # completions per 0.1 s
            if batched:
                clock[0] += 0.1
                lim.completed(n, n * (parallel.FILE_COST + 1000))
            else:
                for _ in range(n):
                    clock[0] += 0.1 / n
                    lim.begin()
                    lim.done(1000)
            limits.append(lim.limit)
        return limits

    for batched in (False, True):
        climbing, flat = drive(batched, scales=True), drive(batched, scales=False)
        assert 32 in climbing[:10] and climbing[-1] == 32, climbing
        assert min(flat) == 1 and max(flat[-20:]) <= 4, flat
