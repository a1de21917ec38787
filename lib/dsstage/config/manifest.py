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

import codecs
import gc
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dsstage.errors import ManifestError
from dsstage.fs import jsontext, untrusted
from dsstage.fs.layout import read_current
from dsstage.fs.pathtext import escape, unescape
from dsstage.fs.safe import write_atomic

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
    shard_of: str = ""  # a shard's manifest: the digest of the version it is part of (dsstage.shards.index)

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
        """The file and the kind of mismatch, never a hash or size of what was read: what
        was read may be a file its data owner may not read (a directory of the source
        swapped for a link), and its hash or size would confirm a guess at its content."""
        if self.found == "missing":
            return f"{self.path!r} is missing"
        if self.found.startswith("size "):
            return f"{self.path!r} differs in size from the manifest"
        if self.found.startswith("not "):
            return f"{self.path!r} is {self.found}"
        return f"{self.path!r} differs in content from the manifest"


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


#: the longest path (bytes) inside a dataset: below a tier's dataset directory (up to 1 KiB
#: of its own) a job must still be able to open it by name, within PATH_MAX (4,096)
MAX_PATH = 3072


def check_lengths(paths: Sequence[str], origin: str) -> None:
    """Reject a path longer than MAX_PATH bytes, naming it."""
    if not paths or max(map(len, paths)) * 4 <= MAX_PATH:  # a character is at most 4 bytes
        return
    for p in paths:
        n = len(os.fsencode(p))
        if n > MAX_PATH:
            shown = p if len(p) <= 120 else p[:60] + "..." + p[-40:]
            raise ManifestError(f"{origin}: {shown!r} is {n} bytes long, longer than the {MAX_PATH} a dataset's "
                                "path may be (a job could not open it below its dataset directory): shorten "
                                "it, or flatten the directories, in the source")


def check_entries(entries: Sequence[Entry], origin: str) -> None:
    """Reject unsafe paths, paths too long to open below a dataset directory, duplicates,
    and a path that is both a file and a directory."""
    paths = [e.path for e in entries]
    if _any_suspicious(paths):
        for p in paths:
            problem = path_problem(p)
            if problem:
                raise ManifestError(f"{origin}: {problem}: {p!r}; rebuild it with `dsstage manifest build`")
    check_lengths(paths, origin)
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


def _body(entries: Sequence[Entry]) -> bytes:
    return "".join(f"{e.hash}\t{e.size}\t{escape(e.path)}\n" for e in entries).encode("utf-8", "surrogateescape")


def compute_digest(entries: Sequence[Entry]) -> str:
    import blake3
    return str(blake3.blake3(_body(entries)).hexdigest())


def write(manifest: Manifest, path: str) -> None:
    """Write atomically (temporary file, fsync, rename)."""
    header = {"name": manifest.name, "digest": manifest.digest, "files": manifest.files,
              "bytes": manifest.total_bytes, "created": manifest.created, "source": manifest.source}
    if manifest.shard_of:
        header["shard_of"] = manifest.shard_of
    write_atomic(path, (MAGIC + jsontext.dumps(header, sort_keys=True) + "\n").encode()
                 + _body(manifest.entries)
                 + (MTIMES + "".join(f"{e.mtime_ns}\n" for e in manifest.entries)).encode())


#: the largest manifest root reads (about 30 million files); a larger file is refused as
#: damaged: its data owner writes it (dsstage.fs.untrusted)
MANIFEST_MAX = 4 * 2**30
#: the largest file a manifest may list (1 PiB): a size past it is a lie, not a file
FILE_MAX = 2**50


def _refused(path: str, exc: untrusted.Refused) -> ManifestError:
    return ManifestError(f"{exc}; the manifest is not read: rebuild it with `dsstage manifest build`")


