"""Slurm, reached through one small interface.

``SlurmClient`` is what the rest of dsstage uses. ``CliSlurm`` runs scontrol (through
proc.run: bounded, its output parsed into small objects); tests use ``FakeSlurm``.
Parsers are tested on saved real output.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from . import proc
from .errors import CommandError

log = logging.getLogger(__name__)

TIMEOUT = 30.0
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


def datasets_of(admin_comment: str) -> tuple[str, ...]:
    m = TAG_RE.search(admin_comment or "")
    return tuple(n for n in m.group(1).split(",") if n) if m else ()


class SlurmClient(Protocol):
    def jobs(self) -> list[Job]: ...
    def job_alive(self, job_id: str) -> bool: ...
    def requeue_hold(self, job_id: str, comment: str) -> None: ...


def parse_show_job(text: str) -> list[Job]:
    """Jobs from ``scontrol show job -o`` output: one line per job, Key=Value fields."""
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


class CliSlurm:
    """Slurm through its command-line clients."""

    def __init__(self, timeout: float = TIMEOUT) -> None:
        self.timeout = timeout

    def jobs(self) -> list[Job]:
        res = proc.run(["scontrol", "show", "job", "-o"], timeout=self.timeout)
        return parse_show_job(res.stdout)

    def job_alive(self, job_id: str) -> bool:
        try:
            res = proc.run(["scontrol", "show", "job", "-o", job_id], timeout=self.timeout, check=False)
        except CommandError:
            return True  # cannot tell: keep the lease
        if res.returncode != 0:
            return "Invalid job id" not in res.stderr
        jobs = parse_show_job(res.stdout)
        return bool(jobs) and jobs[0].state in ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING",
                                                "REQUEUED", "RESIZING", "STOPPED")

    def requeue_hold(self, job_id: str, comment: str) -> None:
        proc.run(["scontrol", "update", f"JobId={job_id}", f"Comment={comment}"], timeout=self.timeout)
        proc.run(["scontrol", "requeuehold", "Incomplete", job_id], timeout=self.timeout)


@dataclass
class FakeSlurm:
    """A stateful stand-in for unit tests of the code around Slurm."""

    queue: dict[str, Job] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)

    def submit(self, job: Job) -> None:
        self.queue[job.job_id] = job

    def finish(self, job_id: str) -> None:
        self.queue.pop(job_id, None)

    def jobs(self) -> list[Job]:
        return list(self.queue.values())

    def job_alive(self, job_id: str) -> bool:
        return job_id in self.queue

    def requeue_hold(self, job_id: str, comment: str) -> None:
        self.held[job_id] = comment


def client() -> SlurmClient:
    """The Slurm backend for this machine: the command-line clients.

    No pyslurm release builds against Slurm 22.05 (Debian 12's), so there is no pyslurm
    backend yet; one belongs here, behind the same interface, once it can be tested.
    """
    return CliSlurm()


def expand_nodes(nodelist: str) -> list[str]:
    """``n[1-3,5],gpu01`` -> [n1, n2, n3, n5, gpu01] (one level of brackets, as Slurm prints)."""
    out: list[str] = []
    for part in _split_top(nodelist):
        m = re.match(r"^(.*?)\[([^\]]+)\](.*)$", part)
        if not m:
            if part:
                out.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-", 1)
                out.extend(f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                out.append(f"{prefix}{r}{suffix}")
    return out


def _split_top(text: str) -> Iterable[str]:
    depth, cur = 0, ""
    for c in text:
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if c == "," and depth == 0:
            yield cur
            cur = ""
        else:
            cur += c
    if cur:
        yield cur
