"""The node-local store: one read-only copy per dataset version, shared by every job.

Layout of a tier on a node (``<root>`` is the tier's path with ``{node}`` filled in)::

    <root>/datasets/<name>/                  0755, or 0750 + group/ACL for a restricted dataset
    <root>/datasets/<name>/<version>/         the published copy: root-owned, files 0444, dirs 0555
    <root>/ready/<name>/<version>.json        ready mark: full digest, size, inode of the copy
    <root>/staging/<name>.<version>/          private (0700) staging area, kept across crashes
    <root>/locks/<name>.lock                  per-dataset flock; <name>.lock.owner says who holds it
    <root>/locks/.tier.lock                   the tier's space lock (space.py)
    <root>/leases/<name>/<job id>.json        one lease per job using the dataset
    <root>/reserved/                          space reserved by stages in progress and the trash
    <root>/trash/                             evicted copies, deleted by a detached process

``<version>`` is the first 16 hex digits of the manifest's root digest. How a staging
area becomes a ready copy is ``publish.py``; how root reaches all of this without
following anything a user planted is ``nodefs.py``; who may read a copy is ``access.py``;
space is ``space.py``; detached work is ``background.py``.

Leases and eviction. The warm path (a ready copy, quick verification) takes no lock and
imports nothing of the staging machinery, to keep a Prolog for a cached dataset cheap:
it writes the job's lease, then checks the ready mark again. Whoever removes a copy must,
holding the dataset lock, first remove the ready mark and then look for leases (putting
the mark back if there is one). Either the reader sees the mark gone (and takes the
locked path) or the remover sees the lease: a copy in use is never removed.

Errors. A failure of the local store raises StoreError (blame "node": the Prolog drains);
a full filesystem NoSpace, a store path a user could steer UnsafeStore, the shared state
directory StateError, the source SourceError: none of those drains.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from . import access, background, nodefs, publish, retention, space
from . import catalog as cat
from .config import Config, Dataset, Tier
from .errors import DsstageError, LockTimeout, NoSpace, OutOfTime, StateError, VerifyError, local_error
from .lease import Lease, LeaseBook, check_job_id, default_holder, holder_alive
from .manifest import Catalog, Manifest
from .nodefs import Layout, RootDir, version_id

if TYPE_CHECKING:  # the staging machinery is imported only when a stage needs it
    from .demand import Snapshot
    from .identity import Identity
    from .stager import FillReport

log = logging.getLogger(__name__)
#: seconds a job's stage waits for the prefetches it asked to yield the room
PREEMPT_WAIT = 3.0


def node_name() -> str:
    """This node's Slurm name (``SLURMD_NODENAME`` in a Prolog), else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


@contextmanager
def local_errors(what: str) -> Iterator[None]:
    """OSError of the local store as the store's error (ENOSPC: NoSpace, which never drains)."""
    try:
        yield
    except OSError as exc:
        raise local_error(exc, what) from None


def open_tier(layout: Layout, *, create: bool = True) -> RootDir:
    """The tier's RootDir with its directories (root-owned; staging, reserved, trash private)."""
    with local_errors(f"cannot open the store at {layout.root}"):
        tier = RootDir(layout.root, create=create)
        try:
            if create:
                for sub in nodefs.TIER_DIRS:
                    tier.dir(sub)
        except BaseException:
            tier.close()
            raise
    return tier


@dataclass
class StageResult:
    dataset: str
    digest: str
    path: str
    tier: str
    node: str
    action: str  # "cached" | "staged" | "repaired"
    job_id: str
    transferred_files: int = 0
    transferred_bytes: int = 0
    linked_files: int = 0
    peer_files: int = 0  # from the job's other nodes (transferred_*: from the source)
    peer_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Eviction:
    dataset: str
    version: str
    action: str  # "evicted" | "kept" | "would evict" (a dry run) | "removed staging"
    reason: str
    bytes: int = 0
    tier: str = ""


@dataclass
class VerifyResult:
    dataset: str
    digest: str
    path: str
    mode: str
    ok: bool
    reason: str
    checked_files: int = 0
    repaired: list[str] = field(default_factory=list)
    removed_extras: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Prefetching:
    """A stage that is a prefetch for a pending job (dsstage.prefetch)."""

    job_id: str  # the pending job it is for
    start: float | None  # its expected start, epoch seconds
    bwlimit: int = 0  # bytes/s, all streams together; 0: the configured transfer's
    #: why a copy must not be evicted to make room for it ("" if it may go)
    spare: Callable[[retention.Copy, retention.Demand], str] | None = None


