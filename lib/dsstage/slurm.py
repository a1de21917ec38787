"""Slurm, reached through one small interface.

``SlurmClient`` is what the rest of dsstage uses. ``CliSlurm`` runs Slurm's clients by
absolute path (the Prolog runs with no search path) through proc.run: bounded, its output
parsed into small objects; ``PySlurm`` reads the queue through pyslurm where that imports;
tests use ``FakeSlurm``. Parsers are tested on saved real output.

Nothing here reads text a user controls: ``squeue -O`` is asked for fixed fields only, the
admin's free text (AdminComment) last. ``scontrol show job`` is not parsed anywhere: a job's
name or comment can forge its fields (see parse_job_records).

Holding a job (``SlurmClient.hold``) never touches the user's ``Comment``. The reason goes
into the job's ``AdminComment``, after what is there already (job_submit.lua's
``dsstage=NAMES`` tag, anything the site keeps there); ``scontrol show job`` shows it to the
user, who cannot edit it. Slurm 22.05 has no other place for it: ``scontrol update`` refuses
``SystemComment=`` and ``Reason=``, and the reason ``squeue`` shows is Slurm's own.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from . import proc
from .errors import CommandError

log = logging.getLogger(__name__)

TIMEOUT = 30.0
BIN_DIR = "/usr/bin"
#: the longest hold reason dsstage writes into a job (it is one line on a terminal)
MAX_REASON = 400
#: how an accepted --dataset request is recorded in the job's admin_comment (by job_submit.lua)
TAG_RE = re.compile(r"(?:^|\s)dsstage=([a-z0-9._,-]+)")


@dataclass(frozen=True)
class Job:
    job_id: str
    user: str
    state: str
    datasets: tuple[str, ...]
    nodes: str = ""  # allocated nodes as a Slurm hostlist ("n[1-2]"); "" while pending
    partition: str = ""
    reason: str = ""
    batch: bool = True  # submitted with sbatch; salloc and srun allocations are not
    requeue: bool = True  # Slurm may requeue it (not sbatch --no-requeue)
    admin_comment: str = ""
    priority: int = 0  # 0: held (by its user, an admin, or a requeue-hold)
    #: epoch seconds: the expected start of a pending job (backfill's plan, or its --begin),
    #: the start of a running one; None if Slurm has none (or the job is held)
    start_time: float | None = None
    sched_nodes: str = ""  # the nodes backfill planned for a pending job (hostlist); "" if none

    def node_names(self, which: Literal["allocated", "scheduled"] = "allocated") -> list[str]:
        """The names in ``nodes`` ("allocated") or ``sched_nodes`` ("scheduled"), expanded."""
        if which not in ("allocated", "scheduled"):
            raise ValueError(f"which must be 'allocated' or 'scheduled', not {which!r}")
        return expand_nodes(self.nodes if which == "allocated" else self.sched_nodes)


def datasets_of(admin_comment: str) -> tuple[str, ...]:
    m = TAG_RE.search(admin_comment or "")
    return tuple(n for n in m.group(1).split(",") if n) if m else ()


@dataclass(frozen=True)
class Node:
    """A node as Slurm knows it: its name, the address to reach it, its state."""

    name: str
    addr: str
    state: str  # lower case, as sinfo %T prints it: idle, mixed, allocated, down*, drained, ...
    features: tuple[str, ...] = ()  # its available features (sinfo %f)

    @property
    def down(self) -> str:
        """Why its report cannot be current ("" if slurmctld hears from it): down, failed,
        or not responding (sinfo's trailing ``*``)."""
        if self.state.endswith("*"):
            return f"{self.state.rstrip('*')}, not responding"
        if self.state.startswith(("down", "fail", "unknown", "future", "power")):
            return self.state
        return ""


def down_nodes(nodes: Mapping[str, Node]) -> dict[str, str]:
    """Node name -> why Slurm does not hear from it (Node.down), for the nodes that are down."""
    return {n.name: n.down for n in nodes.values() if n.down}


#: ``sinfo -o`` of ``nodes``: name, address, state, available features
NODE_FORMAT = "%N|%o|%T|%f"


def parse_nodes(text: str) -> dict[str, Node]:
    """``sinfo -h -N -o NODE_FORMAT`` output: one line per node and partition (the first
    line of a node wins; Slurm prints the same for each). Other lines are skipped; lines
    without the features field (older callers) are read with none."""
    out: dict[str, Node] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) in (3, 4) and parts[0] and parts[0] not in out:
            feats = parts[3] if len(parts) == 4 and parts[3] not in _NONE else ""
            out[parts[0]] = Node(parts[0], parts[1] or parts[0], parts[2].lower(),
                                 tuple(f for f in feats.split(",") if f))
    return out


