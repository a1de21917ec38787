"""A stage as named steps over the node's store: authorize the user, reuse a ready copy, take the
dataset lock, make room (dsstage.node.eviction), fill a staging area (dsstage.node.stager, from the
source and the job's peers), publish it, and lease it to the job; ``warm`` is a stage without a job.

The node report is refreshed (dsstage.node.inventory) once the transfer is about to start, so it
shows the dataset as staging; the store itself never writes the report.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dsstage.config import catalog as cat
from dsstage.config.manifest import Manifest
from dsstage.config.model import Dataset, Transfer
from dsstage.errors import DsstageError, SourceError, StateError
from dsstage.fs import layout as fs_layout
from dsstage.fs.layout import Layout, version_id
from dsstage.fs.safe import RootDir
from dsstage.hostlist import expand_nodes
from dsstage.node import background, eviction, inventory, live, publish, space, stagers, verifying
from dsstage.node import report as node_report
from dsstage.node.lease import Lease, LeaseBook, check_job_id, record
from dsstage.node.store import Prefetching, StageResult, Store, local_errors, open_tier
from dsstage.ready import lease as ready_lease
from dsstage.transfer import peers

if TYPE_CHECKING:  # the staging machinery is imported only when a stage needs it
    from dsstage.node.stager import FillStats


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageRequest:
    """Who a stage is for (the user, the job), what it stages (the current version, or the one
    ``digest`` names), how (a full verification, a prefetch, a live view's worker) and what it
    may spend (a deadline)."""

    user: cat.User
    job_id: str
    pid: int = 0
    deadline: float | None = None  # time.monotonic() by which the stage must stop (OutOfTime)
    prefetch: Prefetching | None = None  # the stage is a prefetch for a pending job
    nodes: str = ""  # the job's nodes (a Slurm hostlist), for the peers
    #: the version the job's nodes agreed on (None: the current one); with ``shard_of``, a shard's
    digest: str | None = None
    #: ``digest`` is a shard of this version (dsstage.node.sharded)
    shard_of: str = ""
    #: a shard: the other shards of ``shard_of`` the job's lease holds already
    leased: tuple[str, ...] = ()
    #: a shard: the job's nodes that stage the same shard (its replicas), for the peers
    replicas: str = ""
    full: bool = False  # verify a ready copy fully (``dsstage stage --full``)
    #: a live view's worker (dsstage.node.live): switches the view's entries as files land
    view: live.Switcher | None = None

    @property
    def shard(self) -> bool:
        """Whether the version staged is a shard."""
        return bool(self.shard_of)


def stage(store: Store, name: str, job: StageRequest, *, on_staging: Callable[[], None] | None = None,
          progress: Callable[[str, int, int], None] | None = None) -> StageResult:
    """Make the current version of ``name`` (or the version ``job.digest``: the one the job's
    nodes agreed on) ready on this node and lease it to ``job.job_id``.

    The steps: ``authorize`` (the user, the job id, the current version), ``reuse`` (a ready
    copy, quick-verified, leased without a lock), then under the dataset lock ``make_ready``
    (a full verification, or ``fill``: make room, copy into a staging area, publish), and the
    lease.

    Before a transfer starts (holding the lock) the node report is rebuilt, so that it
    shows the dataset as staging, and ``on_staging`` is called; the transfer notes its
    progress in the report at most every ``report.interval`` seconds, and to
    ``progress(phase, delta, total)`` if given. ``job.deadline`` (time.monotonic()) bounds
    the lock wait and the transfer: OutOfTime, with the work so far kept.

    A stage that finds the dataset's lock held by a prefetch asks it to yield (see
    dsstage.cluster.prefetch) and then waits for the lock as for any other holder. ``job.prefetch``:
    this stage is one, which waits for no lock and evicts nothing it spares.

    ``job.nodes``: the job's nodes (a Slurm hostlist); with ``peers.enabled`` and more than
    one, this node copies its share from the source and the rest from them.

    ``job.shard_of``: ``job.digest`` is a shard of that version (dsstage.node.sharded); the job's
    lease then holds this shard with those it holds already (``leased``), and ``replicas``
    (a hostlist) are the job's nodes that stage the same shard: with ``peers.enabled`` they
    share its transfer as a job's nodes share a version's.

    ``job.view``: this stage finishes a live view (dsstage.node.live), switching its entries as the
    files land. Any stage that publishes a version switches the whole view of it, if there is one."""
    started = time.monotonic()
    if not job.shard_of and job.replicas:
        job = replace(job, replicas="")  # replicas are a shard's
    ds, digest = authorize(store, name, job, job.digest)
    user, job_id, shard_of, full = job.user, job.job_id, job.shard_of, job.full
    if ds.shards and not shard_of:
        raise StateError(f"dataset {name!r} is sharded: a node stages its part of a job's plan "
                         "(dsstage.node.standalone), never the whole version")
    layout = store.layout(ds.tier)
    result = StageResult(dataset=name, digest=digest, path=layout.version_dir(name, digest), tier=ds.tier,
                         node=store.node, action="cached", job_id=job_id)
    lease = Lease(dataset=name, digest=shard_of or digest, job_id=job_id, user=user.name, node=store.node,
                  taken=store.clock(), host=socket.gethostname(), pid=job.pid,
                  shards=(*job.leased, digest) if shard_of else ())
    with open_tier(layout) as tier:
        book = LeaseBook(tier)
        if not full and reuse(store, tier, ds, digest, book, lease):
            result.seconds = time.monotonic() - started
            return result
        if not full:  # a source known to hang is not waited for again (a verification needs no source)
            closed(store, ds)
        with dataset_lock(store, layout, name, job):
            with local_errors(f"staging {name!r} into {layout.root}"):
                make_ready(store, tier, ds, digest, job, result, on_staging=on_staging, progress=progress)
                book.take(lease)
    result.seconds = time.monotonic() - started
    return result


def closed(store: Store, ds: Dataset) -> None:
    """Raise SourceError, at once, while the breaker of ``ds``'s source is open (dsstage.node.breaker:
    its source stopped answering for a stage on some node, and no probe since has had an answer)."""
    from dsstage.node import breaker
    why = breaker.gate(store.config, ds, store.node)
    if why:
        raise SourceError(f"{ds.name!r} is not staged: {why}")


def authorize(store: Store, name: str, job: StageRequest, digest: str | None = None) -> tuple[Dataset, str]:
    """The dataset, if ``job.user`` may use it and the job id is valid, and the version to stage:
    ``digest`` if given (its manifest must exist), else the current one."""
    ds = store.dataset(name)
    cat.authorize(ds, job.user)
    check_job_id(job.job_id)
    if digest is None:
        return ds, store.current(name)
    path = store.manifests.path(name, digest)
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not os.path.exists(path):
        raise StateError(f"version {digest[:16]} of {name!r}, which this job's nodes agreed on, has no manifest "
                         f"({path}); was it pruned? requeue the job to stage the current version")
    return ds, digest


def reuse(store: Store, tier: RootDir, ds: Dataset, digest: str, book: LeaseBook, lease: Lease) -> bool:
    """Lease a ready copy without the dataset lock (quick verification only); True if leased:
    dsstage.ready.lease's protocol, as the warm paths follow it. A shard's lease gives back
    this shard only where the check after it fails: the job keeps those it held."""
    name = ds.name
    with local_errors(f"staging {name!r} into {tier.root}"):
        store.apply_access(tier, ds)
        if ready_lease.reusable(tier, name, digest, ds.verify) is not None:
            return False
        previous = record(replace(lease, shards=lease.shards[:-1])) if lease.shards[:-1] else None
        return ready_lease.hold([ready_lease.Take(book.tier, record(lease), previous)],
                                lambda: store.ready_state(tier, name, digest).ready)


def dataset_lock(store: Store, layout: Layout, name: str, job: StageRequest) -> AbstractContextManager[object]:
    """The dataset's lock, waited for up to ``lock_timeout`` or the job's deadline; a job's stage
    first asks a prefetch holding it to yield, a prefetch waits for nobody."""
    from dsstage.node.lock import DatasetLock, ask_to_yield
    wait = 0.0 if job.prefetch else store.config.lock_timeout
    bound = ""
    if job.deadline is not None and job.deadline - time.monotonic() < wait:
        wait = max(0.0, job.deadline - time.monotonic())
        bound = f"the Prolog's budget (prolog_budget: {store.config.prolog_budget:g}s)"
    if not job.prefetch:
        ask_to_yield(layout.lock(name), job.job_id)
    return DatasetLock(layout.lock(name), timeout=wait, job_id=job.job_id, what=f"dataset {name!r} on {store.node}",
                       action="prefetch" if job.prefetch else "stage", bound=bound)


def make_ready(store: Store, tier: RootDir, ds: Dataset, digest: str, job: StageRequest, result: StageResult, *,
               on_staging: Callable[[], None] | None = None,
               progress: Callable[[str, int, int], None] | None = None) -> None:
    """Holding the dataset lock: verify a ready copy fully where asked (``job.full``), or fill and
    publish a new one; ``result`` says which and what moved."""
    name = ds.name
    store.apply_access(tier, ds)
    state = store.ready_state(tier, name, digest)
    if state.ready and (job.full or ds.verify == "full"):
        vr = verifying.verify_locked(store, tier, ds, digest)
        result.action = "repaired" if vr.repaired or vr.removed_extras else "cached"
    elif not state.ready:
        log.info("staging %s version %s on %s: %s", name, version_id(digest), store.node, state.reason)
        inventory.refresh(store)
        if on_staging:
            on_staging()
        stats = fill(store, tier, ds, digest, job, progress)
        result.action = "staged"
        result.transferred_files = stats.transferred.files
        result.transferred_bytes = stats.transferred.bytes
        result.linked_files = stats.linked_files
        result.peer_files = stats.from_peers.files
        result.peer_bytes = stats.from_peers.bytes


@dataclass(frozen=True)
class FillPlan:
    """What a fill of one version will do, decided from what it reads (``plan_fill``): the
    manifest, the older versions on the node that lend files by hard links, the bytes left to
    fetch, and the room to make for them (dsstage.node.eviction.Room: what it evicts, or why it
    cannot fit). The stage carries it out holding the dataset's lock; the dry run
    (dsstage.hooks.dryrun) says it and does nothing."""

    manifest: Manifest
    older: list[tuple[int, Manifest]]
    needed: int
    room: eviction.Room | None  # None: the tier does not exist yet (a dry run's)

    @property
    def lent(self) -> int:
        """The bytes older versions lend."""
        return self.manifest.total_bytes - self.needed


def plan_fill(store: Store, tier: RootDir | None, ds: Dataset, digest: str, *, shard: bool = False,
              resumed: str = "") -> FillPlan:
    """The fill of ``ds`` version ``digest`` on ``tier``, decided, nothing done (``FillPlan``).
    ``shard``: the version is a shard (StageRequest.shard); ``resumed``: the reservation of
    the staging area the stage takes over."""
    name = ds.name
    manifest = store.load_manifest(name, digest)
    # the other copies of a sharded dataset are its other shards, which lend no file: not read
    older = [] if shard or tier is None else older_versions(store, tier, name, digest)
    needed = to_fetch(manifest, [m for _fd, m in older])
    room = None if tier is None else eviction.room_for(store, tier, store.config.tiers[ds.tier], name, needed,
                                                       resumed)
    return FillPlan(manifest, older, needed, room)


def fill(store: Store, tier: RootDir, ds: Dataset, digest: str, job: StageRequest,
         progress: Callable[[str, int, int], None] | None = None) -> FillStats:
    """Make room for what older versions cannot lend, copy the version into its staging area
    within a space reservation, and publish it (the caller holds the dataset lock)."""
    from dsstage.node import stager
    from dsstage.transfer.ratelimit import Rate
    from dsstage.transfer.transport import Area, for_source
    name = ds.name
    prefetch = job.prefetch
    staging = fs_layout.staging_name(name, digest)
    record = space.stage_record(staging)
    store.remove_staging(tier, name, keep=staging)
    publish.take_back(tier, name, digest)
    plan = plan_fill(store, tier, ds, digest, shard=job.shard, resumed=record)
    manifest, older, needed = plan.manifest, plan.older, plan.needed
    tier_conf = store.config.tiers[ds.tier]
    assert plan.room is not None  # a fill has its tier: plan_fill decided the room
    eviction.make_room(store, tier, tier_conf, name, plan.room, spare=prefetch.spare if prefetch else None,
                       resumed=record, job_id=job.job_id)
    linked: dict[int, tuple[int, int]] = {}
    holders, ready, claimed = from_whom(store, name, digest, shard=job.shard)
    # a shard: only the nodes that stage the same one (its replicas) are peers
    group = peers.group_for(store.config.peers, job.replicas if job.shard else job.nodes, store.node, holders, ready)
    # the claim first: a reservation that fails gives it back
    with stagers.claimed(store.config, name, version_id(digest), store.node, claimed), \
            space.reservation(tier, tier_conf.name, tier_conf.capacity, record, needed, f"dataset {name!r}",
                              store.node), \
            within_budget(store, ds, job, peers_first=bool(group and group.holders)) as transfer:
        sfd = tier.dir("staging", staging, mode=0o700)  # only once the space is promised
        area = Area(sfd, tier.path("staging", staging), transfer, job.deadline, node_report.ProgressNote(
            store.run_dir, store.node, (tier_conf.name, name, version_id(digest)), job.job_id,
            interval=store.config.report.interval, publish_to=node_report.publish_target(store.config),
            also=progress), whole=manifest.total_bytes if group is not None else 0,
            rate=Rate(prefetch.bwlimit) if prefetch and prefetch.bwlimit else None)
        # the transport, chosen once from the source; peers (the job's nodes, the holders) wrap it
        transport = for_source(ds.source, area, store.reader())
        if group is not None:
            transport = peers.PeersFirst(group, peers.Where(name, digest, tier_conf.name), transport, area)
        if job.view is not None and transport.verified_on_arrival:  # else the view switches at the end
            transport = live.Switching(transport, job.view, area)
        try:
            stats = stager.fill(area, manifest, transport, [(fd, m) for fd, m in older], linked=linked)
        finally:
            if job.view:  # before the lock goes: the rest is switched from the published copy
                job.view.stop()
        versions = [version_id(m.digest) for _fd, m in older]
        publish.publish(tier, name, digest, {
            "files": manifest.files, "bytes": manifest.total_bytes, "staged_at": store.clock(),
            "node": store.node, "linked": {versions[i]: b for i, (_f, b) in linked.items()},
            **({"prefetched_for": prefetch.job_id, "expected_start": prefetch.start} if prefetch else {})})
    # a job may read a live view of this version: every entry becomes the copy's file now (best
    # effort: the copy is published; a view left unswitched still reads right, from the source)
    try:
        if live.complete(tier, name, digest, [e.path for e in manifest.entries]) is not None:
            log.info("the live view of %s version %s is all local now", name, version_id(digest))
    except (OSError, DsstageError) as exc:
        log.warning("the live view of %s version %s was not switched to the copy: %s", name, version_id(digest),
                    exc)
    background.flush_later(Layout(tier.root), name, digest)
    return stats


def from_whom(store: Store, name: str, digest: str, *, shard: bool = False) -> tuple[list[str], bool, bool]:
    """With ``peers.enabled``, whom a stage of this version (or shard) of ``name`` fetches it
    from before the source, whatever job they stage it for: (the nodes whose published
    reports show it ready, True, False); else, where none does, the node that claimed to read
    it from the source now (dsstage.node.stagers), ([that node], False, False), or this node's
    own claim ([], True, True: it gives it back when the stage ends)."""
    conf = store.config
    if not conf.peers.enabled:
        return [], True, False
    vid = version_id(digest)
    among = None if shard else listed_holders(store, name, vid)
    ready = node_report.holders(conf.state_dir, name, vid, store.clock(), conf.report.max_age, among=among,
                                server_now=reports_clock(store) if among is None or among else None)
    ready = [n for n in ready if n != store.node]
    if ready:
        return ready, True, False
    claimer = stagers.claim(conf, name, vid, store.node)
    if claimer is None or claimer == store.node:
        return [], True, claimer == store.node
    return [claimer], False, False


def reports_clock(store: Store) -> float | None:
    """The time now by the clock of the directory the nodes publish their reports in (a probe
    there, as the report's user, at most every few minutes per process:
    dsstage.fs.shared.server_offset); None where it cannot be read."""
    from dsstage.fs import shared
    from dsstage.fs.identity import writing_as
    conf = store.config
    try:
        with writing_as(conf.report.user):
            clock = shared.server_clock(os.path.join(conf.state_dir, node_report.NODES))
    except (OSError, DsstageError):
        return None
    return clock() if clock else None


def listed_holders(store: Store, name: str, vid: str) -> list[str] | None:
    """The nodes the demand snapshot says hold version ``vid`` of ``name`` ready (the poller
    writes ``copies`` from the reports once per round, with peers on), other than this one:
    a cold stage then reads their reports only, not every node's (the snapshot is one file; a
    report per node is a metadata operation per node on the shared filesystem). None (read
    every report) where the snapshot is stale or has no ``copies`` (an older poller, or no
    node holds anything). A version made ready since the poller's round is not listed: the
    node that staged it is found through its claim (dsstage.node.stagers), which it keeps."""
    try:  # the snapshot's copies alone: its queue (every pending job's hostlist) is not read here
        snap = store.snapshot()
    except (DsstageError, OSError):
        return None
    held = snap.holders()
    if snap.stale(store.clock(), store.config.retention.demand_max_age) or not held:
        return None
    return sorted(held.get(name, {}).get(vid, frozenset()) - {store.node})


@contextmanager
def within_budget(store: Store, ds: Dataset, job: StageRequest, *, peers_first: bool = False) -> Iterator[Transfer]:
    """The transfer settings for this stage, held for its duration: where the dataset's source
    has a budget (``sources``), the slots this stage got of the cluster's ``max_in_flight``
    (dsstage.node.budget) bound the requests in flight (the copier's limit, rsync's streams).
    ``peers_first``: the version comes from other nodes that hold it or read it now (holders),
    the source only for what they fail to give: no slot is taken (a stage that waited for a
    slot it does not need would stall the array that follows one reader)."""
    from dsstage.node import budget as source_budget
    transfer = store.config.transfer
    budget = store.config.budget_of(ds.source)
    if budget is None:
        yield transfer
        return
    try:  # a job's nodes that stage together each want an equal share of the budget
        nodes = len(expand_nodes(job.nodes)) if job.nodes else 1
    except ValueError:
        nodes = 1
    share = max(1, budget.max_in_flight // max(1, nodes))
    if peers_first:
        yield transfer
        return
    want = min(share, transfer.max_parallel if ds.source.kind == "local" else transfer.streams)
    with source_budget.held(store.config, budget, store.node, want, job.deadline) as grant:
        log.info("staging %s from %s: at most %d request(s) in flight from this stage (sources.%s: %d in the "
                 "cluster)", ds.name, ds.source.raw, grant.slots, budget.name, budget.max_in_flight)
        yield replace(transfer, max_parallel=min(transfer.max_parallel, grant.slots),
                      streams=min(transfer.streams, grant.slots))


def to_fetch(manifest: Manifest, older: list[Manifest]) -> int:
    """The bytes of ``manifest`` that no file of an ``older`` version on the node can lend
    (same size and hash: hard-linked, not fetched)."""
    reusable = {(e.size, e.hash) for m in older for e in m.entries}
    return sum(e.size for e in manifest.entries if (e.size, e.hash) not in reusable)


def older_versions(store: Store, tier: RootDir, name: str, digest: str) -> list[tuple[int, Manifest]]:
    out = []
    for other in store.ready_digests(tier, name):
        if other == digest or fs_layout.not_ready(tier, name, other):
            continue
        try:
            out.append((tier.dir("datasets", name, version_id(other), create=False),
                        store.manifests.load(name, other)))
        except (DsstageError, OSError):
            continue  # its manifest was pruned, or the copy is gone: nothing to reuse from it
    return out
