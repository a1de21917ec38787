"""The verifying copier's per-file work for small files in C: ``dsstage-copy`` (native/).

In Python each small file costs about 70 us of CPU in the interpreter (open, read, hash,
create, write, rename, the thread hand-off), serialised by the GIL: on a dataset of many
small files that, not the disk, set the pace (docs/benchmarks.md). The helper does the same
per-file work in C threads, with the same rules (dsstage.transfer.copier: opened below the
source's descriptor without following a link, as the source's reader; hashed from the
buffer read; a fresh O_EXCL temporary name, the manifest's mtime, renamed into place only
once verified), while this side keeps every decision: which files, how many in flight
(dsstage.transfer.parallel's limiter, fed from the helper's reports and sent back as it
moves), when to stop (the deadline), and what a failure means (SourceError for the
source's, the store's errors for the node's).

The helper is used where it is installed and trusted: ``native/dsstage-copy`` beside a
checkout's ``lib/`` (packaging/lib.sh builds it), ``/usr/libexec/dsstage/dsstage-copy`` from
the packages; owned by root (or by whoever runs dsstage) and writable by nobody else.
``DSSTAGE_NATIVE_COPY=0`` turns it off (to compare; the benchmarks do), a path names
another. Where it is missing or cannot run (a kernel without openat2) the copier works in
Python, as before.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsstage.config.manifest import Entry
from dsstage.errors import SourceError, local_error
from dsstage.fs.beneath import Tree
from dsstage.fs.identity import Identity
from dsstage.transfer.parallel import FILE_COST, Limiter

log = logging.getLogger(__name__)

ENV = "DSSTAGE_NATIVE_COPY"
NAME = "dsstage-copy"
#: where the packages install it
LIBEXEC = "/usr/libexec/dsstage"
#: the helper's exit status when the kernel lacks openat2
NO_OPENAT2 = 3
#: paths this long or longer are copied in Python (the helper keeps a directory's path
#: in a buffer of PATH_MAX, and the kernel takes no longer path in one call)
MAX_PATH = 4000

_WHAT = {
    "dir": "opening a directory of the staging area",
    "create": "creating a file in the staging area",
    "write": "writing to the staging area",
    "publish": "publishing a file in the staging area",
    "identity": "taking back root's identity after reading as the source's reader",
}


def untrusted(path: str) -> str | None:
    """Why root may not run the program at ``path``, or None."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid not in (0, os.geteuid()):
        return f"{path} is owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"{path} is writable by others than its owner"
    if not st.st_mode & 0o100:
        return f"{path} is not executable"
    return None


def candidates() -> list[str]:
    """Where the helper may be, in order: what DSSTAGE_NATIVE_COPY names, the checkout's
    native/, the packages' libexec directory."""
    named = os.environ.get(ENV, "")
    if named == "0":
        return []
    if named:
        return [named]
    top = Path(__file__).resolve().parents[3]
    return [str(top / "native" / NAME), os.path.join(LIBEXEC, NAME)]


_helper: list[str | None] = []
_lock = threading.Lock()


def helper() -> str | None:
    """The helper to run, or None (the copier works in Python); looked up once."""
    with _lock:
        if not _helper:
            found = None
            for path in candidates():
                if not os.path.exists(path):
                    continue
                why = untrusted(path)
                if why:
                    log.warning("not running the native copier: %s", why)
                    continue
                found = path
                break
            _helper.append(found)
        return _helper[0]


def forget() -> None:
    """Look the helper up again at the next copy (tests)."""
    with _lock:
        _helper.clear()


def disable() -> None:
    """Copy in Python from now on in this process (the helper failed to run here)."""
    with _lock:
        _helper[:] = [None]


@dataclass
class Result:
    files: int = 0
    bytes: int = 0
    #: (entry, what it was found to be: its hash, "size N", or why it was not read)
    failures: list[tuple[Entry, str]] = field(default_factory=list)
    #: False when the helper did not run to its end (the caller copies the rest in Python)
    complete: bool = True


def _records(entries: Sequence[Entry]) -> bytes:
    return b"".join(b"%d %d %s %s\0" % (e.size, e.mtime_ns, e.hash.encode(), os.fsencode(e.path))
                    for e in entries) + b"\0"


