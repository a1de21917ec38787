"""The Prolog and Epilog within their budget, whatever the shared filesystem does.

A hard NFS mount or a FUSE source that stops answering blocks a system call for as long as
it likes, and no deadline check in Python runs while it does: a Prolog blocked that way
outlives slurm.conf's PrologTimeout and slurmd drains the node. So the hook's work (the warm
path, the full Prolog, the Epilog: everything that reads ``state_dir`` or a source) runs in a
forked child, and the hook itself, the process slurmd waits for, only waits for it, up to the
budget (``prolog_budget``). A child that does not finish in time is killed (SIGKILL ends a
FUSE or NFS wait where the kernel allows it, otherwise as soon as the call returns) and left
behind; the hook then decides from what it knows locally (dsstage.hooks.abandoned) and exits
in time. What the child leaves (a staging area, a reservation of a dead process, a lease of
this job) is reclaimed by the next stage or by the Epilog, as after any killed stage.

The child tells the hook what it has done (``tell``: "decided hold" once the job's TaskProlog
file is written, "held" once Slurm holds it), so that a child stopped after deciding keeps its
decision. Its stdout and stderr reach the hook through a pipe the hook reads while it waits
(slurmd reads the hook's output to its end: a child left behind must not hold it open).

Standard library only, and light: the warm path runs behind it.
"""

from __future__ import annotations

import os
import select
import sys
import time

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Callable

#: seconds of the budget kept for deciding, holding the job and writing files
DECIDE_MARGIN = 10.0
#: the exit code of a child whose work raised past every handler
CRASHED = 70

_tell_fd = -1  # in the child: where ``tell`` writes


def stage_deadline(budget: float) -> float:
    """Seconds after the hook's start by which staging stops (OutOfTime), so that the Prolog
    can still decide within its budget."""
    return max(1.0, budget - DECIDE_MARGIN)


def wait_limit(budget: float) -> float:
    """Seconds after the hook's start after which the hook stops waiting for its work: past
    the work's own deadline (``stage_deadline``), with half the margin left to decide."""
    return max(stage_deadline(budget) + 2.0, budget - DECIDE_MARGIN / 2)


class Outcome:
    """How the work ended: its exit code (negative: the signal that ended it; None: it did not
    end in time and was killed), and what it told the hook, in order. (A plain class: importing dataclasses
    cost the warm Prolog about 15 ms: tests/unit/test_warm_imports.py.)"""

    __slots__ = ("code", "said")

    def __init__(self, code: int | None, said: list[str] | None = None) -> None:
        self.code = code
        self.said = [] if said is None else said

    def __repr__(self) -> str:
        return f"Outcome(code={self.code!r}, said={self.said!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Outcome) and (self.code, self.said) == (other.code, other.said)

    def last(self, prefix: str) -> str | None:
        """The rest of the last message that starts with ``prefix``, or None."""
        found = [m[len(prefix):].strip() for m in self.said if m.startswith(prefix)]
        return found[-1] if found else None


def tell(message: str) -> None:
    """From the work: tell the hook ``message`` (one line); nothing when not in a child."""
    if _tell_fd >= 0:
        try:
            os.write(_tell_fd, (message.replace("\n", " ") + "\n").encode())
        except OSError:
            pass


def run(work: Callable[[], int], seconds: float) -> Outcome:
    """``work()`` in a forked child, waited for at most ``seconds``; where the process cannot
    fork, in this process (unbounded, as hooks ran before)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    tell_r, tell_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        for fd in (tell_r, tell_w, out_r, out_w):
            os.close(fd)
        return Outcome(work())
    if pid == 0:  # pragma: no cover - the child: measured by the functional tests
        _child(work, tell_w, out_w, (tell_r, out_r))
    os.close(tell_w)
    os.close(out_w)
    try:
        return _wait(pid, seconds, tell_r, out_r)
    finally:
        os.close(tell_r)
        os.close(out_r)


def _child(work: Callable[[], int], tell_w: int, out_w: int, others: tuple[int, ...]) -> None:  # pragma: no cover
    global _tell_fd
    code = CRASHED
    try:
        for fd in others:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.close(out_w)
        _tell_fd = tell_w
        code = work()
    except BaseException:  # noqa: BLE001 - past every handler of the work: said, and the hook decides
        try:
            import traceback
            traceback.print_exc()
        except BaseException:  # noqa: BLE001, S110 - nothing more to be done in a dying child
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else CRASHED)


def _wait(pid: int, seconds: float, tell_r: int, out_r: int) -> Outcome:
    said = bytearray()
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except OSError:
        pidfd = None  # no pidfd here: the child's end is polled
    deadline = time.monotonic() + max(0.0, seconds)
    ended = False
    open_pipes = [tell_r, out_r]
    try:
        while not ended:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            watch = open_pipes + ([pidfd] if pidfd is not None else [])
            ready, _, _ = select.select(watch, [], [], left if pidfd is not None else min(left, 0.05))
            for fd in ready:
                if fd == pidfd:
                    ended = True
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_pipes.remove(fd)
                elif fd == tell_r:
                    said += chunk
                else:
                    _forward(chunk)
            if pidfd is None:
                reaped, status = os.waitpid(pid, os.WNOHANG)
                if reaped == pid:
                    return _collect(os.waitstatus_to_exitcode(status), tell_r, out_r, said)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    if not ended:
        import signal  # only here: the module imports enum, a few ms of every warm Prolog
        try:
            os.kill(pid, signal.SIGKILL)
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except (ProcessLookupError, ChildProcessError):
            reaped, status = 0, 0
        if reaped == pid and os.WIFEXITED(status):  # it ended on its own just before the kill
            return _collect(os.waitstatus_to_exitcode(status), tell_r, out_r, said)
        return _collect(None, tell_r, out_r, said)
    _, status = os.waitpid(pid, 0)
    return _collect(os.waitstatus_to_exitcode(status), tell_r, out_r, said)


def _collect(code: int | None, tell_r: int, out_r: int, said: bytearray) -> Outcome:
    """What the pipes still hold (without waiting: a child left behind keeps them open)."""
    for fd in (tell_r, out_r):
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            if fd == tell_r:
                said += chunk
            else:
                _forward(chunk)
    return Outcome(code, [m for m in said.decode(errors="replace").splitlines() if m])


def _forward(chunk: bytes) -> None:
    try:
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
