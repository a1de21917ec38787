"""A sharded dataset's part on this node: the shards a job gave it, each staged as a copy of
its own (``datasets/<name>/<shard id>``: ready mark, verification and eviction per shard),
all held by the job's one lease, and shown to the job as one view (dsstage.shards.views).

Each shard is staged by dsstage.node.staging as a version whose manifest is the shard's
(dsstage.shards.index), so what holds for a version (resume after the budget, the space
reservation, make-room, the ready mark) holds for each shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from dsstage.errors import ManifestError
from dsstage.node import access, staging
from dsstage.node.store import StageResult, Store, local_errors, open_tier, state_errors
from dsstage.shards import index as shard_index
from dsstage.shards import views
from dsstage.shards.split import Shard

log = logging.getLogger(__name__)


@dataclass
class PartResult:
    """What a stage of this node's part did: the view the job reads, and each shard's stage."""

    dataset: str
    version: str
    shards: list[Shard]
    view: views.View
    results: list[StageResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def action(self) -> str:
        return "staged" if any(r.action == "staged" for r in self.results) else "cached"

    @property
    def transferred_files(self) -> int:
        return sum(r.transferred_files for r in self.results)

    @property
    def transferred_bytes(self) -> int:
        return sum(r.transferred_bytes for r in self.results)


def shards_of(store: Store, name: str, version: str) -> shard_index.Index:
    """The shards of ``version`` of sharded dataset ``name``, as its ``shards:`` splits it."""
    ds = store.dataset(name)
    if not ds.shards:
        raise ManifestError(f"dataset {name!r} is not sharded")
    with state_errors(store.config.state_dir):
        return shard_index.load(store.manifests, name, version, ds.shards)


def stage_part(store: Store, name: str, version: str, shard_ids: Sequence[str], job: staging.StageRequest, *,
               progress: Callable[[str, int, int], None] | None = None,
               replicas: Mapping[str, str] | None = None) -> PartResult:
    """Make shards ``shard_ids`` (ids of ``version``'s shards) ready on this node, leased to
    ``job.job_id``, and their view; raises as a stage does (OutOfTime keeps the work so far).
    ``replicas``: shard id -> the job's nodes (a hostlist) that stage that shard too, where
    there are more nodes than shards: they share its transfer through the peers."""
    started = time.monotonic()
    index = shards_of(store, name, version)
    by_id = index.by_id()
    unknown = [s for s in shard_ids if s not in by_id]
    if unknown or not shard_ids:
        raise ManifestError(f"dataset {name!r}: shard(s) {', '.join(unknown) or '(none)'} are not shards of version "
                            f"{version[:16]}; requeue the job to stage the current version")
    shards = sorted((by_id[s] for s in dict.fromkeys(shard_ids)), key=lambda s: s.index)
    results: list[StageResult] = []
    leased: tuple[str, ...] = ()
    for shard in shards:
        results.append(staging.stage(store, name, replace(job, digest=shard.digest, shard_of=version, leased=leased,
                                                          replicas=(replicas or {}).get(shard.id, "")),
                                     progress=progress))
        leased = (*leased, shard.digest)
    ds = store.dataset(name)
    layout = store.layout(ds.tier)
    with open_tier(layout) as tier, local_errors(f"making the view of {name!r} in {layout.root}"):
        # the views' top directory carries the dataset's access before any view is made in it
        access.apply(tier, ds, origin=store.config.origin, node=store.node, top=views.TOP)
        view = views.find(tier, name, [s.id for s in shards])
        if view is None:
            with staging.dataset_lock(store, layout, name, job):
                manifests = [store.load_manifest(name, s.digest) for s in shards]
                view = views.make(tier, name, manifests)
    return PartResult(name, version, shards, view, results, time.monotonic() - started)
