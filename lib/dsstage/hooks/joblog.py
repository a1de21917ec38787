"""Where the Prolog and Epilog log: syslog, so journald has them (``journalctl -t dsstage``),
and the file ``DSSTAGE_LOG`` names (from the defaults file) if any; every line carries the
job id (``job 123: ...``), and in the file its time (syslog adds its own). The file is made
0640: it names jobs, users and paths.

Syslog is the local datagram socket ``/dev/log`` (``DSSTAGE_SYSLOG`` names another one, or
``off``), facility daemon, tag ``dsstage``: journald and rsyslog both read it, and a node
without either loses nothing but those lines. With neither a socket nor a file, lines go to
stderr (slurmd's).

This module imports only the standard library's lightest parts: the warm Prolog uses it.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Mapping

SOCKET = "/dev/log"
ENV_SOCKET = "DSSTAGE_SYSLOG"
TAG = "dsstage"
_DAEMON = 3  # syslog facility
_SEVERITY = {"CRITICAL": 2, "ERROR": 3, "WARNING": 4, "INFO": 6, "DEBUG": 7}
_MAX = 8192  # bytes of one datagram; longer lines (a traceback) are cut


def with_job(job_id: str, text: str) -> str:
    """``text`` with the job id in front, unless it starts with it already."""
    if not job_id or text.startswith(f"job {job_id}:"):
        return text
    return f"job {job_id}: {text}"


def syslog(text: str, level: str = "INFO", env: Mapping[str, str] = os.environ) -> bool:
    """Send one line to the syslog socket; False if there is none (or it is off)."""
    where = env.get(ENV_SOCKET) or SOCKET
    if where == "off":
        return False
    import _socket
    pri = _DAEMON * 8 + _SEVERITY.get(level, 6)
    data = f"<{pri}>{TAG}[{os.getpid()}]: {text}".encode(errors="replace")[:_MAX]
    try:
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
        try:
            s.sendto(data, where)
        finally:
            s.close()
    except OSError:
        return False
    return True


def stamp(now: float | None = None) -> str:
    """The time of a log line: local, with its offset (2026-11-26T18:52:01+0100)."""
    import time
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now))


def append(path: str, line: str) -> None:
    """Append ``line`` to the log file, made 0640 (it names jobs, users and paths: not for every
    user to read), never through a symbolic link; a file an older version left readable by
    everyone is closed to others."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o007 and st.st_uid == os.geteuid():
            os.fchmod(fd, st.st_mode & 0o7770)
        os.write(fd, line.encode(errors="replace"))
    finally:
        os.close(fd)


def write(text: str, level: str = "INFO", *, job_id: str = "", env: Mapping[str, str] = os.environ) -> None:
    """One event: to syslog, and to the file DSSTAGE_LOG (else stderr if syslog is not there)."""
    line = with_job(job_id, text)
    sent = syslog(line, level, env)
    path = env.get("DSSTAGE_LOG")
    if path:
        try:
            append(path, f"{stamp()} {TAG}-{os.getpid()}: {level}: {line}\n")
            return
        except OSError:
            pass
    if not sent:
        sys.stderr.write(f"{TAG}-{os.getpid()}: {level}: {line}\n")
