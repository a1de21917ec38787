"""Making a staging area hold exactly what a manifest describes.

``fill`` reuses files from versions already on the node (hard links: published files are
immutable, so sharing an inode is safe), copies the rest (a mounted source: the verifying
copier; ssh and rsync daemons: rsync, then every file is hashed), fetches what is wrong
once more, and raises VerifyError naming the file if it is still wrong; then, in one walk,
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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dsstage.config.manifest import Entry, Manifest, Mismatch
from dsstage.config.model import Source, Transfer
from dsstage.errors import OutOfTime, StoreError, VerifyError
from dsstage.fs import safe as fs_safe
from dsstage.fs.beneath import Tree
from dsstage.fs.identity import Identity
from dsstage.node import publish
from dsstage.node.treecheck import check_tree, sweep_extras
from dsstage.transfer import copier, peers
from dsstage.transfer.rsync import TransferStats, fetch

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


def fill(dest_fd: int, dest_path: str, manifest: Manifest, source: Source, transfer: Transfer,  # noqa: PLR0913
         older: Sequence[tuple[int, Manifest]] = (), *, deadline: float | None = None,
         reader: Identity | None = None, linked: dict[int, tuple[int, int]] | None = None,
         progress: Callable[[str, int, int], None] | None = None,
         group: peers.Group | None = None, tier: str = "",
         checked: Callable[[int], None] | None = None) -> FillStats:
    """Make the staging area ``dest_fd`` (at ``dest_path``) hold exactly ``manifest``, sealed;
    raise VerifyError if the source cannot, OutOfTime when ``deadline`` passes (work is kept).
    ``linked`` receives what was hard-linked from each older version. ``progress(phase,
    delta, total)``: "copying" in bytes, then (rsync sources) "verifying" in files.
    With ``group`` (the nodes of a job, this tier's name ``tier``), this node copies its
    share from the source and the rest from the other nodes (dsstage.transfer.peers); what comes
    back wrong from the source is fetched from the source again, as without peers.
    ``checked(dest_fd)`` is called once every file the area holds at its final name is
    verified and sealed from then on (what an earlier stage left was checked again): a live
    view (dsstage.node.live) may link them as they land. Not with ``group``: what rsync brings
    from a peer stands at its final name before it is hashed."""
    def copying(delta: int, total: int) -> None:
        if progress:  # with peers, several copies run at once: their progress is of the whole
            progress("copying", delta, manifest.total_bytes if group is not None else total)

    def verifying(total: int) -> Callable[[int], None] | None:
        return (lambda delta: progress("verifying", delta, total)) if progress else None

    report = FillStats()
    with Tree(dest_fd, create=True) as dest:
        there = dest.paths()
        resumed = [e for e in manifest.entries if e.path in there]
        reused = link_reuse(dest, manifest.entries, older, there)
    if linked is not None:
        linked.update(reused)
    report.linked_files = sum(f for f, _b in reused.values())
    report.linked_bytes = sum(b for _f, b in reused.values())

    def copy(entries: Sequence[Entry]) -> tuple[TransferStats, list[Mismatch]]:
        if source.kind == "local":
            return copier.copy_verified(source.path, dest_fd, entries, threads=copier.THREADS,
                                        hash_threads=transfer.hash_threads,
                                        bwlimit=transfer.bwlimit * 1024 * transfer.streams,
                                        deadline=deadline, reader=reader, progress=copying,
                                        max_parallel=transfer.max_parallel)
        stats = fetch(source, dest_path, entries, transfer, deadline=deadline, progress=copying)
        _check_time(deadline)
        return stats, check_tree(dest_fd, entries, transfer.hash_threads, verifying(len(entries)))

    if resumed and (source.kind == "local" or group is not None):
        # left by an interrupted stage: renamed into place only once verified, but a crash
        # of the node may have lost what was not yet on disk; and a stage with peers hashes
        # what a peer sent as it arrives, so a stage cut short may have left some unhashed
        _remove(dest_fd, check_tree(dest_fd, resumed, transfer.hash_threads))
    if checked is not None and group is None and source.kind == "local":
        checked(dest_fd)
    if group is not None:
        def present(entries: Sequence[Entry]) -> list[Entry]:
            # asked each round of each peer for that peer's share: a lookup of each, as
            # listing the whole area would cost the dataset, not the share, every round
            with Tree(dest_fd) as tree:
                return [e for e in entries if tree.exists(e.path)]

        total = manifest.total_bytes
        shared = peers.cooperate(
            group, peers.Where(manifest.name, manifest.digest, tier), dest_path, manifest.entries,
            present=present, check=lambda es: check_tree(dest_fd, es, transfer.hash_threads),
            remove=lambda bad: _remove(dest_fd, bad), from_source=copy, deadline=deadline,
            progress=lambda n: copying(n, total))
        stats, bad = shared.source, shared.bad
        report.from_peers, report.peers_given_up = shared.from_peers, shared.given_up
    else:
        stats, bad = copy(manifest.entries)
    report.transferred = stats
    if bad:
        log.info("%d file(s) of %s failed verification; fetching them again", len(bad), manifest.name)
        _remove(dest_fd, bad)
        by_path = {e.path: e for e in manifest.entries}
        again = [by_path[m.path] for m in bad]
        stats, bad = copy(again)
        report.transferred.add(stats)
        report.refetched = [e.path for e in again]
    if bad:
        sweep_extras(dest_fd, manifest.entries)  # kept for the next stage: only what it lists
        raise VerifyError(mismatch_message(manifest.name, bad))
    # what the manifest does not list goes, and the rest is sealed, in one walk; the files the
    # copier made sealed are not looked at again (with peers, what rsync brought from a peer
    # may stand where a file was made: all are checked)
    made = report.transferred.sealed if group is None else frozenset()
    report.removed_extras = publish.seal(dest_fd, gid=0, wanted={e.path for e in manifest.entries}, made=made)
    return report


def _check_time(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise OutOfTime("the transfer used up the time budget; what arrived is kept and the next stage resumes")


def _remove(dest_fd: int, bad: Sequence[Mismatch]) -> None:
    with Tree(dest_fd) as tree:
        for m in bad:
            try:
                with tree.parent(m.path) as (fd, name):
                    fs_safe.remove_at(fd, name)
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError as exc:
                raise StoreError(f"cannot remove {m.path!r} from the staging area: {exc.strerror}") from None


def mismatch_message(name: str, bad: Sequence[Mismatch]) -> str:
    shown = "; ".join(m.describe() for m in bad[:3])
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    cause = ("the source no longer has them" if all(m.found == "missing" for m in bad)
             else "the source changed after its manifest was built, or its reader may not read them")
    return (f"dataset {name!r}, even after fetching again: {shown}{more}; {cause}: nothing was published; "
            f"an admin should run `dsstage manifest build {name}`")
