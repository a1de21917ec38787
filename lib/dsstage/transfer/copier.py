"""A copier for mounted sources that verifies while it copies.

Measured against ``rsync -a`` on the same data (bench/run), rsync's pipeline of processes
and the separate verification pass that must follow it cost more than the copy itself.
Here each file is read once, hashed with BLAKE3 from the same buffer, and written only if
the hash matches the manifest: what lands is what was verified. Many files are in flight
at once (threads; reads, writes and hashing release the GIL; as many as measurably go
faster, up to transfer.max_parallel: dsstage.transfer.parallel), which hides a network
filesystem's round trips and keeps an NVMe queue busy where one rsync reads one file at
a time.

Reading: every source file is opened below the source's directory descriptor without
following a symbolic link at any component (a directory swapped for a link between the
manifest build and the copy is refused, not followed), without blocking (a FIFO), as the
configured ``source_user``; only a regular file is read, and never more than the size
the manifest records (a file that grew shows as one byte too many). A failure to read
the source is the source's (SourceError: fallback or hold, never a drain); a failure to
write the staging area is the node's (StoreError; a full filesystem is NoSpace).

Writing: each file goes to a fresh temporary name (O_EXCL, short whatever the file's own
name), created read-only (root writes through its descriptor) with the manifest's mtime,
and renamed into place only after its hash matched; so after a crash every file under
its final name is whole and verified.

Large files (at least SPLIT bytes) are copied as byte ranges, several at once from another
filesystem (copy_file_range: the kernel copies, no byte passes through Python; pread/pwrite
where a filesystem refuses it), and the temporary copy is hashed in order, range by range
as the ranges land, by ``hash_threads`` BLAKE3 threads: the Python binding cannot combine
hashes of separate ranges, so the ranges are copied in parallel and hashed after copying,
overlapping the copy of the ranges ahead. What is hashed is what landed (the temporary
file is root's, created O_EXCL in the root-only staging area, and nothing writes it once
its range is copied), so a range that changed in the source, or was read wrong, fails
the file like any other mismatch.
Files below SPLIT go to the native helper where it is installed (dsstage.transfer.native:
the same per-file work in C, without the interpreter's cost per file); the rest is here.
rsync stays the transport for remote sources (ssh, rsync daemon).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import blake3

from dsstage.config.manifest import Entry, Mismatch
from dsstage.config.model import Transfer
from dsstage.errors import OutOfTime, SourceError, local_error
from dsstage.fs import beneath, safe
from dsstage.fs.beneath import Tree
from dsstage.fs.identity import Identity, acting_as, creates_as_root
from dsstage.transfer import native, parallel
from dsstage.transfer.ratelimit import Rate, RateLimit
from dsstage.transfer.rsync import TransferStats

CHUNK = 8 * 2**20
#: files in flight at first (dsstage.transfer.parallel then moves it)
THREADS = parallel.START
#: byte ranges of a large file in flight at once from another filesystem
RANGE_STREAMS = 4
#: files at least this large are copied as byte ranges by several streams
SPLIT = 128 * 2**20
#: the byte range one stream copies at a time (and the unit the hash follows the copy in)
RANGE = 32 * 2**20


@dataclass(frozen=True)
class Tuning:
    """How a copy runs. Files are copied ``threads`` at once at first, then more while more
    measurably go faster and fewer while fewer go as fast, up to ``max_parallel``
    (dsstage.transfer.parallel: a latency-bound source needs many requests in flight, a local
    disk a few); at most ``rate`` in all (Rate: no limit by default). A file of at least
    ``split`` bytes is copied as byte ranges of ``range_size``, one such file after another,
    ``range_streams`` ranges at once (0: one if the source is on the staging area's
    filesystem, where the kernel copies and more streams of one file measured slower, else
    RANGE_STREAMS). BLAKE3 uses at most ``hash_threads`` threads per file (0: one per CPU)."""

    threads: int | None = None  # None: THREADS
    rate: Rate = Rate()
    hash_threads: int = 0
    split: int | None = None  # None: SPLIT
    range_size: int | None = None  # None: RANGE
    range_streams: int = 0
    max_parallel: int = Transfer.max_parallel


def hasher(threads: int = 0) -> blake3.blake3:
    """A BLAKE3 hasher using at most ``threads`` threads (0: one per CPU)."""
    return blake3.blake3(max_threads=threads if threads > 0 else blake3.blake3.AUTO)


def open_source_root(path: str, reader: Identity | None = None) -> int:
    """The source directory, reached without following a link at any component."""
    try:
        with acting_as(reader):
            return beneath.open_source_dir(path)
    except OSError as exc:
        raise SourceError(f"source {path} is not reachable from this node ({exc.strerror}); "
                          "check that it is mounted here and that its path holds no symbolic link "
                          "(configure the real path)") from None


def open_source_file(src_fd: int, rel: str, src_root: str) -> tuple[int | None, str]:
    """(descriptor, "") of regular file ``rel`` of the source, or (None, why not) when it is
    missing, a link, not regular or not readable by the source's reader; SourceError when
    the source itself fails (EIO, ESTALE, ...)."""
    try:
        fd = beneath.open_beneath(src_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
            return None, "not a regular file (a symbolic link in its path)"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return None, "not readable by the source's reader (permission denied)"
        raise SourceError(f"reading {os.path.join(src_root, rel)!r} failed: {exc.strerror}; "
                          "check the source's filesystem") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None, "not a regular file"
    return fd, ""


def _mismatch(e: Entry, found: str) -> Mismatch:
    return Mismatch(e.path, e.hash if not found.startswith("size ") else str(e.size), found)


def _copy_one(src: native.Reading, dest: Tree, e: Entry, limit: RateLimit, hash_threads: int = 0) -> Mismatch | None:
    """Copy one file if it matches its entry; else the mismatch (and nothing written)."""
    def bad(found: str) -> Mismatch:
        return _mismatch(e, found)
    src_root = src.root
    with acting_as(src.reader):
        fin, why = open_source_file(src.fd, e.path, src_root)
    if fin is None:
        return bad(why)
    try:
        with dest.parent(e.path) as (dfd, name):
            if e.size < CHUNK:
                data = _read_source(fin, e.size + 1, src_root, e)  # one byte more: a file that grew shows
                limit.take(len(data))
                if len(data) != e.size:
                    return bad(f"size {len(data)}")
                digest = blake3.blake3(data).hexdigest()
                if digest != e.hash:
                    return bad(digest)
                _publish(dfd, name, e, [data])
                return None
            # large file: ask the kernel to read ahead the whole file while we hash and write
            os.posix_fadvise(fin, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            os.posix_fadvise(fin, 0, 0, os.POSIX_FADV_WILLNEED)
            h = hasher(hash_threads)
            tmp = safe.temp_name()
            fout = _create(dfd, tmp)
            size = 0
            try:
                try:
                    while size <= e.size:
                        c = _read_source(fin, min(CHUNK, e.size + 1 - size), src_root, e)
                        if not c:
                            break
                        limit.take(len(c))
                        h.update(c)
                        size += len(c)
                        if size <= e.size:
                            _write(fout, c)
                finally:
                    os.close(fout)
                return _settle(dfd, tmp, name, e, f"size {size}" if size != e.size else h.hexdigest())
            except BaseException:
                safe.unlink_at(dfd, tmp)
                raise
    finally:
        os.close(fin)


class _Ranges:
    """Copying one large file's byte ranges, from any number of threads."""

    def __init__(self, fin: int, fout: int, src_root: str, e: Entry, limit: RateLimit) -> None:
        self.fin, self.fout, self.src_root, self.e, self.limit = fin, fout, src_root, e, limit
        self.kernel = True  # copy_file_range until the filesystems refuse it
        self.buffers = threading.local()

    def copy(self, off: int, n: int) -> int:
        """Copy bytes [off, off + n) of the source to the same offsets of the copy; the
        number copied (fewer only if the source ended)."""
        done = 0
        while done < n:
            step = min(CHUNK, n - done)
            self.limit.take(step)
            got = self._piece(off + done, step)
            if not got:
                break
            done += got
        return done

    def _piece(self, off: int, n: int) -> int:
        if self.kernel:
            try:
                got = os.copy_file_range(self.fin, self.fout, n, off, off)
                if got:
                    return got
                # the end of the source, or a filesystem that copies nothing: read to tell
            except OSError:
                # another filesystem, a filesystem without it, or an error that the read or
                # the write below reports with the right party to blame
                self.kernel = False
        buf = getattr(self.buffers, "buf", None)
        if buf is None:
            buf = self.buffers.buf = memoryview(bytearray(CHUNK))
        try:
            got = os.preadv(self.fin, [buf[:n]], off)
        except OSError as exc:
            raise SourceError(f"reading {os.path.join(self.src_root, self.e.path)!r} failed: {exc.strerror}; "
                              "check the source's filesystem") from None
        written = 0
        try:
            while written < got:
                written += os.pwrite(self.fout, buf[written:got], off + written)
        except OSError as exc:
            raise local_error(exc, "writing to the staging area") from None
        return got