class SlurmClient(Protocol):
    def queue(self) -> list[Job]: ...
    def nodes(self) -> dict[str, Node]: ...
    def job_alive(self, job_id: str) -> bool: ...
    def hold(self, job_id: str, reason: str) -> str: ...
    def set_features(self, nodes: str, features: list[str]) -> None: ...


# -- holding a job: what is done and what the user reads (pure) ---------------------------

#: what ``hold`` did; the text the Prolog logs
HELD = "requeued and held"
ALREADY_HELD = "already requeued and held, or ending: left as it is"
CANCELLED = "interactive allocation: not requeued (only batch jobs can be); cancelled, the reason sent to salloc/srun"
NOT_REQUEUED = ("batch job submitted with --no-requeue: not requeued; its TaskProlog fails it, "
                "the reason in the job's output")
GONE = "the job is gone: nothing to hold"

#: dsstage's own part of an AdminComment: from these words to the end
_OWN_PART = re.compile(r"(?:^|\s+)dsstage (?:held|cancelled|stopped) this job: .*\Z", re.S)
#: a word that job_submit.lua's tag parser (TAG_RE) would take for the tag
_TAG_LOOKALIKE = re.compile(r"(?<!\S)dsstage=")


def hold_reason(text: str, limit: int = MAX_REASON) -> str:
    """``text`` as one line of at most ``limit`` characters that Slurm and a terminal can take.

    Whitespace runs become one space; control, format and unassigned characters (escape
    sequences, bidi overrides) are dropped; a word that looks like the ``dsstage=`` tag is
    defused. The Prolog's reason quotes paths and error messages, which nobody vetted.
    """
    kept = "".join(" " if c.isspace() else c for c in text
                   if c.isspace() or unicodedata.category(c)[0] != "C")
    line = _TAG_LOOKALIKE.sub("dsstage:", " ".join(kept.split()))
    if len(line) > limit:
        line = line[:max(limit - 3, 0)].rstrip() + "..."
    return line


def hold_message(job: Job, reason: str) -> str:
    """What the user reads in AdminComment (and, for an allocation, on the terminal)."""
    if not job.batch:
        return f"dsstage cancelled this job: {reason} (an interactive allocation cannot be requeued)"
    if not job.requeue:
        return f"dsstage stopped this job: {reason} (it was submitted with --no-requeue)"
    return f"dsstage held this job: {reason} -- once that is fixed: scontrol release {job.job_id}"


def merge_admin_comment(current: str, message: str) -> str:
    """``current`` with dsstage's earlier message, if any, replaced by ``message``.

    Everything before dsstage's part is kept as it is: the ``dsstage=`` tag and whatever the
    site keeps there. dsstage's part runs to the end (dsstage always appends it last).
    """
    kept = _OWN_PART.sub("", current or "").rstrip()
    return f"{kept} {message}" if kept else message


#: job states of a job that a hold finds requeued already, or on its way out
_ENDING = ("PENDING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD")
#: job states in which a job may still run or use its node's data: what ``queue`` lists
_ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "STOPPED", "SIGNALING", "STAGE_OUT", "SPECIAL_EXIT")

# -- reading jobs from squeue -------------------------------------------------------------

