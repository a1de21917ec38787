"""Fleet operations: one dsstage command on many nodes over SSH, from an admin node.

``dsstage warm X --nodes n[1-8]``, ``evict``, ``verify`` and ``status --live`` run
``<fleet.command...> --node NODE <verb args> --json`` on every node with paramiko, at most
``fleet.parallel`` at once. The remote prints one JSON document on stdout at the end and,
with ``--progress-json``, lines ``{"progress": {"phase": ..., "done": N, "total": M}}`` on
stderr; any other stderr line is a message for a human.

Nothing goes through a local shell. SSH carries one command string, which the node's login
shell splits: every argument is quoted with ``shlex.quote`` (POSIX sh rules; root's login
shell must be sh-like: csh expands ``!`` even inside single quotes), and arguments holding
NUL, CR or LF are refused (a newline ends a command in csh, a NUL cannot be carried).

Host keys are never accepted blindly (paramiko's RejectPolicy): they come from
``fleet.known_hosts``, ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts, read once per run.
A key listed under the node's name is accepted as well as one listed under its address:
the address is Slurm's NodeAddr of that very node. paramiko matches plain and hashed
names, ``[address]:port`` for a port other than 22; it knows no ``*`` patterns and no
``@cert-authority`` lines.

One node's failure never raises: it becomes ``Answer.error``, one line that says what
failed and what to do. ``run`` raises only for what would fail on every node alike (an
unreadable key or known_hosts file, an argument that cannot be carried).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import shlex
import socket
import sys
import threading
import time
import unicodedata
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from errno import ECONNREFUSED, EHOSTUNREACH, ENETUNREACH
from typing import TYPE_CHECKING, Any

import paramiko

from .config import Fleet
from .errors import CommandError, ConfigError, DsstageError
from .slurm import CliSlurm, Node, expand_nodes, natural_key
from .slurm import fold_nodes as fold

if TYPE_CHECKING:
    from rich.console import Console

log = logging.getLogger(__name__)

#: a node name: what a hostname may hold (Slurm's NodeName; ``_`` occurs in the wild)
NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
#: a NodeAddr to connect to: a host name, an IPv4 or IPv6 address (``%`` for an IPv6 zone)
ADDRESS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:%-]{0,252}")
#: at most this many nodes in one hostlist (``n[1-100000000]`` would fill the admin node's memory)
MAX_NODES = 100_000
#: the host key files every run reads after ``fleet.known_hosts``, in OpenSSH's order
KNOWN_HOSTS = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
SINFO_TIMEOUT = 30.0
#: paramiko's transport logs each failure at ERROR with a traceback; it is in Answer.error
#: already, so it is logged under this name, for an entry point to quieten
SSH_LOGGER = "dsstage.fleet.ssh"
#: stderr lines (other than progress) kept in an Answer
STDERR_LINES = 20
#: a longer stderr line is cut (a remote writing without newlines must not fill memory)
MAX_LINE = 64 * 1024
#: the most stdout kept from one node: dsstage's JSON is far smaller; a node that sends more is cut off
MAX_STDOUT = 64 * 1024 * 1024
#: the longest message kept from a node, one line
MAX_MESSAGE = 400
#: how often a waiting worker looks at its deadline and at a cancel
_TICK = 0.5

ProgressFn = Callable[[str, dict], None]
DoneFn = Callable[["Answer"], None]


# -- node names and addresses (pure, and one sinfo) ---------------------------------------

def check_node(name: str) -> str:
    """``name`` if it is a node name; else DsstageError. Names reach a remote argv, the
    progress display and known_hosts look-ups: hostname characters only."""
    if not isinstance(name, str) or not NODE_RE.fullmatch(name):
        raise DsstageError(f"{name!r} is not a node name: use letters, digits, '.', '-' and '_' "
                           "(or a Slurm hostlist such as n[1-8])")
    return name


def expand(nodes_expr: str) -> list[str]:
    """The node names of a Slurm hostlist (``n[1-3],gpu01``), sorted, each once.

    Raises DsstageError for an empty or malformed list, NodeSet's own operators and groups
    (``@``, ``!``, ``&``, ``^``: Slurm has none) and more than MAX_NODES names.
    """
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetException

    text = (nodes_expr or "").strip()
    hint = "give a Slurm hostlist such as n[1-8],gpu01"
    if not text:
        raise DsstageError(f"no nodes given: {hint}")
    try:
        # counted before it is listed: a typo like n[1-100000000] must not fill memory
        count = len(NodeSet(text, resolver=RESOLVER_NOGROUP)) if not any(c in text for c in "@!&^") else 0
    except NodeSetException as exc:
        raise DsstageError(f"{text!r} is not a node list ({exc}): {hint}") from None
    if count > MAX_NODES:
        raise DsstageError(f"{text!r} names {count} nodes, more than {MAX_NODES}: is there a typo?")
    try:
        names = expand_nodes(text)
    except ValueError:
        raise DsstageError(f"{text!r} is not a node list: {hint}") from None
    if not names:
        raise DsstageError(f"{text!r} names no node: {hint}")
    for name in names:
        check_node(name)
    return names


def addresses(nodes: Sequence[str], slurm_bin: str | None) -> dict[str, str]:
    """Node name -> the address to connect to: Slurm's NodeAddr, asked once with sinfo.

    A node Slurm does not list, or every node when Slurm cannot be asked (``slurm_bin``
    None, sinfo missing, failing or slow), is reached by its name: Slurm's NodeAddr
    defaults to the name too. Raises DsstageError for a name that is no node name.
    """
    for node in nodes:
        check_node(node)
    known: dict[str, str] = {}
    if slurm_bin and nodes:
        try:
            known = node_addresses(CliSlurm(slurm_bin, timeout=SINFO_TIMEOUT).nodes())
        except CommandError as exc:
            log.warning("cannot ask Slurm for the nodes' addresses (%s): connecting to the node names", exc)
    return {node: known.get(node, node) for node in nodes}


def node_addresses(nodes: Mapping[str, Node]) -> dict[str, str]:
    """Node name -> NodeAddr of the nodes Slurm listed; a name or an address that is not a
    plain host name or address is skipped with a warning: nothing is connected to that
    was not one."""
    found: dict[str, str] = {}
    for n in nodes.values():
        if NODE_RE.fullmatch(n.name) and ADDRESS_RE.fullmatch(n.addr):
            found[n.name] = n.addr
        else:
            log.warning("sinfo: ignoring node %r with address %r: not a host name or address", n.name[:100],
                        n.addr[:100])
    return found


# -- the remote command (pure) ------------------------------------------------------------

def remote_command(command: Sequence[str], node: str, args: Sequence[str]) -> str:
    """The command string SSH carries: ``command --node NODE args``, every element quoted.

    SSH carries one string that the node's login shell splits again; quoting every element
    is what makes the string mean exactly this argv. NUL, CR and LF are refused: a NUL
    cannot be carried and a line break ends a command in some shells.
    """
    if not command:
        raise ConfigError("fleet.command is empty: give the remote dsstage command, e.g. [/usr/bin/dsstage]")
    argv = [*command, "--node", check_node(node), *args]
    for arg in argv:
        if not isinstance(arg, str):
            raise DsstageError(f"remote argument {arg!r} is not text")
        if any(c in arg for c in "\0\r\n"):
            raise DsstageError(f"remote argument {arg!r} holds a NUL or a line break, which cannot be "
                               "passed over SSH safely: give it without")
    return shlex.join(argv)


# -- what a node answered (pure) ----------------------------------------------------------

@dataclass
class Answer:
    """What one node answered. ``ok``: the remote exited 0 and printed JSON."""

    node: str
    address: str
    ok: bool = False
    exit_code: int | None = None
    result: Any = None  # the parsed JSON of stdout (a dict from dsstage), None if none
    stderr: str = ""  # the last STDERR_LINES lines of stderr, progress lines left out
    error: str = ""  # "" or one line: what failed and what to do
    seconds: float = 0.0


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` as one line a terminal shows as it is: control and format characters
    (escape sequences, bidi overrides) dropped, whitespace runs made one space. Nodes'
    messages are shown to an admin, and a node is not trusted to write to the terminal."""
    kept = "".join(" " if c.isspace() else c for c in text
                   if c.isspace() or unicodedata.category(c)[0] != "C")
    line = " ".join(kept.split())
    return line if len(line) <= limit else line[:max(limit - 3, 0)].rstrip() + "..."


