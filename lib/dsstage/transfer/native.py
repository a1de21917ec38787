"""The verifying copier's per-file work for small files in C: ``dsstage-copy`` (native/).

In Python each small file costs about 80 us of CPU in the interpreter (open, read, hash,
create, write, rename, the thread hand-off), serialised by the GIL: on a dataset of many
small files that, not the disk, set the pace (docs/benchmarks.md). The helper does the same
per-file work in C threads, with the same rules (dsstage.transfer.copier: opened below the
source's descriptor without following a link, as the source's reader; hashed from the
buffer read; nothing under its final name before it is whole and verified, with the
manifest's mtime), each copy written unnamed (O_TMPFILE) and linked under its name once
verified (a temporary name and a rename where that is refused), while this side keeps
every decision: which files, how many in flight
(dsstage.transfer.parallel's limiter, fed from the helper's reports and sent back as it
moves), when to stop (the deadline), and what a failure means (SourceError for the
source's, the store's errors for the node's). It checks a tree on this node's disk the same
way (check: each file hashed against its manifest entry, nothing written), for ``verify
--full`` and for what rsync and peers deliver (dsstage.transfer.check.check_tree).

The helper is used where it is installed and trusted: ``native/dsstage-copy`` beside a
checkout's ``lib/`` (packaging/lib.sh builds it), ``/usr/libexec/dsstage/dsstage-copy`` from
the packages; owned by root (or by whoever runs dsstage), writable by nobody else, in
directories only root may change, and run through the descriptor that was checked.
``DSSTAGE_NATIVE_COPY=0`` turns it off (to compare; the benchmarks do), a path names
another. Where it is missing or cannot run (openat2 refused, out of memory or threads) the
copier works in Python, as before.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dsstage.config.manifest import Entry
from dsstage.errors import SourceError, local_error
from dsstage.fs import safe
from dsstage.fs.beneath import Tree
from dsstage.fs.identity import Identity
from dsstage.transfer.parallel import FILE_COST, Limiter

log = logging.getLogger(__name__)

ENV = "DSSTAGE_NATIVE_COPY"
NAME = "dsstage-copy"
#: where the packages install it
LIBEXEC = "/usr/libexec/dsstage"
#: the helper's exit status when openat2 is missing or refused, and when it runs out of
#: memory or threads (neither the source's nor the store's fault: the Python copier goes on)
NO_OPENAT2 = 3
NO_RESOURCES = 4
#: the helper's exit status when its input ended before it had handed out every file: the
#: caller closed it at its deadline (expected), or it ended early for another reason
INPUT_ENDED = 5
#: paths this long or longer are copied in Python (the helper keeps a directory's path
#: in a buffer of PATH_MAX, and the kernel takes no longer path in one call)
MAX_PATH = 4000

_WHAT = {
    "dir": "opening a directory of the staging area",
    "create": "creating a file in the staging area",
    "write": "writing to the staging area",
    "publish": "publishing a file in the staging area",
    "identity": "taking back root's identity after reading as the source's reader",
    "read": "reading a file on this node's disk",
}


@dataclass(frozen=True)
class Helper:
    """The helper found: ``path`` (for messages) and ``fd``, an O_PATH descriptor of the file
    that was checked, which is what runs (/proc/self/fd/N): swapping the path afterwards
    changes nothing."""

    path: str
    fd: int

    @property
    def argv0(self) -> str:
        return f"/proc/self/fd/{self.fd}"


def open_trusted(path: str) -> tuple[int | None, str]:
    """(an O_PATH descriptor of the program at ``path``, "") if root may run it, else (None,
    why not): a regular executable file owned by root (or by whoever runs dsstage) that
    nobody else may write, every directory above it root's and writable by nobody else
    (or sticky), reached without following a link."""
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"{path}: {exc.strerror}"
    why = None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        why = f"{real} is not a regular file"
    elif st.st_uid not in (0, os.geteuid()):
        why = f"{real} is owned by uid {st.st_uid}"
    elif st.st_mode & 0o022:
        why = f"{real} is writable by others than its owner"
    elif not st.st_mode & 0o100:
        why = f"{real} is not executable"
    d = os.path.dirname(real)
    while why is None:
        try:
            problem = safe.dir_problem(os.lstat(d), store=False)
        except OSError as exc:
            problem = exc.strerror
        if problem:
            why = f"{d} {problem}"
        elif d == "/":
            break
        d = os.path.dirname(d)
    if why:
        os.close(fd)
        return None, why
    return fd, ""


def candidates() -> list[str]:
    """Where the helper may be, in order: what DSSTAGE_NATIVE_COPY names, the checkout's
    native/, the packages' libexec directory."""
    named = os.environ.get(ENV, "")
    if named == "0":
        return []
    if named:
        return [named]
    top = os.path.realpath(__file__)  # lib/dsstage/transfer/native.py of a checkout
    for _ in range(4):
        top = os.path.dirname(top)
    return [os.path.join(top, "native", NAME), os.path.join(LIBEXEC, NAME)]