#: ``squeue -O`` fields of a job for ``hold``: none that its user controls, the admin's free text last
JOB_FORMAT = "JobID:|,BatchFlag:|,Requeue:|,State:|,admin_comment:|"
#: ``squeue -O`` fields of every job for ``queue``: the same rule. (SchedNodes is 22.05's name
#: for scontrol's SchedNodeList; ``-O`` has no help list in 22.05: ``man squeue``.)
QUEUE_FORMAT = ("JobID:|,UserName:|,State:|,Partition:|,PriorityLong:|,StartTime:|,SchedNodes:|,NodeList:|,"
                "BatchFlag:|,Requeue:|,admin_comment:|")

#: what squeue prints in each field it may be asked for. The record of a job starts at a line
#: that matches them all in order, so the fixed ones are strict; the admin's text comes last.
_FIELD_PATTERNS = {"JobID": r"\d+", "BatchFlag": "[01]", "Requeue": "[01]", "State": "[A-Z_]+",
                   "PriorityLong": r"\d*", "UserName": r"[^|\s]*", "Partition": r"[^|\s]*",
                   "StartTime": r"[^|\s]*", "SchedNodes": r"[^|\s]*", "NodeList": r"[^|\s]*"}
_LAST = "admin_comment"
#: squeue's words for "none": an empty string field, a time it does not know
_NONE = ("", "(null)", "N/A", "None", "Unknown")


def _record_re(fmt: str) -> tuple[list[str], re.Pattern[str]]:
    names = [part.split(":", 1)[0] for part in fmt.split(",")]
    if names[-1] != _LAST or any(n not in _FIELD_PATTERNS for n in names[:-1]):
        raise ValueError(f"squeue format {fmt!r}: known fields only, {_LAST} last")
    return names, re.compile("^" + "".join(f"({_FIELD_PATTERNS[n]})\\|" for n in names[:-1]), re.M)


def parse_job_records(text: str, fmt: str = JOB_FORMAT) -> dict[str, Job]:
    """Jobs by id from ``squeue -h -O FMT`` output (JOB_FORMAT, QUEUE_FORMAT).

    Only fixed fields are asked for because a user can put anything, line breaks included,
    into a job's name, comment, working directory or output paths, and ``scontrol show job``
    prints those as they are: its text can be forged (seen: a job name with a line break and
    ``AdminComment=...`` in it). Here the only free text is AdminComment, which only admins
    write; it is last, so it may hold ``|`` and line breaks. Slurm prints an empty one as
    ``(null)``. ``squeue -j`` of an array's first task lists every task of the array.
    StartTime is read as epoch seconds (``SLURM_TIME_FORMAT=%s``, see CliSlurm).
    """
    names, record = _record_re(fmt)
    out: dict[str, Job] = {}
    records = list(record.finditer(text))
    for i, m in enumerate(records):
        end = records[i + 1].start() if i + 1 < len(records) else len(text)
        f = dict(zip(names, m.groups()))
        f[_LAST] = text[m.end():end].removesuffix("\n").removesuffix("|")
        out[f["JobID"]] = _job(
            job_id=f["JobID"], user=f.get("UserName", ""), state=f["State"], partition=f.get("Partition", ""),
            priority=f.get("PriorityLong"), start=_epoch(f.get("StartTime", "")),
            sched_nodes=f.get("SchedNodes"), nodes=f.get("NodeList"), batch=f.get("BatchFlag", "1") == "1",
            requeue=f.get("Requeue", "1") == "1", admin_comment=f[_LAST])
    return out


def _epoch(text: str) -> float | None:
    return float(text) if text.isdigit() else None


