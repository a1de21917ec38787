"""Building a manifest: walk a dataset's source (as ``source_user``, never following a link),
hash every regular file with the adaptive limiter, and write the new version
(``dsstage manifest build``). The format is dsstage.config.manifest.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dsstage.config.manifest import Entry, Manifest, check_entries, check_lengths, compute_digest
from dsstage.errors import ManifestError
from dsstage.fs.beneath import open_source_dir
from dsstage.fs.identity import Identity, acting_as
from dsstage.fs.safe import O_DIR
from dsstage.transfer import hashing, parallel


@dataclass
class BuildReport:
    manifest: Manifest
    hashed: int = 0  # files whose content was read
    reused: int = 0  # files whose hash came from the previous manifest
    skipped: dict[str, list[str]] = field(default_factory=dict)  # kind -> paths
    unchanged: bool = False  # same digest as before


def walk(root_fd: int, shown: str = "", limiter: parallel.Limiter | None = None,
         reader: Identity | None = None) -> list[tuple[str, os.stat_result | None, str]]:
    """(relative path, stat, kind) of everything below directory ``root_fd``, sorted by
    path; kind is "file", or "symlink"/"special" for what a manifest skips (stat None).
    Directories are opened relative to their parent without following links, so a
    directory swapped for a link while walking is skipped, never followed.

    A level of the tree at a time, its directories are listed and then their entries
    examined (a stat per file, an open per directory) on ``limiter``'s threads: on a
    network filesystem each of those is a round trip, which many in flight hide. Every
    thread reads as ``reader``."""
    gate = limiter or parallel.Limiter(1, 1)
    out: list[tuple[str, os.stat_result | None, str]] = []
    level: list[tuple[str, int]] = [("", os.dup(root_fd))]
    opened = {fd for _rel, fd in level}  # every descriptor not yet closed, whatever fails
    mutex = threading.Lock()

    def listing(d: tuple[str, int]) -> list[tuple[str, os.DirEntry[str]]]:
        rel_dir, fd = d
        try:
            with acting_as(reader), os.scandir(fd) as it:
                return [(f"{rel_dir}/{de.name}" if rel_dir else de.name, de) for de in it]
        except OSError as exc:
            raise ManifestError(f"cannot read {os.path.join(shown, rel_dir)}: {exc.strerror}") from None

    def examine(item: tuple[str, os.DirEntry[str], int]) -> tuple[str, os.stat_result | None, str, int | None]:
        rel, de, parent = item
        try:
            with acting_as(reader):
                st = de.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                try:
                    with acting_as(reader):
                        fd = os.open(de.name, O_DIR, dir_fd=parent)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        return rel, None, "symlink", None  # swapped for a link since the listing
                    raise
                with mutex:
                    opened.add(fd)
                return rel, None, "dir", fd
        except OSError as exc:
            raise ManifestError(f"cannot read {os.path.join(shown, rel)}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            return rel, None, "symlink", None
        return (rel, st, "file", None) if stat.S_ISREG(st.st_mode) else (rel, None, "special", None)

    try:
        while level:
            listed = parallel.run(level, listing, gate)
            items = [(rel, de, fd) for (_r, fd), found in zip(level, listed) for rel, de in found or ()]
            examined = parallel.run(items, examine, gate)
            for _rel, done in level:  # the level's entries are all examined: its directories are done
                opened.discard(done)
                os.close(done)
            level = []
            for got in examined:
                if got is not None:
                    rel, st, kind, sub = got
                    if sub is not None:
                        level.append((rel, sub))
                    else:
                        out.append((rel, st, kind))
    finally:
        for fd in opened:
            os.close(fd)
    out.sort(key=lambda t: t[0])
    return out


@dataclass(frozen=True)
class ReadOptions:
    """How a build reads its source: as ``reader`` (source_user; None: root), hashing with
    ``threads`` (0: one per CPU), and up to ``max_parallel`` directories, stats and files at
    once while more go faster (parallel.Limiter.for_source), for a network filesystem."""

    reader: Identity | None = None
    threads: int = 0
    max_parallel: int = 0


def build(name: str, root: str, *, source: str = "", previous: Manifest | None = None,
          how: ReadOptions = ReadOptions(), progress: Callable[[int, int], None] | None = None,
          clock: Callable[[], float] = time.time) -> BuildReport:
    """Walk ``root`` and describe every regular file; reuse hashes from ``previous``
    for files whose size and mtime did not change. Files are listed and read below one
    descriptor of ``root``, never through a symbolic link, as ``how`` says (ReadOptions).

    ``progress(files_done_delta, files_to_hash)`` is called as files are hashed.
    """
    try:
        with acting_as(how.reader):
            root_fd = open_source_dir(os.path.abspath(root))
    except OSError as exc:
        raise ManifestError(f"source {root!r} of dataset {name!r} is not a readable directory ({exc.strerror}); "
                            "check the path, that it is mounted here and that it holds no symbolic link "
                            "(give the real path)") from None
    try:
        return _build(name, root, root_fd, source, previous, how, progress, clock)
    finally:
        os.close(root_fd)


def _build(name: str, root: str, root_fd: int, source: str, previous: Manifest | None, how: ReadOptions,
           progress: Callable[[int, int], None] | None, clock: Callable[[], float]) -> BuildReport:
    threads, reader, max_parallel = how.threads, how.reader, how.max_parallel
    old = {e.path: e for e in previous.entries} if previous else {}
    skipped: dict[str, list[str]] = {}
    found: list[tuple[str, int, int]] = []
    workers = hashing.default_threads(threads)
    gate = parallel.Limiter.for_source(workers, max_parallel, f"reading {root}")
    listing = walk(root_fd, root, gate, reader)
    for rel, st, kind in listing:
        if st is None:
            skipped.setdefault(kind, []).append(rel)
            continue
        found.append((rel, st.st_size, st.st_mtime_ns))
    found.sort()
    check_lengths([f[0] for f in found], f"source of {name!r}")  # before any is hashed

    entries: list[Entry | None] = []
    todo: list[int] = []
    for rel, size, mtime in found:
        prev = old.get(rel)
        if prev is not None and prev.size == size and prev.mtime_ns == mtime:
            entries.append(prev)
        else:
            entries.append(None)
            todo.append(len(entries) - 1)

    def tick(n: int) -> None:
        if progress:
            progress(n, len(todo))

    hashes = hashing.hash_many(root_fd, [found[i][0] for i in todo], threads,
                               progress=tick if progress else None, reader=reader, max_parallel=max_parallel)
    for i, got in zip(todo, hashes):
        rel, size, mtime = found[i]
        if got is None:
            raise ManifestError(f"cannot read {os.path.join(root, rel)!r} while building the manifest of {name!r} "
                                "(missing, no longer a regular file, a symbolic link in its path, or unreadable)")
        if got[0] != size:
            raise ManifestError(f"{os.path.join(root, rel)!r} changed while the manifest of {name!r} was built; "
                                "build it again once the source is quiet")
        entries[i] = Entry(rel, size, mtime, got[1])
    final = [e for e in entries if e is not None]
    check_entries(final, f"source of {name!r}")
    digest = compute_digest(final)
    manifest = Manifest(name=name, digest=digest, entries=final, total_bytes=sum(e.size for e in final),
                        created=clock(), source=source)
    return BuildReport(manifest=manifest, hashed=len(todo), reused=len(final) - len(todo), skipped=skipped,
                       unchanged=previous is not None and previous.digest == digest)


@dataclass(frozen=True)
class Drift:
    """How a source differs from a manifest, by path, size and mtime (no content is read)."""

    added: list[str]
    removed: list[str]
    changed: list[str]  # size or mtime differ

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.changed)


def compare(found: list[tuple[str, int, int]], manifest: Manifest) -> Drift:
    """The drift between the source's files (path, size, mtime_ns) and ``manifest``."""
    now = {rel: (size, mtime) for rel, size, mtime in found}
    then = {e.path: (e.size, e.mtime_ns) for e in manifest.entries}
    return Drift(added=sorted(set(now) - set(then)), removed=sorted(set(then) - set(now)),
                 changed=sorted(p for p in set(now) & set(then) if now[p] != then[p]))


def drift(manifest: Manifest, root: str, *, reader: Identity | None = None, max_parallel: int = 0,
          threads: int = 0) -> Drift:
    """Walk ``root`` as ``build`` does (as ``reader``, never following a link) and compare
    what is there with ``manifest`` by size and mtime (``dsstage manifest check``)."""
    name = manifest.name
    try:
        with acting_as(reader):
            root_fd = open_source_dir(os.path.abspath(root))
    except OSError as exc:
        raise ManifestError(f"source {root!r} of dataset {name!r} is not a readable directory ({exc.strerror}); "
                            "check that it is mounted here") from None
    try:
        gate = parallel.Limiter.for_source(hashing.default_threads(threads), max_parallel, f"reading {root}")
        found = [(rel, st.st_size, st.st_mtime_ns) for rel, st, _kind in walk(root_fd, root, gate, reader)
                 if st is not None]
    finally:
        os.close(root_fd)
    return compare(found, manifest)