def parse_progress(line: str) -> dict | None:
    """The progress dict of a ``{"progress": {...}}`` stderr line, None for any other line."""
    text = line.strip()
    if not (text.startswith("{") and '"progress"' in text):
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if isinstance(doc, dict) and len(doc) == 1 and isinstance(doc.get("progress"), dict):
        return doc["progress"]
    return None


_NO_JSON = object()


def parse_result(stdout: str) -> Any:
    """The JSON document of stdout, or ``_NO_JSON``. The document is normally all of stdout;
    if something printed before it (a login banner, a warning), its last line is tried."""
    text = stdout.strip()
    if not text:
        return _NO_JSON
    try:
        return json.loads(text)
    except ValueError:
        pass
    last = text.splitlines()[-1]
    try:
        return json.loads(last)
    except ValueError:
        return _NO_JSON


def judge(exit_code: int | None, stdout: str, stderr_lines: Sequence[str]) -> tuple[bool, Any, str]:
    """``(ok, result, error)`` of a command that ran: ok needs exit 0 and a JSON result.

    The error quotes the last stderr line: dsstage's CLI ends with ``dsstage: error: ...``.
    """
    result = parse_result(stdout)
    parsed = result is not _NO_JSON
    last = next((one_line(x) for x in reversed(stderr_lines) if x.strip()), "")
    tail = f": {last}" if last else ""
    if exit_code is None:
        error = f"the remote command ended without an exit status (killed by a signal?){tail}"
    elif exit_code == 0 and not parsed:
        error = ("the remote command printed no JSON result (is fleet.command a dsstage that knows --json?)"
                 + tail)
    elif exit_code in (126, 127):
        error = f"remote exit {exit_code}{tail or ': cannot run the command'} (check fleet.command on the node)"
    elif exit_code != 0:
        error = f"remote exit {exit_code}{tail or ': no message'}"
    else:
        error = ""
    return not error, (result if parsed else None), error


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


