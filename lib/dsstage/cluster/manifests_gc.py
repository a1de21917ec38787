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
from dsstage.fs.layout import read_current, version_id


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
        for f in os.listdir(catalog.dir(name)):
            digest = f[:-len(SUFFIX)] if f.endswith(SUFFIX) else ""
            if not digest or digest == current or (name, version_id(digest)) in held:
                continue
            try:
                os.unlink(os.path.join(catalog.dir(name), f))
            except FileNotFoundError:
                continue
            removed.append((name, digest))
    return removed
