"""A latency-bound source for tests and benchmarks: tests/latencyfs.c, a read-only FUSE
passthrough in which every metadata operation, open and read waits one emulated round
trip (docs/benchmarks.md, "Latency-bound sources").

    with LatencyFS(backing, mountpoint, delay_us=1000, rate=100 << 20) as fs:
        ...                  # read through mountpoint
        fs.stats()           # {"ops": {"getattr": ..., "open": ...}, "by_area": {"nodes": {"open": ...}, ...},
                             #  "bytes_read": ..., "peak_in_flight": ...}
        fs.reset()           # zero the counters
        fs.remount()         # cold dentry, attribute and page caches
        fs.hang()            # no request is answered any more, as a hard NFS mount whose server is gone
        fs.answer()          # ... until this
        fs.fail_reads()      # every read answered EIO (fail_reads(False): no more; error=: another)

The binary is built on demand (gcc, pkg-config fuse3: Debian's libfuse3-dev) into
build/latencyfs/ (ignored by git), keyed by the source's hash. The filesystem runs in the
foreground as a child process and is stopped by its pid.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TOP = Path(__file__).resolve().parent.parent
SOURCE = Path(__file__).resolve().parent / "latencyfs.c"
BUILD_DIR = TOP / "build" / "latencyfs"
INSTALL_HINT = "apt-get install fuse3 libfuse3-dev (packaging/run-tests and bench/run install them)"


class Unavailable(RuntimeError):
    """latencyfs cannot run here: no /dev/fuse, no compiler or no libfuse3-dev."""


def unavailable() -> str | None:
    """Why latencyfs cannot run on this machine, or None if it can (it is then built)."""
    try:
        binary()
    except Unavailable as e:
        return str(e)
    return None


def require() -> None:
    """For pytest: fail when latencyfs cannot run under CI (CI=true installs everything it
    needs), skip with the reason elsewhere."""
    import pytest
    why = unavailable()
    if why is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"latencyfs: {why}", pytrace=False)
    pytest.skip(f"latencyfs: {why}")


_build_lock = threading.Lock()


def binary() -> Path:
    """The compiled tests/latencyfs.c, built now if this version of it is not built yet."""
    if not os.path.exists("/dev/fuse"):
        raise Unavailable("/dev/fuse does not exist (no FUSE in this kernel or container)")
    source = SOURCE.read_bytes()
    out = BUILD_DIR / f"latencyfs-{hashlib.sha256(source).hexdigest()[:16]}"
    with _build_lock:
        if out.exists():
            return out
        gcc, pkgconf = shutil.which("gcc"), shutil.which("pkg-config")
        if not gcc or not pkgconf:
            raise Unavailable(f"gcc and pkg-config are needed to build it; {INSTALL_HINT}")
        flags = subprocess.run([pkgconf, "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
        if flags.returncode != 0:
            raise Unavailable(f"pkg-config finds no fuse3: {INSTALL_HINT}")
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        res = subprocess.run([gcc, "-Wall", "-Wextra", "-O2", "-o", str(tmp), str(SOURCE), *flags.stdout.split()],
                             capture_output=True, text=True)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise Unavailable(f"building {SOURCE.name} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    return out


def _unescape(field: str) -> str:
    """A path as /proc/self/mountinfo writes it (octal escapes for space, tab, newline, backslash)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounted(mountpoint: str | Path) -> bool:
    """Whether a latencyfs is mounted on ``mountpoint`` (per /proc/self/mountinfo)."""
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split(" - ", 1)
            pre = fields[0].split()
            if len(pre) > 4 and _unescape(pre[4]) == target and len(fields) > 1 \
                    and fields[1].split()[0] == "fuse.latencyfs":
                return True
    return False


def _umount(mountpoint: str, lazy: bool = False) -> bool:
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.umount2(mountpoint.encode(), 2 if lazy else 0) == 0  # MNT_DETACH
    res = subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint], capture_output=True)
    return res.returncode == 0


