"""The one way dsstage runs external commands (rsync, squeue, scontrol).

Every command runs in its own session with ``LC_ALL=C``, is bounded by a timeout, and on
timeout its whole process group is killed, so that no rsync or ssh outlives the Prolog that
started it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence

from dsstage.errors import CommandError

log = logging.getLogger(__name__)

_SETPRIV = shutil.which("setpriv")  # util-linux


def run(argv: Sequence[str], *, timeout: float | None = None, check: bool = True,
        env: Mapping[str, str] | None = None, cwd: str | None = None,
        stdin: bytes | None = None, die_with_parent: bool = False) -> subprocess.CompletedProcess[str]:
    """Run argv, wait at most ``timeout`` seconds, return its output as text.

    Raises CommandError (carrying argv, exit code, stdout, stderr) when the command
    cannot start, times out, or exits non-zero while ``check`` is true. With
    ``die_with_parent`` the child is killed when this process dies, even by kill -9,
    so a crashed stage leaves no copier writing behind the next one.
    """
    argv = [str(a) for a in argv]
    log.debug("run: %s", argv)
    if die_with_parent and _SETPRIV:
        # PR_SET_PDEATHSIG survives exec; setpriv sets it without running Python in the child
        argv = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=c_locale(env),
                                cwd=cwd, start_new_session=True)
    except OSError as exc:
        raise CommandError(argv, None, "", str(exc), message=f"cannot run {argv[0]}: {exc.strerror}") from exc
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise CommandError(argv, None, _text(out), _text(err),
                           message=f"{argv[0]} did not finish within {timeout:g}s") from None
    except BaseException:
        kill_group(proc)
        proc.wait()
        raise
    result = subprocess.CompletedProcess(argv, proc.returncode, _text(out), _text(err))
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, result.stdout, result.stderr)
    return result


def c_locale(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``LC_ALL=C``: a command's messages, numbers and
    sorting are the same on every node whatever locale the site or the user set, so what dsstage
    reads of them does not depend on it."""
    out = dict(os.environ if env is None else env)
    out["LC_ALL"] = "C"
    return out


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the process group that ``proc`` leads (it was started in a new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", "replace")
