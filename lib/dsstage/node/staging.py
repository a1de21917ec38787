"""A stage as named steps over the node's store: authorize the user, reuse a ready copy, take the
dataset lock, make room (dsstage.node.eviction), fill a staging area (dsstage.node.stager, from the
source and the job's peers), publish it, and lease it to the job; ``warm`` is a stage without a job.

The node report is refreshed (dsstage.node.inventory) once the transfer is about to start, so it
shows the dataset as staging; the store itself never writes the report.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from dsstage.config import catalog as cat
from dsstage.config.manifest import Manifest
from dsstage.config.model import Dataset
from dsstage.errors import DsstageError
from dsstage.fs import layout as fs_layout
from dsstage.fs.layout import Layout, version_id
from dsstage.fs.safe import RootDir
from dsstage.node import background, eviction, inventory, publish, space, verifying
from dsstage.node import report as node_report
from dsstage.node.lease import Lease, LeaseBook, check_job_id, default_holder
from dsstage.node.store import Prefetching, StageResult, Store, local_errors, open_tier
from dsstage.transfer import peers

if TYPE_CHECKING:  # the staging machinery is imported only when a stage needs it
    from dsstage.node.stager import FillReport


log = logging.getLogger(__name__)


def stage(store: Store, name: str, *, user: cat.User, job_id: str, pid: int = 0, full: bool = False,
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
    dsstage.cluster.prefetch) and then waits for the lock as for any other holder. ``prefetch``:
    this stage is one, which waits for no lock and evicts nothing it spares.

    ``nodes``: the job's nodes (a Slurm hostlist); with ``peers.enabled`` and more than
    one, this node copies its share from the source and the rest from them."""
    started = time.monotonic()
    ds = store.dataset(name)
    cat.authorize(ds, user)
    check_job_id(job_id)
    digest = store.current(name)
    layout = store.layout(ds.tier)
    result = StageResult(dataset=name, digest=digest, path=layout.version_dir(name, digest), tier=ds.tier,
                         node=store.node, action="cached", job_id=job_id)
    lease = Lease(dataset=name, digest=digest, job_id=job_id, user=user.name, node=store.node,
                  taken=store.clock(), host=socket.gethostname(), pid=pid)
    with open_tier(layout) as tier:
        book = LeaseBook(tier)
        with local_errors(f"staging {name!r} into {layout.root}"):
            store.apply_access(tier, ds)
            if not full and ds.verify == "quick" and store.ready_state(tier, name, digest).ready:
                book.take(lease)
                if store.ready_state(tier, name, digest).ready:  # see "Leases and eviction" above
                    result.seconds = time.monotonic() - started
                    return result
                book.release(name, job_id)
        from dsstage.node.lock import DatasetLock, ask_to_yield
        wait = 0.0 if prefetch else store.config.lock_timeout
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        if not prefetch:
            ask_to_yield(layout.lock(name), job_id)
        with DatasetLock(layout.lock(name), timeout=wait, job_id=job_id, what=f"dataset {name!r} on {store.node}",
                         action="prefetch" if prefetch else "stage"):
            with local_errors(f"staging {name!r} into {layout.root}"):
                store.apply_access(tier, ds)
                state = store.ready_state(tier, name, digest)
                if state.ready and (full or ds.verify == "full"):
                    vr = verifying.verify_locked(store, tier, ds, digest)
                    result.action = "repaired" if vr.repaired or vr.removed_extras else "cached"
                elif not state.ready:
                    log.info("staging %s version %s on %s: %s", name, version_id(digest), store.node, state.reason)
                    inventory.refresh(store)
                    if on_staging:
                        on_staging()
                    report = _fill(store, tier, ds, digest, deadline, job_id, progress, prefetch,
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


def _fill(store: Store, tier: RootDir, ds: Dataset, digest: str, deadline: float | None,
                  job_id: str = "", progress: Callable[[str, int, int], None] | None = None,
                  prefetch: Prefetching | None = None, nodes: str = "") -> FillReport:
    from dsstage.node import stager
    name = ds.name
    manifest = store.load_manifest(name, digest)
    staging = fs_layout.staging_name(name, digest)
    record = space.stage_record(staging)
    store.remove_staging(tier, name, keep=staging)
    publish.take_back(tier, name, digest)
    older = _older_versions(store, tier, name, digest)
    reusable = {(e.size, e.hash) for _, m in older for e in m.entries}
    needed = sum(e.size for e in manifest.entries if (e.size, e.hash) not in reusable)
    tier_conf = store.config.tiers[ds.tier]
    eviction.make_room(store, tier, tier_conf, name, needed, prefetch.spare if prefetch else None,
                    resumed=record, job_id=job_id)
    transfer = store.config.transfer
    if prefetch and prefetch.bwlimit:
        # rsync's --bwlimit is KiB/s per stream; the copier spreads streams x bwlimit over its threads
        transfer = replace(transfer, bwlimit=max(1, prefetch.bwlimit // 1024 // max(1, transfer.streams)))
    linked: dict[int, tuple[int, int]] = {}
    with space.reservation(tier, tier_conf.name, tier_conf.capacity, record, needed,
                           f"dataset {name!r}", store.node):
        sfd = tier.dir("staging", staging, mode=0o700)  # only once the space is promised
        report = stager.fill(sfd, tier.path("staging", staging), manifest, ds.source, transfer,
                             [(fd, m) for fd, m in older], deadline=deadline, reader=store.reader(),
                             linked=linked, progress=node_report.ProgressNote(
                                 store.run_dir, store.node, tier_conf.name, name, version_id(digest), job_id,
                                 interval=store.config.report.interval,
                                 publish_to=node_report.publish_target(store.config), also=progress),
                             group=peers.group_for(store.config.peers, nodes, store.node), tier=tier_conf.name)
        versions = [version_id(m.digest) for _fd, m in older]
        publish.publish(tier, name, digest, {
            "files": manifest.files, "bytes": manifest.total_bytes, "staged_at": store.clock(),
            "node": store.node, "linked": {versions[i]: b for i, (_f, b) in linked.items()},
            **({"prefetched_for": prefetch.job_id, "expected_start": prefetch.start} if prefetch else {})})
    background.flush_later(Layout(tier.root), name, digest)
    return report


def _older_versions(store: Store, tier: RootDir, name: str, digest: str) -> list[tuple[int, Manifest]]:
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


def warm(store: Store, name: str, *, user: cat.User, progress: Callable[[str, int, int], None] | None = None,
         deadline: float | None = None) -> StageResult:
    """Make ``name`` ready on this node without keeping a lease (``dsstage warm``, ahead
    of a reservation or a campaign): the copy then stays as retention decides, its last
    use being now."""
    holder, pid = default_holder()
    result = stage(store, name, user=user, job_id=holder, pid=pid, progress=progress, deadline=deadline)
    store.release(name, holder)
    result.job_id = ""
    return result
