"""The SSH transport of fleet operations (paramiko): connect with known host keys only, run
one dsstage command per node with a deadline and bounded output, stream its progress lines,
and classify every failure in words an admin can act on.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from errno import ECONNREFUSED, EHOSTUNREACH, ENETUNREACH
from typing import TYPE_CHECKING, Any

import paramiko

from dsstage.config.model import Fleet
from dsstage.errors import ConfigError, DsstageError

if TYPE_CHECKING:
    pass
from dsstage.cluster.fleet import (
    ADDRESS_RE,
    Answer,
    DoneFn,
    ProgressFn,
    judge,
    one_line,
    parse_progress,
    remote_command,
)

log = logging.getLogger(__name__)

#: the host key files every run reads after ``fleet.known_hosts``, in OpenSSH's order
KNOWN_HOSTS = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
#: paramiko's transport logs each failure at ERROR with a traceback; it is in Answer.error
#: already, so it is logged under this name, for an entry point to quieten
SSH_LOGGER = "dsstage.cluster.ssh.paramiko"
#: stderr lines (other than progress) kept in an Answer
STDERR_LINES = 20
#: a longer stderr line is cut (a remote writing without newlines must not fill memory)
MAX_LINE = 64 * 1024
#: the most stdout kept from one node: dsstage's JSON is far smaller; a node that sends more is cut off
MAX_STDOUT = 64 * 1024 * 1024
#: how often a waiting worker looks at its deadline and at a cancel
_TICK = 0.5


class UnknownHostKey(paramiko.SSHException):
    """The node offered a host key that no known_hosts file lists."""

    def __init__(self, name: str, key: paramiko.PKey) -> None:
        super().__init__(f"{name}: host key not in known_hosts")
        self.name = name
        self.key = key


class _Reject(paramiko.RejectPolicy):
    """paramiko's RejectPolicy, raising an exception that carries the offered key."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(hostname, key)


def _fingerprint(key: Any) -> str:
    try:
        return str(key.fingerprint)  # "SHA256:...", as ssh-keygen -l prints it
    except Exception:  # an old paramiko
        return key.get_name() if key is not None else "?"


def _errnos(exc: BaseException) -> set[int]:
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        return {e.errno for e in exc.errors.values() if e.errno is not None}
    errno = getattr(exc, "errno", None)
    return {errno} if isinstance(errno, int) else set()


def classify(exc: BaseException, *, node: str, address: str, conf: Fleet, phase: str = "connecting") -> str:
    """One line saying why talking to ``node`` failed, and what to do about it.

    ``phase`` is "connecting" (TCP, SSH handshake, host key, authentication) or "running"
    (the command was started: a lost connection there means its outcome is unknown).
    Pure: tests give it the exceptions paramiko and the socket layer raise.
    """
    hostport = address if conf.port == 22 else f"{address}:{conf.port}"
    ct = f"{conf.connect_timeout:g}s"
    msg = one_line(str(exc), 200)
    if isinstance(exc, UnknownHostKey):
        file = conf.known_hosts or "~/.ssh/known_hosts"
        port = "" if conf.port == 22 else f"-p {conf.port} "
        return (f"host key of {node} ({hostport}) is not in known_hosts: add it with "
                f"ssh-keyscan {port}{address} >> {file} (check its fingerprint {_fingerprint(exc.key)} "
                "on the node first)")
    if isinstance(exc, paramiko.BadHostKeyException):
        name = address if conf.port == 22 else f"[{address}]:{conf.port}"
        return (f"host key of {node} ({hostport}) does not match known_hosts (offered {_fingerprint(exc.key)}): "
                f"if the node was reinstalled, remove the old key (ssh-keygen -R '{name}') and add the new one; "
                "otherwise someone may be in between")
    if isinstance(exc, paramiko.AuthenticationException):
        if "timeout" in msg.lower():
            return f"timed out after {ct} authenticating as {conf.user}@{hostport}"
        how = f"the key {conf.key}" if conf.key else "the SSH agent and ~/.ssh keys"
        allowed = getattr(exc, "allowed_types", None)
        extra = f" (the node allows only: {', '.join(allowed)})" if allowed else ""
        return (f"authentication failed for {conf.user}@{hostport} with {how}{extra}: "
                "install its public key in the node's authorized_keys or set fleet.key")
    if phase == "running":
        return f"connection lost while the command ran (its outcome is unknown): {msg or type(exc).__name__}"
    if isinstance(exc, socket.gaierror):
        return f"unreachable: cannot resolve {address}: {exc.strerror or msg}"
    codes = _errnos(exc)
    if codes and codes <= {ECONNREFUSED}:
        return "unreachable: connection refused"
    if codes & {EHOSTUNREACH, ENETUNREACH}:
        return "unreachable: no route to host"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"timed out after {ct} connecting"
    if isinstance(exc, paramiko.SSHException) and msg == "No existing session":
        # what paramiko raises when the handshake did not finish within the timeout
        return f"timed out after {ct} in the SSH handshake (is {hostport} an SSH server?)"
    if isinstance(exc, paramiko.SSHException) and "banner" in msg.lower():
        cause = exc.__cause__ or exc.__context__
        if "timed out" in msg.lower() or isinstance(cause, (socket.timeout, TimeoutError)):
            return f"timed out after {ct} waiting for the SSH banner (is {hostport} an SSH server?)"
        return f"no SSH banner from {hostport} (is it an SSH server?): {msg}"
    if isinstance(exc, EOFError):
        return f"{hostport} closed the connection during the SSH handshake"
    if isinstance(exc, OSError):
        return f"unreachable: {one_line(exc.strerror or msg, 200)}"
    if isinstance(exc, paramiko.SSHException):
        return f"ssh: {msg}"
    return f"internal error: {type(exc).__name__}: {msg}"


