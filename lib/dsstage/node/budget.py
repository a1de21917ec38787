"""A source's budget of requests in flight, the cluster's (``sources.<name>.max_in_flight``).

Each stage that reads from a source with a budget, on any node, for any job or a prefetch,
takes *slots* of it before it starts and gives them back when it ends; the copier's
concurrency (or rsync's streams) is then the slots it got. So the source never sees more
requests in flight from dsstage than ``max_in_flight``, however many jobs stage at once.

Where. ``<state_dir>/budget/<source>/``: one grant per stage, ``<node>.<token>.json`` (its
slots and until when they are held), written by root or ``report.user``. Taking slots
reads the grants under a short lock (``.lock``, made with link(2): one holder, NFS
included; a lock older than ``LOCK_TTL`` is a dead taker's and is broken), adds up the
unexpired ones and writes a grant for what is free, at most what the stage wants. No slot
free: the stage waits, in steps of ``POLL``, until some are or its deadline passes
(OutOfTime: the dataset gets its ``on_failure``). A few round trips to the state directory
per stage, none per file.

Times (a grant's ``until``, the lock's age) are the state directory's clock (its offset from this
host's, measured by touching a probe ``budget/.clock.<host>`` at most every 5 minutes:
dsstage.fs.shared.server_clock), never compared across the nodes' own clocks.
A node that dies holding slots gives them back by itself: a grant holds until ``until``,
which a living stage moves on every ``TTL / 3`` seconds (a thread); a dead one's expires
within ``TTL``. A stage stalled longer than that (its thread stopped too) may find its slots
taken: it logs it and goes on with what it has (the one way past the budget; a stall of
``TTL`` on a node).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dsstage.config.model import Config, SourceBudget
from dsstage.errors import OutOfTime, StateError
from dsstage.fs import formats, jsontext, safe, shared, untrusted

log = logging.getLogger(__name__)

DIR = "budget"
TTL = 60.0  # seconds a grant holds without being renewed
LOCK_TTL = 10.0  # seconds after which a taker's lock is broken
POLL = 1.0  # seconds between two tries when no slot is free
LOCK = ".lock"


def free(grants: Mapping[str, Mapping[str, Any]], now: float, max_in_flight: int) -> int:
    """The slots no unexpired grant holds (pure); a grant that is not one holds nothing."""
    held = 0
    for g in grants.values():
        slots, until = g.get("slots"), g.get("until")
        if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 \
                and isinstance(until, (int, float)) and until > now:
            held += slots
    return max(0, max_in_flight - held)


@dataclass
class Grant:
    """Slots this stage holds of ``source``'s budget, in ``path``."""

    source: str
    slots: int
    path: str
    record: dict[str, Any]


def _where(state_dir: str, budget: SourceBudget) -> str:
    return os.path.join(state_dir, DIR, budget.name)


def _clock(where: str) -> Callable[[], float]:
    """The clock the grants in ``where`` (``budget/<source>``) are timed by: the state
    directory's (its probe in ``budget/``, which no taker lists), else this host's."""
    top = os.path.dirname(where)
    try:
        os.makedirs(top, mode=0o755, exist_ok=True)
    except OSError:
        pass  # the probe fails and says so; taking the slots meets the same error
    return shared.server_clock(top) or time.time


def _grants(where: str, now: float | None = None) -> dict[str, dict[str, Any]]:
    """The grants in ``where``; with ``now``, those expired more than ``TTL`` ago are removed
    (a stage killed without giving its slots back: they hold nothing, and would only make
    every taker read more)."""
    try:
        names = [n for n in os.listdir(where) if n.endswith(".json") and not n.startswith(".")]
    except FileNotFoundError:
        return {}
    out = {}
    for n in names:
        g = untrusted.read_json(os.path.join(where, n), 4096)
        until = g.get("until")
        if now is not None and isinstance(until, (int, float)) and until < now - TTL:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(where, n))
            continue
        out[n] = g
    return out


@contextmanager
def _locked(where: str, writers: tuple[int, ...], clock: Callable[[], float],
            deadline: float | None) -> Iterator[bool]:
    """Hold the takers' lock; yields False if it could not be had within ``LOCK_TTL`` (or by
    ``deadline``, time.monotonic()). The lock carries a nonce: only a lock that was read whole
    and is older than ``LOCK_TTL`` is broken, and only the holder's own is removed at the end."""
    until = time.monotonic() + LOCK_TTL
    if deadline is not None:
        until = min(until, deadline)
    nonce = secrets.token_hex(8)
    got = False
    while not got:
        # its time is when it is made: a lock had after a wait is as fresh as any
        data = jsontext.dumps({"time": clock(), "pid": os.getpid(), "nonce": nonce}).encode()
        got = shared.create_once(where, LOCK, data, writers)
        if got:
            break
        held = untrusted.read_json(os.path.join(where, LOCK), 4096)
        since = held.get("time")
        if isinstance(since, (int, float)) and clock() - since > LOCK_TTL:
            shared.remove(where, LOCK, writers)  # a dead taker's (read whole, and old)
            continue
        if time.monotonic() > until:
            break
        time.sleep(0.05)
    try:
        yield got
    finally:
        if got and untrusted.read_json(os.path.join(where, LOCK), 4096).get("nonce") == nonce:
            shared.remove(where, LOCK, writers)


