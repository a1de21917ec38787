"""Slurm, reached through one small interface.

``SlurmClient`` is what the rest of dsstage uses. ``CliSlurm`` runs Slurm's clients by
absolute path (the Prolog runs with no search path) through proc.run: bounded, its output
parsed into small objects; tests use ``FakeSlurm``. Parsers are tested on saved real output.

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
from dataclasses import dataclass, field, replace
from typing import Protocol

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
    nodes: str = ""  # allocated nodes (running) or planned nodes (pending, if known)
    partition: str = ""
    reason: str = ""
    batch: bool = True  # submitted with sbatch; salloc and srun allocations are not
    requeue: bool = True  # Slurm may requeue it (not sbatch --no-requeue)
    admin_comment: str = ""


def datasets_of(admin_comment: str) -> tuple[str, ...]:
    m = TAG_RE.search(admin_comment or "")
    return tuple(n for n in m.group(1).split(",") if n) if m else ()


class SlurmClient(Protocol):
    def jobs(self) -> list[Job]: ...
    def job_alive(self, job_id: str) -> bool: ...
    def hold(self, job_id: str, reason: str) -> str: ...


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
#: job states in which a job may still run or use its node's data
_ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "STOPPED", "SIGNALING", "STAGE_OUT", "SPECIAL_EXIT")

#: ``squeue -O`` fields of a job: none that its user controls, the admin's free text last
JOB_FORMAT = "JobID:|,BatchFlag:|,Requeue:|,State:|,admin_comment:|"
_RECORD = re.compile(r"^(\d+)\|([01])\|([01])\|([A-Z_]+)\|", re.M)


def parse_job_records(text: str) -> dict[str, Job]:
    """Jobs by id from ``squeue -h -t all -j ID -O JOB_FORMAT`` output.

    Only these fields are asked for because a user can put anything, line breaks included,
    into a job's name, comment, working directory or output paths, and ``scontrol show job``
    prints those as they are: its text can be forged (seen: a job name with a line break and
    ``AdminComment=...`` in it). Here the only free text is AdminComment, which only admins
    write; it is last, so it may hold ``|`` and line breaks. Slurm prints an empty one as
    ``(null)``. ``squeue -j`` of an array's first task lists every task of the array.
    """
    out: dict[str, Job] = {}
    records = list(_RECORD.finditer(text))
    for i, m in enumerate(records):
        end = records[i + 1].start() if i + 1 < len(records) else len(text)
        admin = text[m.end():end].removesuffix("\n").removesuffix("|")
        admin = "" if admin == "(null)" else admin
        out[m.group(1)] = Job(job_id=m.group(1), user="", state=m.group(4), datasets=datasets_of(admin),
                              batch=m.group(2) == "1", requeue=m.group(3) == "1", admin_comment=admin)
    return out


def parse_show_job(text: str) -> list[Job]:
    """Jobs from ``scontrol show job -o`` output: one line per job, Key=Value fields.

    Good enough for ``dsstage status``; nothing that decides about a job may rest on it: a
    user's job name or comment can hold line breaks and ``Key=`` text (see parse_job_records).
    """
    jobs = []
    for line in text.splitlines():
        if not line.startswith("JobId="):
            continue
        f = _fields(line)
        nodes = f.get("NodeList", "")
        if nodes in ("(null)", ""):
            nodes = f.get("SchedNodeList", "")
        jobs.append(Job(job_id=f.get("JobId", ""), user=f.get("UserId", "").split("(")[0],
                        state=f.get("JobState", ""), datasets=datasets_of(f.get("AdminComment", "")),
                        nodes="" if nodes == "(null)" else nodes, partition=f.get("Partition", ""),
                        reason=f.get("Reason", "")))
    return jobs


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def _fields(line: str) -> dict[str, str]:
    """Key=Value pairs of one ``scontrol -o`` line; values may contain spaces (Comment=...)."""
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out.setdefault(m.group(1), line[m.end():end].strip())
    return out


#: what Slurm's clients read from the environment that would change what they print, what
#: they act on or which cluster they ask (seen: SQUEUE_USERS filters squeue's jobs,
#: SQUEUE_ARRAY splits arrays, SLURM_TIME_FORMAT changes dates; SCANCEL_* filter scancel,
#: SLURM_CLUSTERS picks another cluster). None of it may come from whoever runs dsstage.
_CLIENT_ENV_DROP = ("SQUEUE_", "SCONTROL_", "SCANCEL_", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT")


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

    def jobs(self) -> list[Job]:
        return parse_show_job(self._run("scontrol", "show", "job", "-o").stdout)

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
    cancelled. A job the fake was never given counts as a plain batch job. ``held`` and
    ``cancelled`` map a job id to its reason, ``notified`` to the message its terminal got.
    """

    queue: dict[str, Job] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)
    cancelled: dict[str, str] = field(default_factory=dict)
    notified: dict[str, str] = field(default_factory=dict)

    def submit(self, job: Job) -> None:
        self.queue[job.job_id] = job

    def finish(self, job_id: str) -> None:
        self.queue.pop(job_id, None)

    def jobs(self) -> list[Job]:
        return list(self.queue.values())

    def job_alive(self, job_id: str) -> bool:
        return job_id in self.queue

    def hold(self, job_id: str, reason: str) -> str:
        reason = hold_reason(reason)
        job = self.queue.get(job_id) or Job(job_id, "", "RUNNING", ())
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
        if job.job_id in self.queue:
            self.queue[job.job_id] = replace(job, state=state, reason=reason,
                                             admin_comment=merge_admin_comment(job.admin_comment, message))


def client(bin_dir: str = BIN_DIR) -> SlurmClient:
    """The Slurm backend for this machine: the command-line clients in ``bin_dir``.

    No pyslurm release builds against Slurm 22.05 (Debian 12's), so there is no pyslurm
    backend yet; one belongs here, behind the same interface, once it can be tested.
    """
    return CliSlurm(bin_dir=bin_dir)


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