def read_header(path: str) -> dict[str, object]:
    """The header of the manifest at ``path``, read without blocking or following a link, at
    most its first 64 KiB. Its ``files`` and ``bytes`` are not covered by the digest: a reader
    that trusts them checks them (``header_bytes``)."""
    try:
        first = untrusted.first_line(path)
    except untrusted.Refused as exc:
        raise _refused(path, exc) from None
    if first is None:
        raise ManifestError(f"{path}: no such manifest; run `dsstage manifest build`")
    return _parse_header(first.decode("utf-8", "surrogateescape") + "\n", path)


def header_bytes(header: dict[str, object], path: str) -> int:
    """The header's ``bytes``: a whole number from 0 up to what a manifest can list, else a
    ManifestError (it is not covered by the digest)."""
    value = header.get("bytes", 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= FILE_MAX * 2**25:
        raise ManifestError(f"{path}: its header says {value!r} bytes, not a size; rebuild it with "
                            "`dsstage manifest build`")
    return value


def _parse_header(first: str, path: str) -> dict[str, object]:
    if not first.startswith(MAGIC):
        raise ManifestError(f"{path}: not a dsstage manifest (bad first line); "
                            "rebuild it with `dsstage manifest build`")
    try:
        header = jsontext.loads(first[len(MAGIC):])
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
        raw = untrusted.read_bytes(path, MANIFEST_MAX)
    except untrusted.Refused as exc:
        raise _refused(path, exc) from None
    if raw is None:
        raise ManifestError(f"{path}: no such manifest; run `dsstage manifest build`")
    # slices of one buffer (a memoryview), not copies: a manifest near its bound is read once
    start = raw.find(b"\n") + 1 or len(raw)
    header = _parse_header(raw[:start].decode("utf-8", "surrogateescape"), path)
    sep = raw.find(b"\n" + MTIMES.encode(), start - 1) + 1  # at a line's start: a file may be named #mtimes
    if sep <= 0 and len(raw) > start:
        raise ManifestError(f"{path}: damaged (no {MTIMES.strip()} section); rebuild it with `dsstage manifest build`")
    sep = len(raw) if sep <= 0 else sep
    view = memoryview(raw)
    body = view[start:sep]
    digest = blake3.blake3(body).hexdigest()
    if check and digest != header["digest"]:
        raise ManifestError(f"{path}: contents do not match the digest in its header (it was edited or damaged); "
                            "rebuild it with `dsstage manifest build`")
    lines = codecs.decode(body, "utf-8", "surrogateescape").split("\n")
    lines.pop()  # after the last newline
    mtimes = bytes(view[sep + len(MTIMES):]).split()
    del body, view, raw
    rows = [line.split("\t") for line in lines]
    new = tuple.__new__  # what Entry._make does, without a Python call per entry
    try:
        if len(mtimes) != len(rows):
            raise ValueError
        entries: list[Entry] = [new(Entry, (unescape(r[2]) if "\\" in r[2] else r[2], int(r[1]), int(m), r[0]))
                                for r, m in zip(rows, mtimes)]
    except (ValueError, IndexError):
        bad = next((n for n, r in enumerate(rows, start=2) if len(r) != 3 or not _size_ok(r[1])), None)
        where = f"{path}:{bad}: malformed line" if bad else f"{path}: damaged mtimes"
        raise ManifestError(f"{where}; rebuild it with `dsstage manifest build`") from None
    sizes_problem(rows, entries, path)
    # at most 18 digits (and a sign) is within 64 bits: the exact test only past that (cheap at 1M)
    if mtimes and max(map(len, mtimes)) > 18 and \
            not -MTIME_MAX <= min(e.mtime_ns for e in entries) <= max(e.mtime_ns for e in entries) <= MTIME_MAX:
        raise ManifestError(f"{path}: an mtime is out of range (a file's time in nanoseconds, 64 bits); rebuild it "
                            "with `dsstage manifest build`")
    if check:
        if not _all_hex(rows):
            bad = next(n for n, r in enumerate(rows, start=2) if not _all_hex([r]))
            raise ManifestError(f"{path}:{bad}: malformed hash; rebuild it with `dsstage manifest build`")
        check_entries(entries, path)
    return Manifest(name=str(header.get("name", "")), digest=digest, entries=entries,
                    total_bytes=sum(e.size for e in entries), created=header_created(header, path),
                    source=str(header.get("source", "")), shard_of=str(header.get("shard_of") or ""))


_HEX = b"0123456789abcdef"


def _all_hex(rows: Sequence[Sequence[str]]) -> bool:
    """Whether every row's hash is 64 lowercase hex digits (one pass at C speed: 0.1 s at 1M)."""
    hashes = "".join(r[0] for r in rows)
    try:
        return len(hashes) == 64 * len(rows) and not hashes.encode("ascii").translate(None, _HEX)
    except UnicodeEncodeError:
        return False


#: a file's mtime in nanoseconds must fit the 64 bits the copier and the native helper use
MTIME_MAX = 2**63 - 1


def header_created(header: dict[str, object], path: str) -> float:
    """The header's ``created`` (seconds since the epoch; 0 if absent), else a ManifestError:
    the digest does not cover the header."""
    value = header.get("created") or 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ManifestError(f"{path}: its header says created {value!r}, not a time; rebuild it with "
                            "`dsstage manifest build`")
    return float(value)


def _size_ok(text: str) -> bool:
    """A size as a manifest writes it: ASCII digits only (no sign, no ``_``, no space)."""
    return text.isascii() and text.isdigit() and int(text) <= FILE_MAX


def sizes_problem(rows: Sequence[Sequence[str]], entries: Sequence[Entry], path: str) -> None:
    """Refuse a size that is not what a manifest writes, naming its line: a digest is only
    as good as what it covers, and a data owner can write any line with a matching digest
    (a negative size beside a huge one would sum to a few bytes and pass every space check).
    Cheap at a million files: one join and two scans at C speed."""
    if not entries:
        return
    sizes = [r[1] for r in rows]
    text = "".join(sizes)
    # at most 15 digits is below FILE_MAX (2**50, 16 digits): the exact test only past that
    if text.isascii() and text.isdigit() and (max(map(len, sizes)) <= 15 or max(e.size for e in entries) <= FILE_MAX):
        return
    bad = next(n for n, r in enumerate(rows, start=2) if not _size_ok(r[1]))
    raise ManifestError(f"{path}:{bad}: the size {rows[bad - 2][1]!r} is not a size of a file (digits, at most "
                        f"{FILE_MAX}); rebuild it with `dsstage manifest build`")


class Catalog:
    """Where the manifests of one state directory live. With ``remember``, each dataset's
    ``CURRENT`` is read once for the catalog's life (one Prolog or Epilog): the tier's plan
    and the node's report read the current version of every dataset the node holds, and
    on a shared filesystem each read is four requests (docs/benchmarks.md); a version
    published meanwhile is the next job's."""

    def __init__(self, state_dir: str, *, remember: bool = False) -> None:
        self.root = os.path.join(state_dir, "manifests")
        self._current: dict[str, str | None] | None = {} if remember else None

    def dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def path(self, name: str, digest: str) -> str:
        return os.path.join(self.dir(name), digest + SUFFIX)

    def current(self, name: str) -> str | None:
        """The digest of the current version, or None if no manifest was built (cheap)."""
        if self._current is not None and name in self._current:
            return self._current[name]
        try:
            digest = read_current(os.path.dirname(self.root), name)
        except untrusted.Refused as exc:
            raise ManifestError(f"{exc}; then run `dsstage manifest build {name}`") from None
        except ValueError:
            raise ManifestError(f"{self.dir(name)}/{CURRENT}: damaged; rebuild with "
                                f"`dsstage manifest build {name}`") from None
        if self._current is not None:
            self._current[name] = digest
        return digest

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
        if self._current is not None:
            self._current[manifest.name] = manifest.digest
        return path