def take(conf: Config, budget: SourceBudget, node: str, want: int, deadline: float | None, *,
         clock: Callable[[], float] | None = None, sleep: Callable[[float], None] = time.sleep) -> Grant:
    """Slots of ``budget`` for one stage on ``node``: at least one, at most ``want`` and what is
    free; waits (``POLL``) while none is. Raises OutOfTime when ``deadline`` (time.monotonic())
    passes first. The caller acts as the state directory's writer (report.user). Times in the
    grants are the state directory's clock (``clock``: another, for tests): the nodes' clocks
    may disagree."""
    where = _where(conf.state_dir, budget)
    clock = clock or _clock(where)
    writers = shared.writers(conf.report.user)
    token = f"{node}.{secrets.token_hex(6)}.json"
    path = os.path.join(where, token)
    waited = False
    while True:
        try:
            got = _try_take(where, writers, clock, deadline, budget, node, want, path)
        except OSError as exc:  # the state directory's, never this node's store: no drain
            raise StateError(f"sources.{budget.name}: the shared state directory {conf.state_dir} failed taking "
                             f"this stage's requests in flight ({exc.strerror or exc})") from None
        if got is not None:
            if waited:
                log.info("sources.%s: %d slot(s) free again", budget.name, got.slots)
            return got
        if deadline is not None and time.monotonic() + POLL > deadline:
            raise OutOfTime(f"sources.{budget.name} has no request in flight to spare (max_in_flight "
                            f"{budget.max_in_flight}, all taken by other stages) within the time budget")
        if not waited:
            log.info("sources.%s: all %d request(s) in flight are taken by other stages: waiting", budget.name,
                     budget.max_in_flight)
            waited = True
        sleep(POLL)


def _try_take(where: str, writers: tuple[int, ...], clock: Callable[[], float], deadline: float | None,
              budget: SourceBudget, node: str, want: int, path: str) -> Grant | None:
    """One try under the lock: a grant of what is free, or None. Counted again once written:
    where a broken lock let another taker in at the same time and the two went over the
    budget, this one withdraws (and tries again) rather than keep it."""
    os.makedirs(where, mode=0o755, exist_ok=True)
    with _locked(where, writers, clock, deadline) as locked:
        if not locked:
            return None
        now = clock()
        room = free(_grants(where, now), now, budget.max_in_flight)
        if room <= 0:
            return None
        slots = max(1, min(want, room))
        record = formats.stamp("budget-grant", {"node": node, "slots": slots, "until": now + TTL,
                                                "pid": os.getpid()})
        safe.write_json(path, record, fsync=False)
        if free(_grants(where), now, budget.max_in_flight + slots) < slots:  # over: someone came in too
            os.unlink(path)
            return None
        return Grant(budget.name, slots, path, record)


def renew(grant: Grant, clock: Callable[[], float] | None = None) -> bool:
    """Move the grant's ``until`` on (by the state directory's clock, as it was taken); False if
    it is gone or has expired (its slots may be another stage's now: a stall of ``TTL``), in
    which case it is not renewed."""
    clock = clock or _clock(os.path.dirname(grant.path))
    held = untrusted.read_json(grant.path, 4096)
    until = held.get("until")
    if not held or not isinstance(until, (int, float)) or until < clock():
        return False
    grant.record = {**grant.record, "until": clock() + TTL}
    safe.write_json(grant.path, grant.record, fsync=False)
    return True


def release(grant: Grant) -> None:
    try:
        os.unlink(grant.path)
    except FileNotFoundError:
        pass


@contextmanager
def held(conf: Config, budget: SourceBudget, node: str, want: int, deadline: float | None) -> Iterator[Grant]:
    """Slots of ``budget`` for the stage in the ``with`` block, renewed by a thread while it
    runs and given back when it ends, however it ends."""
    from dsstage.fs.identity import writing_as
    with writing_as(conf.report.user):
        grant = take(conf, budget, node, want, deadline)
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(TTL / 3):
            try:
                with writing_as(conf.report.user):
                    if not renew(grant):
                        log.warning("sources.%s: this stage's %d slot(s) expired after a stall and may be "
                                    "others' now; going on", grant.source, grant.slots)
                        return
            except Exception as exc:  # noqa: BLE001 - a renewal that fails is said; the stage goes on
                log.warning("sources.%s: cannot renew this stage's slots: %s", grant.source, exc)

    keeper = threading.Thread(target=keep, name="budget", daemon=True)
    try:
        keeper.start()
    except BaseException:
        release(grant)
        raise
    try:
        yield grant
    finally:
        stop.set()
        keeper.join(5)
        try:
            with writing_as(conf.report.user):
                release(grant)
        except OSError as exc:
            log.warning("sources.%s: cannot give this stage's slots back (they expire within %g s): %s",
                        grant.source, TTL, exc)
