"""A source's budget of requests in flight, the cluster's (``sources.<name>.max_in_flight``).

Each stage that reads from a source with a budget, on any node, for any job or a prefetch,
takes *slots* of it before it starts and gives them back when it ends; the copier's
concurrency (or rsync's streams) is then the slots it got. So the source never sees more
requests in flight from dsstage than ``max_in_flight``, however many jobs stage at once.

Where. ``<state_dir>/budget/<source>/``: one grant per stage,
``@<slots>.<until>.<node>.<token>.json``, written by root or ``report.user``: its name says
how many slots it holds and until when (whole seconds), so a listing of the directory alone
adds them up; its content says the same for takers before 0.3.0, which open every grant (a
grant of theirs, ``<node>.<token>.json``, is opened and read here). Taking slots lists the
grants, and where some are free takes a short lock (``.lock``, made with link(2): one
holder, NFS included; while another holds it, only its attributes are looked at; a lock
whose modification time and the time its taker wrote in it are both older than
``LOCK_TTL``, confirmed by an open, is a dead taker's and is broken), lists
them again under it and writes a grant for what is free, at most what the stage wants. No
slot free: the stage waits, in steps of ``POLL`` (a listing each), until some are or its
deadline passes (OutOfTime: the dataset gets its ``on_failure``). A few round trips to the
state directory per stage, none per file.

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
import math
import os
import re
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
OVERLAP = 1.0  # seconds a renewed grant shows under both its names
LOCK = ".lock"
#: a grant's file name from 0.3.0 on: ``@<slots>.<until>.<node>.<token>.json``
GRANT_NAME = re.compile(r"@([0-9]{1,6})\.([0-9]{1,12})\.")


def grant_name(slots: int, until: float, node: str, token: str) -> str:
    """The file name of a grant of ``slots`` held until ``until`` (whole seconds, rounded up)."""
    return f"@{slots}.{math.ceil(until)}.{node}.{token}.json"


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
    node: str  # the name's parts a renewal keeps
    token: str


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
    """The grants in ``where``, by their names (one listing; a grant written before 0.3.0 is
    opened); with ``now``, those expired more than ``TTL`` ago are removed (a stage killed
    without giving its slots back: they hold nothing, and would only make every taker read
    more)."""
    try:
        names = [n for n in os.listdir(where) if n.endswith(".json") and not n.startswith(".")]
    except FileNotFoundError:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        named = GRANT_NAME.match(n)
        g = {"slots": int(named.group(1)), "until": float(named.group(2))} if named \
            else untrusted.read_json(os.path.join(where, n), 4096)
        until = g.get("until")
        if now is not None and isinstance(until, (int, float)) and until < now - TTL:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(where, n))
            continue
        # a grant being renewed shows a moment under its old and its new name: counted once
        key = "@" + n[named.end():] if named else n
        if key not in out or float(out[key].get("until") or 0) < float(g.get("until") or 0):
            out[key] = g
    return out


@contextmanager
def _locked(where: str, writers: tuple[int, ...], clock: Callable[[], float],
            deadline: float | None) -> Iterator[bool]:
    """Hold the takers' lock; yields False if it could not be had within ``LOCK_TTL`` (or by
    ``deadline``, time.monotonic()). While another holds it, only the lock's attributes are
    looked at (one request a try, not the dozen of making one); a lock whose modification
    time (the state directory's clock, as ``clock``) is older than ``LOCK_TTL`` is a dead
    taker's and is broken once ``_dead`` confirms it. The lock carries a nonce: only the
    holder's own is removed at the end."""
    until = time.monotonic() + LOCK_TTL
    if deadline is not None:
        until = min(until, deadline)
    nonce = secrets.token_hex(8)
    path = os.path.join(where, LOCK)
    got = False
    while not got:
        try:
            since: float | None = os.stat(path, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            since = None
        if since is None:
            # its time is when it is made: a lock had after a wait is as fresh as any
            data = jsontext.dumps({"time": clock(), "pid": os.getpid(), "nonce": nonce}).encode()
            got = shared.create_once(where, LOCK, data, writers)
            if got:
                break
        elif clock() - since > LOCK_TTL and _dead(path, clock):
            shared.remove(where, LOCK, writers)  # a dead taker's
            continue
        if time.monotonic() > until:
            break
        time.sleep(0.05)
    try:
        yield got
    finally:
        if got and untrusted.read_json(os.path.join(where, LOCK), 4096).get("nonce") == nonce:
            shared.remove(where, LOCK, writers)


def _dead(path: str, clock: Callable[[], float]) -> bool:
    """The lock ``stat`` found old is old indeed: read whole by an open (which asks the server
    again where attributes or a name may be cached), its modification time and the time its
    taker wrote in it (by a taker's clock, the only one there is where the server's cannot be
    measured) both older than ``LOCK_TTL``."""
    held, mtime = untrusted.read_json_dated(path, 4096)
    written = held.get("time")
    now = clock()
    return mtime is not None and now - mtime > LOCK_TTL \
        and isinstance(written, (int, float)) and now - written > LOCK_TTL


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
    token = secrets.token_hex(6)
    waited = False
    while True:
        try:
            got = _try_take(where, writers, clock, deadline, budget, node, want, token)
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
              budget: SourceBudget, node: str, want: int, token: str) -> Grant | None:
    """One try: a listing, and where some slots are free, under the lock, a grant of what is
    free, or None. Counted again once written: where a broken lock let another taker in at
    the same time and the two went over the budget, this one withdraws (and tries again)
    rather than keep it."""
    if free(_grants(where), clock(), budget.max_in_flight) <= 0:
        return None  # all held: no lock taken, nothing written
    os.makedirs(where, mode=0o755, exist_ok=True)
    with _locked(where, writers, clock, deadline) as locked:
        if not locked:
            return None
        now = clock()
        room = free(_grants(where, now), now, budget.max_in_flight)
        if room <= 0:
            return None
        slots = max(1, min(want, room))
        until = float(math.ceil(now + TTL))
        record = formats.stamp("budget-grant", {"node": node, "slots": slots, "until": until, "pid": os.getpid()})
        path = os.path.join(where, grant_name(slots, until, node, token))
        safe.write_json(path, record, fsync=False)
        if free(_grants(where), now, budget.max_in_flight + slots) < slots:  # over: someone came in too
            os.unlink(path)
            return None
        return Grant(budget.name, slots, path, record, node, token)


def renew(grant: Grant, clock: Callable[[], float] | None = None,
          sleep: Callable[[float], None] = time.sleep) -> bool:
    """Move the grant's ``until`` on (by the state directory's clock, as it was taken): the grant
    written whole under its new name, and its old name removed ``OVERLAP`` seconds later (a
    taker that listed the old name and opens it meanwhile still finds it; takers from 0.3.0
    count the two names once, older ones count both for that moment: never less than is held).
    False if it is gone or has expired (its slots may be another stage's now: a stall of
    ``TTL``), in which case it is not renewed."""
    where = os.path.dirname(grant.path)
    clock = clock or _clock(where)
    now = clock()
    until = grant.record.get("until")
    if not isinstance(until, (int, float)) or until < now or not os.path.lexists(grant.path):
        return False  # expired by its own time, or removed by a taker that found it expired
    new_until = float(math.ceil(now + TTL))
    renewed = os.path.join(where, grant_name(grant.slots, new_until, grant.node, grant.token))
    record = {**grant.record, "until": new_until}
    safe.write_json(renewed, record, fsync=False)
    old, grant.path, grant.record = grant.path, renewed, record
    if old != renewed:
        sleep(OVERLAP)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old)
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
