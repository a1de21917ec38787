"""Making a directory hold exactly what a manifest describes.

``fill`` reuses files from versions already on the node (hard links: published files are
immutable, so sharing an inode is safe), copies the rest (a mounted source: the verifying
copier; ssh and rsync daemons: rsync, then every file is hashed), removes anything the
manifest does not list, fetches what is wrong once more, and raises VerifyError naming
the file if it is still wrong.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import copier, hashing
from .config import Source, Transfer
from .errors import SourceError, VerifyError
from .manifest import Entry, Manifest, Mismatch
from .transfer import TransferStats, fetch

log = logging.getLogger(__name__)


@dataclass
class FillReport:
    transferred: TransferStats = field(default_factory=TransferStats)
    linked_files: int = 0
    linked_bytes: int = 0
    refetched: list[str] = field(default_factory=list)
    removed_extras: int = 0


def check_tree(root: str, entries: Sequence[Entry], threads: int = 0,
               progress: Callable[[int], None] | None = None) -> list[Mismatch]:
    """Every entry of ``entries`` that is missing or wrong under ``root``."""
    bad: list[Mismatch] = []
    to_hash: list[Entry] = []
    for e in entries:
        try:
            st = os.lstat(os.path.join(root, e.path))
        except OSError:
            bad.append(Mismatch(e.path, str(e.size), "missing"))
            continue
        if not stat.S_ISREG(st.st_mode):
            bad.append(Mismatch(e.path, str(e.size), "missing"))
        elif st.st_size != e.size:
            bad.append(Mismatch(e.path, str(e.size), f"size {st.st_size}"))
        else:
            to_hash.append(e)
    hashes = hashing.hash_many([os.path.join(root, e.path) for e in to_hash], threads, progress)
    for e, h in zip(to_hash, hashes):
        if h != e.hash:
            bad.append(Mismatch(e.path, e.hash, h or "missing"))
    return bad


def sweep_extras(root: str, entries: Sequence[Entry]) -> int:
    """Remove everything under ``root`` that the manifest does not list; return the count."""
    wanted = {e.path for e in entries}
    dirs = {p.rsplit("/", 1)[0] for p in wanted if "/" in p}
    for d in list(dirs):
        while "/" in d:
            d = d.rsplit("/", 1)[0]
            dirs.add(d)
    removed = 0
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(root, rel_dir) if rel_dir else root) as it:
            for de in it:
                rel = f"{rel_dir}/{de.name}" if rel_dir else de.name
                if de.is_dir(follow_symlinks=False):
                    if rel in dirs:
                        stack.append(rel)
                        continue
                    shutil.rmtree(de.path)
                    removed += 1
                elif rel not in wanted or not de.is_file(follow_symlinks=False):
                    os.unlink(de.path)
                    removed += 1
    return removed


def link_reuse(dest: str, entries: Sequence[Entry], older: Sequence[tuple[str, Manifest]]) -> tuple[int, int]:
    """Hard-link into ``dest`` the files that an older local version has with the same
    content; return (files, bytes) linked."""
    have: dict[tuple[str, int, str], str] = {}
    for root, m in older:
        for e in m.entries:
            have.setdefault((e.path, e.size, e.hash), root)
        # the same content under another name is worth reusing too
        for e in m.entries:
            have.setdefault(("", e.size, e.hash), os.path.join(root, e.path))
    files = nbytes = 0
    for e in entries:
        target = os.path.join(dest, e.path)
        if os.path.lexists(target):
            continue
        src = have.get((e.path, e.size, e.hash))
        src = os.path.join(src, e.path) if src else have.get(("", e.size, e.hash))
        if not src:
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(src, target)
        except OSError:
            continue  # another filesystem, or the old copy is gone: fetch it instead
        files += 1
        nbytes += e.size
    return files, nbytes


def fill(dest: str, manifest: Manifest, source: Source, transfer: Transfer,
         older: Sequence[tuple[str, Manifest]] = ()) -> FillReport:
    """Make ``dest`` hold exactly ``manifest``; raise VerifyError if the source cannot."""
    report = FillReport()
    resumed = [e for e in manifest.entries if os.path.lexists(os.path.join(dest, e.path))]
    report.linked_files, report.linked_bytes = link_reuse(dest, manifest.entries, older)
    copy = _copy_local if source.kind == "local" else _copy_rsync
    if resumed and source.kind == "local":
        # left by an interrupted stage: renamed into place only once verified, but a crash
        # of the node may have lost what was not yet on disk
        _remove(dest, check_tree(dest, resumed, transfer.hash_threads))
    stats, bad = copy(dest, manifest.entries, source, transfer)
    report.transferred = stats
    report.removed_extras = sweep_extras(dest, manifest.entries)
    if bad:
        log.info("%d file(s) of %s failed verification; fetching them again", len(bad), manifest.name)
        _remove(dest, bad)
        by_path = {e.path: e for e in manifest.entries}
        again = [by_path[m.path] for m in bad]
        stats, bad = copy(dest, again, source, transfer)
        report.transferred.add(stats)
        report.refetched = [e.path for e in again]
    if bad:
        raise VerifyError(mismatch_message(manifest.name, bad))
    return report


def _copy_local(dest: str, entries: Sequence[Entry], source: Source,
                transfer: Transfer) -> tuple[TransferStats, list[Mismatch]]:
    """Mounted source: copy what is missing, verifying each file as it is copied."""
    if not os.path.isdir(source.path):
        raise SourceError(f"source {source.raw} is not reachable from this node (not a directory); "
                          "check that it is mounted, or ask the admins")
    return copier.copy_verified(source.path, dest, entries, threads=copier.THREADS,
                                bwlimit=transfer.bwlimit * 1024 * transfer.streams)


def _copy_rsync(dest: str, entries: Sequence[Entry], source: Source,
                transfer: Transfer) -> tuple[TransferStats, list[Mismatch]]:
    """Remote source: rsync what is missing, then verify every file."""
    stats = fetch(source, dest, entries, transfer)
    return stats, check_tree(dest, entries, transfer.hash_threads)


def _remove(dest: str, bad: Sequence[Mismatch]) -> None:
    for m in bad:
        try:
            os.unlink(os.path.join(dest, m.path))
        except FileNotFoundError:
            pass


def mismatch_message(name: str, bad: Sequence[Mismatch]) -> str:
    shown = "; ".join(m.describe() for m in bad[:3])
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    cause = ("the source no longer has them" if all(m.found == "missing" for m in bad)
             else "the source changed after its manifest was built")
    return (f"dataset {name!r}, even after fetching again: {shown}{more}; {cause}: nothing was published; "
            f"an admin should run `dsstage manifest build {name}`")