_helper: list[Helper | None] = []
_lock = threading.Lock()


def helper() -> Helper | None:
    """The helper to run, or None (the copier works in Python); looked up once."""
    with _lock:
        if not _helper:
            found = None
            for path in candidates():
                if not os.path.lexists(path):
                    continue
                fd, why = open_trusted(path)
                if fd is None:
                    log.warning("not running the native copier: %s", why)
                    continue
                found = Helper(path, fd)
                break
            _helper.append(found)
        return _helper[0]


#: descriptors of helpers no longer used: kept open for the life of the process, as another
#: thread may still be about to run one (/proc/self/fd/N), and a number closed under it could
#: be reused by any file that thread's process opens next (a source file, say), which root
#: would then run
_retired: list[int] = []


def _drop(then: list[Helper | None]) -> None:
    with _lock:
        _retired.extend(h.fd for h in _helper if h is not None)
        _helper[:] = then


def forget() -> None:
    """Look the helper up again at the next copy (tests, between two: no copy runs, so the
    descriptors are closed rather than kept, one per test)."""
    _drop([])
    with _lock:
        while _retired:
            os.close(_retired.pop())


def disable() -> None:
    """Copy in Python from now on in this process (the helper failed to run here)."""
    _drop([None])


@dataclass(frozen=True)
class Reading:
    """Where a copy reads: the source directory's descriptor, its path (for messages), and
    the identity it reads as (None: root)."""

    fd: int
    root: str
    reader: Identity | None = None


@dataclass
class Result:
    files: int = 0
    bytes: int = 0
    #: (entry, what it was found to be: its hash, "size N", or why it was not read)
    failures: list[tuple[Entry, str]] = field(default_factory=list)
    #: False when the helper did not run to its end (the caller copies the rest in Python)
    complete: bool = True
    #: the caller stopped it at its deadline (``late()``): not complete, and not the helper's fault
    cut_short: bool = False


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


def copy(program: Helper, src: Reading, dest_fd: int, entries: Sequence[Entry], gate: Limiter,
         late: Callable[[], bool], progress: Callable[[int], None] | None = None) -> Result:
    """Copy ``entries`` (each smaller than the copier's split size, their directories made)
    from ``src`` to ``dest_fd`` with ``program``; ``late()`` true stops handing out files
    (those in flight finish). Raises SourceError or the store's error as the Python copier
    does; Result.complete is False if the helper could not run or did not finish."""
    if not entries:
        return Result()
    args = [program.argv0, str(src.fd), str(dest_fd), str(gate.bound), str(gate.limit)]
    if src.reader is not None and os.geteuid() == 0:
        args += [str(src.reader.uid), str(src.reader.gid), ",".join(map(str, src.reader.groups)) or "-"]
    return _run(program, args, (src.fd, dest_fd), entries, gate, late,
                (lambda _files, nbytes: progress(nbytes)) if progress else None, src.root)


def check(program: Helper, root_fd: int, entries: Sequence[Entry], threads: int,
          progress: Callable[[int], None] | None = None) -> Result:
    """Hash ``entries`` below ``root_fd``, a tree on this node's disk, with ``program``,
    ``threads`` files at once: Result.failures has each file that is not as listed (what it
    was found to be: its hash, "size N", or "missing"); an error of the disk itself raises
    the store's error. ``progress`` gets the files found as listed as they are."""
    if not entries:
        return Result()
    args = [program.argv0, "--check", str(root_fd), str(threads), str(threads)]
    return _run(program, args, (root_fd,), entries, Limiter(threads, threads, "checking"), lambda: False,
                (lambda files, _nbytes: progress(files)) if progress else None, "")