def _fatal(fields: list[str], entries: Sequence[Entry], src_root: str) -> Exception:
    """The error a helper's "!" line reports."""
    err = int(fields[2])
    if fields[1] == "source":
        e = entries[int(fields[3])]
        return SourceError(f"reading {os.path.join(src_root, e.path)!r} failed: {os.strerror(err)}; "
                           "check the source's filesystem")
    what = _WHAT.get(fields[3], "writing to the staging area")
    i = int(fields[4])
    if i < len(entries):
        what += f" ({entries[i].path!r})"
    return local_error(OSError(err, os.strerror(err)), what)


def copy(program: str, src_fd: int, src_root: str, dest_fd: int, entries: Sequence[Entry], gate: Limiter,
         reader: Identity | None, late: Callable[[], bool],
         progress: Callable[[int], None] | None = None) -> Result:
    """Copy ``entries`` (each smaller than the copier's split size, their directories made)
    from ``src_fd`` to ``dest_fd`` with ``program``; ``late()`` true stops handing out files
    (those in flight finish). Raises SourceError or the store's error as the Python copier
    does; Result.complete is False if the helper could not run or did not finish."""
    result = Result()
    if not entries:
        return result
    args = [program, str(src_fd), str(dest_fd), str(gate.bound), str(gate.limit)]
    if reader is not None and os.geteuid() == 0:
        args += [str(reader.uid), str(reader.gid), ",".join(map(str, reader.groups)) or "-"]
    try:
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(src_fd, dest_fd))
    except OSError as exc:
        log.warning("the native copier %s does not run (%s): copying in Python", program, exc.strerror)
        result.complete = False
        return result
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    send = threading.Lock()
    closed = False

    def close_input() -> None:
        nonlocal closed
        with send:
            if not closed:
                closed = True
                try:
                    stdin.close()
                except OSError:
                    pass

    def feed() -> None:
        with send:
            try:
                stdin.write(_records(entries))
                stdin.write(b"L %d\n" % gate.limit)
                stdin.flush()
            except OSError:  # the helper is gone: its exit says why
                pass

    writer = threading.Thread(target=feed, name="native-copy-feed", daemon=True)
    writer.start()
    fatal: Exception | None = None
    finished = False
    try:
        for raw in stdout:
            fields = raw.decode("utf-8", "replace").rstrip("\n").split(" ", 2)
            kind = fields[0]
            if kind == "+":
                files, nbytes = int(fields[1]), int(fields[2])
                result.files += files
                result.bytes += nbytes
                before = gate.limit
                gate.completed(files, files * FILE_COST + nbytes)
                if gate.limit != before and not closed:
                    with send:
                        try:
                            stdin.write(b"L %d\n" % gate.limit)
                            stdin.flush()
                        except (OSError, ValueError):
                            pass
                if progress:
                    progress(nbytes)
            elif kind == "x":
                result.failures.append((entries[int(fields[1])], fields[2]))
            elif kind == "!":
                fatal = _fatal(raw.decode("utf-8", "replace").split(), entries, src_root)
            elif kind == "=":
                finished = True
            if late():
                close_input()
    finally:
        close_input()
        writer.join()
        rc = proc.wait()
        stdout.close()
    if fatal is not None:
        raise fatal
    if rc != 0 or not finished:
        why = "this kernel has no openat2" if rc == NO_OPENAT2 else f"it ended with status {rc}"
        log.warning("the native copier %s stopped before its end (%s): copying the rest in Python", program, why)
        result.complete = False
    return result


def copy_some(src_fd: int, src_root: str, dest: Tree, entries: list[Entry], gate: Limiter,
              reader: Identity | None, late: Callable[[], bool], progress: Callable[[int], None],
              *, rate_limited: bool) -> tuple[list[Entry], Result]:
    """Copy what the helper can of ``entries`` (dsstage.transfer.copier's files below its
    split size, their directories made): the entries left for the Python copier (all of
    them where there is no helper, or a rate limit, which only the Python copier keeps;
    the paths too long for it; those it did not reach if it stopped before its end), and
    what it did."""
    program = helper()
    if program is None or rate_limited:
        return entries, Result()
    fits = [e for e in entries if len(os.fsencode(e.path)) < MAX_PATH]
    left = [e for e in entries if len(os.fsencode(e.path)) >= MAX_PATH]
    done = copy(program, src_fd, src_root, dest.root_fd, fits, gate, reader, late, progress)
    if not done.complete:
        disable()
        failed = {e.path for e, _found in done.failures}
        try:
            have = dest.paths()
        except OSError as exc:
            raise local_error(exc, "reading the staging area") from None
        left = [e for e in entries if e.path not in have and e.path not in failed]
    return left, done
