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

import json
import logging
import re
import shlex
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsstage.errors import CommandError, ConfigError, DsstageError
from dsstage.hostlist import TooManyNodes, expand_nodes
from dsstage.slurm.client import CliSlurm
from dsstage.slurm.records import Node

if TYPE_CHECKING:
    pass
log = logging.getLogger(__name__)



#: a node name: what a hostname may hold (Slurm's NodeName; ``_`` occurs in the wild)
NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
#: a NodeAddr to connect to: a host name, an IPv4 or IPv6 address (``%`` for an IPv6 zone)
ADDRESS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:%-]{0,252}")
#: at most this many nodes in one hostlist (``n[1-100000000]`` would fill the admin node's memory)
SINFO_TIMEOUT = 30.0
#: the longest message kept from a node, one line
MAX_MESSAGE = 400
ProgressFn = Callable[[str, dict], None]
DoneFn = Callable[["Answer"], None]


def check_node(name: str) -> str:
    """``name`` if it is a node name; else DsstageError. Names reach a remote argv, the
    progress display and known_hosts look-ups: hostname characters only."""
    if not isinstance(name, str) or not NODE_RE.fullmatch(name):
        raise DsstageError(f"{name!r} is not a node name: use letters, digits, '.', '-' and '_' "
                           "(or a Slurm hostlist such as n[1-8])")
    return name


def parse_nodes_arg(nodes_expr: str) -> list[str]:
    """The node names of a Slurm hostlist (``n[1-3],gpu01``), sorted, each once.

    Raises DsstageError for an empty or malformed list, NodeSet's own operators and groups
    (``@``, ``!``, ``&``, ``^``: Slurm has none) and more than hostlist.MAX_NODES names.
    """
    text = (nodes_expr or "").strip()
    hint = "give a Slurm hostlist such as n[1-8],gpu01"
    if not text:
        raise DsstageError(f"no nodes given: {hint}")
    try:
        names = expand_nodes(text)  # counted before it is listed: a typo must not fill memory
    except TooManyNodes as exc:
        raise DsstageError(str(exc)) from None
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


def exit_code(answers: Mapping[str, Answer]) -> int:
    """0 when every node answered ok, 1 otherwise."""
    return 0 if all(a.ok for a in answers.values()) else 1


Row = tuple[str, str, float, str]