#: what paramiko raises for a line it cannot read (a bad base64 key: InvalidHostKey)
_BAD_KNOWN_HOSTS = (paramiko.SSHException, ValueError, paramiko.hostkeys.InvalidHostKey)


def load_host_keys(conf: Fleet, system_files: Sequence[str] = KNOWN_HOSTS) -> paramiko.HostKeys:
    """The host keys of every known_hosts file, read once for all nodes.

    ``fleet.known_hosts`` was asked for, so it must be readable (ConfigError otherwise);
    the user's and the system's files are optional (a warning if unreadable). paramiko
    keeps one key per host and key type, the first one read: ``fleet.known_hosts`` wins,
    and a stale line in a later file for the same host and type is never looked at.
    """
    keys = paramiko.HostKeys()
    if conf.known_hosts:
        try:
            keys.load(conf.known_hosts)
        except OSError as exc:
            raise ConfigError(f"fleet.known_hosts {conf.known_hosts}: cannot read: {exc.strerror or exc}; "
                              "create it, e.g. with ssh-keyscan") from None
        except _BAD_KNOWN_HOSTS as exc:
            raise ConfigError(f"fleet.known_hosts {conf.known_hosts}: not a known_hosts file: {exc}") from None
    for path in system_files:
        path = os.path.expanduser(path)
        if os.path.exists(path):
            try:
                keys.load(path)
            except (OSError, *_BAD_KNOWN_HOSTS) as exc:
                log.warning("cannot read the known_hosts file %s: %s", path, exc)
    return keys


def host_key_name(address: str, port: int) -> str:
    """How known_hosts names a host: ``address``, or ``[address]:port`` off port 22."""
    return address if port == 22 else f"[{address}]:{port}"


def _load_key(path: str) -> paramiko.PKey:
    try:
        return paramiko.PKey.from_path(path)
    except FileNotFoundError:
        raise ConfigError(f"fleet.key {path}: no such file") from None
    except paramiko.PasswordRequiredException:
        raise ConfigError(f"fleet.key {path}: the key has a passphrase: use an unencrypted key readable "
                          "by root only, or leave fleet.key unset to use the SSH agent") from None
    except (OSError, paramiko.SSHException, ValueError) as exc:
        raise ConfigError(f"fleet.key {path}: cannot load the private key: {exc}") from None