# -- host keys and the client key (once per run) -------------------------------------------

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


# -- running one command on every node ----------------------------------------------------

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


def _connect(conf: Fleet, node: str, address: str, host_keys: paramiko.HostKeys,
             pkey: paramiko.PKey | None) -> paramiko.SSHClient:
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


def _run_one(conf: Fleet, node: str, address: str, command: str, host_keys: paramiko.HostKeys,
             pkey: paramiko.PKey | None, on_progress: ProgressFn | None, cancel: threading.Event,
             clock: Callable[[], float] = time.monotonic) -> Answer:
    start = clock()
    answer = Answer(node=node, address=address)
    phase = "connecting"
    err = _Stderr(node, on_progress)
    client: paramiko.SSHClient | None = None
    try:
        if on_progress:
            on_progress(node, {"phase": "connecting"})
        client = _connect(conf, node, address, host_keys, pkey)
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

    def one(node: str) -> Answer:
        answer = _run_one(conf, node, targets[node], commands[node], host_keys, pkey, on_progress, cancel)
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


def exit_code(answers: Mapping[str, Answer]) -> int:
    """0 when every node answered ok, 1 otherwise."""
    return 0 if all(a.ok for a in answers.values()) else 1


# -- presentation ---------------------------------------------------------------------------

Row = tuple[str, str, float, str]


def summary_rows(answers: Mapping[str, Answer], describe: Callable[[dict], str]) -> list[Row]:
    """``(node, "ok" | "failed", seconds, message)`` per node, in node order. The message of
    an ok node is ``describe(result)``, of a failed one its error."""
    rows = []
    for node in sorted(answers, key=natural_key):
        a = answers[node]
        if a.ok:
            try:
                message = describe(a.result) if isinstance(a.result, dict) else ""
            except Exception as exc:  # the node's JSON is not what describe expects
                message = f"(cannot describe the answer: {type(exc).__name__}: {exc})"
            rows.append((node, "ok", a.seconds, one_line(message)))
        else:
            rows.append((node, "failed", a.seconds, one_line(a.error)))
    return rows


