"""BLAKE3 hashing of files, in parallel.

Files are opened below a directory descriptor without following a symbolic link at any
component and without blocking (nodefs.open_beneath), and only regular files are read,
so what is hashed is what was listed inside the tree. Small files are read whole and
hashed on a pool of threads (blake3 and file reads release the GIL); large files are
memory-mapped and hashed by blake3's own thread pool.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import blake3

from . import nodefs
from .identity import Identity, acting_as

#: files at least this large are memory-mapped and hashed with several threads
LARGE = 8 * 2**20
#: files per task when hashing many small files, to keep the pool's overhead low
BATCH = 64


def default_threads(configured: int = 0) -> int:
    return configured if configured > 0 else max(2, os.cpu_count() or 2)


def hash_fd(fd: int) -> str:
    """The BLAKE3 hex digest of an open regular file, from its start."""
    size = os.fstat(fd).st_size
    if size < LARGE:
        data = os.pread(fd, size + 1, 0)
        while len(data) <= size:  # short reads happen on network filesystems
            more = os.pread(fd, size + 1 - len(data), len(data))
            if not more:
                break
            data += more
        return blake3.blake3(data).hexdigest()
    # read ahead the whole file: measured faster than b3sum on a cold cache
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
        h.update(mm)
    return h.hexdigest()


def hash_at(root_fd: int, rel: str, reader: Identity | None = None) -> tuple[int, str] | None:
    """(size, hash) of regular file ``rel`` below ``root_fd``; None if it is missing, not a
    regular file, behind a symbolic link or unreadable."""
    try:
        with acting_as(reader):
            fd = nodefs.open_beneath(root_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return st.st_size, hash_fd(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def hash_many(root_fd: int, rels: Sequence[str], threads: int = 0,
              progress: Callable[[int], None] | None = None,
              reader: Identity | None = None) -> list[tuple[int, str] | None]:
    """(size, hash) of ``rels`` below ``root_fd`` in order (None where a file cannot be read).

    ``progress`` is called with the number of files finished since its last call.
    """
    threads = default_threads(threads)
    batches = [rels[i:i + BATCH] for i in range(0, len(rels), BATCH)]

    def work(batch: Sequence[str]) -> list[tuple[int, str] | None]:
        out = [hash_at(root_fd, p, reader) for p in batch]
        if progress:
            progress(len(batch))
        return out

    if len(batches) <= 1:
        return work(rels) if rels else []
    results: list[tuple[int, str] | None] = []
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="blake3") as pool:
        for chunk in pool.map(work, batches):
            results.extend(chunk)
    return results
