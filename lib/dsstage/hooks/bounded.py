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

Standard library only, and light: the warm path runs behind it.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Callable

#: seconds of the budget kept for deciding, holding the job and writing files
DECIDE_MARGIN = 10.0
#: the exit code of a child whose work raised past every handler
CRASHED = 70


def stage_deadline(budget: float) -> float:
    """Seconds after the hook's start by which staging stops (OutOfTime), so that the Prolog
    can still decide within its budget."""
    return max(1.0, budget - DECIDE_MARGIN)


def wait_limit(budget: float) -> float:
    """Seconds after the hook's start after which the hook stops waiting for its work: past
    the work's own deadline (``stage_deadline``), with half the margin left to decide."""
    return max(stage_deadline(budget) + 2.0, budget - DECIDE_MARGIN / 2)


def run(work: Callable[[], int], seconds: float) -> int | None:
    """``work()``'s exit code, run in a forked child (a negative number if a signal ended
    it); None when it did not end within ``seconds``: the child is then killed and not
    waited for."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: measured by the functional tests
        code = CRASHED
        try:
            _let_go_of_output()
            code = work()
        except BaseException:  # noqa: BLE001 - past every handler of the work: the parent says so
            pass
        finally:
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else CRASHED)
    pidfd = os.pidfd_open(pid)
    try:
        ended, _, _ = select.select([pidfd], [], [], max(0.0, seconds))
    finally:
        os.close(pidfd)
    if not ended:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, os.WNOHANG)  # reaped if the kill ended it at once; else init reaps it
        except (ProcessLookupError, ChildProcessError):
            pass
        return None
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _let_go_of_output() -> None:
    """The child writes nothing to the hook's stdout and stderr (its log goes to syslog and
    the log file): a child left behind, blocked until the filesystem answers, would hold
    them open, and whoever reads the hook's output to its end (slurmd) would wait with it."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    finally:
        os.close(null)
