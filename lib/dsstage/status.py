"""`dsstage status`: what is cached where, what is staging, and what the queue wants.

Compute nodes' stores are not visible from a login node, so every Prolog and Epilog
writes a node report to ``<state_dir>/nodes/<node>.json``; status reads those. The queue's
demand comes from the demand poller's snapshot when it is fresh; else status asks Slurm
once (the same query the poller makes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import demand
from .config import Config
from .demand import Snapshot
from .errors import DsstageError
from .nodefs import node_reports
from .slurm import SlurmClient


@dataclass
class Status:
    copies: list[dict[str, Any]] = field(default_factory=list)
    reports: dict[str, float] = field(default_factory=dict)  # node -> report time
    demand: list[dict[str, Any]] = field(default_factory=list)
    queue_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"copies": self.copies, "reports": self.reports, "demand": self.demand,
                "queue_error": self.queue_error}


def demand_rows(snap: Snapshot) -> list[dict[str, Any]]:
    """Per dataset: how many jobs want it, pending and running, and which jobs."""
    rows = []
    for name, wants in snap.datasets.items():
        pending, running = wants.get("pending", []), wants.get("running", [])
        rows.append({"dataset": name, "pending": len(pending), "running": len(running),
                     "jobs": [str(w.get("job_id")) for w in [*pending, *running]]})
    return sorted(rows, key=lambda r: (-r["pending"] - r["running"], r["dataset"]))


def collect(config: Config, slurm: SlurmClient | None, clock: Callable[[], float] = time.time) -> Status:
    st = Status()
    for node, when, copies in node_reports(config.state_dir):
        st.reports[node] = when
        st.copies.extend(copies)
    if slurm is None:
        return st
    now = clock()
    snap = demand.read(config.state_dir)
    if snap.stale(now, config.retention.demand_max_age):
        try:
            snap = demand.build(slurm.queue(), now)
        except DsstageError as exc:
            st.queue_error = str(exc)
            return st
    st.demand = demand_rows(snap)
    return st