class LatencyFS:
    """``backing`` served read-only on ``mountpoint`` by latencyfs, each metadata operation,
    open and read request delayed by ``delay_us`` microseconds, up to ``threads`` requests
    served at once; the kernel caches entries and attributes for ``attr_timeout`` seconds.
    ``rate`` (bytes per second, 0 = unlimited) caps what the read replies of all threads
    and clients together deliver, as a shared filesystem's aggregate bandwidth: each read
    waits its round trip, then its turn on the link."""

    def __init__(self, backing: str | Path, mountpoint: str | Path, delay_us: int = 1000, threads: int = 256,
                 attr_timeout: float = 1.0, entry_timeout: float | None = None, readdirplus: bool = False,
                 allow_other: bool = False, extra_options: str = "", rate: int = 0, squash: bool = False) -> None:
        """``squash``: writable, each request as its caller, root served as 65534:65534 (an NFS
        export with root_squash); the backing directory's own permissions decide."""
        if rate < 0:
            raise ValueError(f"latencyfs: rate must be >= 0 bytes per second, not {rate}")
        self.backing = os.path.realpath(backing)
        self.mountpoint = os.path.realpath(mountpoint)
        self.delay_us, self.threads, self.rate = delay_us, threads, int(rate)
        self.attr_timeout = attr_timeout
        self.entry_timeout = attr_timeout if entry_timeout is None else entry_timeout
        self.readdirplus, self.allow_other, self.extra_options = readdirplus, allow_other, extra_options
        self.squash = squash
        self.workdir = Path(tempfile.mkdtemp(prefix="latencyfs-"))
        self.stats_file = self.workdir / "stats.json"
        self.hang_file = self.workdir / "hang"  # while it exists, latencyfs answers nothing
        self.fail_file = self.workdir / "fail"  # while it exists, every read is answered EIO
        self.log = self.workdir / "latencyfs.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.final: dict[str, Any] | None = None  # the counters written at the last unmount
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def options(self) -> str:
        opts = [f"delay_us={self.delay_us}", f"threads={self.threads}", f"rate={self.rate}", f"stats={self.stats_file}",
                f"hang={self.hang_file}", f"fail={self.fail_file}",
                f"attr_timeout={self.attr_timeout}", f"entry_timeout={self.entry_timeout}"]
        opts += ["readdirplus"] * self.readdirplus + ["allow_other"] * self.allow_other + ["squash"] * self.squash
        return ",".join(opts + ([self.extra_options] if self.extra_options else []))

    def mount(self, timeout: float = 15) -> LatencyFS:
        exe = binary()
        if mounted(self.mountpoint):
            raise RuntimeError(f"latencyfs: {self.mountpoint} is already mounted")
        os.makedirs(self.mountpoint, exist_ok=True)
        self.stats_file.unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(exe), self.backing, self.mountpoint, "-f", "-o", self.options()],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while not (mounted(self.mountpoint) and self._read() is not None):
            if self.proc.poll() is not None:
                raise RuntimeError(f"latencyfs exited with {self.proc.returncode} before mounting "
                                   f"{self.mountpoint}: {self.log.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                self._stop()
                raise RuntimeError(f"latencyfs did not mount {self.mountpoint} within {timeout} s")
            time.sleep(0.01)
        return self

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.stats_file.read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None

    def _signal(self, sig: int, timeout: float = 10) -> dict[str, Any]:
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError("latencyfs is not running")
            before = (self._read() or {}).get("seq", 0)
            os.kill(self.proc.pid, sig)
            deadline = time.monotonic() + timeout
            while True:
                now = self._read()
                if now is not None and now.get("seq", 0) > before:
                    return now
                if time.monotonic() > deadline:
                    raise RuntimeError("latencyfs did not write its counters")
                time.sleep(0.005)

    def stats(self) -> dict[str, Any]:
        """The counters now: ``ops`` by kind (getattr, readlink, opendir, readdir, open, read,
        release, releasedir, statfs, write, change), ``by_area`` (the same by the first component
        of the path, cut at its first dot after the first character: ``nodes``, ``demand`` for
        demand.json, ``/`` for the root), ``bytes_read`` (bytes delivered by read replies),
        ``in_flight``, ``peak_in_flight`` and ``peak_opens_in_flight`` since the mount or the
        last reset; and the settings ``delay_us``, ``threads`` and ``rate``."""
        return self._signal(signal.SIGUSR1)

    def reset(self) -> dict[str, Any]:
        """Zero the counters (the peaks start again from what is in flight now)."""
        return self._signal(signal.SIGUSR2)

    def hang(self) -> None:
        """Stop answering: every request (but a close) blocks its caller until ``answer()``
        or until the caller is killed, as on a hard NFS mount whose server stopped answering."""
        self.hang_file.touch()

    def fail_reads(self, failing: bool = True, error: int = errno.EIO) -> None:
        """Answer every read with ``error`` (until called with False), as a server whose disk fails."""
        if failing:
            self.fail_file.write_text(str(error))
        else:
            self.fail_file.unlink(missing_ok=True)

    def answer(self) -> None:
        """Answer again, the requests that waited first."""
        self.hang_file.unlink(missing_ok=True)

    def unmount(self, timeout: float = 15) -> None:
        if self.proc is None:
            return
        self.answer()
        if self.proc.poll() is None:
            deadline = time.monotonic() + timeout
            while mounted(self.mountpoint) and not _umount(self.mountpoint):
                if time.monotonic() > deadline:  # busy: detach it, the process then ends
                    _umount(self.mountpoint, lazy=True)
                    break
                time.sleep(0.05)
        self._stop(timeout)
        self.final = self._read()

    def _stop(self, timeout: float = 15) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # by its pid: this process only
            proc.wait()
        if mounted(self.mountpoint):  # killed with the mount left behind
            _umount(self.mountpoint, lazy=True)

    def remount(self) -> None:
        """Unmount and mount again: the kernel's dentry, attribute and page caches of the
        mount are gone, as on a client that has not seen these files yet."""
        self.unmount()
        self.mount()

    def __enter__(self) -> LatencyFS:
        return self.mount()

    def __exit__(self, *exc: object) -> None:
        try:
            self.unmount()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
