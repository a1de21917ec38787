"""Verifying a local copy against its manifest: quick (the ready mark, O(1)) or full (re-hash every
file, repair what differs, remove what the manifest does not name), under the dataset lock.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from dsstage.config.manifest import Manifest
from dsstage.config.model import Dataset
from dsstage.errors import DsstageError, OutOfTime, VerifyError
from dsstage.fs import beneath, safe
from dsstage.fs import layout as fs_layout
from dsstage.fs.layout import version_id
from dsstage.fs.safe import RootDir
from dsstage.node import publish, treecheck
from dsstage.node.store import Store, VerifyResult, local_errors, open_tier
from dsstage.transfer import check

if TYPE_CHECKING:  # the staging machinery is imported only when a stage needs it
    pass


log = logging.getLogger(__name__)


def verify(store: Store, name: str, *, full: bool = False) -> VerifyResult:
    ds = store.dataset(name)
    digest = store.current(name)
    layout = store.layout(ds.tier)
    if ds.shards:
        return verify_shards(store, ds, digest, full=full)
    with open_tier(layout) as tier:
        state = store.ready_state(tier, name, digest)
        if not full or not state.ready:
            return VerifyResult(dataset=name, digest=digest, path=layout.version_dir(name, digest), mode="quick",
                                ok=state.ready, reason=state.reason)
        from dsstage.node.lock import DatasetLock
        with DatasetLock(layout.lock(name), timeout=store.config.lock_timeout, what=f"dataset {name!r}",
                         action="verify"), local_errors(f"verifying {name!r} in {layout.root}"):
            return verify_locked(store, tier, ds, digest)


def verify_shards(store: Store, ds: Dataset, version: str, *, full: bool = False) -> VerifyResult:
    """A sharded dataset: each of the current version's shards this node holds, checked as a
    version of its own; ok when there is at least one and every one is (repairs included)."""
    current = store.current_copies(ds.name) or set()
    layout = store.layout(ds.tier)
    result = VerifyResult(dataset=ds.name, digest=version, path=os.path.join(layout.root, "datasets", ds.name),
                          mode="full" if full else "quick", ok=True, reason="")
    with open_tier(layout) as tier:
        here = [v for v in tier.names("datasets", ds.name) if v in current]
        if not here:
            result.ok, result.reason = False, f"no shard of version {version_id(version)} on this node"
            return result
        digests = {version_id(d): d for d in store.shard_digests(ds.name, version)}
        bad = []
        for vid in here:
            state = store.ready_state(tier, ds.name, digests[vid])
            if not state.ready:
                bad.append(f"shard {vid}: {state.reason}")
                continue
            if full:
                from dsstage.node.lock import DatasetLock
                with DatasetLock(layout.lock(ds.name), timeout=store.config.lock_timeout, what=f"dataset {ds.name!r}",
                                 action="verify"), local_errors(f"verifying {ds.name!r} in {layout.root}"):
                    one = verify_locked(store, tier, ds, digests[vid])
                result.checked_files += one.checked_files
                result.repaired += one.repaired
                result.removed_extras += one.removed_extras
    result.ok = not bad
    result.reason = "; ".join(bad) if bad else (
        f"{len(here)} of the version's {ds.shards} shards are on this node, "
        + ("every file matches its manifest" if full else "each ready"))
    return result


def verify_locked(store: Store, tier: RootDir, ds: Dataset, digest: str) -> VerifyResult:
    """Re-hash the published copy; fetch again what is wrong, atomically per file. A
    copy that cannot be repaired is flagged bad (never ready) before the error rises."""
    from dsstage.node import stager
    from dsstage.transfer.transport import Area, for_source
    manifest = store.load_manifest(ds.name, digest)
    vid = version_id(digest)
    vfd = tier.dir("datasets", ds.name, vid)
    vdir = tier.path("datasets", ds.name, vid)
    bad = check.check_tree(vfd, manifest.entries, store.config.transfer.hash_threads)
    if bad:
        store.count([("verify_failures", {"dataset": ds.name}, 1)])
    result = VerifyResult(dataset=ds.name, digest=digest, path=vdir, mode="full", ok=True,
                          reason="every file matches the manifest", checked_files=manifest.files)
    result.removed_extras = treecheck.sweep_extras(vfd, manifest.entries)
    if bad:
        by_path = {e.path: e for e in manifest.entries}
        part = Manifest(name=ds.name, digest=digest, entries=[by_path[b.path] for b in bad],
                        total_bytes=sum(by_path[b.path].size for b in bad), created=manifest.created)
        repair = fs_layout.staging_name(ds.name, digest) + ".repair"
        sdir = tier.dir("staging")
        safe.remove_at(sdir, repair)
        try:
            os.mkdir(repair, 0o700, dir_fd=sdir)
            rfd = tier.dir("staging", repair)
            try:
                area = Area(rfd, tier.path("staging", repair), store.config.transfer)
                stager.fill(area, part, for_source(ds.source, area, store.reader()))
            except (VerifyError, OutOfTime, DsstageError) as exc:
                publish.flag_bad(tier, ds.name, digest, f"verify --full found {len(bad)} bad file(s)")
                raise type(exc)(f"{exc} (the copy on {store.node} is flagged bad: no job gets it until "
                                "a stage repairs it)") from None
            with beneath.Tree(rfd) as src, beneath.Tree(vfd, create=True) as dst:
                for e in part.entries:
                    with src.parent(e.path) as (sfd, sname), dst.parent(e.path) as (dfd, dname):
                        # rename over the bad file: a job reading it keeps its open file
                        os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        finally:
            tier.forget("staging", repair)
            safe.remove_at(sdir, repair)
        result.repaired = [b.path for b in bad]
        result.reason = f"repaired {len(bad)} file(s): " + "; ".join(b.describe() for b in bad[:3])
        if ds.shards:  # a shard's views link the files replaced: link them to the repaired ones
            from dsstage.shards import views
            views.relink(tier, ds.name, vid, result.repaired)
    if bad or result.removed_extras:
        publish.seal(vfd, gid=0)
    if result.repaired and not ds.shards:  # a live view links the files replaced: to the repaired ones
        from dsstage.node import live
        live.complete(tier, ds.name, digest, result.repaired, whole=False)
    return result
