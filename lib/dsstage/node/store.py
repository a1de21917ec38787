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
following anything a user planted is ``dsstage.fs``; who may read a copy is ``access.py``;
space is ``space.py``; detached work is ``background.py``. Staging is
``staging.py``, retention applied ``eviction.py``, verification ``verifying.py``: each a
module of functions over this store, which itself never writes the node report or asks Slurm.

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
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from dsstage.config import catalog as cat
from dsstage.config.manifest import Catalog, Manifest
from dsstage.config.model import Config, Dataset, Tier
from dsstage.errors import DsstageError, StateError, StoreError, local_error
from dsstage.fs import layout as fs_layout
from dsstage.fs import runfiles, safe
from dsstage.fs.layout import Layout
from dsstage.fs.safe import RootDir
from dsstage.node import access, space
from dsstage.node.lease import Lease, LeaseBook, holder_alive
from dsstage.node.local import node_name
from dsstage.policy import demand, retention

if TYPE_CHECKING:  # the staging machinery is imported only when a stage needs it
    from dsstage.fs.identity import Identity
    from dsstage.policy.demand import Snapshot

log = logging.getLogger(__name__)
#: seconds a job's stage waits for the prefetches it asked to yield the room
PREEMPT_WAIT = 3.0


@contextmanager
def local_errors(what: str) -> Iterator[None]:
    """OSError of the local store as the store's error (ENOSPC: NoSpace, which never drains)."""
    try:
        yield
    except OSError as exc:
        raise local_error(exc, what) from None