def _copy_large(src: native.Reading, dest: Tree, e: Entry, limit: RateLimit, pool: ThreadPoolExecutor,
                streams: int, tuning: Tuning, progress: Callable[[int], None] | None = None) -> Mismatch | None:
    """Copy one large file as byte ranges on ``pool`` (at most ``streams`` ranges in flight),
    hashing the copy in order as its ranges land; publish it only if it matches ``e``."""
    src_root, hash_threads, range_size = src.root, tuning.hash_threads, tuning.range_size or RANGE
    with acting_as(src.reader):
        fin, why = open_source_file(src.fd, e.path, src_root)
    if fin is None:
        return _mismatch(e, why)
    try:
        os.posix_fadvise(fin, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        os.posix_fadvise(fin, 0, 0, os.POSIX_FADV_WILLNEED)
        with dest.parent(e.path) as (dfd, name):
            tmp = safe.temp_name()
            fout = _create(dfd, tmp, os.O_RDWR)  # read back to be hashed: what landed is what is verified
            inflight: deque[tuple[int, int, Future[int]]] = deque()
            try:
                try:
                    try:
                        os.ftruncate(fout, e.size)  # the mapping below covers the whole file
                    except OSError as exc:
                        raise local_error(exc, "writing to the staging area") from None
                    ranges = _Ranges(fin, fout, src_root, e, limit)
                    h = hasher(hash_threads)
                    offsets = iter(range(0, e.size, range_size))
                    short: int | None = None

                    def fill() -> None:
                        # no more ranges in flight than streams: the hash follows closely, so
                        # what it reads is still in the page cache
                        while len(inflight) < streams:
                            off = next(offsets, None)
                            if off is None:
                                return
                            n = min(range_size, e.size - off)
                            inflight.append((off, n, pool.submit(ranges.copy, off, n)))

                    with mmap.mmap(fout, e.size, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
                        fill()
                        while inflight:
                            off, n, fut = inflight.popleft()
                            got = fut.result()
                            if got != n:  # the source is shorter than the manifest says
                                short = off + got
                                break
                            fill()  # the next ranges are copied while this one is hashed
                            h.update(view[off:off + n])
                            if progress:
                                progress(n)
                    try:
                        grew = b"" if short is not None else os.pread(fin, 1, e.size)
                    except OSError as exc:
                        raise SourceError(f"reading {os.path.join(src_root, e.path)!r} failed: {exc.strerror}; "
                                          "check the source's filesystem") from None
                finally:
                    # no stream may still be writing to the copy when its descriptor is closed
                    for _o, _n, fut in inflight:
                        fut.cancel()
                    for _o, _n, fut in inflight:
                        if not fut.cancelled():
                            try:
                                fut.result()
                            except BaseException:  # the first failure is already on its way up
                                pass
                    os.close(fout)
                found = f"size {short}" if short is not None else f"size {e.size + 1}" if grew else h.hexdigest()
                return _settle(dfd, tmp, name, e, found)
            except BaseException:
                safe.unlink_at(dfd, tmp)
                raise
    finally:
        os.close(fin)


def _read_source(fd: int, n: int, src_root: str, e: Entry) -> bytes:
    """Up to ``n`` bytes (fewer only at end of file): reads can be short on network filesystems."""
    try:
        data = os.read(fd, n)
        while data and len(data) < n:
            more = os.read(fd, n - len(data))
            if not more:
                break
            data += more
    except OSError as exc:
        raise SourceError(f"reading {os.path.join(src_root, e.path)!r} failed: {exc.strerror}; "
                          "check the source's filesystem") from None
    return data


def _create(dfd: int, tmp: str, access: int = os.O_WRONLY) -> int:
    try:
        return os.open(tmp, access | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444, dir_fd=dfd)
    except OSError as exc:
        raise local_error(exc, f"creating a file in the staging area ({tmp})") from None


def _write(fd: int, data: bytes) -> None:
    try:
        safe.write_all(fd, data)
    except OSError as exc:
        raise local_error(exc, "writing to the staging area") from None


def _publish(dfd: int, name: str, e: Entry, chunks: Sequence[bytes]) -> None:
    tmp = safe.temp_name()
    fout = _create(dfd, tmp)
    try:
        try:
            for c in chunks:
                _write(fout, c)
        finally:
            os.close(fout)
        _finish(dfd, tmp, name, e)
    except BaseException:
        safe.unlink_at(dfd, tmp)
        raise


def _settle(dfd: int, tmp: str, name: str, e: Entry, found: str) -> Mismatch | None:
    """Publish the written copy ``tmp`` if what was ``found`` (its hash) is the entry's;
    else remove it and return the mismatch."""
    if found != e.hash:
        safe.unlink_at(dfd, tmp)
        return _mismatch(e, found)
    _finish(dfd, tmp, name, e)
    return None


def _finish(dfd: int, tmp: str, name: str, e: Entry) -> None:
    try:
        os.utime(tmp, ns=(e.mtime_ns, e.mtime_ns), dir_fd=dfd, follow_symlinks=False)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        raise local_error(exc, f"publishing {e.path!r} in the staging area") from None


def copy_verified(src_root: str, dest_fd: int, entries: Sequence[Entry], tuning: Tuning | None = None, *,
                  deadline: float | None = None, reader: Identity | None = None,
                  progress: Callable[[int, int], None] | None = None) -> tuple[TransferStats, list[Mismatch]]:
    """Copy ``entries`` that are not yet below ``dest_fd``, as ``tuning`` says (Tuning);
    return stats and the files that were missing or did not match the manifest (nothing is
    written for those). Raises OutOfTime when ``deadline`` (monotonic) passes: what was
    copied stays, the next call resumes. ``progress(bytes_delta, bytes_total)`` is called as
    files finish."""
    tuning = tuning or Tuning()
    split = SPLIT if tuning.split is None else tuning.split
    tuning = replace(tuning, range_size=RANGE if tuning.range_size is None else tuning.range_size)
    rate, range_streams = tuning.rate, tuning.range_streams
    threads = max(1, THREADS if tuning.threads is None else tuning.threads)
    max_parallel = max(1, tuning.max_parallel)
    limit = RateLimit(rate)
    src_fd = open_source_root(src_root, reader)
    src = native.Reading(src_fd, src_root, reader)
    stop = threading.Event()
    try:
        if range_streams <= 0:
            range_streams = 1 if os.fstat(src_fd).st_dev == os.fstat(dest_fd).st_dev else RANGE_STREAMS
        streams = max(1, min(threads, range_streams, max_parallel))
        with Tree(dest_fd, create=True) as dest:
            try:
                have = dest.paths()
                todo = [e for e in entries if e.path not in have]
                # the directories first, then the files (as dcp does): with each directory made
                # when its first file came, creating the files took 2-4 times the system time
                # on this project's ext4 disk (100,000 empty files; docs/benchmarks.md)
                for d in sorted({e.path.rpartition("/")[0] for e in todo}):
                    with dest.opened(d):
                        pass
            except OSError as exc:
                raise local_error(exc, "reading the staging area and making its directories") from None
            total = sum(e.size for e in todo)
            large = [e for e in todo if e.size >= max(split, 1)]
            rest = [e for e in todo if e.size < max(split, 1)]
            stats, failures = TransferStats(), []
            counting = threading.Lock()

            def late() -> bool:
                if stop.is_set() or (deadline is not None and time.monotonic() > deadline):
                    stop.set()
                return stop.is_set()

            def count(e: Entry, failure: Mismatch | None) -> None:
                with counting:
                    if failure:
                        failures.append(failure)
                    else:
                        stats.files += 1
                        stats.bytes += e.size

            def one(e: Entry) -> int:
                failure = _copy_one(src, dest, e, limit, tuning.hash_threads)
                count(e, failure)
                ranged(e.size)  # the progress of a whole file
                late()  # sets stop once the deadline passed: no more files are handed out
                return 0 if failure else e.size

            def ranged(delta: int) -> None:
                if progress:
                    progress(delta, total)

            try:
                if not late():
                    gate = parallel.Limiter(min(threads, max_parallel), max_parallel, f"copying from {src_root}")
                    rest, done = native.copy_some(src, dest, rest, gate, late, ranged, rate_limited=bool(rate))
                    with counting:
                        stats.files += done.files
                        stats.bytes += done.bytes
                        failures.extend(_mismatch(e, found) for e, found in done.failures)
                    parallel.run(rest, one, gate, size=lambda n: n, stop=stop)
                if large and not late():
                    with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="range") as pool:
                        for e in large:
                            if late():
                                break
                            count(e, _copy_large(src, dest, e, limit, pool, streams, tuning, ranged))
            except BaseException:
                stop.set()
                raise
            if stop.is_set():
                raise OutOfTime(f"copied {stats.files} of {len(todo)} files before the time budget ran out; "
                                "the copy so far is kept and the next stage resumes")
            if creates_as_root(0o444):  # what was made here (all but the failures) is sealed already
                stats.sealed = {e.path for e in todo}.difference(m.path for m in failures)
    finally:
        os.close(src_fd)
    return stats, failures
