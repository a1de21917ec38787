"""Retention applied on this node: the planner (dsstage.policy.retention) run over a tier's copies
with the queue's demand, and its decisions carried out: evict unleased copies (``retain``, what
the Epilog does; ``evict``, what an admin asks), and make room for a stage (``make_room``),
never a copy in use.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dsstage.config.model import Tier
from dsstage.errors import DsstageError, LockTimeout, NoSpace
from dsstage.fs import layout as fs_layout
from dsstage.fs import safe
from dsstage.fs.layout import Layout, version_id
from dsstage.fs.safe import RootDir
from dsstage.node import background, jobrecord, live, publish, space
from dsstage.node.lease import LeaseBook
from dsstage.node.store import PREEMPT_WAIT, Eviction, Store, _human, _lock, local_errors, open_tier
from dsstage.policy import retention
from dsstage.shards import views

if TYPE_CHECKING:  # the staging machinery is imported only when a stage needs it
    pass


log = logging.getLogger(__name__)


def copies(store: Store, tier: RootDir, tier_conf: Tier, released: str = "") -> list[retention.Copy]:
    """This tier's copies as the retention planner sees them. Last use: the last lease
    taken or released on the dataset (the mtime of its leases directory), or when it
    was staged. A copy whose current version cannot be read counts as current. ``released``:
    a job whose leases count as given back (what its Epilog would see, for a dry run)."""
    book = LeaseBook(tier)
    out = []
    for name in tier.names("datasets"):
        current = store.current_copies(name)
        leases = book.of_dataset(name)
        lfd = tier.has_dir("leases", name)
        touched = os.fstat(lfd).st_mtime if lfd is not None else 0.0
        rfd = tier.has_dir("ready", name)
        for version in tier.names("datasets", name):
            mark = safe.read_json_at(rfd, fs_layout.mark_name(version))
            linked = mark.get("linked")
            out.append(retention.Copy(
                dataset=name, version=version, bytes=space.as_bytes(mark.get("bytes")), tier=tier_conf.name,
                last_used=max(touched, space.as_float(mark.get("staged_at"))),
                leases=tuple(sorted(x.job_id for x in leases
                                    if x.covers(version) and x.job_id != (released or None))),
                current=current is None or version in current,
                ready=bool(mark) and not mark.get("bad"),
                shared={str(v): space.as_bytes(b) for v, b in linked.items()} if isinstance(linked, dict) else {}))
    return out


def with_shard_demand(store: Store, cs: list[retention.Copy], dem: retention.Demand) -> list[retention.Copy]:
    """``cs`` with each sharded dataset's copies marked with the pending jobs whose plan
    gives this node other shards (``Copy.not_for``, from shards_not_for)."""
    out = list(cs)
    for name in {c.dataset for c in cs}:
        not_for = shards_not_for(store, name, dem)
        if not_for:
            out = [replace(c, not_for=not_for.get(c.version, frozenset())) if c.dataset == name else c for c in out]
    return out


#: the pending jobs per sharded dataset whose plans are worked out for retention, soonest
#: first (each reads its nodes' published reports); the demand of the others counts for
#: every shard, which keeps more, never less
PLANNED_JOBS = 8


def shards_not_for(store: Store, name: str, dem: retention.Demand) -> dict[str, frozenset[str]]:
    """shard id -> the pending jobs planned on this node (and others) whose plan would give
    this node other shards of ``name`` (dsstage.node.jobrecord.plan, as the job's first node will
    make it from what the nodes hold now); {} for a dataset that is not sharded."""
    ds = store.config.datasets.get(name)
    if ds is None or not ds.shards or dem.stale:
        return {}
    planned = sorted((w for w in dem.wants.get(name, ()) if w.state == "pending" and store.node in w.nodes
                      and len(w.nodes) > 1), key=lambda w: (w.start is None, w.start or 0.0))[:PLANNED_JOBS]
    if not planned:
        return {}
    try:
        ids = [fs_layout.version_id(d) for d in store.shard_digests(name, store.current(name))]
    except (DsstageError, OSError):
        return {}
    out: dict[str, set[str]] = {}
    plans = jobrecord.plans(store.config.state_dir, name, ids, [list(w.nodes) for w in planned])
    for w, plan in zip(planned, plans):
        mine = set(plan.get(store.node) or ids)
        for shard in ids:
            if shard not in mine:
                out.setdefault(shard, set()).add(w.job_id)
    return {shard: frozenset(jobs) for shard, jobs in out.items()}


def space_of(store: Store, tier: RootDir, tier_conf: Tier, need: int = 0,
             use: space.Usage | None = None) -> retention.Space:
    """The tier's space for the planner: its capacity, or what its filesystem can hold if
    that is less (the filesystem may hold other data)."""
    use = use or space.usage(tier)
    cap, free = space.capacity_of(tier_conf.capacity, tier.fd)
    return retention.Space(capacity=min(cap, use.copies + free), high=tier_conf.high_watermark,
                           low=tier_conf.low_watermark, reserved=use.reserved, need=need)


def policy(store: Store) -> retention.Policy:
    r = store.config.retention
    return retention.Policy(min_keep=r.min_keep, max_idle=r.max_idle)


def plan(store: Store, tier: RootDir, tier_conf: Tier, dem: retention.Demand, *, space: retention.Space | None = None,
         asked: retention.Asked = retention.Asked(), released: str = "",
         have: list[retention.Copy] | None = None) -> retention.Plan:
    """The planner on this tier, doing what the caller ``asked`` (retention.Asked); ``space``
    and ``have`` (its copies, as copies() gives them with the same ``released``): the
    tier's, if the caller has them already. Which
    pending jobs a shard copy is for (reading the published reports of their nodes) is worked
    out only where it can matter: over the high watermark, or for a stage that needs room."""
    sp = space or space_of(store, tier, tier_conf)
    cs = copies(store, tier, tier_conf, released) if have is None else have
    if sp.over(retention.used(cs) + sp.reserved):
        cs = with_shard_demand(store, cs, dem)
    return retention.plan(cs, dem, sp,
                          store.clock(),
                          policy=policy(store), node=store.node, asked=asked)


def retain(store: Store, dem: retention.Demand | None = None, *, evict: tuple[str, ...] = (), force: bool = False,
           dry_run: bool = False, wait: float = 0.0, held: str = "", released: str = "") -> list[Eviction]:
    """Plan every tier of this node and carry the plan out (what the Epilog does).

    ``evict``: only these datasets, as an admin asked (``dsstage evict``), with their
    interrupted staging areas. A copy whose dataset lock is busy (a stage or a verify
    in progress) is kept for now; ``wait`` is how long to try for each lock; ``held``
    is a dataset whose lock the caller holds; ``released``: a job whose leases count as given
    back (only with ``dry_run``: what that job's Epilog would do)."""
    if released and not dry_run:
        raise ValueError("released is for a dry run")
    if dem is None:
        dem = store.demand()[0]
    out: list[Eviction] = []
    for tier_conf in store.config.tiers.values():
        layout = store.layout(tier_conf)
        with open_tier(layout) as tier, local_errors(f"applying retention in {layout.root}"):
            p = plan(store, tier, tier_conf, dem, asked=retention.Asked(evict=evict, force=force), released=released)
            decisions = [d for d in p.decisions if not evict or d.copy.dataset in evict]
            out += _apply(store, tier, layout, decisions, dry_run=dry_run, wait=wait, held=held)
            if evict and not dry_run:
                out += _remove_left_staging(store, tier, layout, tier_conf, evict, wait, held)
            if not dry_run:
                _prune_views(tier, layout, held)
                for name, vid in live.tidy(tier, LeaseBook(tier)):
                    log.info("dropped the live view of %s version %s: no job holds it and it was never whole", name,
                             vid)
                _purge_if_left(store, tier, layout)
    return out


def _prune_views(tier: RootDir, layout: Layout, held: str) -> None:
    """Drop the sharded datasets' views no job uses, but the newest (dsstage.shards.views), each
    dataset's under its lock (a Prolog makes and finds views holding it); a busy lock: later."""
    book = LeaseBook(tier)

    def leased(name: str) -> set[str]:
        return {views.view_id([version_id(d) for d in x.shards]) for x in book.of_dataset(name) if x.shards}
    for name in tier.names(views.TOP):
        try:
            with _lock(layout, name, 0.0, held):
                for vid in views.unused(tier, name, leased(name)):
                    # the warm path leases, then finds the view without this lock: retire
                    # hides the view before it reads the leases again
                    views.retire(tier, name, vid, lambda name=name: leased(name))  # type: ignore[misc]
        except LockTimeout:
            continue


def _apply(store: Store, tier: RootDir, layout: Layout, decisions: list[retention.Decision], *, dry_run: bool,
           wait: float, purge: bool = True, held: str = "") -> list[Eviction]:
    out: list[Eviction] = []
    book = LeaseBook(tier)
    for d in decisions:
        c = d.copy
        if not d.evict or dry_run:
            out.append(Eviction(c.dataset, c.version, "would evict" if d.evict else "kept", d.reason,
                                c.bytes, c.tier))
            continue
        try:
            with _lock(layout, c.dataset, wait, held):
                # under the tier's space lock: while its mark is away the copy must still
                # count (in the trash record, or by its mark put back)
                with space.tier_lock(tier):  # type: ignore[attr-defined]
                    if c.version in tier.names("datasets", c.dataset):  # else evicted since the plan
                        out.append(_evict_version(store, tier, book, c, d.reason, d.rule))
        except LockTimeout:
            out.append(Eviction(c.dataset, c.version, "kept", "busy: a stage or verify holds its lock; "
                                f"planned: {d.reason}", c.bytes, c.tier))
    if purge and any(e.action == "evicted" for e in out):
        background.purge_later(layout)
    return out


def _evict_version(store: Store, tier: RootDir, book: LeaseBook, c: retention.Copy, reason: str,
                   rule: str = "") -> Eviction:
    """Evict one copy, following the protocol in the module doc: under the dataset lock
    the ready mark goes first, then the leases are read; a copy with a lease gets its
    mark back and stays. The copy is renamed into the tier's trash (instant, whatever
    its size) and deleted by a detached process."""
    name, version = c.dataset, c.version
    mark = publish.unmark(tier, name, version)
    size = space.as_bytes(mark.get("bytes"))
    holders = sorted(x.job_id for x in book.of_dataset(name) if x.covers(version))
    if holders:
        if mark:
            safe.write_json_at(tier.dir("ready", name), fs_layout.mark_name(version), mark)
        return Eviction(name, version, "kept", retention.leased(holders), size, c.tier)
    entry = f"{name}.{version}.{time.time_ns()}"
    space.hold(tier, space.trash_record(entry), size, f"evicted {name} {version}")
    tier.forget("datasets", name, version)
    try:
        os.rename(version, entry, src_dir_fd=tier.dir("datasets", name), dst_dir_fd=tier.dir("trash"))
    except BaseException:
        space.forget(tier, space.trash_record(entry))
        raise
    views.drop_containing(tier, name, version)  # their links would keep the copy's blocks
    live.drop(tier, name, version)  # a live view's too (no job holds it: the copy has no lease)
    labels = {"dataset": name, "reason": rule or "other"}
    store.count([("evictions", labels, 1), ("evicted_bytes", labels, size)])
    return Eviction(name, version, "evicted", reason, size, c.tier)


def discard_staging(store: Store, name: str) -> list[str]:
    """Remove the staging areas of ``name`` (an abandoned prefetch's), if its lock is
    free now; what was removed."""
    ds = store.dataset(name)
    layout = store.layout(ds.tier)
    try:
        with _lock(layout, name, 0.0, ""), open_tier(layout) as tier, \
                local_errors(f"removing the staging area of {name!r} in {layout.root}"):
            return store.remove_staging(tier, name)
    except LockTimeout:
        return []  # a stage took it over: its staging area is in use


def _remove_left_staging(store: Store, tier: RootDir, layout: Layout, tier_conf: Tier, names: tuple[str, ...],
                         wait: float, held: str) -> list[Eviction]:
    out = []
    for name in names:
        if not any(e.rpartition(".")[0] == name for e in tier.names("staging")):
            continue
        try:
            with _lock(layout, name, wait, held):
                out += [Eviction(name, entry.rpartition(".")[2], "removed staging", "left by an interrupted stage",
                                 0, tier_conf.name) for entry in store.remove_staging(tier, name)]
        except LockTimeout:
            pass  # a stage is running: its staging area is not left over
    return out


def _purge_if_left(store: Store, tier: RootDir, layout: Layout) -> None:
    """Restart the trash's deletion if it was cut short (a reboot, a kill)."""
    from dsstage.node.lock import is_held
    if tier.names("trash") and not is_held(layout.lock(background.PURGE_LOCK)):
        background.purge_later(layout)


def evict(store: Store, name: str, *, force: bool = False, dry_run: bool = False,
          dem: retention.Demand | None = None) -> list[Eviction]:
    """Evict this node's unleased copies of ``name`` (``dsstage evict``), through the
    planner: a copy the queue wants stays unless ``force``. Planned and carried out
    holding the dataset's lock: what an interrupted or running stage leaves is judged
    once it is done (a dry run takes no lock). ``dem``: the demand, if read already."""
    ds = store.dataset(name)
    dem = dem or store.demand()[0]
    if dry_run:
        return retain(store, dem, evict=(name,), force=force, dry_run=True)
    with _lock(store.layout(ds.tier), name, store.config.lock_timeout, ""):
        return retain(store, dem, evict=(name,), force=force, held=name)


@dataclass(frozen=True)
class Room:
    """Whether a stage fits on its tier and what it would evict to: decided, nothing done
    (``room_for``). ``plan`` is None where the stage fits without evicting."""

    use: space.Usage
    space: retention.Space
    plan: retention.Plan | None = None
    demand: retention.Demand | None = None

    @property
    def fits(self) -> bool:
        return self.plan is None or self.plan.fits

    def evictions(self) -> list[retention.Decision]:
        return [] if self.plan is None else self.plan.evictions()


def room_for(store: Store, tier: RootDir, tier_conf: Tier, name: str, needed: int, resumed: str = "") -> Room:
    """The room a stage of ``name`` needing ``needed`` bytes has on the tier now: nothing to
    evict where it fits under the high watermark's rule (``Space.over``), else the planner's
    evictions, with ``name`` protected. ``resumed``: the reservation of the staging area the
    stage takes over, which ``needed`` replaces. Reads only: the stage (make_room) and the dry
    run (dsstage.hooks.dryrun) both decide with it."""
    use = space.usage(tier, besides=resumed)
    sp = space_of(store, tier, tier_conf, needed, use)
    if not sp.over(use.total):
        return Room(use, sp)
    dem, _snap = store.demand()
    return Room(use, sp, plan(store, tier, tier_conf, dem, space=sp, asked=retention.Asked(protect=(name,))), dem)


def make_room(store: Store, tier: RootDir, tier_conf: Tier, name: str, room: Room, *,
              spare: Callable[[retention.Copy, retention.Demand], str] | None = None,
              resumed: str = "", job_id: str = "") -> None:
    """Before a stage of ``name`` (holding its lock): evict what ``room`` (``room_for``'s
    answer for the bytes the stage needs) says to; NoSpace, saying what holds the space, if they cannot fit,
    or if the plan would evict a copy that ``spare`` (a prefetch's rule) gives a reason
    to keep. ``resumed``: the reservation of the staging area this stage takes over
    (an interrupted stage's, a yielded prefetch's), which ``needed`` replaces. A stage
    for a job (not a prefetch) first stops the prefetches of other datasets whose
    staging areas keep it from fitting when evictions cannot: a job allocated here
    outweighs one expected later."""
    needed = room.space.need
    if room.plan is None:
        return
    if not room.fits and spare is None and room.use.reserved and _stop_prefetches(store, tier, name, job_id):
        room = room_for(store, tier, tier_conf, name, needed, resumed)
        if room.plan is None:
            return
    if not room.fits:
        raise NoSpace(no_room(store, tier_conf, name, needed, room))
    dem = room.demand or retention.Demand()
    spared = [(d.copy, why) for d in room.evictions() if spare and (why := spare(d.copy, dem))]
    if spared:
        c, why = spared[0]
        raise NoSpace(f"tier {tier_conf.name!r} on {store.node}: making room for {name!r} ({_human(needed)}) "
                      f"would evict {c.dataset} {c.version}, {why}: not prefetched")
    done = _apply(store, tier, Layout(tier.root), room.evictions(), dry_run=False, wait=0.0, purge=False)
    for e in done:
        log.info("making room for %s on %s: %s %s %s (%s)", name, store.node, e.action, e.dataset, e.version,
                 e.reason)
    if any(e.action == "evicted" for e in done):
        # the evicted bytes count until they are deleted: delete them now, the stage needs the room
        background.purge(tier.root)


def no_room(store: Store, tier_conf: Tier, name: str, needed: int, room: Room) -> str:
    """Why a stage of ``name`` cannot fit even after ``room``'s evictions, and what to do."""
    use, sp = room.use, room.space
    held = room.plan.holding() if room.plan is not None else "nothing"
    fix = ("the dataset alone is larger than the tier: raise the tier's capacity" if held == "nothing" else
           f"it is held by {held}: wait for those jobs, or raise the tier's capacity")
    return (f"tier {tier_conf.name!r} on {store.node} ({_human(sp.capacity)}, {_human(use.total)} in use) "
            f"cannot make room for {name!r}, which needs {_human(needed)} more, even by evicting every "
            f"copy that may go; {fix}")


def _stop_prefetches(store: Store, tier: RootDir, name: str, job_id: str, wait: float = PREEMPT_WAIT) -> list[str]:
    """Ask the prefetches staging other datasets in ``tier`` to yield, and remove the
    staging areas of those that did within ``wait`` seconds (their reservations go
    with them); the datasets whose staging areas went."""
    from dsstage.node.lock import ask_to_yield, clear_yield
    layout = Layout(tier.root)
    others = {e.rpartition(".")[0] for e in tier.names("staging")} - {name}
    asked = [o for o in sorted(others) if ask_to_yield(layout.lock(o), job_id or "?")]
    deadline = time.monotonic() + wait
    stopped = []
    for other in asked:
        try:
            with _lock(layout, other, max(0.0, deadline - time.monotonic()), ""):
                if store.remove_staging(tier, other):
                    stopped.append(other)
        except LockTimeout:
            continue  # still staging: its space stays taken
        finally:
            clear_yield(layout.lock(other))
    for other in stopped:
        log.info("job %s: stopped the prefetch of %s on %s and removed its staging area: the job needs the "
                 "room now", job_id or "?", other, store.node)
    return stopped
