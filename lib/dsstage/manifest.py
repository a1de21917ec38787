"""BLAKE3 manifests: what a dataset version is, file by file.

A manifest lives at ``<state_dir>/manifests/<name>/<digest>.manifest``; the file
``CURRENT`` beside it names the version jobs get now. Older manifests stay so that a
node can tell which files a new version shares with the copy it already holds.

File format (UTF-8, raw bytes of non-UTF-8 names kept through surrogateescape)::

    #dsstage-manifest 2 {"name": ..., "digest": ..., "files": N, "bytes": B, ...}
    <blake3 hex>\t<size>\t<path>          one line per regular file, sorted by path
    #mtimes
    <mtime_ns>                             one line per file, in the same order

In ``path`` a backslash, newline, tab and carriage return are written ``\\\\``, ``\\n``,
``\\t``, ``\\r``. The root digest is the BLAKE3 of the file lines (bytes between the
header and ``#mtimes``), so touching a file does not make a new version while any change
of content, size or name does; and it is checked with one call over one buffer, which keeps
loading a manifest of a million files fast.

What a source may hold: regular files are the dataset. Symbolic links, sockets, FIFOs
and devices are skipped (a link could point outside the dataset or at another user's
data) and counted in the build report; directories exist only as the files in them
need, so an empty directory is not recorded.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from . import hashing, parallel
from .errors import ManifestError
from .fsutil import write_atomic
from .identity import Identity, acting_as
from .nodefs import O_DIR, open_source_dir, read_current

MAGIC = "#dsstage-manifest 2 "
MTIMES = "#mtimes\n"
CURRENT = "CURRENT"
SUFFIX = ".manifest"


class Entry(NamedTuple):
    path: str
    size: int
    mtime_ns: int
    hash: str


@dataclass
class Manifest:
    name: str
    digest: str
    entries: list[Entry]
    total_bytes: int
    created: float
    source: str = ""

    @property
    def files(self) -> int:
        return len(self.entries)


@dataclass(frozen=True)
class Mismatch:
    """A file that does not match its manifest entry."""

    path: str
    expected: str
    found: str  # "missing", "size N", "not ..." (a link, not readable), or the hash found

    def describe(self) -> str:
        if self.found == "missing":
            return f"{self.path!r} is missing"
        if self.found.startswith("size "):
            return f"{self.path!r} has {self.found}, the manifest says size {self.expected}"
        if self.found.startswith("not "):
            return f"{self.path!r} is {self.found}"
        return f"{self.path!r} has blake3 {self.found[:16]}..., the manifest says {self.expected[:16]}..."


@dataclass
class BuildReport:
    manifest: Manifest
    hashed: int = 0  # files whose content was read
    reused: int = 0  # files whose hash came from the previous manifest
    skipped: dict[str, list[str]] = field(default_factory=dict)  # kind -> paths
    unchanged: bool = False  # same digest as before


# -- paths -------------------------------------------------------------------------

_ESC = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_UNESC = {"\\": "\\", "n": "\n", "t": "\t", "r": "\r"}


def escape(path: str) -> str:
    if not any(c in path for c in _ESC):
        return path
    return "".join(_ESC.get(c, c) for c in path)


def unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            nxt = text[i + 1:i + 2]
            if nxt not in _UNESC:
                raise ValueError(f"bad escape in {text!r}")
            out.append(_UNESC[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def path_problem(path: str) -> str | None:
    """Why a manifest path is unsafe, or None: it must stay inside the dataset."""
    if not path:
        return "empty path"
    if "\0" in path:
        return "NUL byte in path"
    if path.startswith("/"):
        return "absolute path"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return f"path component {part!r} is not allowed"
    return None


_SUSPICIOUS = ("\n/", "\n./", "\n../", "//", "/./", "/../", "/\n", "/.\n", "/..\n", "\n.\n", "\n..\n", "\n\n", "\0")


def _any_suspicious(paths: Sequence[str]) -> bool:
    """Whether any path might fail path_problem(): a few substring searches over all paths
    joined (C speed); a name containing a newline can only cause a false alarm."""
    joined = "\n" + "\n".join(paths) + "\n"
    return any(pattern in joined for pattern in _SUSPICIOUS)


def check_entries(entries: Sequence[Entry], origin: str) -> None:
    """Reject unsafe paths, duplicates, and a path that is both a file and a directory."""
    paths = [e.path for e in entries]
    if _any_suspicious(paths):
        for p in paths:
            problem = path_problem(p)
            if problem:
                raise ManifestError(f"{origin}: {problem}: {p!r}; rebuild it with `dsstage manifest build`")
    seen = set(paths)
    if len(seen) != len(paths):
        dup = next(p for p, n in _counts(paths).items() if n > 1)
        raise ManifestError(f"{origin}: duplicate entry {dup!r}; rebuild it with `dsstage manifest build`")
    # every directory that holds a file, with its ancestors: none may also be a file
    dirs = {p.rpartition("/")[0] for p in paths}
    dirs.discard("")
    for d in list(dirs):
        while "/" in d:
            d = d.rpartition("/")[0]
            if d in dirs:
                break
            dirs.add(d)
    clash = dirs & seen
    if clash:
        parent = min(clash)
        child = next(p for p in paths if p.startswith(parent + "/"))
        raise ManifestError(f"{origin}: {parent!r} is listed as a file but also holds {child!r}")


def _counts(items: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


# -- digest, reading, writing -------------------------------------------------------

def _body(entries: Sequence[Entry]) -> bytes:
    return "".join(f"{e.hash}\t{e.size}\t{escape(e.path)}\n" for e in entries).encode("utf-8", "surrogateescape")


def compute_digest(entries: Sequence[Entry]) -> str:
    import blake3
    return str(blake3.blake3(_body(entries)).hexdigest())


def write(manifest: Manifest, path: str) -> None:
    """Write atomically (temporary file, fsync, rename)."""
    header = {"name": manifest.name, "digest": manifest.digest, "files": manifest.files,
              "bytes": manifest.total_bytes, "created": manifest.created, "source": manifest.source}
    write_atomic(path, (MAGIC + json.dumps(header, sort_keys=True) + "\n").encode()
                 + _body(manifest.entries)
                 + (MTIMES + "".join(f"{e.mtime_ns}\n" for e in manifest.entries)).encode())


def read_header(path: str) -> dict[str, object]:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:
            first = fh.readline()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest; run `dsstage manifest build`") from None
    return _parse_header(first, path)


def _parse_header(first: str, path: str) -> dict[str, object]:
    if not first.startswith(MAGIC):
        raise ManifestError(f"{path}: not a dsstage manifest (bad first line); "
                            "rebuild it with `dsstage manifest build`")
    try:
        header = json.loads(first[len(MAGIC):])
    except ValueError:
        raise ManifestError(f"{path}: damaged header; rebuild it with `dsstage manifest build`") from None
    if not isinstance(header, dict) or not isinstance(header.get("digest"), str):
        raise ManifestError(f"{path}: damaged header; rebuild it with `dsstage manifest build`")
    return header


def read(path: str, *, check: bool = True) -> Manifest:
    """Load a manifest, checking that its digest matches its contents and its paths are safe."""
    # a million entries are millions of new objects and none is garbage: without this the
    # cyclic collector runs over and over while they are made (measured: 6 s -> 2 s at 1M)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _read(path, check)
    finally:
        if enabled:
            gc.enable()


def _read(path: str, check: bool) -> Manifest:
    import blake3
    try:
        with open(path, "rb") as fh:
            first = fh.readline().decode("utf-8", "surrogateescape")
            data = fh.read()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest; run `dsstage manifest build`") from None
    header = _parse_header(first, path)
    body, sep, mtimes_raw = data.partition(MTIMES.encode())
    if not sep and data:
        raise ManifestError(f"{path}: damaged (no {MTIMES.strip()} section); rebuild it with `dsstage manifest build`")
    digest = blake3.blake3(body).hexdigest()
    if check and digest != header["digest"]:
        raise ManifestError(f"{path}: contents do not match the digest in its header (it was edited or damaged); "
                            "rebuild it with `dsstage manifest build`")
    lines = body.decode("utf-8", "surrogateescape").split("\n")
    lines.pop()  # after the last newline
    mtimes = mtimes_raw.split()
    rows = [line.split("\t") for line in lines]
    new = tuple.__new__  # what Entry._make does, without a Python call per entry
    try:
        if len(mtimes) != len(rows):
            raise ValueError
        entries: list[Entry] = [new(Entry, (unescape(r[2]) if "\\" in r[2] else r[2], int(r[1]), int(m), r[0]))
                                for r, m in zip(rows, mtimes)]
    except (ValueError, IndexError):
        bad = next((n for n, r in enumerate(rows, start=2) if len(r) != 3 or not r[1].isdigit()), None)
        where = f"{path}:{bad}: malformed line" if bad else f"{path}: damaged mtimes"
        raise ManifestError(f"{where}; rebuild it with `dsstage manifest build`") from None
    if check:
        bad = next((n for n, r in enumerate(rows, start=2) if len(r[0]) != 64), None)
        if bad:
            raise ManifestError(f"{path}:{bad}: malformed hash; rebuild it with `dsstage manifest build`")
        check_entries(entries, path)
    return Manifest(name=str(header.get("name", "")), digest=digest, entries=entries,
                    total_bytes=sum(e.size for e in entries),
                    created=float(str(header.get("created") or 0)), source=str(header.get("source", "")))


class Catalog:
    """Where the manifests of one state directory live."""

    def __init__(self, state_dir: str) -> None:
        self.root = os.path.join(state_dir, "manifests")

    def dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def path(self, name: str, digest: str) -> str:
        return os.path.join(self.dir(name), digest + SUFFIX)

    def current(self, name: str) -> str | None:
        """The digest of the current version, or None if no manifest was built (cheap)."""
        try:
            return read_current(os.path.dirname(self.root), name)
        except ValueError:
            raise ManifestError(f"{self.dir(name)}/{CURRENT}: damaged; rebuild with "
                                f"`dsstage manifest build {name}`") from None

    def require_current(self, name: str) -> str:
        digest = self.current(name)
        if digest is None:
            raise ManifestError(f"dataset {name!r} has no manifest yet: an admin must run "
                                f"`dsstage manifest build {name}`")
        return digest

    def load(self, name: str, digest: str | None = None) -> Manifest:
        digest = digest or self.require_current(name)
        m = read(self.path(name, digest))
        if m.digest != digest:
            raise ManifestError(f"{self.path(name, digest)}: holds version {m.digest[:12]}, "
                                f"not {digest[:12]}; rebuild with `dsstage manifest build {name}`")
        return m

    def publish(self, manifest: Manifest) -> str:
        os.makedirs(self.dir(manifest.name), mode=0o755, exist_ok=True)
        path = self.path(manifest.name, manifest.digest)
        write(manifest, path)
        write_atomic(os.path.join(self.dir(manifest.name), CURRENT), manifest.digest + "\n")
        return path


# -- building -------------------------------------------------------------------------

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


def build(name: str, root: str, *, source: str = "", previous: Manifest | None = None,
          threads: int = 0, progress: Callable[[int, int], None] | None = None,
          clock: Callable[[], float] = time.time, reader: Identity | None = None,
          max_parallel: int = 0) -> BuildReport:
    """Walk ``root`` and describe every regular file; reuse hashes from ``previous``
    for files whose size and mtime did not change. Files are listed and read below one
    descriptor of ``root``, never through a symbolic link, as ``reader`` (source_user).

    ``progress(files_done_delta, files_to_hash)`` is called as files are hashed. Up to
    ``max_parallel`` directories, stats and files are read at once while more go faster
    (parallel.Limiter.for_source), for a source that is a network filesystem.
    """
    try:
        with acting_as(reader):
            root_fd = open_source_dir(os.path.abspath(root))
    except OSError as exc:
        raise ManifestError(f"source {root!r} of dataset {name!r} is not a readable directory ({exc.strerror}); "
                            "check the path, that it is mounted here and that it holds no symbolic link "
                            "(give the real path)") from None
    try:
        return _build(name, root, root_fd, source, previous, threads, progress, clock, reader, max_parallel)
    finally:
        os.close(root_fd)


def _build(name: str, root: str, root_fd: int, source: str, previous: Manifest | None, threads: int,
           progress: Callable[[int, int], None] | None, clock: Callable[[], float],
           reader: Identity | None, max_parallel: int) -> BuildReport:
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

