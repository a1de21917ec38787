"""Checking a tree on this node's disk against its manifest: the files that are missing or
wrong, and what is there that the manifest does not list.

``verify --full``, the checks after rsync and peers (dsstage.node.stager) and the fast
``verify --full`` of a ready copy (dsstage.cli.fast) share it; it imports neither the
configuration nor the staging machinery, so that the fast path does not pay for them.
"""

from __future__ import annotations

import stat
import threading
from collections.abc import Callable, Generator, Sequence

from dsstage.config.manifest import Entry, Mismatch
from dsstage.fs import safe
from dsstage.fs.beneath import Tree
from dsstage.node.publish import dirs_of
from dsstage.transfer import hashing, native


def check_tree(root_fd: int, entries: Sequence[Entry], threads: int = 0,
               progress: Callable[[int], None] | None = None) -> list[Mismatch]:
    """Every entry of ``entries`` that is missing or wrong below ``root_fd``, a tree on this
    node's disk, in the manifest's order: an I/O error of the disk raises the node's
    StoreError, or OSError (which the caller's local_errors makes one), never a mismatch
    blamed on the source. Files below hashing.LARGE are hashed by the native helper where
    there is one (dsstage.transfer.native: many small files cost Python's per-file work,
    serialised by the GIL), the larger ones here, each on BLAKE3's threads."""
    small = [e for e in entries if e.size < hashing.LARGE]
    rest, done = native.check_some(root_fd, small, hashing.default_threads(threads), progress)
    if len(small) < len(entries):
        rest += [e for e in entries if e.size >= hashing.LARGE]
    if progress and not done.complete and done.files:  # checked again here: counted once
        progress = _counting_after(done.files, progress)
    found = {e.path: what for e, what in done.failures}
    got = hashing.hash_many(root_fd, [e.path for e in rest], threads, progress, disk_errors=True, mapped=True)
    for e, g in zip(rest, got):
        if g is None or g[0] != e.size or g[1] != e.hash:
            found[e.path] = "missing" if g is None else f"size {g[0]}" if g[0] != e.size else g[1]
    if not found:
        return []
    return [Mismatch(e.path, str(e.size) if what == "missing" or what.startswith("size ") else e.hash, what)
            for e in entries if (what := found.get(e.path))]


def _counting_after(skip: int, progress: Callable[[int], None]) -> Callable[[int], None]:
    """``progress``, passed only what comes after the first ``skip`` units (from threads)."""
    mutex = threading.Lock()
    left = [skip]

    def counted(n: int) -> None:
        with mutex:
            taken = min(left[0], n)
            left[0] -= taken
        if n > taken:
            progress(n - taken)
    return counted


def extras(root_fd: int, entries: Sequence[Entry]) -> Generator[tuple[int, str], None, None]:
    """What is below ``root_fd`` that the manifest does not list, as (its directory's
    descriptor, its name), from the directories' listings: a directory that holds no listed
    file, a file not listed, anything that is neither a directory nor a regular file. The
    descriptor is open until the next item."""
    wanted = {e.path for e in entries}
    dirs = dirs_of(wanted)
    with Tree(root_fd) as tree:
        for fd, found in tree.listing(descend=lambda rel: rel in dirs):
            for name, rel, kind in found:
                keep = rel in dirs if kind == stat.S_IFDIR else kind == stat.S_IFREG and rel in wanted
                if not keep:
                    yield fd, name


def sweep_extras(root_fd: int, entries: Sequence[Entry]) -> int:
    """Remove everything below ``root_fd`` that the manifest does not list (extras); return
    the count (a published copy checked by ``verify --full``, which is sealed again only if
    this or the check changed it)."""
    removed = 0
    for fd, name in extras(root_fd, entries):
        safe.remove_at(fd, name)
        removed += 1
    return removed