def _signal(chan: paramiko.Channel, name: str) -> None:
    """Ask sshd to signal the remote command's process group (RFC 4254 "signal"; OpenSSH
    7.9+). paramiko has no call for it, so the request is built here. Best effort: OpenSSH
    refuses it for root's sessions (seen with 9.2: "session signalling requires privilege
    separation"), and then closing the channel is what stops the command: without a pty it
    runs on until it next writes to its closed stdout or stderr."""
    try:
        from paramiko.common import cMSG_CHANNEL_REQUEST
        m = paramiko.Message()
        m.add_byte(cMSG_CHANNEL_REQUEST)
        m.add_int(chan.remote_chanid)
        m.add_string("signal")
        m.add_boolean(False)
        m.add_string(name)
        chan.transport._send_user_message(m)
    except Exception as exc:  # the connection is gone, or paramiko changed: closing is what is left
        log.debug("cannot send %s to the remote command: %s", name, exc)


class _Stderr:
    """Splits stderr into lines: progress ones go to ``on_progress``, the last others are kept."""

    def __init__(self, node: str, on_progress: ProgressFn | None) -> None:
        self.node = node
        self.on_progress = on_progress
        self.partial = b""
        self.lines: deque[str] = deque(maxlen=STDERR_LINES)

    def feed(self, data: bytes) -> None:
        self.partial += data
        *done, self.partial = self.partial.split(b"\n")
        if len(self.partial) > MAX_LINE:
            done.append(self.partial[:MAX_LINE])
            self.partial = b""
        for raw in done:
            self.line(raw.decode("utf-8", "replace").rstrip("\r"))

    def line(self, text: str) -> None:
        progress = parse_progress(text)
        if progress is None:
            self.lines.append(text)
        elif self.on_progress:
            self.on_progress(self.node, progress)

    def close(self) -> None:
        if self.partial:
            self.line(self.partial.decode("utf-8", "replace"))
            self.partial = b""


class _Cancelled(Exception):
    pass


class _Deadline(Exception):
    pass


class _TooMuch(Exception):
    pass


@dataclass(frozen=True)
class _Login:
    """How every node of one fleet run is logged in to: the fleet's settings, the host keys
    that vouch for the nodes, and the key (None: the agent and the usual keys)."""

    conf: Fleet
    host_keys: paramiko.HostKeys
    pkey: paramiko.PKey | None


def _connect(login: _Login, node: str, address: str) -> paramiko.SSHClient:
    conf, host_keys, pkey = login.conf, login.host_keys, login.pkey
    client = paramiko.SSHClient()
    client.set_log_channel(SSH_LOGGER)
    try:
        client.set_missing_host_key_policy(_Reject())
        name = host_key_name(address, conf.port)
        known = client.get_host_keys()
        # the node's own name vouches too (see the module docstring); its address first
        for lookup in (host_key_name(node, conf.port), name):
            for ktype, key in (host_keys.lookup(lookup) or {}).items():
                known.add(name, ktype, key)
        client.connect(address, port=conf.port, username=conf.user, pkey=pkey,
                       allow_agent=pkey is None, look_for_keys=pkey is None,
                       timeout=conf.connect_timeout, banner_timeout=conf.connect_timeout,
                       auth_timeout=conf.connect_timeout, channel_timeout=conf.connect_timeout)
    except BaseException:
        client.close()
        raise
    return client