def _run(program: Helper, args: list[str], fds: tuple[int, ...], entries: Sequence[Entry], gate: Limiter,
         late: Callable[[], bool], progress: Callable[[int, int], None] | None, src_root: str) -> Result:
    """Run the helper over ``entries`` and read its reports (the module's protocol:
    native/dsstage_copy.c)."""
    import subprocess  # here: a check of large files alone, the fast verify --full's, never runs the helper
    result = Result()
    try:
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(*fds, program.fd))
    except OSError as exc:
        log.warning("the native copier %s does not run (%s): going on in Python", program.path, exc.strerror)
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
                    progress(files, nbytes)
            elif kind == "x":
                result.failures.append((entries[int(fields[1])], fields[2]))
            elif kind == "!":
                fatal = _fatal(raw.decode("utf-8", "replace").split(), entries, src_root)
            elif kind == "=":
                finished = True
            if late():
                close_input()
    except BaseException:
        proc.kill()  # nothing reads its reports any more: it would block writing them
        raise
    finally:
        close_input()
        writer.join()
        rc = proc.wait()
        stdout.close()
    if fatal is not None:
        raise fatal
    if rc == INPUT_ENDED and closed and late():
        result.complete, result.cut_short = False, True  # stopped at the deadline, as asked
        return result
    if rc != 0 or not finished:
        why = {NO_OPENAT2: "openat2 is missing or refused here", NO_RESOURCES: "out of memory or threads",
               INPUT_ENDED: "its input ended before its plan did"}.get(rc, f"it ended with status {rc}")
        log.warning("the native copier %s stopped before its end (%s): going on in Python", program.path, why)
        result.complete = False
    return result


def copy_some(src: Reading, dest: Tree, entries: list[Entry], gate: Limiter, late: Callable[[], bool],
              progress: Callable[[int], None], *, rate_limited: bool) -> tuple[list[Entry], Result]:
    """Copy what the helper can of ``entries`` (dsstage.transfer.copier's files below its
    split size, their directories made): the entries left for the Python copier (all of
    them where there is no helper, or a rate limit, which only the Python copier keeps;
    the paths too long for it; those it did not reach if it stopped before its end), and
    what it did."""
    program = helper()
    if program is None or rate_limited:
        return entries, Result()
    fits, left = _fitting(entries)
    done = copy(program, src, dest.root_fd, fits, gate, late, progress)
    if not done.complete:
        if not done.cut_short:
            disable()
        failed = {e.path for e, _found in done.failures}
        try:
            have = dest.paths()
        except OSError as exc:
            raise local_error(exc, "reading the staging area") from None
        left = [e for e in entries if e.path not in have and e.path not in failed]
    return left, done


def check_some(root_fd: int, entries: Sequence[Entry], threads: int,
               progress: Callable[[int], None] | None) -> tuple[list[Entry], Result]:
    """Check what the helper can of ``entries`` below ``root_fd`` (check): the entries left
    for Python (all of them where there is no helper or it stopped before its end; the
    paths too long for it), and what it found (where it stopped before its end, nothing
    but the files it reported to ``progress`` as found as listed: Result.complete False)."""
    program = helper()
    if program is None:
        return list(entries), Result()
    fits, left = _fitting(entries)
    done = check(program, root_fd, fits, threads, progress)
    if not done.complete:  # all of them again; what was reported already stays counted
        disable()
        return list(entries), Result(files=done.files, complete=False)
    if progress and done.failures:  # every file checked counts, as in hashing.hash_many
        progress(len(done.failures))
    return left, done


def _fitting(entries: Sequence[Entry]) -> tuple[list[Entry], list[Entry]]:
    """``entries`` whose paths the helper takes, and the others (MAX_PATH)."""
    fits: list[Entry] = []
    left: list[Entry] = []
    for e in entries:  # (at most 4 bytes a character: most paths need no encoding to tell)
        (fits if len(e.path) < MAX_PATH // 4 or len(os.fsencode(e.path)) < MAX_PATH else left).append(e)
    return fits, left
