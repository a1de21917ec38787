"""Real servers for functional tests: an rsync daemon and an OpenSSH server on loopback.

Each listens on a free non-default port on 127.0.0.1, and is stopped by its pid.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RsyncDaemon:
    """``rsync --daemon`` serving one module, logging every file it sends with its length."""

    def __init__(self, workdir: Path, module_path: Path, module: str = "data", *, chroot: bool = True) -> None:
        self.port = free_port()
        self.module = module
        self.log = workdir / "rsyncd.log"
        conf = workdir / "rsyncd.conf"
        conf.write_text(
            f"port = {self.port}\naddress = 127.0.0.1\nuse chroot = {'yes' if chroot else 'no'}\n"
            f"pid file = {workdir}/rsyncd.pid\n"
            f"log file = {self.log}\ntransfer logging = yes\nlog format = %o %l %f\n"
            f"max connections = 0\n[{module}]\n  path = {module_path}\n  read only = yes\n"
            "  uid = root\n  gid = root\n")
        self.proc = subprocess.Popen(["rsync", "--daemon", "--no-detach", f"--config={conf}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, self.proc, "rsync daemon")

    def url(self, path: str = "") -> str:
        return f"rsync://127.0.0.1:{self.port}/{self.module}/{path}".rstrip("/")

    def bytes_sent(self) -> int:
        """Bytes of file data the daemon read from its module and sent (from its log)."""
        total = 0
        for line in self.log.read_text(errors="replace").splitlines():
            parts = line.split("] ", 1)[-1].split(" ", 2)
            if len(parts) >= 2 and parts[0] == "send" and parts[1].isdigit():
                total += int(parts[1])
        return total

    def stop(self) -> None:
        stop(self.proc)


class SshServer:
    """An OpenSSH server on loopback accepting one generated key for root."""

    def __init__(self, workdir: Path, addresses: tuple[str, ...] = ("127.0.0.1",)) -> None:
        """``addresses``: loopback addresses it listens on (the devcluster's nodes have their own)."""
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        self.addresses = addresses
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(workdir, 0o700)
        self.key = workdir / "client_key"
        self.host_key = host_key = workdir / "host_key"
        for k in (self.key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
        auth = workdir / "authorized_keys"
        auth.write_text((workdir / "client_key.pub").read_text())
        os.chmod(auth, 0o600)
        conf = workdir / "sshd_config"
        conf.write_text(
            f"Port {self.port}\n" + "".join(f"ListenAddress {a}\n" for a in addresses) +
            f"HostKey {host_key}\nPidFile {workdir}/sshd.pid\n"
            f"AuthorizedKeysFile {auth}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nPermitRootLogin prohibit-password\nStrictModes no\n"
            "Subsystem sftp internal-sftp\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=open(workdir / "sshd.log", "wb"))
        wait_port(self.port, self.proc, "sshd")

    @property
    def rsh(self) -> str:
        return (f"ssh -p {self.port} -i {self.key} -o BatchMode=yes -o StrictHostKeyChecking=no "
                "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR")

    @property
    def known_hosts_line(self) -> str:
        """This server's lines of a known_hosts file, one per address it listens on, as
        ``ssh-keyscan -p PORT ADDRESS`` prints them."""
        kind, blob = (self.host_key.with_suffix(".pub")).read_text().split()[:2]
        return "\n".join(f"[{a}]:{self.port} {kind} {blob}" for a in self.addresses)

    def stop(self) -> None:
        stop(self.proc)
