"""Making a staging area hold exactly what a manifest describes.

``fill`` reuses files from versions already on the node (hard links: published files are
immutable, so sharing an inode is safe), copies the rest with the stage's transport
(dsstage.transfer.transport: a mounted source through the verifying copier; ssh and rsync
daemons through rsync, then every file is hashed; peers first where they are on), fetches
what is wrong once more, and raises VerifyError naming the file if it is still wrong; then, in one walk,
removes anything the manifest does not list and seals the rest (publish.seal: root-owned,
read-only), which leaves the area ready to publish.

Everything here works below directory descriptors (beneath.Tree, open_beneath): a link
in a staging area or a published copy is never followed. rsync writes by path into the
staging area, which is private to root (0700) inside a verified tier, and is run without
``-l``, so it creates no links there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsstage.config.manifest import Entry, Manifest, Mismatch
from dsstage.errors import VerifyError
from dsstage.fs.beneath import Tree
from dsstage.node import publish
from dsstage.node.treecheck import sweep_extras
from dsstage.transfer.rsync import TransferStats
from dsstage.transfer.transport import Area, Transport

log = logging.getLogger(__name__)


@dataclass
class FillStats:
    transferred: TransferStats = field(default_factory=TransferStats)
    linked_files: int = 0
    linked_bytes: int = 0
    refetched: list[str] = field(default_factory=list)
    removed_extras: int = 0
    from_peers: TransferStats = field(default_factory=TransferStats)  # transferred counts the source's only
    peers_given_up: dict[str, str] = field(default_factory=dict)  # peer -> why


def link_reuse(dest: Tree, entries: Sequence[Entry], older: Sequence[tuple[int, Manifest]],
               there: set[str]) -> dict[int, tuple[int, int]]:
    """Hard-link into ``dest`` the files not ``there`` yet (``dest.paths()``) that an older
    local version (its descriptor and manifest) has with the same content; return {older
    index: (files, bytes)} linked."""
    have: dict[tuple[str, int, str], tuple[int, str]] = {}
    for i, (_fd, m) in enumerate(older):
        for e in m.entries:
            have.setdefault((e.path, e.size, e.hash), (i, e.path))
            # the same content under another name is worth reusing too
            have.setdefault(("", e.size, e.hash), (i, e.path))
    linked: dict[int, tuple[int, int]] = {}
    if not older:
        return linked
    trees = [Tree(fd) for fd, _m in older]
    try:
        for e in entries:
            if e.path in there:
                continue
            src = have.get((e.path, e.size, e.hash)) or have.get(("", e.size, e.hash))
            if not src:
                continue
            i, rel = src
            try:
                with trees[i].parent(rel) as (sfd, sname), dest.parent(e.path) as (dfd, dname):
                    os.link(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue  # another filesystem, or the old copy is gone: fetch it instead
            files, nbytes = linked.get(i, (0, 0))
            linked[i] = (files + 1, nbytes + e.size)
    finally:
        for t in trees:
            t.close()
    return linked


def fill(area: Area, manifest: Manifest, transport: Transport, older: Sequence[tuple[int, Manifest]] = (), *,
         linked: dict[int, tuple[int, int]] | None = None) -> FillStats:
    """Make the staging area ``area`` hold exactly ``manifest``, sealed, with ``transport``
    (dsstage.transfer.transport: chosen from the source, peers wrapping it); raise VerifyError
    if the source cannot, OutOfTime when the area's deadline passes (work is kept).
    ``linked`` receives what was hard-linked from each older version. What comes back wrong
    from the source is fetched from the source again (``transport.origin``). ``transport.copy``
    is first called once what an earlier stage left was checked again, so that from then on
    every file the area holds at its final name is verified (a transport that switches a live
    view as files land, dsstage.node.live.Switching, relies on it)."""
    report = FillStats()
    with Tree(area.fd, create=True) as dest:
        there = dest.paths()
        resumed = [e for e in manifest.entries if e.path in there]
        reused = link_reuse(dest, manifest.entries, older, there)
    if linked is not None:
        linked.update(reused)
    report.linked_files = sum(f for f, _b in reused.values())
    report.linked_bytes = sum(b for _f, b in reused.values())
    if resumed and not transport.checks_all:
        # left by an interrupted stage: renamed into place only once verified, but a crash
        # of the node may have lost what was not yet on disk; and a stage with peers hashes
        # what a peer sent as it arrives, so a stage cut short may have left some unhashed
        area.remove(area.check(resumed))
    got = transport.copy(manifest.entries)
    stats, bad = got.source, got.bad
    report.from_peers, report.peers_given_up = got.from_peers, got.given_up
    report.transferred = stats
    if bad:
        log.info("%d file(s) of %s failed verification; fetching them again", len(bad), manifest.name)
        area.remove(bad)
        by_path = {e.path: e for e in manifest.entries}
        again = [by_path[m.path] for m in bad]
        got = transport.origin.copy(again)
        bad = got.bad
        report.transferred.add(got.source)
        report.refetched = [e.path for e in again]
    if bad:
        sweep_extras(area.fd, manifest.entries)  # kept for the next stage: only what it lists
        raise VerifyError(mismatch_message(manifest.name, bad))
    # what the manifest does not list goes, and the rest is sealed, in one walk; the files the
    # copier made sealed are not looked at again (with peers, what rsync brought from a peer
    # may stand where a file was made: all are checked)
    made = report.transferred.sealed if transport.verified_on_arrival else frozenset()
    report.removed_extras = publish.seal(area.fd, gid=0, wanted={e.path for e in manifest.entries}, made=made)
    return report


def mismatch_message(name: str, bad: Sequence[Mismatch]) -> str:
    shown = "; ".join(m.describe() for m in bad[:3])
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    cause = ("the source no longer has them" if all(m.found == "missing" for m in bad)
             else "the source changed after its manifest was built, or its reader may not read them")
    return (f"dataset {name!r}, even after fetching again: {shown}{more}; {cause}: nothing was published; "
            f"an admin should run `dsstage manifest build {name}`")
