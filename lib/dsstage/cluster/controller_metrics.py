"""The controller's metrics, beside each node's: what the demand poller sees of the whole
cluster, written each round it acts to ``metrics.controller_textfile`` for node_exporter's
textfile collector on that host.

* ``dsstage_demand_snapshot_timestamp_seconds``: when the snapshot the Epilogs and prefetch
  read was taken (alert on ``time() - x`` above ``retention.demand_max_age``);
* ``dsstage_catalog_timestamp_seconds``: when the catalog job_submit.lua checks was written
  (group changes reach the submit check only through it);
* ``dsstage_pending_jobs{dataset}``: pending jobs that want each dataset, and
  ``dsstage_pending_jobs_not_ready{dataset}``: those of them whose dataset is ready on no node;
* ``dsstage_held_jobs{reason}``: jobs dsstage held, by kind of reason (``hold_kind``);
* ``dsstage_poller_acting``: 1 on the host whose poller acts (controllers in pairs).

``families`` is a pure function of what the round read; ``write`` is prometheus_client's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dsstage.slurm.records import Job

PREFIX = "dsstage_"
#: hold messages by kind: the first whose words occur in the reason (lower case) names it
HOLD_KINDS = (
    ("unknown_dataset", ("unknown dataset",)),
    ("access", ("may not use", "not in group", "groups")),
    ("no_space", ("cannot make room", "capacity", "no space", "filesystem is full")),
    ("source", ("source", "manifest", "verification", "differs")),
    ("budget", ("prolog_budget", "budget", "out of time")),
    ("config", ("misconfigured", "configuration", "catalog")),
    ("node", ("local store", "run directory")),
)
HELD_PREFIX = "dsstage held this job: "

Family = tuple[str, str, str, list[str], list[tuple[list[str], float]]]


def hold_kind(reason: str) -> str:
    """The kind of a hold's reason, for a label with few values."""
    text = reason.lower()
    for kind, words in HOLD_KINDS:
        if any(w in text for w in words):
            return kind
    return "other"


def held_reason(job: Job) -> str | None:
    """Why dsstage holds ``job`` (its AdminComment's message), or None if it does not."""
    at = job.admin_comment.find(HELD_PREFIX)
    if at < 0 or job.state != "PENDING":
        return None
    return job.admin_comment[at + len(HELD_PREFIX):].split(" -- once that is fixed", 1)[0]


def families(*, snapshot_time: float, catalog_time: float | None, jobs: Sequence[Job],
             ready: Mapping[str, int], acting: bool, breakers: Mapping[str, float] | None = None) -> list[Family]:
    """The controller's metric families: (name, "gauge", help, label names, [(label values,
    value)]). ``ready``: per dataset, the nodes whose reports show it ready; ``breakers``: the
    sources whose breaker is open, and since when (dsstage.node.breaker)."""
    pending: dict[str, int] = {}
    held: dict[str, int] = {}
    for job in jobs:
        if job.state == "PENDING":
            for name in job.datasets:
                pending[name] = pending.get(name, 0) + 1
        why = held_reason(job)
        if why is not None:
            kind = hold_kind(why)
            held[kind] = held.get(kind, 0) + 1
    out: list[Family] = [
        (PREFIX + "demand_snapshot_timestamp_seconds", "gauge", "When the demand snapshot was taken (epoch seconds).",
         [], [([], snapshot_time)]),
        (PREFIX + "pending_jobs", "gauge", "Pending jobs that want the dataset.", ["dataset"],
         [([n], float(c)) for n, c in sorted(pending.items())]),
        (PREFIX + "pending_jobs_not_ready", "gauge", "Pending jobs that want the dataset while no node holds it ready.",
         ["dataset"], [([n], float(c)) for n, c in sorted(pending.items()) if not ready.get(n)]),
        (PREFIX + "held_jobs", "gauge", "Jobs dsstage holds, by the kind of reason.", ["reason"],
         [([k], float(c)) for k, c in sorted(held.items())]),
        (PREFIX + "poller_acting", "gauge", "1 where the demand poller acts (one of a controller pair).", [],
         [([], 1.0 if acting else 0.0)]),
        (PREFIX + "source_breaker_open_since_timestamp_seconds", "gauge",
         "Since when a source's breaker is open: it stopped answering, and stages from it decide at once "
         "(epoch seconds).", ["source"], [([k], float(t)) for k, t in sorted((breakers or {}).items())]),
    ]
    if catalog_time is not None:
        out.append((PREFIX + "catalog_timestamp_seconds", "gauge",
                    "When the catalog job_submit.lua checks was written (epoch seconds).", [], [([], catalog_time)]))
    return out


def ready_counts(reports: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Per dataset, the nodes whose reports show its current version ready."""
    out: dict[str, int] = {}
    for rep in reports:
        for name in {c.get("dataset") for c in rep.get("copies", []) if c.get("state") == "ready" and c.get("current")}:
            if isinstance(name, str):
                out[name] = out.get(name, 0) + 1
    return out


def catalog_time(paths: Sequence[str]) -> float | None:
    """The modification time of the first catalog of ``paths`` that exists."""
    for p in paths:
        try:
            return os.stat(p).st_mtime
        except OSError:
            continue
    return None


def write(path: str, fams: Sequence[Family]) -> None:
    """Write the textfile atomically (prometheus_client writes beside it, then renames)."""
    from prometheus_client import CollectorRegistry, write_to_textfile
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

    metrics: list[Metric] = []
    for name, _kind, text, labels, rows in fams:
        family = GaugeMetricFamily(name, text, labels=labels)
        for values, value in rows:
            family.add_metric(values, value)
        metrics.append(family)

    class Collected:
        def collect(self) -> Iterable[Metric]:
            return iter(metrics)
    registry = CollectorRegistry()
    registry.register(Collected())  # type: ignore[arg-type]
    write_to_textfile(path, registry)
