"""BLAKE3 hashing of files, in parallel.

Files are opened below a directory descriptor without following a symbolic link at any
component and without blocking (beneath.open_beneath), and only regular files are read,
so what is hashed is what was listed inside the tree. Small files are read whole and
hashed on a pool of threads (blake3 and file reads release the GIL); large files are
read in chunks and hashed by blake3's own thread pool, one after another once the small
files are done, so that no more than the configured number of threads hash at once.

A source's files are read with plain reads, never memory-mapped: a source file truncated
while it is hashed would kill a mapping's reader with SIGBUS, and a FUSE source mounted with
``direct_io`` cannot be mapped at all (ENODEV). A file that ends before the size it had
when opened, or goes on past it, is hashed as read, and its size is what was read: the
caller compares it with what it listed and calls the file changed.

A tree on this node's own disk (``mapped``: a published copy, which nothing but root
changes) has its large files hashed through a memory mapping instead, a window at a time,
as b3sum does: a read copies every byte once more before BLAKE3 sees it, and that copy was
the serial part that kept ``verify --full`` from scaling with cores (bench/run --only cpu).
The pages are faulted in by BLAKE3's threads as they hash, not mapped ahead (MAP_POPULATE,
which the one thread that maps a window does before any hashing starts). Hashing 2 x 512 MiB
that way, in 64 MiB windows, took 250 ms from the page cache and 1,035 ms after a drop;
faulted in by the hashing threads, in 256 MiB windows, 225 and 832 ms; b3sum 230 and 898 ms
(medians of 10 and 5 runs, alternated, 2026-11-28).

The cost of a mapping is the failure mode of a disk that fails under it: the process dies
of SIGBUS instead of seeing EIO, so a Prolog's work ends "unexpectedly" and the job gets
its on_failure rather than the node a drain (dsstage.hooks.abandoned); the copier's check
of what it wrote has the same.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Callable, Sequence

import blake3

from dsstage.fs import beneath
from dsstage.fs.identity import Identity, acting_as
from dsstage.transfer import parallel

#: files at least this large are hashed with several threads, a chunk at a time
LARGE = 8 * 2**20
#: what one read of a large file brings (blake3 spreads a chunk over its threads)
CHUNK = 8 * 2**20
#: what one mapping of a large file on this node's disk covers (``mapped``)
WINDOW = 256 * 2**20


def default_threads(configured: int = 0) -> int:
    return configured if configured > 0 else max(2, os.cpu_count() or 2)


def hash_fd(fd: int, threads: int = 0, large: bool = True, mapped: bool = False) -> tuple[int, str] | None:
    """(bytes read, BLAKE3 hex digest) of an open regular file, from its start, with at
    most ``threads`` threads (0: one per CPU); None for a file of LARGE bytes or more
    unless ``large``. The bytes read differ from the size fstat gave when the file
    changed while it was read. ``mapped``: a large file is read through a memory mapping
    (a file on this node's disk only: see the module's notes)."""
    size = os.fstat(fd).st_size
    if size >= LARGE and not large:
        return None
    if size < LARGE:
        data = os.pread(fd, size + 1, 0)
        while len(data) <= size:  # short reads happen on network filesystems
            more = os.pread(fd, size + 1 - len(data), len(data))
            if not more:
                break
            data += more
        return len(data), blake3.blake3(data).hexdigest()
    # read ahead the whole file: measured faster than b3sum on a cold cache
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    h = blake3.blake3(max_threads=threads if threads > 0 else blake3.blake3.AUTO)
    done = _hash_mapped(fd, size, h) if mapped else 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while True:  # the file (or, mapped, what it has past its size at the start: it grew)
        n = os.preadv(fd, [view], done)
        if not n:
            break
        h.update(view[:n])
        done += n
    return done, h.hexdigest()


def _hash_mapped(fd: int, size: int, h: blake3.blake3) -> int:
    """Feed ``h`` the file's first ``size`` bytes through mappings of WINDOW bytes; the
    bytes fed (0 where the file cannot be mapped: the caller reads it)."""
    done = 0
    while done < size:
        n = min(WINDOW, size - done)
        try:
            m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=done)
        except OSError:
            if done:
                raise
            return 0  # a filesystem without mappings (ENODEV): plain reads
        with m:
            h.update(m)
        done += n
    return done


#: errors that mean the disk itself fails, not that a file is absent or unreadable: EIO, and
#: what ext4 and XFS return for a corrupt filesystem, EUCLEAN (EFSCORRUPTED) and EBADMSG
#: (EFSBADCRC, a checksum that does not match). The native helper's check has the same
#: list: native/dsstage_copy.c, unreadable()
DISK_ERRORS = frozenset({errno.EIO, errno.EUCLEAN, errno.EBADMSG})


def hash_at(root_fd: int, rel: str, reader: Identity | None = None, threads: int = 0,
            large: bool = True, disk_errors: bool = False,
            errors: dict[str, str] | None = None, mapped: bool = False) -> tuple[int, str | None] | None:
    """(bytes read, hash) of regular file ``rel`` below ``root_fd``; None if it is missing,
    not a regular file, behind a symbolic link or unreadable (``errors`` gets the reason of
    a failed open or read, by path). The hash is None (and the size fstat's) for a large
    file unless ``large`` (hash_fd). With ``disk_errors`` (a tree on this node's own disk), an
    error of the disk itself (DISK_ERRORS) is raised, not taken for a missing file: a failing
    NVMe is the node's fault, never the source's."""
    try:
        with acting_as(reader):
            fd = beneath.open_beneath(root_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        if disk_errors and exc.errno in DISK_ERRORS:
            raise
        if errors is not None:
            errors[rel] = exc.strerror or str(exc)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        got = hash_fd(fd, threads, large, mapped)
        return (st.st_size, None) if got is None else got
    except OSError as exc:
        if disk_errors and exc.errno in DISK_ERRORS:
            raise
        if errors is not None:
            errors[rel] = exc.strerror or str(exc)
        return None
    finally:
        os.close(fd)


def hash_many(root_fd: int, rels: Sequence[str], threads: int = 0,
              progress: Callable[[int], None] | None = None,
              reader: Identity | None = None, max_parallel: int = 0,
              disk_errors: bool = False, mapped: bool = False) -> list[tuple[int, str] | None]:
    """(bytes read, hash) of ``rels`` below ``root_fd`` in order (None where a file cannot be
    read; ``disk_errors``: see hash_at; ``mapped``: a tree on this node's disk,
    whose large files are read through a mapping: see the module's notes).

    Small files are read and hashed ``threads`` at once (0: one per CPU), or, given
    ``max_parallel`` (a source that may be a network filesystem), as many as measurably
    pay up to that (parallel.Limiter.for_source). ``progress`` is called with the number
    of files finished since its last call.
    """
    workers = default_threads(threads)

    def small(rel: str) -> tuple[int, str | None] | None:
        got = hash_at(root_fd, rel, reader, large=False, disk_errors=disk_errors)
        if progress and (got is None or got[1] is not None):
            progress(1)
        return got

    gate = parallel.Limiter.for_source(workers, max_parallel, "hashing")
    results = parallel.run(rels, small, gate, size=lambda got: got[0] if got is not None and got[1] is not None else 0)
    # large files one at a time, each on blake3's threads (reading ahead)
    for i, got in enumerate(results):
        if got is not None and got[1] is None:
            results[i] = hash_at(root_fd, rels[i], reader, threads, disk_errors=disk_errors, mapped=mapped)
            if progress:
                progress(1)
    return [None if r is None or r[1] is None else (r[0], r[1]) for r in results]
