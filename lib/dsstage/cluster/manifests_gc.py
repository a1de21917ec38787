"""Old manifest versions in the state directory: removed once no node holds them.

Every ``dsstage manifest build`` that finds a change adds a version; the old ones matter
while some node still holds (or stages) a copy of that version: a stage of the new version
reuses its unchanged files, and ``verify`` of a leased old copy needs it. The demand poller
removes a version when it is not the current one, no node report lists a copy of it, and
it was superseded more than ``retention.manifest_keep`` ago (the time ``CURRENT`` last
changed), so that a node whose report is late has time to send it. A node that never
reported is not known to hold anything: a copy it holds of a pruned version is only
evicted, never staged from.
"""

from __future__ import annotations

import os

from dsstage.cluster.reports import read_all
from dsstage.config.manifest import CURRENT, SUFFIX, Catalog
from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.fs.layout import read_current, version_id
from dsstage.shards import index as shard_index


def held_versions(state_dir: str) -> set[tuple[str, str]]:
    """(dataset, version) of every copy in a node report, whatever its state."""
    return {(str(c.get("dataset", "")), str(c.get("version", "")))
            for r in read_all(state_dir) for c in r["copies"]}


def prune(conf: Config, now: float) -> list[tuple[str, str]]:
    """Remove the manifests nobody needs any more (see the module doc); return (name, digest)."""
    catalog = Catalog(conf.state_dir)
    held = held_versions(conf.state_dir)
    removed: list[tuple[str, str]] = []
    try:
        names = sorted(os.listdir(catalog.root))
    except FileNotFoundError:
        return removed
    for name in names:
        try:
            current = read_current(conf.state_dir, name)
            superseded = os.stat(os.path.join(catalog.dir(name), CURRENT)).st_mtime
        except (OSError, ValueError):
            continue  # no CURRENT, or a damaged one: leave the directory to the admin
        if current is None or now - superseded < conf.retention.manifest_keep:
            continue
        files = os.listdir(catalog.dir(name))
        keep = {current} | current_shards(catalog, name, files, current)
        for f in files:
            digest = f[:-len(SUFFIX)] if f.endswith(SUFFIX) else ""
            if not digest or digest in keep or (name, version_id(digest)) in held:
                continue
            try:
                os.unlink(os.path.join(catalog.dir(name), f))
            except FileNotFoundError:
                continue
            removed.append((name, digest))
        # a version's shard indexes go with it (its shards' manifests went above, unless a node holds them)
        left = set(os.listdir(catalog.dir(name)))
        for f in files:
            if shard_index.is_index(f) and shard_index.index_version(f) + SUFFIX not in left:
                try:
                    os.unlink(os.path.join(catalog.dir(name), f))
                except FileNotFoundError:
                    pass
    return removed


def current_shards(catalog: Catalog, name: str, files: list[str], current: str) -> set[str]:
    """The shard digests of the current version, in any split its indexes describe."""
    out: set[str] = set()
    for f in files:
        if shard_index.is_index(f) and shard_index.index_version(f) == current:
            try:
                index = shard_index.load(catalog, name, current, shard_index.index_count(f))
                out.update(s.digest for s in index.shards)
            except (DsstageError, ValueError):
                continue  # damaged: its shards are rebuilt by the next manifest build
    return out
