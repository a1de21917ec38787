"""Checking a tree on this node's disk against its manifest: every listed file that is missing
or wrong. ``verify --full``, what rsync and the peers deliver (dsstage.transfer.transport,
dsstage.transfer.peers) and the fast ``verify --full`` of a ready copy (dsstage.cli.fast)
share it; it imports neither the configuration nor the staging machinery, so that the fast
path does not pay for them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from dsstage.config.manifest import Entry, Mismatch
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