def _job(*, job_id: str, user: str | None, state: str, partition: str | None, priority: Any, start: float | None,
         sched_nodes: str | None, nodes: str | None, batch: bool, requeue: bool, admin_comment: str | None) -> Job:
    """A Job from what a backend read, with Slurm's words for "none" made empty.

    A held pending job (priority 0) has no expected start, whatever Slurm shows (a requeued
    one shows the time its requeue delay ends).
    """
    def text(v: str | None) -> str:
        return "" if v is None or v in _NONE else v
    prio = int(priority) if isinstance(priority, int) or (isinstance(priority, str) and priority.isdigit()) else 0
    admin = "" if admin_comment in (None, "(null)") else str(admin_comment)
    return Job(job_id=job_id, user=text(user), state=state, datasets=datasets_of(admin), nodes=text(nodes),
               partition=text(partition), batch=batch, requeue=requeue, admin_comment=admin, priority=prio,
               start_time=None if state == "PENDING" and prio == 0 else start, sched_nodes=text(sched_nodes))


#: what Slurm's clients read from the environment that would change what they print, what
#: they act on or which cluster they ask (seen: SQUEUE_USERS filters squeue's jobs,
#: SQUEUE_ARRAY splits arrays, SLURM_TIME_FORMAT changes dates; SCANCEL_* filter scancel,
#: SLURM_CLUSTERS picks another cluster). None of it may come from whoever runs dsstage.
_CLIENT_ENV_DROP = ("SQUEUE_", "SINFO_", "SCONTROL_", "SCANCEL_", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT")


def client_env() -> dict[str, str]:
    """The environment of Slurm's clients: ours, less _CLIENT_ENV_DROP, with times printed as
    epoch seconds (``%s``): squeue otherwise prints local time without a zone, which a
    daylight-saving change makes ambiguous, and follows ``TZ``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_DROP)}
    env["SLURM_TIME_FORMAT"] = "%s"
    return env


class CliSlurm:
    """Slurm through its command-line clients, called by absolute path in ``bin_dir``."""

    def __init__(self, bin_dir: str = BIN_DIR, timeout: float = TIMEOUT) -> None:
        if not os.path.isabs(bin_dir):
            raise ValueError(f"the Slurm bin directory must be an absolute path, not {bin_dir!r}")
        self.bin_dir = bin_dir
        self.timeout = timeout

    def _cmd(self, name: str) -> str:
        return os.path.join(self.bin_dir, name)

    def _run(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return proc.run([self._cmd(name), *args], timeout=self.timeout, check=check, env=client_env())

    def queue_argv(self) -> list[str]:
        """The one squeue command of ``queue``: every active job, in all partitions (``-a``:
        hidden ones too), of this cluster only (``--local``: not a federation's others)."""
        return [self._cmd("squeue"), "-h", "-a", "--local", "-t", ",".join(_ALIVE), "-O", QUEUE_FORMAT]

    def queue(self) -> list[Job]:
        """Every job that may still run or use its nodes' data (see parse_job_records).

        Raises CommandError if squeue cannot be run or fails (slurmctld down, timeout).
        """
        argv = self.queue_argv()
        out = proc.run(argv, timeout=self.timeout, env=client_env()).stdout
        return list(parse_job_records(out, QUEUE_FORMAT).values())

    def nodes(self) -> dict[str, Node]:
        """Every node, in every partition (``-a``: hidden ones too): one ``sinfo`` call.
        Raises CommandError if it fails."""
        return parse_nodes(self._run("sinfo", "-h", "-a", "-N", "-o", NODE_FORMAT).stdout)

    def set_features(self, nodes: str, features: list[str]) -> None:
        """Make ``features`` the available and active features of ``nodes`` (a hostlist):
        one ``scontrol update``. Raises CommandError if Slurm refuses."""
        feats = ",".join(features)
        self._run("scontrol", "update", f"NodeName={nodes}", f"AvailableFeatures={feats}",
                  f"ActiveFeatures={feats}")

    def job_alive(self, job_id: str) -> bool:
        try:
            job = self._job(job_id)
        except CommandError:
            return True  # cannot tell: keep the lease
        return job is not None and job.state in _ALIVE

    def hold(self, job_id: str, reason: str) -> str:
        """Keep the job from running without its data; say what was done (see hold_message).

        The message goes into the job's AdminComment first, after what is there. Then a batch
        job is requeued and held (``scontrol requeuehold Incomplete``: the nodes are free, the
        job stays; its user releases it). Slurm requeues only batch jobs, and not those
        submitted with ``--no-requeue``: such a batch job is left to its TaskProlog, which
        fails it with the reason in its output; an allocation from ``salloc`` or ``srun`` gets
        the message on its terminal (``scontrol notify``) and is cancelled, so that it does
        not keep its nodes idle. Raises CommandError if Slurm cannot be asked, or refuses;
        the TaskProlog still keeps the job's tasks from starting.
        """
        reason = hold_reason(reason)
        job = self._job(job_id)
        if job is None or job.state not in _ALIVE:
            return GONE
        message = hold_message(job, reason)
        self._record(job, message)
        if job.batch and job.requeue:
            # Incomplete: a job that another node's Prolog requeued already (COMPLETING while its
            # batch script is killed, then PENDING) is left as it is
            self._run("scontrol", "requeuehold", "Incomplete", job_id)
            return ALREADY_HELD if job.state in _ENDING else HELD
        if job.batch:
            return NOT_REQUEUED
        self._run("scontrol", "notify", job_id, message, check=False)  # best effort: the terminal
        self._run("scancel", job_id)
        return CANCELLED

    def _job(self, job_id: str) -> Job | None:
        """The job as squeue sees it (see parse_job_records); None if Slurm does not know it."""
        res = self._run("squeue", "-h", "-t", "all", "-j", job_id, "-O", JOB_FORMAT, check=False)
        if res.returncode != 0 and "Invalid job id" in res.stderr:
            return None
        if res.returncode != 0:
            raise CommandError(res.args, res.returncode, res.stdout, res.stderr)
        return parse_job_records(res.stdout).get(job_id)

    def _record(self, job: Job, message: str) -> None:
        """``message`` into the job's AdminComment, after what is there (best effort)."""
        merged = merge_admin_comment(job.admin_comment, message)
        res = self._run("scontrol", "update", f"JobId={job.job_id}", f"AdminComment={merged}", check=False)
        if res.returncode != 0:  # "Job has already finished": another node's Prolog cancelled it
            log.warning("job %s: cannot record the hold reason: %s", job.job_id, res.stderr.strip())


@dataclass
class FakeSlurm:
    """A stateful stand-in for unit tests of the code around Slurm.

    ``hold`` follows CliSlurm.hold: a batch job that may be requeued is requeued and held, a
    ``--no-requeue`` batch job only gets the message, an allocation is notified and
    cancelled. A job the fake was never given counts as a plain batch job. ``jobs`` maps a job
    id to the job as it is now; ``held`` and ``cancelled`` map a job id to its reason,
    ``notified`` to the message its terminal got.
    """

    jobs: dict[str, Job] = field(default_factory=dict)
    node_table: dict[str, Node] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)
    cancelled: dict[str, str] = field(default_factory=dict)
    notified: dict[str, str] = field(default_factory=dict)
    feature_calls: list[tuple[str, list[str]]] = field(default_factory=list)

    def submit(self, job: Job) -> None:
        self.jobs[job.job_id] = job

    def finish(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)

    def queue(self) -> list[Job]:
        """The jobs in an active state, as CliSlurm.queue lists them (a held job is; a
        cancelled allocation is not)."""
        return [j for j in self.jobs.values() if j.state in _ALIVE]

    def nodes(self) -> dict[str, Node]:
        return dict(self.node_table)

    def set_features(self, nodes: str, features: list[str]) -> None:
        self.feature_calls.append((nodes, list(features)))
        for name in expand_nodes(nodes):
            if name in self.node_table:
                self.node_table[name] = replace(self.node_table[name], features=tuple(features))

    def job_alive(self, job_id: str) -> bool:
        return job_id in self.jobs

    def hold(self, job_id: str, reason: str) -> str:
        reason = hold_reason(reason)
        job = self.jobs.get(job_id) or Job(job_id, "", "RUNNING", ())
        if job.state not in _ALIVE:
            return GONE
        message = hold_message(job, reason)
        if job.batch and job.requeue:
            self.held[job_id] = reason
            self._update(job, state="PENDING", reason="job_requeued_in_held_state", message=message)
            return ALREADY_HELD if job.state in _ENDING else HELD
        if job.batch:
            self._update(job, state=job.state, reason=job.reason, message=message)
            return NOT_REQUEUED
        self.notified[job_id] = message
        self.cancelled[job_id] = reason
        self._update(job, state="CANCELLED", reason=job.reason, message=message)
        return CANCELLED

    def _update(self, job: Job, *, state: str, reason: str, message: str) -> None:
        if job.job_id in self.jobs:
            self.jobs[job.job_id] = replace(job, state=state, reason=reason,
                                            admin_comment=merge_admin_comment(job.admin_comment, message))


def client(bin_dir: str = BIN_DIR) -> SlurmClient:
    """The Slurm backend for this machine: pyslurm where it imports with the job API
    PySlurm follows, else the command-line clients in ``bin_dir``.

    No pyslurm release builds against Slurm 22.05 (Debian 12's); PyPI's old 17.x/18.x
    releases have no ``pyslurm.Jobs``: both get CliSlurm.
    """
    cli = CliSlurm(bin_dir=bin_dir)
    module = _pyslurm()
    return PySlurm(module, cli) if module is not None else cli


def _pyslurm() -> Any:
    """The pyslurm module if it imports and has the API PySlurm uses, else None."""
    try:
        import pyslurm  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError; a build against another libslurm fails as it loads
        log.debug("pyslurm: not used: %s", exc)
        return None
    if callable(getattr(getattr(pyslurm, "Jobs", None), "load", None)) and hasattr(pyslurm, "PyslurmError"):
        return pyslurm
    log.debug("pyslurm %s: no pyslurm.Jobs.load: not used", getattr(pyslurm, "__version__", "?"))
    return None


class PySlurm:
    """Slurm through pyslurm's job API, for ``queue``: one RPC (slurm_load_jobs), no client
    process, no text to parse.

    Follows pyslurm 24.11.0 (pyslurm/core/job/job.pyx; the same names since 23.2.2, whose
    ``Jobs`` became a MultiClusterMap: ``values()`` yields every cluster's jobs):
    ``Jobs.load()``; of each ``Job``: ``id``, ``user_name``, ``user_id``, ``state``,
    ``partition``, ``priority`` (0 when held; None for NO_VAL), ``start_time`` (epoch
    seconds, None for 0), ``scheduled_nodes``, ``allocated_nodes``, ``admin_comment`` (None
    when empty), ``is_batch_job``, ``is_requeueable``. Load errors are ``pyslurm.RPCError``
    (a ``pyslurm.PyslurmError``).

    ``hold`` and ``job_alive`` are CliSlurm's (``cli``): pyslurm could set AdminComment
    (``Job.modify(JobSubmitDescription(admin_comment=...))``), but ``Job.requeue(hold=True)``
    sends JOB_REQUEUE_HOLD alone, without scontrol's ``Incomplete`` (JOB_RUNNING: leave a job
    that another node's Prolog requeued already as it is); and one implementation of the
    hold rules is the one tested on a real Slurm.
    """

    def __init__(self, module: Any, cli: CliSlurm) -> None:
        self.pyslurm = module
        self.cli = cli

    @property
    def bin_dir(self) -> str:
        return self.cli.bin_dir

    def queue(self) -> list[Job]:
        """Every job that may still run or use its nodes' data, as CliSlurm.queue lists them.

        Raises CommandError if slurmctld cannot be asked.
        """
        try:
            loaded = self.pyslurm.Jobs.load()
            return [_job(job_id=str(j.id), user=j.user_name or str(j.user_id), state=str(j.state),
                         partition=j.partition, priority=j.priority,
                         start=float(j.start_time) if j.start_time else None, sched_nodes=j.scheduled_nodes,
                         nodes=j.allocated_nodes, batch=bool(j.is_batch_job), requeue=bool(j.is_requeueable),
                         admin_comment=j.admin_comment)
                    for j in loaded.values() if j.state in _ALIVE]
        except self.pyslurm.PyslurmError as exc:
            raise CommandError(["pyslurm.Jobs.load()"], None, "", str(exc),
                               message="pyslurm cannot load the jobs from slurmctld") from exc

    def job_alive(self, job_id: str) -> bool:
        return self.cli.job_alive(job_id)

    def nodes(self) -> dict[str, Node]:
        return self.cli.nodes()

    def set_features(self, nodes: str, features: list[str]) -> None:
        self.cli.set_features(nodes, features)

    def hold(self, job_id: str, reason: str) -> str:
        """CliSlurm.hold (see the class docstring for why)."""
        return self.cli.hold(job_id, reason)


def expand_nodes(nodelist: str) -> list[str]:
    """The node names of a Slurm hostlist: ``n[1-3,5],gpu01`` -> [gpu01, n1, n2, n3, n5].

    ClusterShell's NodeSet does it (any bracket depth and padding, as Slurm prints them);
    the names come sorted and once each. Raises ValueError for text that is no hostlist, and
    for NodeSet's own syntax (``@group``, ``!``, ``&``, ``^``), which Slurm never prints.
    """
    # imported here: the Prolog, which only holds jobs, does not depend on ClusterShell
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetException

    if any(c in nodelist for c in "@!&^"):
        raise ValueError(f"not a Slurm hostlist: {nodelist!r}")
    try:
        return list(NodeSet(nodelist, resolver=RESOLVER_NOGROUP))
    except NodeSetException as exc:
        raise ValueError(f"not a Slurm hostlist: {nodelist!r}: {exc}") from None


_NODE_NAME = re.compile(r"([A-Za-z0-9_.-]*?[^0-9\[\],]|)([0-9]+)")


def fold_nodes(nodes: Iterable[str]) -> str:
    """Node names as one Slurm hostlist (n[1-3,5]), as ClusterShell's NodeSet folds them.

    Names of the common shape (a prefix, then digits of one width, or unpadded) are folded
    here: NodeSet parses every name, which for 1,000 nodes' copies was most of status's
    time. Anything else (several digit groups, mixed padding) goes to NodeSet."""
    names = list(nodes)
    by_prefix: dict[str, set[str]] = {}
    for n in names:
        m = _NODE_NAME.fullmatch(n)
        if m is None:
            return _fold_nodeset(names)
        by_prefix.setdefault(m.group(1), set()).add(m.group(2))
    out = []
    for prefix in sorted(by_prefix):
        digits = by_prefix[prefix]
        widths = {len(d) for d in digits}
        if len(widths) > 1 and any(d[0] == "0" and len(d) > 1 for d in digits):
            return _fold_nodeset(names)  # mixed zero padding: NodeSet's rules
        width = widths.pop() if len(widths) == 1 else 0
        seq = sorted(int(d) for d in digits)
        ranges, start = [], 0
        for i in range(1, len(seq) + 1):
            if i == len(seq) or seq[i] != seq[i - 1] + 1:
                a, b = seq[start], seq[i - 1]
                ranges.append(f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}")
                start = i
        out.append(prefix + ranges[0] if len(seq) == 1 else f"{prefix}[{','.join(ranges)}]")
    return ",".join(out)


def natural_key(name: str) -> list[Any]:
    """Sort key putting n2 before n10 (re.split with a group alternates text and digits)."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]


def _fold_nodeset(names: list[str]) -> str:
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetException
    try:
        return str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP))
    except NodeSetException:  # a name NodeSet cannot fold is shown as it is
        return ",".join(sorted(names, key=natural_key))