def fold_rows(rows: Sequence[Row]) -> list[tuple[str, str, str, str]]:
    """Rows with the same result and message as one, their nodes folded (``n[1-2,4-8]``),
    the time as a range: a thousand nodes that did the same thing read as one line. The ok
    ones first, the failed last, next to the summary line."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row[1], row[3]), []).append(row)
    folded = []
    for (status, message), members in groups.items():
        times = [r[2] for r in members]
        lo, hi = min(times), max(times)
        span = f"{lo:.1f}s" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}s"
        folded.append((status != "ok", natural_key(members[0][0]), (fold([r[0] for r in members]), status, span,
                                                                  message)))
    folded.sort(key=lambda x: (x[0], x[1]))
    return [x[2] for x in folded]


def summary_line(answers: Mapping[str, Answer], max_reasons: int = 3) -> str:
    """``8 nodes: 7 ok, 1 failed (n3: unreachable: connection refused)``."""
    total = len(answers)
    failed = [a for a in answers.values() if not a.ok]
    line = f"{total} node{'' if total == 1 else 's'}: {total - len(failed)} ok, {len(failed)} failed"
    if not failed:
        return line
    by_error: dict[str, list[str]] = {}
    for a in sorted(failed, key=lambda a: natural_key(a.node)):
        by_error.setdefault(one_line(a.error, 200), []).append(a.node)
    reasons = [f"{fold(nodes)}: {error}" for error, nodes in by_error.items()]
    more = len(reasons) - max_reasons
    shown = "; ".join(reasons[:max_reasons]) + (f"; {more} more reason{'s' if more > 1 else ''} above"
                                                if more > 0 else "")
    return f"{line} ({shown})"


def print_summary(answers: Mapping[str, Answer], describe: Callable[[dict], str], *,
                  console: Console | None = None, title: str | None = None) -> None:
    """The table of what every node answered (folded, see fold_rows) and the summary line."""
    from rich.table import Table
    from rich.text import Text

    from .ui import console as default_console
    out = console or default_console()
    table = Table(title=title, title_justify="left")
    for column in ("node", "result", "time", "message"):
        table.add_column(column, justify="right" if column == "time" else "left")
    for nodes, status, span, message in fold_rows(summary_rows(answers, describe)):
        # Text, not markup: the message comes from the nodes
        table.add_row(Text(nodes), Text(status, style="green" if status == "ok" else "bold red"), Text(span),
                      Text(message))
    out.print(table)
    out.print(Text(summary_line(answers), style="bold" if exit_code(answers) == 0 else "bold red"))


def progress_state(progress: Mapping[str, Any]) -> tuple[str, int | None, int | None]:
    """``(phase, done, total)`` of a progress dict; done and total (bytes) only when they are
    sane counts. The phase is the remote's word, made one short line."""
    phase = one_line(str(progress.get("phase") or "running"), 40)
    done, total = progress.get("done"), progress.get("total")

    def count(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    done_n, total_n = count(done), count(total)
    if done_n is None or total_n is None:
        return phase, None, None
    return phase, min(done_n, total_n), total_n


@contextlib.contextmanager
def progress_view(nodes: Sequence[str], what: str, enabled: bool = True) -> Iterator[tuple[ProgressFn, DoneFn]]:
    """Yield ``(on_progress, on_done)`` for ``run`` that draw one bar per node on a terminal
    (stderr), nothing elsewhere: bytes done/total once the node sends progress, else a
    pulsing bar with its state (waiting, connecting, running); ok or failed at the end.

    A first line counts the answers. With more nodes than the terminal has lines, only the
    nodes at work and the failed ones are shown.
    """
    if not (enabled and sys.stderr.isatty()):
        yield (lambda _node, _progress: None), (lambda _answer: None)
        return
    from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from .ui import err_console
    from .units import human

    class StateColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(task.fields.get("state", ""), style=task.fields.get("style", ""))

    con = err_console()
    compact = len(nodes) > max(con.height - 5, 5)
    lock = threading.Lock()
    counts = {"ok": 0, "failed": 0}
    totals: dict[str, int] = {}
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), StateColumn(), TimeElapsedColumn(),
                  console=con, transient=True) as prog:
        overall = prog.add_task(one_line(what, 60), total=len(nodes), state=f"{len(nodes)} nodes")
        tasks = {node: prog.add_task(node, total=None, state="waiting", visible=not compact) for node in nodes}

        def on_progress(node: str, progress: dict) -> None:
            phase, done, total = progress_state(progress)
            with lock:
                if node not in tasks:
                    return
                if done is None or total is None:
                    prog.update(tasks[node], total=None, state=phase, visible=True)
                else:
                    totals[node] = max(total, 1)
                    prog.update(tasks[node], total=totals[node], completed=done, visible=True,
                                state=f"{phase} {human(done)} / {human(total)}")

        def on_done(answer: Answer) -> None:
            with lock:
                task = tasks.get(answer.node)
                if task is None:
                    return
                counts["ok" if answer.ok else "failed"] += 1
                if answer.ok:
                    total = totals.get(answer.node, 1)
                    prog.update(task, total=total, completed=total, state="ok", style="green",
                                visible=not compact)
                else:
                    prog.update(task, total=1, completed=0, state=f"failed: {one_line(answer.error, 80)}",
                                style="bold red", visible=True)
                prog.update(overall, advance=1, state=f"{counts['ok']} ok, {counts['failed']} failed")
        yield on_progress, on_done
