"""rsync as the transport for remote sources (ssh and rsync daemons).

Files are split into several lists balanced by bytes and each list goes to its own rsync
(``--files-from``, NUL-separated so any file name works). rsync writes every file to a
temporary name and renames it when complete, so after a crash a file under its final
name is whole, and a new run fetches only what is missing.

How the files are named to an rsync daemon (``files_from``): rsync 3.5.0's daemon, in a
module with ``use chroot = no``, refuses ``--files-from`` names below a source directory
that is not the module's root: asked for ``f`` in ``rsync://h/mod/dir/`` it looks up
``/dir/f`` from the real ``/`` and answers "file has vanished" for every file (exit 24),
while the same request works with ``use chroot = yes``. Named from the module's root with
rsync's ``/./`` marker (``dir/./f`` in ``rsync://h/mod/``), the same files arrive under the
same names with either setting, so every daemon request (sources and peers) is made so.
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dsstage import proc
from dsstage.config.manifest import Entry
from dsstage.config.model import Source, Transfer
from dsstage.errors import CommandError, NoSpace, OutOfTime, SourceError
from dsstage.fs.layout import partial_dir

log = logging.getLogger(__name__)

#: rsync exit codes that mean "some files could not be transferred": the verification
#: that follows says which, with a better message than rsync's
PARTIAL = (23, 24)
#: rsync's own I/O timeout: a source that stops answering is given up after this long
IO_TIMEOUT = 300
#: what rsync says when the receiving side (our tier) is full


@dataclass
class TransferStats:
    files: int = 0
    bytes: int = 0
    #: paths of files this transfer made that are sealed already (root's, group 0, 0444),
    #: which the seal (dsstage.node.publish.seal) need not look at again: the verifying
    #: copier's, where it can tell (copier.copy_verified); never rsync's
    sealed: set[str] = field(default_factory=set)

    def add(self, other: TransferStats) -> None:
        self.files += other.files
        self.bytes += other.bytes
        self.sealed |= other.sealed


def plan_streams(entries: Sequence[Entry], streams: int) -> list[list[Entry]]:
    """Split entries into at most ``streams`` lists of about equal bytes.

    Largest files first, each to the currently lightest list (LPT scheduling); every
    list is then sorted by path so rsync walks directories in order.
    """
    streams = max(1, min(streams, len(entries)))
    heap: list[tuple[int, int]] = [(0, i) for i in range(streams)]
    lists: list[list[Entry]] = [[] for _ in range(streams)]
    for e in sorted(entries, key=lambda e: (-e.size, e.path)):
        load, i = heapq.heappop(heap)
        lists[i].append(e)
        # count every file as at least 64 KiB so that many empty files still spread out
        heapq.heappush(heap, (load + max(e.size, 65536), i))
    return [sorted(lst, key=lambda e: e.path) for lst in lists if lst]


_STAT_FILES = re.compile(r"Number of regular files transferred:\s*([\d,.]+)")
_STAT_BYTES = re.compile(r"Total transferred file size:\s*([\d,.]+)")


def parse_stats(output: str) -> TransferStats:
    """Files and bytes transferred, from ``rsync --stats`` output."""
    def num(rx: re.Pattern[str]) -> int:
        m = rx.search(output)
        return int(re.sub(r"[,.]", "", m.group(1))) if m else 0
    return TransferStats(files=num(_STAT_FILES), bytes=num(_STAT_BYTES))


def files_from(url: str, paths: Iterable[str]) -> tuple[str, bytes]:
    """The source argument and the NUL-separated ``--files-from`` list that fetch ``paths``
    (relative to the directory ``url`` names) into the destination under the same names.

    For a daemon URL (``rsync://[user@]host[:port]/module/dir``) the request is made from the
    module's root, each name as ``dir/./path``: the only form rsync 3.5.0's daemon serves from
    a module with ``use chroot = no`` (see the module doc); ``/./`` tells rsync where the name
    it recreates begins. Other URLs (``host:/path``) are asked as they are."""
    if url.startswith("rsync://"):
        host, _, rest = url[len("rsync://"):].partition("/")
        module, _, sub = rest.partition("/")
        sub = "/".join(p for p in sub.split("/") if p)
        if sub:
            prefix = os.fsencode(sub) + b"/./"
            return (f"rsync://{host}/{module}/",
                    b"".join(prefix + os.fsencode(p) + b"\0" for p in paths))
    return url.rstrip("/") + "/", b"".join(os.fsencode(p) + b"\0" for p in paths)


def rsync_argv(source: Source, dest: str, list_file: str, transfer: Transfer) -> list[str]:
    # no -l: a link on the source is skipped, never recreated in the staging area
    argv = ["rsync", "-t", "--from0", f"--files-from={list_file}", "--stats",
            # whole files arrive under their final name only when complete (see module doc);
            # an interrupted one waits beside the staging area, where no dataset name can be
            f"--partial-dir={partial_dir(dest)}",
            # the BLAKE3 verification that follows is the real check, so rsync's
            # size+mtime quick check is relaxed to size: files linked from an older
            # version keep their old mtime and must not be fetched again
            "--size-only",
            "--no-perms", "--chmod=u+rw", f"--timeout={IO_TIMEOUT}"]
    if transfer.bwlimit:
        argv.append(f"--bwlimit={transfer.bwlimit}")
    if source.kind == "ssh":
        argv += ["-e", transfer.rsh]
    return argv + [files_from(source.rsync_base(), ())[0], dest.rstrip("/") + "/"]


def cannot_hold(dest: str, entries: Sequence[Entry]) -> bool:
    """Whether the filesystem of ``dest`` has less room than what of ``entries`` has not
    arrived there: after a failed rsync, the structured answer to "was the tier full?"
    (statvfs), not the text of rsync's message."""
    missing = 0
    for e in entries:
        try:
            if os.lstat(os.path.join(dest, e.path)).st_size == e.size:
                continue
        except OSError:
            pass
        missing += e.size
    try:
        st = os.statvfs(dest)
    except OSError:
        return False
    return missing > 0 and st.f_bavail * st.f_frsize < missing


def vanished(stderr: str) -> int:
    """How many files rsync said had vanished (``file has vanished: "..."``)."""
    return sum(1 for line in stderr.splitlines() if line.startswith("file has vanished: "))


def all_vanished(source: Source, asked: int) -> str:
    """Why a source that says every file asked for has vanished is the source's fault, not
    the manifest's: a listing that just matched them says they are there."""
    where = ("the rsync daemon's module (its path, that its uid may read the files; dsstage needs "
             "`read only = yes` and nothing more: see the admin guide)" if source.kind == "daemon"
             else "the remote path and that the remote login may read it")
    return (f"{source.raw} says every one of the {asked} file(s) asked for has vanished: the source does not serve "
            f"the files its manifest lists; check {where}. If they were really removed there, rebuild the "
            "manifest with `dsstage manifest build`")


def fetch(source: Source, dest: str, entries: Sequence[Entry], transfer: Transfer, *,
          deadline: float | None = None, progress: Callable[[int, int], None] | None = None) -> TransferStats:
    """Copy ``entries`` from ``source`` into ``dest`` with parallel rsync streams; stop with
    OutOfTime at ``deadline`` (monotonic; what arrived is kept). ``progress(bytes_delta,
    bytes_total)`` is called as each stream's share is done."""
    total = TransferStats()
    if not entries:
        return total
    lists = plan_streams(entries, transfer.streams)
    with tempfile.TemporaryDirectory(prefix="dsstage-lists-") as tmp:
        files = []
        share: dict[str, int] = {}
        listed: dict[str, list[Entry]] = {}
        whole = sum(e.size for e in entries)
        for i, lst in enumerate(lists):
            path = os.path.join(tmp, f"list{i}")
            with open(path, "wb") as fh:
                fh.write(files_from(source.rsync_base(), (e.path for e in lst))[1])
            files.append(path)
            share[path] = sum(e.size for e in lst)
            listed[path] = lst

        def one(list_file: str) -> TransferStats:
            argv = rsync_argv(source, dest, list_file, transfer)
            timeout = transfer.timeout
            if deadline is not None:
                timeout = max(1.0, min(timeout, deadline - time.monotonic()))
            try:
                res = proc.run(argv, timeout=timeout, check=False, die_with_parent=True)
            except CommandError as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise OutOfTime(f"copying from {source.raw} did not finish within the time budget; "
                                    "what arrived is kept and the next stage resumes") from None
                raise SourceError(f"copying from {source.raw} failed: {exc}; check that the source is up") from None
            if res.returncode != 0 and cannot_hold(dest, listed[list_file]):
                raise NoSpace(f"the tier's filesystem filled up while copying from {source.raw}; what arrived "
                              "is kept and the next stage resumes: free space or lower the tier's capacity")
            if res.returncode not in (0, *PARTIAL):
                tail = " | ".join(res.stderr.strip().splitlines()[-2:])
                raise SourceError(f"cannot copy from {source.raw} (rsync exit {res.returncode}: {tail}); "
                                  "check that the source is up and reachable from this node")
            asked = len(listed[list_file])
            if res.returncode == 24 and vanished(res.stderr) >= asked:
                raise SourceError(all_vanished(source, asked))
            if res.returncode:
                log.info("rsync could not copy some files from %s; verification will name them", source.raw)
            if progress:
                progress(share[list_file], whole)
            return parse_stats(res.stdout)

        with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="rsync") as pool:
            for stats in pool.map(one, files):
                total.add(stats)
    return total
