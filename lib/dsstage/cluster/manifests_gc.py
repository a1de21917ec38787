"""Old manifest versions in the state directory: removed once no node holds them.

Every ``dsstage manifest build`` that finds a change adds a version; the old ones matter
while some node still holds (or stages) a copy of that version: a stage of the new version
reuses its unchanged files, and ``verify`` of a leased old copy needs it. The demand poller
removes a version when it is not the current one, no node report lists a copy of it, and
it was superseded more than ``retention.manifest_keep`` ago (the time ``CURRENT`` last
changed), so that a node whose report is late has time to send it. A node that never
reported is not known to hold anything: a copy it holds of a pruned version is only
evicted, never staged from. Entries are removed as the directory's owner (``as_owner``): where
NFS squashes root, root could remove nothing there.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext

from dsstage.cluster.reports import read_all
from dsstage.config.manifest import CURRENT, SUFFIX, Catalog
from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.fs.layout import read_current, version_id
from dsstage.shards import index as shard_index

log = logging.getLogger(__name__)


def held_versions(state_dir: str) -> set[tuple[str, str]]:
    """(dataset, version) of every copy in a node report, whatever its state."""
    return {(str(c.get("dataset", "")), str(c.get("version", "")))
            for r in read_all(state_dir) for c in r["copies"]}


def prune(conf: Config, now: float) -> list[tuple[str, str]]:
    """Remove the manifests nobody needs any more (see the module doc); return (name, digest).
    A dataset's directory that cannot be pruned (its data owner's entries are data: a FIFO
    named ``CURRENT``, a directory named like a manifest) is logged and skipped, never a stop
    for the datasets after it."""
    catalog = Catalog(conf.state_dir)
    held = held_versions(conf.state_dir)
    removed: list[tuple[str, str]] = []
    try:
        names = sorted(os.listdir(catalog.root))
    except FileNotFoundError:
        return removed
    for name in names:
        try:
            removed += prune_one(catalog, conf, name, held, now)
        except (OSError, ValueError) as exc:
            log.warning("manifests of %s: not pruned: %s", name, exc)
    return removed


def prune_one(catalog: Catalog, conf: Config, name: str, held: set[tuple[str, str]],
              now: float) -> list[tuple[str, str]]:
    """Prune dataset ``name``'s directory (see ``prune``)."""
    try:
        current = read_current(conf.state_dir, name)
        superseded = os.lstat(os.path.join(catalog.dir(name), CURRENT)).st_mtime
    except (OSError, ValueError):
        return []  # no CURRENT, or a damaged one: leave the directory to the admin
    if current is None or now - superseded < conf.retention.manifest_keep:
        return []
    removed: list[tuple[str, str]] = []
    files = os.listdir(catalog.dir(name))
    keep = {current} | current_shards(catalog, name, files, current)
    with as_owner(catalog.dir(name)):
        for f in files:
            digest = f[:-len(SUFFIX)] if f.endswith(SUFFIX) else ""
            if not digest or digest in keep or (name, version_id(digest)) in held:
                continue
            if _unlink(catalog.dir(name), f):
                removed.append((name, digest))
        # a version's shard indexes go with it (its shards' manifests went above, unless a node holds them)
        left = set(os.listdir(catalog.dir(name)))
        for f in files:
            if shard_index.is_index(f) and shard_index.index_version(f) + SUFFIX not in left:
                _unlink(catalog.dir(name), f)
    return removed


def as_owner(directory: str) -> AbstractContextManager[None]:
    """Remove entries of a dataset's manifest directory as the user who owns it (its data
    owner, or report.user): root on a client of an NFS export with root_squash may remove
    nothing there, that user may, and can do no more than it could itself. Root's directory,
    or an owner unknown here: as root."""
    st = os.stat(directory, follow_symlinks=False)
    if st.st_uid == 0 or os.geteuid() != 0:
        return nullcontext()
    import pwd

    from dsstage.errors import ConfigError
    from dsstage.fs.identity import acting_as, lookup
    try:
        ident = lookup(pwd.getpwuid(st.st_uid).pw_name, "the manifest directory's owner")
    except (KeyError, ConfigError):
        return nullcontext()  # unknown here, or no identity switch on this machine: as root
    return acting_as(ident)


def _unlink(directory: str, f: str) -> bool:
    """Remove entry ``f`` (never followed: a link goes, not what it names); False, logged, if
    it is gone or cannot go (a directory its data owner made there is theirs to remove)."""
    try:
        os.unlink(os.path.join(directory, f))
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("%s: not removed (%s): remove it by hand", os.path.join(directory, f), exc.strerror)
        return False


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
