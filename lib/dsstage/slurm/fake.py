"""A stateful fake of Slurm for tests and the simulator: one method per client call,
keeping jobs and nodes as Slurm would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dsstage.hostlist import expand_nodes
from dsstage.slurm.hold import (
    ALREADY_HELD,
    CANCELLED,
    GONE,
    HELD,
    NOT_REQUEUED,
    clean_reason,
    hold_message,
    merge_admin_comment,
)
from dsstage.slurm.records import _ALIVE, _ENDING, Job, Node, Placing

log = logging.getLogger(__name__)


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
    feature_calls: list[tuple[str, list[str], list[str]]] = field(default_factory=list)
    drained: dict[str, str] = field(default_factory=dict)
    placing_table: dict[str, Placing] = field(default_factory=dict)
    exclusion_calls: list[tuple[str, str | None, str]] = field(default_factory=list)

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

    def set_features(self, nodes: str, available: list[str], active: list[str]) -> None:
        self.feature_calls.append((nodes, list(available), list(active)))
        for name in expand_nodes(nodes):
            if name in self.node_table:
                self.node_table[name] = replace(self.node_table[name], features=tuple(available),
                                                active=tuple(active))

    def placing(self) -> dict[str, Placing]:
        return {k: v for k, v in self.placing_table.items() if k in self.jobs}

    def set_exclusion(self, job_id: str, job_ref: str, exclude: str | None, comment: Callable[[str], str]) -> bool:
        job = self.jobs.get(job_id)
        if job is None or job.state != "PENDING":
            return False
        text = comment(job.admin_comment)
        self.exclusion_calls.append((job_ref, exclude, text))
        if exclude is not None and job_id in self.placing_table:
            self.placing_table[job_id] = replace(self.placing_table[job_id], exc_nodes=exclude)
        self.jobs[job_id] = replace(job, admin_comment=text)
        return True

    def job_alive(self, job_id: str) -> bool:
        return job_id in self.jobs

    def drain(self, node: str, reason: str) -> None:
        self.drained[node] = "dsstage: " + clean_reason(reason)

    def hold(self, job_id: str, reason: str) -> str:
        reason = clean_reason(reason)
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