@dataclass(frozen=True)
class ReadyState:
    ready: bool
    reason: str


class Store:
    """The store of one node, over all tiers of a configuration."""

    def __init__(self, config: Config, node: str | None = None, *,
                 clock: Callable[[], float] = time.time, run_dir: str | None = None) -> None:
        self.config = config
        self.node = node or node_name()
        #: node-local runtime state (the node's report, the metrics' counters)
        self.run_dir = run_dir or os.environ.get("DSSTAGE_RUN_DIR") or nodefs.RUN_DIR
        self.manifests = Catalog(config.state_dir)
        self.clock = clock
        self._reader: Identity | None | bool = False

    # -- where things are ------------------------------------------------------

    def layout(self, tier: str | Tier) -> Layout:
        t = tier if isinstance(tier, Tier) else self.config.tiers[tier]
        return Layout(t.root(self.node))

    def dataset(self, name: str) -> Dataset:
        return cat.lookup(self.config, name)

    def reader(self) -> Identity | None:
        """Who reads mounted sources: the configured source_user, else root."""
        if self._reader is False:
            user = self.config.source_user
            from . import identity
            self._reader = identity.lookup(user) if user else None
        return self._reader  # type: ignore[return-value]

    # -- the shared state directory --------------------------------------------

    def current(self, name: str) -> str:
        with state_errors(self.config.state_dir):
            return self.manifests.require_current(name)

    def load_manifest(self, name: str, digest: str) -> Manifest:
        with state_errors(self.config.state_dir):
            return self.manifests.load(name, digest)

    # -- the quick check -------------------------------------------------------

    def ready_state(self, tier: RootDir, name: str, digest: str) -> ReadyState:
        """Whether the copy of version ``digest`` is ready, at a cost independent of its size."""
        reason = nodefs.not_ready(tier, name, digest)
        if reason:
            return ReadyState(False, reason)
        return ReadyState(True, "ready mark matches the current manifest")

    # -- staging ---------------------------------------------------------------

    def stage(self, name: str, *, user: cat.User, job_id: str, pid: int = 0, full: bool = False,
              on_staging: Callable[[], None] | None = None, deadline: float | None = None,
              progress: Callable[[str, int, int], None] | None = None, prefetch: Prefetching | None = None,
              nodes: str = "") -> StageResult:
        """Make the current version of ``name`` ready on this node and lease it to ``job_id``.

        Before a transfer starts (holding the lock) the node report is rebuilt, so that it
        shows the dataset as staging, and ``on_staging`` is called; the transfer notes its
        progress in the report at most every ``report.interval`` seconds, and to
        ``progress(phase, delta, total)`` if given. ``deadline`` (time.monotonic()) bounds
        the lock wait and the transfer: OutOfTime, with the work so far kept.

        A stage that finds the dataset's lock held by a prefetch asks it to yield (see
        dsstage.prefetch) and then waits for the lock as for any other holder. ``prefetch``:
        this stage is one, which waits for no lock and evicts nothing it spares.

        ``nodes``: the job's nodes (a Slurm hostlist); with ``peers.enabled`` and more than
        one, this node copies its share from the source and the rest from them."""
        started = time.monotonic()
        ds = self.dataset(name)
        cat.authorize(ds, user)
        check_job_id(job_id)
        digest = self.current(name)
        layout = self.layout(ds.tier)
        result = StageResult(dataset=name, digest=digest, path=layout.version_dir(name, digest), tier=ds.tier,
                             node=self.node, action="cached", job_id=job_id)
        lease = Lease(dataset=name, digest=digest, job_id=job_id, user=user.name, node=self.node,
                      taken=self.clock(), host=socket.gethostname(), pid=pid)
        with open_tier(layout) as tier:
            book = LeaseBook(tier)
            with local_errors(f"staging {name!r} into {layout.root}"):
                self._apply_access(tier, ds)
                if not full and ds.verify == "quick" and self.ready_state(tier, name, digest).ready:
                    book.take(lease)
                    if self.ready_state(tier, name, digest).ready:  # see "Leases and eviction" above
                        result.seconds = time.monotonic() - started
                        return result
                    book.release(name, job_id)
            from .lock import DatasetLock, ask_to_yield
            wait = 0.0 if prefetch else self.config.lock_timeout
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            if not prefetch:
                ask_to_yield(layout.lock(name), job_id)
            with DatasetLock(layout.lock(name), timeout=wait, job_id=job_id, what=f"dataset {name!r} on {self.node}",
                             action="prefetch" if prefetch else "stage"):
                with local_errors(f"staging {name!r} into {layout.root}"):
                    self._apply_access(tier, ds)
                    state = self.ready_state(tier, name, digest)
                    if state.ready and (full or ds.verify == "full"):
                        vr = self._verify_full_locked(tier, ds, digest)
                        result.action = "repaired" if vr.repaired or vr.removed_extras else "cached"
                    elif not state.ready:
                        log.info("staging %s version %s on %s: %s", name, version_id(digest), self.node, state.reason)
                        self.report()
                        if on_staging:
                            on_staging()
                        report = self._stage_locked(tier, ds, digest, deadline, job_id, progress, prefetch,
                                                    nodes)
                        result.action = "staged"
                        result.transferred_files = report.transferred.files
                        result.transferred_bytes = report.transferred.bytes
                        result.linked_files = report.linked_files
                        result.peer_files = report.from_peers.files
                        result.peer_bytes = report.from_peers.bytes
                    book.take(lease)
        result.seconds = time.monotonic() - started
        return result

    def _stage_locked(self, tier: RootDir, ds: Dataset, digest: str, deadline: float | None,
                      job_id: str = "", progress: Callable[[str, int, int], None] | None = None,
                      prefetch: Prefetching | None = None, nodes: str = "") -> FillReport:
        from . import peers, stager
        from . import report as node_report
        name = ds.name
        manifest = self.load_manifest(name, digest)
        staging = nodefs.staging_name(name, digest)
        record = space.stage_record(staging)
        self._remove_staging(tier, name, keep=staging)
        publish.take_back(tier, name, digest)
        older = self._older_versions(tier, name, digest)
        reusable = {(e.size, e.hash) for _, m in older for e in m.entries}
        needed = sum(e.size for e in manifest.entries if (e.size, e.hash) not in reusable)
        tier_conf = self.config.tiers[ds.tier]
        self._make_room(tier, tier_conf, name, needed, prefetch.spare if prefetch else None,
                        resumed=record, job_id=job_id)
        transfer = self.config.transfer
        if prefetch and prefetch.bwlimit:
            # rsync's --bwlimit is KiB/s per stream; the copier spreads streams x bwlimit over its threads
            transfer = replace(transfer, bwlimit=max(1, prefetch.bwlimit // 1024 // max(1, transfer.streams)))
        linked: dict[int, tuple[int, int]] = {}
        with space.reservation(tier, tier_conf.name, tier_conf.capacity, record, needed,
                               f"dataset {name!r}", self.node):
            sfd = tier.dir("staging", staging, mode=0o700)  # only once the space is promised
            report = stager.fill(sfd, tier.path("staging", staging), manifest, ds.source, transfer,
                                 [(fd, m) for fd, m in older], deadline=deadline, reader=self.reader(),
                                 linked=linked, progress=node_report.ProgressNote(
                                     self.run_dir, self.node, tier_conf.name, name, version_id(digest), job_id,
                                     interval=self.config.report.interval,
                                     publish_to=node_report.publish_target(self.config), also=progress),
                                 group=peers.group_for(self.config.peers, nodes, self.node), tier=tier_conf.name)
            versions = [version_id(m.digest) for _fd, m in older]
            publish.publish(tier, name, digest, {
                "files": manifest.files, "bytes": manifest.total_bytes, "staged_at": self.clock(),
                "node": self.node, "linked": {versions[i]: b for i, (_f, b) in linked.items()},
                **({"prefetched_for": prefetch.job_id, "expected_start": prefetch.start} if prefetch else {})})
        background.flush_later(Layout(tier.root), name, digest)
        return report

    def _older_versions(self, tier: RootDir, name: str, digest: str) -> list[tuple[int, Manifest]]:
        out = []
        for other in self.ready_digests(tier, name):
            if other == digest or nodefs.not_ready(tier, name, other):
                continue
            try:
                out.append((tier.dir("datasets", name, version_id(other), create=False),
                            self.manifests.load(name, other)))
            except (DsstageError, OSError):
                continue  # its manifest was pruned, or the copy is gone: nothing to reuse from it
        return out

    def _remove_staging(self, tier: RootDir, name: str, keep: str = "") -> list[str]:
        """Remove the staging areas of ``name`` (but ``keep``) and their reservations:
        left by killed stages of versions no longer wanted. Needs the dataset lock."""
        removed = []
        for entry in tier.names("staging"):
            if entry.rpartition(".")[0] == name and entry != keep:
                tier.forget("staging", entry)
                nodefs.remove_at(tier.dir("staging"), entry)
                space.forget(tier, space.stage_record(entry))
                removed.append(entry)
        return removed

    def ready_digests(self, tier: RootDir, name: str) -> list[str]:
        fd = tier.has_dir("ready", name)
        out = []
        for f in tier.names("ready", name):
            digest = nodefs.read_json_at(fd, f).get("digest")
            if isinstance(digest, str):
                out.append(digest)
        return out

    def _apply_access(self, tier: RootDir, ds: Dataset) -> None:
        access.apply(tier, ds, origin=self.config.origin, node=self.node)

    # -- retention and eviction --------------------------------------------------

    def copies(self, tier: RootDir, tier_conf: Tier) -> list[retention.Copy]:
        """This tier's copies as the retention planner sees them. Last use: the last lease
        taken or released on the dataset (the mtime of its leases directory), or when it
        was staged. A copy whose current version cannot be read counts as current."""
        book = LeaseBook(tier)
        out = []
        for name in tier.names("datasets"):
            try:
                current = self.manifests.current(name)
            except (DsstageError, OSError):
                current = None
            leases = book.of_dataset(name)
            lfd = tier.has_dir("leases", name)
            touched = os.fstat(lfd).st_mtime if lfd is not None else 0.0
            rfd = tier.has_dir("ready", name)
            for version in tier.names("datasets", name):
                mark = nodefs.read_json_at(rfd, nodefs.mark_name(version))
                linked = mark.get("linked")
                out.append(retention.Copy(
                    dataset=name, version=version, bytes=space.as_bytes(mark.get("bytes")), tier=tier_conf.name,
                    last_used=max(touched, space.as_float(mark.get("staged_at"))),
                    leases=tuple(sorted(x.job_id for x in leases if version_id(x.digest) == version)),
                    current=current is None or version_id(current) == version,
                    ready=bool(mark) and not mark.get("bad"),
                    shared={str(v): space.as_bytes(b) for v, b in linked.items()} if isinstance(linked, dict) else {}))
        return out

    def space_of(self, tier: RootDir, tier_conf: Tier, need: int = 0,
                 use: space.Usage | None = None) -> retention.Space:
        """The tier's space for the planner: its capacity, or what its filesystem can hold if
        that is less (the filesystem may hold other data)."""
        use = use or space.usage(tier)
        cap, free = space.capacity_of(tier_conf.capacity, tier.fd)
        return retention.Space(capacity=min(cap, use.copies + free), high=tier_conf.high_watermark,
                               low=tier_conf.low_watermark, reserved=use.reserved, need=need)

    def policy(self) -> retention.Policy:
        r = self.config.retention
        return retention.Policy(min_keep=r.min_keep, max_idle=r.max_idle)

    def demand(self) -> tuple[retention.Demand, Snapshot]:
        """The queue's demand from the poller's snapshot (stale if old or missing)."""
        from . import demand
        snap = demand.read(self.config.state_dir)
        return snap.demand(self.clock(), self.config.retention.demand_max_age), snap

    def plan(self, tier: RootDir, tier_conf: Tier, dem: retention.Demand, *, space: retention.Space | None = None,
             protect: tuple[str, ...] = (), evict: tuple[str, ...] = (), force: bool = False) -> retention.Plan:
        """The planner on this tier; ``space``: the tier's, if the caller has it already."""
        return retention.plan(self.copies(tier, tier_conf), dem, space or self.space_of(tier, tier_conf), self.clock(),
                              policy=self.policy(), node=self.node, protect=protect, evict=evict, force=force)

    def retain(self, dem: retention.Demand | None = None, *, evict: tuple[str, ...] = (), force: bool = False,
               dry_run: bool = False, wait: float = 0.0, held: str = "") -> list[Eviction]:
        """Plan every tier of this node and carry the plan out (what the Epilog does).

        ``evict``: only these datasets, as an admin asked (``dsstage evict``), with their
        interrupted staging areas. A copy whose dataset lock is busy (a stage or a verify
        in progress) is kept for now; ``wait`` is how long to try for each lock; ``held``
        is a dataset whose lock the caller holds."""
        if dem is None:
            dem = self.demand()[0]
        out: list[Eviction] = []
        for tier_conf in self.config.tiers.values():
            layout = self.layout(tier_conf)
            with open_tier(layout) as tier, local_errors(f"applying retention in {layout.root}"):
                p = self.plan(tier, tier_conf, dem, evict=evict, force=force)
                decisions = [d for d in p.decisions if not evict or d.copy.dataset in evict]
                out += self._apply(tier, layout, decisions, dry_run=dry_run, wait=wait, held=held)
                if evict and not dry_run:
                    out += self._remove_left_staging(tier, layout, tier_conf, evict, wait, held)
                if not dry_run:
                    self._purge_if_left(tier, layout)
        return out

    def _apply(self, tier: RootDir, layout: Layout, decisions: list[retention.Decision], *, dry_run: bool,
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
                            out.append(self._evict_version(tier, book, c, d.reason, d.rule))
            except LockTimeout:
                out.append(Eviction(c.dataset, c.version, "kept", "busy: a stage or verify holds its lock; "
                                    f"planned: {d.reason}", c.bytes, c.tier))
        if purge and any(e.action == "evicted" for e in out):
            background.purge_later(layout)
        return out

    def _evict_version(self, tier: RootDir, book: LeaseBook, c: retention.Copy, reason: str,
                       rule: str = "") -> Eviction:
        """Evict one copy, following the protocol in the module doc: under the dataset lock
        the ready mark goes first, then the leases are read; a copy with a lease gets its
        mark back and stays. The copy is renamed into the tier's trash (instant, whatever
        its size) and deleted by a detached process."""
        name, version = c.dataset, c.version
        mark = publish.unmark(tier, name, version)
        size = space.as_bytes(mark.get("bytes"))
        holders = sorted(x.job_id for x in book.of_dataset(name) if version_id(x.digest) == version)
        if holders:
            if mark:
                nodefs.write_json_at(tier.dir("ready", name), nodefs.mark_name(version), mark)
            return Eviction(name, version, "kept", retention.leased(holders), size, c.tier)
        entry = f"{name}.{version}.{time.time_ns()}"
        space.hold(tier, space.trash_record(entry), size, f"evicted {name} {version}")
        tier.forget("datasets", name, version)
        try:
            os.rename(version, entry, src_dir_fd=tier.dir("datasets", name), dst_dir_fd=tier.dir("trash"))
        except BaseException:
            space.forget(tier, space.trash_record(entry))
            raise
        labels = {"dataset": name, "reason": rule or "other"}
        self.count([("evictions", labels, 1), ("evicted_bytes", labels, size)])
        return Eviction(name, version, "evicted", reason, size, c.tier)

    def discard_staging(self, name: str) -> list[str]:
        """Remove the staging areas of ``name`` (an abandoned prefetch's), if its lock is
        free now; what was removed."""
        ds = self.dataset(name)
        layout = self.layout(ds.tier)
        try:
            with _lock(layout, name, 0.0, ""), open_tier(layout) as tier, \
                    local_errors(f"removing the staging area of {name!r} in {layout.root}"):
                return self._remove_staging(tier, name)
        except LockTimeout:
            return []  # a stage took it over: its staging area is in use

    def _remove_left_staging(self, tier: RootDir, layout: Layout, tier_conf: Tier, names: tuple[str, ...],
                             wait: float, held: str) -> list[Eviction]:
        out = []
        for name in names:
            if not any(e.rpartition(".")[0] == name for e in tier.names("staging")):
                continue
            try:
                with _lock(layout, name, wait, held):
                    out += [Eviction(name, entry.rpartition(".")[2], "removed staging", "left by an interrupted stage",
                                     0, tier_conf.name) for entry in self._remove_staging(tier, name)]
            except LockTimeout:
                pass  # a stage is running: its staging area is not left over
        return out

    def _purge_if_left(self, tier: RootDir, layout: Layout) -> None:
        """Restart the trash's deletion if it was cut short (a reboot, a kill)."""
        from .lock import is_held
        if tier.names("trash") and not is_held(layout.lock(background.PURGE_LOCK)):
            background.purge_later(layout)

    def evict(self, name: str, *, force: bool = False, dry_run: bool = False,
              dem: retention.Demand | None = None) -> list[Eviction]:
        """Evict this node's unleased copies of ``name`` (``dsstage evict``), through the
        planner: a copy the queue wants stays unless ``force``. Planned and carried out
        holding the dataset's lock: what an interrupted or running stage leaves is judged
        once it is done (a dry run takes no lock). ``dem``: the demand, if read already."""
        ds = self.dataset(name)
        dem = dem or self.demand()[0]
        if dry_run:
            return self.retain(dem, evict=(name,), force=force, dry_run=True)
        with _lock(self.layout(ds.tier), name, self.config.lock_timeout, ""):
            return self.retain(dem, evict=(name,), force=force, held=name)

    def _make_room(self, tier: RootDir, tier_conf: Tier, name: str, needed: int,
                   spare: Callable[[retention.Copy, retention.Demand], str] | None = None,
                   resumed: str = "", job_id: str = "") -> None:
        """Before a stage of ``name`` (holding its lock): evict what the planner says to make
        room for ``needed`` bytes; NoSpace, saying what holds the space, if they cannot fit,
        or if the plan would evict a copy that ``spare`` (a prefetch's rule) gives a reason
        to keep. ``resumed``: the reservation of the staging area this stage takes over
        (an interrupted stage's, a yielded prefetch's), which ``needed`` replaces. A stage
        for a job (not a prefetch) first stops the prefetches of other datasets whose
        staging areas keep it from fitting when evictions cannot: a job allocated here
        outweighs one expected later."""
        use = space.usage(tier, besides=resumed)
        sp = self.space_of(tier, tier_conf, needed, use)
        if use.total + needed <= sp.high * sp.capacity:
            return
        dem, _snap = self.demand()
        p = self.plan(tier, tier_conf, dem, space=sp, protect=(name,))
        if not p.fits and spare is None and use.reserved and self._stop_prefetches(tier, name, job_id):
            use = space.usage(tier, besides=resumed)
            sp = self.space_of(tier, tier_conf, needed, use)
            if use.total + needed <= sp.high * sp.capacity:
                return
            p = self.plan(tier, tier_conf, dem, space=sp, protect=(name,))
        if not p.fits:
            held = p.holding()
            fix = ("the dataset alone is larger than the tier: raise the tier's capacity" if held == "nothing" else
                   f"it is held by {held}: wait for those jobs, or raise the tier's capacity")
            raise NoSpace(f"tier {tier_conf.name!r} on {self.node} ({_human(sp.capacity)}, {_human(use.total)} in use) "
                          f"cannot make room for {name!r}, which needs {_human(needed)} more, even by evicting every "
                          f"copy that may go; {fix}")
        spared = [(d.copy, why) for d in p.evictions() if spare and (why := spare(d.copy, dem))]
        if spared:
            c, why = spared[0]
            raise NoSpace(f"tier {tier_conf.name!r} on {self.node}: making room for {name!r} ({_human(needed)}) "
                          f"would evict {c.dataset} {c.version}, {why}: not prefetched")
        done = self._apply(tier, Layout(tier.root), p.evictions(), dry_run=False, wait=0.0, purge=False)
        for e in done:
            log.info("making room for %s on %s: %s %s %s (%s)", name, self.node, e.action, e.dataset, e.version,
                     e.reason)
        if any(e.action == "evicted" for e in done):
            # the evicted bytes count until they are deleted: delete them now, the stage needs the room
            background.purge(tier.root)

    def _stop_prefetches(self, tier: RootDir, name: str, job_id: str, wait: float = PREEMPT_WAIT) -> list[str]:
        """Ask the prefetches staging other datasets in ``tier`` to yield, and remove the
        staging areas of those that did within ``wait`` seconds (their reservations go
        with them); the datasets whose staging areas went."""
        from .lock import ask_to_yield, clear_yield
        layout = Layout(tier.root)
        others = {e.rpartition(".")[0] for e in tier.names("staging")} - {name}
        asked = [o for o in sorted(others) if ask_to_yield(layout.lock(o), job_id or "?")]
        deadline = time.monotonic() + wait
        stopped = []
        for other in asked:
            try:
                with _lock(layout, other, max(0.0, deadline - time.monotonic()), ""):
                    if self._remove_staging(tier, other):
                        stopped.append(other)
            except LockTimeout:
                continue  # still staging: its space stays taken
            finally:
                clear_yield(layout.lock(other))
        for other in stopped:
            log.info("job %s: stopped the prefetch of %s on %s and removed its staging area: the job needs the "
                     "room now", job_id or "?", other, self.node)
        return stopped

    def reclaim_stale(self, snap: Snapshot) -> list[Lease]:
        """Remove the leases of jobs that the demand snapshot shows are gone: not running
        anywhere, and the lease older than the snapshot (a job that started since keeps
        it). Nothing on a stale snapshot; process leases are checked as by ``reclaim``."""
        if snap.stale(self.clock(), self.config.retention.demand_max_age):
            return []

        def alive(lease: Lease) -> bool:
            if not lease.is_job:
                return holder_alive(lease, lambda _j: True)
            return lease.job_id in snap.running or lease.taken >= snap.time - CLOCK_SKEW

        return self._reclaim(alive)

    # -- release, verify -------------------------------------------------------

    def release(self, name: str, job_id: str) -> bool:
        ds = self.dataset(name)
        with open_tier(self.layout(ds.tier)) as tier:
            return LeaseBook(tier).release(name, job_id)

    def reclaim(self, job_alive: Callable[[str], bool]) -> list[Lease]:
        """Remove the leases on this node whose job (or process) is gone, and damaged lease
        files: left behind when an Epilog never ran, they would keep copies from ever
        being evicted. ``job_alive`` asks Slurm; the Epilog uses ``reclaim_stale``."""
        return self._reclaim(lambda lease: holder_alive(lease, job_alive))

    def _reclaim(self, alive: Callable[[Lease], bool]) -> list[Lease]:
        gone: list[Lease] = []
        for tier_conf in self.config.tiers.values():
            with open_tier(self.layout(tier_conf)) as tier:
                book = LeaseBook(tier)
                for name in book.datasets():
                    leases, damaged = book.reclaim(name, alive)
                    gone += leases
                    for n in damaged:
                        log.warning("removed damaged lease file %s", tier.path("leases", name, n))
        return gone

    def release_job(self, job_id: str) -> list[Lease]:
        """Release every lease of ``job_id`` on this node (what the Epilog does)."""
        released = []
        for tier_conf in self.config.tiers.values():
            with open_tier(self.layout(tier_conf)) as tier:
                book = LeaseBook(tier)
                for lease in book.of_job(job_id):
                    book.release(lease.dataset, lease.job_id)
                    released.append(lease)
        return released

    def verify(self, name: str, *, full: bool = False) -> VerifyResult:
        ds = self.dataset(name)
        digest = self.current(name)
        layout = self.layout(ds.tier)
        with open_tier(layout) as tier:
            state = self.ready_state(tier, name, digest)
            if not full or not state.ready:
                return VerifyResult(dataset=name, digest=digest, path=layout.version_dir(name, digest), mode="quick",
                                    ok=state.ready, reason=state.reason)
            from .lock import DatasetLock
            with DatasetLock(layout.lock(name), timeout=self.config.lock_timeout, what=f"dataset {name!r}",
                             action="verify"), local_errors(f"verifying {name!r} in {layout.root}"):
                return self._verify_full_locked(tier, ds, digest)

    def _verify_full_locked(self, tier: RootDir, ds: Dataset, digest: str) -> VerifyResult:
        """Re-hash the published copy; fetch again what is wrong, atomically per file. A
        copy that cannot be repaired is flagged bad (never ready) before the error rises."""
        from . import stager
        manifest = self.load_manifest(ds.name, digest)
        vid = version_id(digest)
        vfd = tier.dir("datasets", ds.name, vid)
        vdir = tier.path("datasets", ds.name, vid)
        bad = stager.check_tree(vfd, manifest.entries, self.config.transfer.hash_threads)
        if bad:
            self.count([("verify_failures", {"dataset": ds.name}, 1)])
        result = VerifyResult(dataset=ds.name, digest=digest, path=vdir, mode="full", ok=True,
                              reason="every file matches the manifest", checked_files=manifest.files)
        result.removed_extras = stager.sweep_extras(vfd, manifest.entries)
        if bad:
            by_path = {e.path: e for e in manifest.entries}
            part = Manifest(name=ds.name, digest=digest, entries=[by_path[b.path] for b in bad],
                            total_bytes=sum(by_path[b.path].size for b in bad), created=manifest.created)
            repair = nodefs.staging_name(ds.name, digest) + ".repair"
            sdir = tier.dir("staging")
            nodefs.remove_at(sdir, repair)
            try:
                os.mkdir(repair, 0o700, dir_fd=sdir)
                rfd = tier.dir("staging", repair)
                try:
                    stager.fill(rfd, tier.path("staging", repair), part, ds.source, self.config.transfer,
                                reader=self.reader())
                except (VerifyError, OutOfTime, DsstageError) as exc:
                    publish.flag_bad(tier, ds.name, digest, f"verify --full found {len(bad)} bad file(s)")
                    raise type(exc)(f"{exc} (the copy on {self.node} is flagged bad: no job gets it until "
                                    "a stage repairs it)") from None
                publish.seal(rfd, gid=0)
                with nodefs.Tree(rfd) as src, nodefs.Tree(vfd, create=True) as dst:
                    for e in part.entries:
                        sfd, sname = src.split(e.path)
                        dfd, dname = dst.split(e.path)
                        # rename over the bad file: a job reading it keeps its open file
                        os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
            finally:
                tier.forget("staging", repair)
                nodefs.remove_at(sdir, repair)
            result.repaired = [b.path for b in bad]
            result.reason = f"repaired {len(bad)} file(s): " + "; ".join(b.describe() for b in bad[:3])
        if bad or result.removed_extras:
            publish.seal(vfd, gid=0)
        return result

    # -- what is here ------------------------------------------------------------

    def warm(self, name: str, *, user: cat.User, progress: Callable[[str, int, int], None] | None = None,
             deadline: float | None = None) -> StageResult:
        """Make ``name`` ready on this node without keeping a lease (``dsstage warm``, ahead
        of a reservation or a campaign): the copy then stays as retention decides, its last
        use being now."""
        holder, pid = default_holder()
        result = self.stage(name, user=user, job_id=holder, pid=pid, progress=progress, deadline=deadline)
        self.release(name, holder)
        result.job_id = ""
        return result

    def report(self) -> dict[str, object]:
        """Rebuild and publish this node's report (see dsstage.report), and write the
        metrics' textfile if configured; best effort."""
        from . import report
        rep = report.refresh(self, self.run_dir)
        textfile = self.config.metrics.textfile
        if rep and textfile:
            from . import metrics
            try:
                metrics.export(textfile.replace("{node}", self.node), self.run_dir, self.node, rep["tiers"],
                               rep["copies"])
            except (OSError, DsstageError) as exc:
                log.warning("cannot write the metrics file %s: %s", textfile, exc)
        return rep

    def count(self, events: list[tuple[str, dict[str, str], float]]) -> None:
        """Add to this node's metrics counters (see dsstage.metrics; never raises for I/O)."""
        from . import metrics
        metrics.count(self.run_dir, self.node, events)


def _lock(layout: Layout, name: str, wait: float, held: str) -> AbstractContextManager[object]:
    """The dataset lock of ``name``, unless the caller holds it already (``held``)."""
    if name == held:
        return nullcontext()
    from .lock import DatasetLock
    return DatasetLock(layout.lock(name), timeout=wait, what=f"dataset {name!r}")


#: seconds of clock difference tolerated between the node and the demand poller's host
CLOCK_SKEW = 60.0


def _human(n: int) -> str:
    from .units import human
    return human(n)


@contextmanager
def state_errors(state_dir: str) -> Iterator[None]:
    """A failing shared state directory (ESTALE, EIO, ...) is the site's problem, not the node's."""
    try:
        yield
    except OSError as exc:
        raise StateError(f"the shared state directory {state_dir} failed ({exc.strerror or exc}); "
                         "check its filesystem (NFS, Lustre) on this node") from None