def _run_one(login: _Login, node: str, address: str, command: str, on_progress: ProgressFn | None,
             cancel: threading.Event, clock: Callable[[], float] = time.monotonic) -> Answer:
    conf = login.conf
    start = clock()
    answer = Answer(node=node, address=address)
    phase = "connecting"
    err = _Stderr(node, on_progress)
    client: paramiko.SSHClient | None = None
    try:
        if on_progress:
            on_progress(node, {"phase": "connecting"})
        client = _connect(login, node, address)
        transport = client.get_transport()
        chan = transport.open_session(timeout=conf.connect_timeout)
        chan.exec_command(command)
        phase = "running"
        if on_progress:
            on_progress(node, {"phase": "running"})
        deadline = clock() + conf.timeout
        out = bytearray()
        fd = chan.fileno()
        try:
            while True:
                if cancel.is_set():
                    raise _Cancelled()
                remaining = deadline - clock()
                if remaining <= 0:
                    raise _Deadline()
                select.select([fd], [], [], min(remaining, _TICK))
                while chan.recv_ready():
                    out += chan.recv(65536)
                    if len(out) > MAX_STDOUT:
                        raise _TooMuch()
                while chan.recv_stderr_ready():
                    err.feed(chan.recv_stderr(65536))
                if chan.eof_received or chan.closed:
                    # everything sent before EOF is in; the exit status follows (or the close)
                    if not (chan.recv_ready() or chan.recv_stderr_ready()):
                        break
            while not chan.status_event.wait(min(max(deadline - clock(), 0), _TICK)):
                if cancel.is_set():
                    raise _Cancelled()
                if clock() >= deadline:
                    raise _Deadline()
        except (_Cancelled, _Deadline, _TooMuch) as exc:
            _signal(chan, "TERM")
            chan.close()
            err.close()
            answer.stderr = "\n".join(err.lines)
            what = ("cancelled" if isinstance(exc, _Cancelled) else
                    f"command timed out after {conf.timeout:g}s" if isinstance(exc, _Deadline) else
                    f"the remote command printed more than {MAX_STDOUT >> 20} MiB on stdout")
            answer.error = f"{what}: closed its session (the remote dsstage stops at its next output)"
            return answer
        err.close()
        status = chan.exit_status if chan.exit_status_ready() else -1
        answer.exit_code = None if status < 0 else status
        answer.stderr = "\n".join(err.lines)
        answer.ok, answer.result, answer.error = judge(answer.exit_code, out.decode("utf-8", "replace"),
                                                       list(err.lines))
    except Exception as exc:
        if not isinstance(exc, (OSError, EOFError, paramiko.SSHException)):
            log.exception("fleet: %s: unexpected error", node)
        err.close()
        answer.stderr = "\n".join(err.lines)
        answer.error = classify(exc, node=node, address=address, conf=conf, phase=phase)
    finally:
        if client is not None:
            client.close()
        answer.seconds = clock() - start
    return answer


def run(conf: Fleet, targets: Mapping[str, str], argv_of: Callable[[str], Sequence[str]], *,
        on_progress: ProgressFn | None = None, on_done: DoneFn | None = None,
        host_keys: paramiko.HostKeys | None = None) -> dict[str, Answer]:
    """Run ``conf.command --node NODE argv_of(NODE)`` on every node of ``targets``
    (node -> address, see ``addresses``) over SSH, at most ``conf.parallel`` at once.

    Returns node -> Answer for every target. One node's failure is in its Answer, never
    raised. Raises DsstageError before any connection for what no node could do: an
    unreadable fleet.key or fleet.known_hosts, an argument that SSH cannot carry.

    ``on_progress(node, dict)`` gets ``{"phase": "connecting"}``, ``{"phase": "running"}``
    and then the remote's progress dicts; ``on_done(answer)`` each answer as it arrives.
    Both are called from worker threads. ``host_keys`` replaces the known_hosts files
    (``load_host_keys``). On KeyboardInterrupt the running commands are sent SIGTERM.
    """
    commands = {node: remote_command(conf.command, node, list(argv_of(node))) for node in targets}
    for address in targets.values():
        if not ADDRESS_RE.fullmatch(address):
            raise DsstageError(f"{address!r} is not a host name or an address")
    if host_keys is None:
        host_keys = load_host_keys(conf)
    pkey = _load_key(conf.key) if conf.key else None
    answers: dict[str, Answer] = {}
    if not targets:
        return answers
    cancel = threading.Event()
    login = _Login(conf, host_keys, pkey)

    def one(node: str) -> Answer:
        answer = _run_one(login, node, targets[node], commands[node], on_progress, cancel)
        if on_done:
            try:
                on_done(answer)
            except Exception:  # a display's bug must not lose the node's answer
                log.exception("fleet: on_done failed for %s", node)
        return answer

    pool = ThreadPoolExecutor(max_workers=max(1, min(conf.parallel, len(targets))), thread_name_prefix="fleet")
    try:
        futures = [pool.submit(one, node) for node in targets]
        for fut in as_completed(futures):
            answer = fut.result()
            answers[answer.node] = answer
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return {node: answers[node] for node in targets}
