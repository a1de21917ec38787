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

A node that dies holding slots gives them back by itself: a grant holds until ``until``,
which a living stage moves on every ``TTL / 3`` seconds (a thread); a dead one's expires
within ``TTL``. A stage stalled longer than that (its thread stopped too) may find its slots
taken: it logs it and goes on with what it has (the one way past the budget; a stall of
``TTL`` on a node).
"""

from __future__ import annotations

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
from dsstage.errors import OutOfTime
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


def _grants(where: str) -> dict[str, dict[str, Any]]:
    try:
        names = [n for n in os.listdir(where) if n.endswith(".json") and not n.startswith(".")]
    except FileNotFoundError:
        return {}
    return {n: untrusted.read_json(os.path.join(where, n), 4096) for n in names}


@contextmanager
def _locked(where: str, writers: tuple[int, ...], clock: Callable[[], float]) -> Iterator[bool]:
    """Hold the takers' lock; yields False if it could not be had within ``LOCK_TTL``."""
    deadline = time.monotonic() + LOCK_TTL
    data = jsontext.dumps({"time": clock(), "pid": os.getpid()}).encode()
    got = False
    while not got:
        got = shared.create_once(where, LOCK, data, writers)
        if got:
            break
        held = untrusted.read_json(os.path.join(where, LOCK), 4096)
        since = held.get("time")
        if not isinstance(since, (int, float)) or clock() - since > LOCK_TTL:
            shared.remove(where, LOCK, writers)  # a dead taker's
            continue
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    try:
        yield got
    finally:
        if got:
            shared.remove(where, LOCK, writers)


def take(conf: Config, budget: SourceBudget, node: str, want: int, deadline: float | None, *,
         clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> Grant:
    """Slots of ``budget`` for one stage on ``node``: at least one, at most ``want`` and what is
    free; waits (``POLL``) while none is. Raises OutOfTime when ``deadline`` (time.monotonic())
    passes first. The caller acts as the state directory's writer (report.user)."""
    where = _where(conf.state_dir, budget)
    writers = shared.writers(conf.report.user)
    token = f"{node}.{secrets.token_hex(6)}.json"
    waited = False
    while True:
        os.makedirs(where, mode=0o755, exist_ok=True)
        with _locked(where, writers, clock) as locked:
            if locked:
                now = clock()
                room = free(_grants(where), now, budget.max_in_flight)
                if room > 0:
                    slots = max(1, min(want, room))
                    record = formats.stamp("budget-grant", {"node": node, "slots": slots, "until": now + TTL,
                                                            "pid": os.getpid()})
                    safe.write_json(os.path.join(where, token), record, fsync=False)
                    if waited:
                        log.info("sources.%s: %d slot(s) free again", budget.name, slots)
                    return Grant(budget.name, slots, os.path.join(where, token), record)
        if deadline is not None and time.monotonic() + POLL > deadline:
            raise OutOfTime(f"sources.{budget.name} has no request in flight to spare (max_in_flight "
                            f"{budget.max_in_flight}, all taken by other stages) within the time budget")
        if not waited:
            log.info("sources.%s: all %d request(s) in flight are taken by other stages: waiting", budget.name,
                     budget.max_in_flight)
            waited = True
        sleep(POLL)


def renew(grant: Grant, clock: Callable[[], float] = time.time) -> bool:
    """Move the grant's ``until`` on; False if it is gone (taken over after a stall)."""
    if not os.path.exists(grant.path):
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
                        log.warning("sources.%s: this stage's %d slot(s) were taken over after a stall; going on",
                                    grant.source, grant.slots)
                        return
            except OSError as exc:
                log.warning("sources.%s: cannot renew this stage's slots: %s", grant.source, exc)

    keeper = threading.Thread(target=keep, name="budget", daemon=True)
    keeper.start()
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
