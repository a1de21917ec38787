"""What Slurm says about jobs and nodes, parsed into small records.

Nothing here reads text a user controls: ``squeue -O`` is asked for fixed fields with a
separator, the admin's free text (AdminComment) last; ``scontrol show job`` is not parsed, as a
job name or comment can forge its fields. Parsers are tested on saved real output.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, TypedDict

from dsstage.hostlist import expand_nodes

log = logging.getLogger(__name__)

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
    active: tuple[str, ...] | None = None  # its active features (sinfo %b); None: as available
    partitions: tuple[str, ...] = ()  # the partitions it is in (sinfo %R, one line per partition)

    @property
    def active_features(self) -> tuple[str, ...]:
        return self.features if self.active is None else self.active

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


#: ``sinfo -o`` of ``nodes``: name, address, state, available and active features, partition
NODE_FORMAT = "%N|%o|%T|%f|%b|%R"


def _features(field: str) -> tuple[str, ...]:
    return () if field in _NONE else tuple(f for f in field.split(",") if f)


def parse_nodes(text: str) -> dict[str, Node]:
    """``sinfo -h -N -o NODE_FORMAT`` output: one line per node and partition (the first
    line of a node wins; Slurm prints the same for each, but the partition, which is
    collected). Other lines are skipped; lines without the features fields (older callers)
    are read with none, without the active ones with the available ones active."""
    out: dict[str, Node] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) not in (3, 4, 5, 6) or not parts[0]:
            continue
        partition = parts[5] if len(parts) > 5 and parts[5] not in _NONE else ""
        if parts[0] in out:
            node = out[parts[0]]
            if partition and partition not in node.partitions:
                out[parts[0]] = replace(node, partitions=(*node.partitions, partition))
            continue
        out[parts[0]] = Node(parts[0], parts[1] or parts[0], parts[2].lower(),
                             _features(parts[3]) if len(parts) > 3 else (),
                             _features(parts[4]) if len(parts) > 4 else None,
                             (partition,) if partition else ())
    return out


@dataclass(frozen=True)
class Placing:
    """What the bounded wait for data (dsstage.policy.datawait) reads of a job, besides ``queue``."""

    job_id: str  # as Job.job_id (squeue %A)
    job_ref: str  # how scontrol names this one job (squeue %i): "12", "12_3" (an array task), "12+1"
    state: str
    nodes: int  # allocated, or the minimum a pending job asked for
    end_time: float | None  # a running job's time limit, as a time
    req_nodes: str  # -w
    exc_nodes: str  # ExcNodeList
    reservation: str  # --reservation
    constraint: str  # -C

    @property
    def array_pending(self) -> bool:
        """A pending array not split into its tasks yet (``12_[1-9]``): one record, many jobs."""
        return "[" in self.job_ref

    @property
    def heterogeneous(self) -> bool:
        """A component of a heterogeneous job (``12+1``): an update of one reaches them all."""
        return "+" in self.job_ref


#: ``squeue -o`` of ``placing``: Slurm's fields, hostlists and names, none with ``|`` in
#: it, the constraint last (it may hold ``|``; Slurm accepts only feature names and
#: operators there, no line break). ``-O`` has no field for the excluded nodes in 22.05.
PLACING_FORMAT = "%A|%i|%T|%D|%e|%n|%x|%v|%f"
_PLACING_RE = re.compile(r"^(\d+)\|([0-9_+\[\],%-]+)\|([A-Z_]+)\|(\d+)(?:-\d*)?\|([^|\s]*)\|([^|\s]*)\|([^|\s]*)\|"
                         r"([^|\s]*)\|(.*)$", re.M)


def parse_placing(text: str) -> dict[str, Placing]:
    """``squeue -h -o PLACING_FORMAT`` output: jobs by id; lines that do not match are skipped."""
    out = {}
    for m in _PLACING_RE.finditer(text):
        job_id, ref, state, nodes, end, req, exc, resv, constraint = m.groups()
        out[job_id] = Placing(job_id=job_id, job_ref=ref, state=state, nodes=int(nodes), end_time=_epoch(end),
                              req_nodes="" if req in _NONE else req, exc_nodes="" if exc in _NONE else exc,
                              reservation="" if resv in _NONE else resv,
                              constraint="" if constraint.strip() in _NONE else constraint.strip())
    return out


#: job states of a job that a hold finds requeued already, or on its way out
_ENDING = ("PENDING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD")
#: job states in which a job may still run or use its node's data: what ``queue`` lists
_ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "STOPPED", "SIGNALING", "STAGE_OUT", "SPECIAL_EXIT")
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
        out[f["JobID"]] = _job(RawJob(
            job_id=f["JobID"], user=f.get("UserName", ""), state=f["State"], partition=f.get("Partition", ""),
            priority=f.get("PriorityLong"), start=_epoch(f.get("StartTime", "")),
            sched_nodes=f.get("SchedNodes"), nodes=f.get("NodeList"), batch=f.get("BatchFlag", "1") == "1",
            requeue=f.get("Requeue", "1") == "1", admin_comment=f[_LAST]))
    return out


def _epoch(text: str) -> float | None:
    return float(text) if text.isdigit() else None


class RawJob(TypedDict):
    """A job's fields as a backend (squeue's text, pyslurm) read them, Slurm's words for
    "none" included."""

    job_id: str
    user: str | None
    state: str
    partition: str | None
    priority: Any
    start: float | None
    sched_nodes: str | None
    nodes: str | None
    batch: bool
    requeue: bool
    admin_comment: str | None


def _job(raw: RawJob) -> Job:
    """A Job from what a backend read, with Slurm's words for "none" made empty.

    A held pending job (priority 0) has no expected start, whatever Slurm shows (a requeued
    one shows the time its requeue delay ends).
    """
    def text(v: str | None) -> str:
        return "" if v is None or v in _NONE else v
    priority, state = raw["priority"], raw["state"]
    prio = int(priority) if isinstance(priority, int) or (isinstance(priority, str) and priority.isdigit()) else 0
    admin = "" if raw["admin_comment"] in (None, "(null)") else str(raw["admin_comment"])
    return Job(job_id=raw["job_id"], user=text(raw["user"]), state=state, datasets=datasets_of(admin),
               nodes=text(raw["nodes"]), partition=text(raw["partition"]), batch=raw["batch"],
               requeue=raw["requeue"], admin_comment=admin, priority=prio,
               start_time=None if state == "PENDING" and prio == 0 else raw["start"],
               sched_nodes=text(raw["sched_nodes"]))
