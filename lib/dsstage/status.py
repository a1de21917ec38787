"""`dsstage status`: what is cached where, what is staging, and what the queue wants.

Compute nodes' stores are not visible from a login node, so every Prolog and Epilog
writes a node report to ``<state_dir>/nodes/<node>.json``; status reads those, and asks
Slurm (once) for the jobs that requested datasets.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import Config
from .errors import DsstageError
from .fsutil import read_json
from .slurm import Job, SlurmClient


@dataclass
class Status:
    copies: list[dict[str, Any]] = field(default_factory=list)
    reports: dict[str, float] = field(default_factory=dict)  # node -> report time
    demand: list[dict[str, Any]] = field(default_factory=list)
    queue_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"copies": self.copies, "reports": self.reports, "demand": self.demand,
                "queue_error": self.queue_error}


def demand(jobs: list[Job]) -> list[dict[str, Any]]:
    """Per dataset: how many jobs want it, pending and running, and which jobs."""
    by: dict[str, dict[str, Any]] = {}
    for job in jobs:
        state = "running" if job.state in ("RUNNING", "CONFIGURING", "COMPLETING") else \
            "pending" if job.state == "PENDING" else None
        if state is None:
            continue
        for name in job.datasets:
            row = by.setdefault(name, {"dataset": name, "pending": 0, "running": 0, "jobs": []})
            row[state] += 1
            row["jobs"].append(job.job_id)
    return sorted(by.values(), key=lambda r: (-r["pending"] - r["running"], r["dataset"]))


def collect(config: Config, slurm: SlurmClient | None, clock: Callable[[], float] = time.time) -> Status:
    st = Status()
    for path in sorted(glob.glob(os.path.join(config.state_dir, "nodes", "*.json"))):
        report = read_json(path)
        node = str(report.get("node") or os.path.basename(path)[:-5])
        st.reports[node] = float(str(report.get("time") or 0))
        copies = report.get("copies")
        if isinstance(copies, list):
            st.copies.extend(c for c in copies if isinstance(c, dict))
    if slurm is not None:
        try:
            st.demand = demand(slurm.queue())
        except DsstageError as exc:
            st.queue_error = str(exc)
    return st