def open_tier(layout: Layout, *, create: bool = True) -> RootDir:
    """The tier's RootDir with its directories (root-owned; staging, reserved, trash private).
    Before anything is created, a tier on the root filesystem that is not meant to be there
    (a disk that is not mounted) is refused: StoreError, the node's store is broken."""
    if create and not layout.root_filesystem:
        problem = safe.root_filesystem_problem(layout.root)
        if problem:
            raise StoreError(f"tier {layout.tier}: {problem}")
    with local_errors(f"cannot open the store at {layout.root}"):
        tier = RootDir(layout.root, create=create)
        try:
            if create:
                for sub in safe.TIER_DIRS:
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
    """A stage that is a prefetch for a pending job (dsstage.cluster.prefetch)."""

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
                 clock: Callable[[], float] = time.time, run_dir: str | None = None, one_job: bool = False) -> None:
        """``one_job``: the store of one Prolog or Epilog, whose datasets' current versions are
        read once (Catalog's ``remember``)."""
        self.config = config
        self.node = node or node_name()
        #: node-local runtime state (the node's report, the metrics' counters)
        self.run_dir = run_dir or runfiles.default_run_dir()
        self.manifests = Catalog(config.state_dir, remember=one_job)
        self.clock = clock
        self._reader: Identity | None | bool = False

    # -- where things are ------------------------------------------------------

    def layout(self, tier: str | Tier) -> Layout:
        t = tier if isinstance(tier, Tier) else self.config.tiers[tier]
        return Layout(t.root(self.node), t.name, t.root_filesystem)

    def dataset(self, name: str) -> Dataset:
        return cat.lookup(self.config, name)

    def reader(self) -> Identity | None:
        """Who reads mounted sources: the configured source_user, else root."""
        if self._reader is False:
            user = self.config.source_user
            from dsstage.fs import identity
            self._reader = identity.lookup(user) if user else None
        return self._reader  # type: ignore[return-value]

    # -- the shared state directory --------------------------------------------

    def current(self, name: str) -> str:
        with state_errors(self.config.state_dir):
            return self.manifests.require_current(name)

    def current_copies(self, name: str) -> set[str] | None:
        """The version ids a current copy of ``name`` has: the current version's, or for a
        sharded dataset its shards' (dsstage.shards.index); None if that cannot be read."""
        try:
            with state_errors(self.config.state_dir):
                current = self.manifests.current(name)
                ds = self.config.datasets.get(name)
                if current is None:
                    return None
                if ds is None or not ds.shards:
                    return {fs_layout.version_id(current)}
                from dsstage.shards import index as shard_index
                return set(shard_index.load(self.manifests, name, current, ds.shards).by_id())
        except (DsstageError, OSError):
            return None

    def shard_digests(self, name: str, version: str) -> list[str]:
        """The shard digests of ``version`` of sharded dataset ``name``."""
        from dsstage.shards import index as shard_index
        ds = self.dataset(name)
        with state_errors(self.config.state_dir):
            return [s.digest for s in shard_index.load(self.manifests, name, version, ds.shards or 0).shards]

    def load_manifest(self, name: str, digest: str) -> Manifest:
        with state_errors(self.config.state_dir):
            return self.manifests.load(name, digest)

    # -- the quick check -------------------------------------------------------

    def ready_state(self, tier: RootDir, name: str, digest: str) -> ReadyState:
        """Whether the copy of version ``digest`` is ready, at a cost independent of its size."""
        reason = fs_layout.not_ready(tier, name, digest)
        if reason:
            return ReadyState(False, reason)
        return ReadyState(True, fs_layout.READY)

    # -- staging ---------------------------------------------------------------

    def remove_staging(self, tier: RootDir, name: str, keep: str = "") -> list[str]:
        """Remove the staging areas of ``name`` (but ``keep``), the partial files beside them
        and their reservations: left by killed stages of versions no longer wanted. Needs
        the dataset lock."""
        removed = []
        for entry in tier.names("staging"):
            area = fs_layout.staging_of(entry)  # a staging area, or the partial files beside one
            if area.rpartition(".")[0] == name and area != keep:
                tier.forget("staging", entry)
                safe.remove_at(tier.dir("staging"), entry)
                if area == entry:
                    space.forget(tier, space.stage_record(entry))
                removed.append(entry)
        return removed

    def ready_digests(self, tier: RootDir, name: str) -> list[str]:
        fd = tier.has_dir("ready", name)
        out = []
        for f in tier.names("ready", name):
            digest = safe.read_json_at(fd, f).get("digest")
            if isinstance(digest, str):
                out.append(digest)
        return out

    def apply_access(self, tier: RootDir, ds: Dataset) -> None:
        access.apply(tier, ds, origin=self.config.origin, node=self.node)

    # -- retention and eviction --------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The poller's demand snapshot, read as ``report.user`` where set: under
        ``PrivateData=jobs`` the snapshot is that user's alone (0600), which root on an NFS
        client that squashes root could not read."""
        from dsstage.fs.identity import writing_as
        with writing_as(self.config.report.user):
            return demand.read(self.config.state_dir)

    def demand(self) -> tuple[retention.Demand, Snapshot]:
        """The queue's demand from the poller's snapshot (stale if old or missing)."""
        snap = self.snapshot()
        # which nodes hold each version counts only where they serve each other (peers across jobs)
        return snap.demand(self.clock(), self.config.retention.demand_max_age, copies=self.config.peers.enabled), snap

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



    # -- what is here ------------------------------------------------------------

    def count(self, events: list[tuple[str, dict[str, str], float]]) -> None:
        """Add to this node's metrics counters (see dsstage.node.metrics; never raises for I/O)."""
        from dsstage.node import metrics
        metrics.count(self.run_dir, self.node, events)


def _lock(layout: Layout, name: str, wait: float, held: str) -> AbstractContextManager[object]:
    """The dataset lock of ``name``, unless the caller holds it already (``held``)."""
    if name == held:
        return nullcontext()
    from dsstage.node.lock import DatasetLock
    return DatasetLock(layout.lock(name), timeout=wait, what=f"dataset {name!r}")


#: seconds of clock difference tolerated between the node and the demand poller's host
CLOCK_SKEW = 60.0


def _human(n: int) -> str:
    from dsstage.units import human
    return human(n)


@contextmanager
def state_errors(state_dir: str) -> Iterator[None]:
    """A failing shared state directory (ESTALE, EIO, ...) is the site's problem, not the node's."""
    try:
        yield
    except OSError as exc:
        raise StateError(f"the shared state directory {state_dir} failed ({exc.strerror or exc}); "
                         "check its filesystem (NFS, Lustre) on this node") from None
