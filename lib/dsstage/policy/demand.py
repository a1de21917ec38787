"""What the queue wants: the demand snapshot, as the poller (dsstage.cluster.poller) writes it and
the nodes read it.

``dsstage demand-poller`` runs on the controller or a login node (a systemd service, or
``--once`` from cron). Every ``retention.poll_interval`` seconds it asks Slurm once for the
active jobs (one ``squeue`` with fixed fields, see dsstage.slurm.client) and writes
``<state_dir>/demand.json`` atomically::

    {"format": 1, "time": 1763800000.0, "host": "ctl01", "backend": "squeue",
     "datasets": {"imagenet22t": {
         "pending": [{"job_id": "456", "user": "ana", "partition": "gpu", "priority": 4294,
                      "start": 1763801200.0, "nodes": "gpu[01-02]"}],
         "running": [{"job_id": "123", "user": "bo", "partition": "gpu", "nodes": "gpu07"}]}},
     "running": {"123": "gpu07", "124": "cpu[01-04]"},
     "uses": {"imagenet22t": 12.4, "coco": 0.8},
     "copies": {"imagenet22t": {"3f2a9c0d1e4b5a6f": "gpu[01-03]"}}}

``datasets`` lists, per dataset, the pending jobs that requested it (expected start and the
backfill plan's nodes where Slurm knows them, else null and "") and the running ones with
their nodes. A pending job that waits for the nodes holding its data (the poller's
bounded wait, dsstage.policy.datawait) also has ``"waiting": SINCE`` (epoch seconds, from
the marker in its AdminComment). ``running`` maps every running job (with or without datasets) to its nodes:
it is what stale leases are checked against. Node lists are Slurm hostlists.

``uses`` is the history: per dataset, an exponentially decayed count of the job starts the
poller has seen (half-life ``retention.HALF_LIFE``, 7 days), as of the snapshot's ``time``. A job is
counted once, in the first snapshot that shows it running: the poller reads its previous
snapshot, and a job id in that one's ``running`` was counted then. A job that starts and
ends between two rounds is not seen, and the starts while the poller is down are lost
(the counts only rank datasets, so a uniform loss changes nothing). The planner ranks
copies nothing in the queue wants by these counts (see dsstage.policy.retention).
``copies`` (with ``peers.enabled``): per dataset and version, the nodes whose current
report, as the poller read it this round, shows that version ready: a node's Epilog
then evicts a copy other nodes hold too before the one the cluster keeps of each version
(retention.keeper), one read of the reports per round for the whole cluster rather than
one per Epilog.

Prologs and Epilogs only read this file; they never ask Slurm about demand. A snapshot
older than ``retention.demand_max_age`` is stale: the Epilog then keeps what it cannot
judge and says so. The poller also removes old manifest versions that no node holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsstage.fs import formats
from dsstage.fs.safe import read_json, write_json
from dsstage.hostlist import expand_nodes
from dsstage.policy.retention import HALF_LIFE, Demand, Want

log = logging.getLogger(__name__)



FORMAT = formats.CURRENT["demand"]
FILE = "demand.json"
#: counts per dataset, readable by everyone where the snapshot is not (PrivateData=jobs)
SUMMARY = "demand-summary.json"
#: smaller decayed counts are dropped from the snapshot
_NEGLIGIBLE = 0.01
_PENDING = ("PENDING",)
_RUNNING = ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING")


def path(state_dir: str) -> str:
    return os.path.join(state_dir, FILE)


@dataclass(frozen=True)
class Snapshot:
    time: float  # epoch seconds; 0: there is none
    datasets: Mapping[str, Mapping[str, list[dict[str, Any]]]] = field(default_factory=dict)
    running: Mapping[str, str] = field(default_factory=dict)  # job id -> its nodes (hostlist)
    uses: Mapping[str, float] = field(default_factory=dict)  # dataset -> decayed job starts, as of time
    #: dataset -> version id -> the nodes (a hostlist) whose reports show it ready
    copies: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    host: str = ""
    backend: str = ""
    problem: str = ""  # why there is no usable snapshot

    def age(self, now: float) -> float:
        return now - self.time if self.time else float("inf")

    def stale(self, now: float, max_age: float) -> bool:
        """Too old to act on, or missing (age infinite)."""
        return self.age(now) > max_age

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "time": self.time, "host": self.host, "backend": self.backend,
                "datasets": self.datasets, "running": self.running, "uses": self.uses,
                **({"copies": self.copies} if self.copies else {})}

    def demand(self, now: float, max_age: float, copies: bool = False) -> Demand:
        """The planner's view: every dataset's wants, stale if too old or missing; the
        counts of job starts decayed to ``now``, also from a stale snapshot (they are
        history, not the queue: see dsstage.policy.retention); with ``copies`` (peers on),
        which nodes hold each version."""
        age = self.age(now)
        uses = decay(self.uses, self.time, now) if self.time else {}
        if self.stale(now, max_age):
            return Demand(stale=True, age=age, uses=uses)
        wants: dict[str, list[Want]] = {}
        for name, rows in self.datasets.items():
            out = wants.setdefault(name, [])
            for state in ("pending", "running"):
                for r in rows.get(state, ()):
                    out.append(Want(job_id=str(r.get("job_id", "")), state=state, partition=str(r.get("partition", "")),
                                    priority=_int(r.get("priority")), start=_float(r.get("start")),
                                    nodes=tuple(expand_nodes(str(r.get("nodes") or ""))), user=str(r.get("user", ""))))
        return Demand(wants=wants, age=age, uses=uses, copies=self.holders() if copies else {})

    def holders(self) -> dict[str, dict[str, frozenset[str]]]:
        """``copies`` with each hostlist expanded; an entry that is no hostlist (the snapshot
        is the poller's write, read back as data) is left out."""
        out: dict[str, dict[str, frozenset[str]]] = {}
        for name, versions in self.copies.items():
            for v, nodes in versions.items():
                try:
                    out.setdefault(name, {})[v] = frozenset(expand_nodes(nodes))
                except ValueError:
                    continue
        return out


def decay(uses: Mapping[str, float], since: float, now: float) -> dict[str, float]:
    """``uses`` (counts as of ``since``) as of ``now``."""
    f = 0.5 ** (max(0.0, now - since) / HALF_LIFE)
    return {name: n * f for name, n in uses.items()}


def count_starts(uses: Mapping[str, float], since: float, now: float,
                 started: Iterable[Sequence[str]]) -> dict[str, float]:
    """The counts of ``uses`` (as of ``since``) decayed to ``now``, plus one per dataset of
    each job in ``started`` (its datasets) that started since; negligible counts dropped.
    The poller and the simulator both count with this."""
    out = decay(uses, since, now) if since else {}
    for datasets in started:
        for name in set(datasets):
            out[name] = out.get(name, 0.0) + 1.0
    return {name: round(n, 4) for name, n in out.items() if n >= _NEGLIGIBLE}


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def build(jobs: Iterable[Any], now: float, *, backend: str = "", host: str = "",
          previous: Snapshot | None = None, copies: Mapping[str, Mapping[str, str]] | None = None) -> Snapshot:
    """The snapshot of ``jobs`` (dsstage.slurm.records.Job records from one query); ``previous``: the last
    one written, whose counts of job starts it carries on (without it, they start at 0);
    ``copies``: which nodes hold each version (``copies_from``)."""
    from dsstage.policy import datawait  # the poller's, not the nodes' readers of the snapshot
    datasets: dict[str, dict[str, list[dict[str, Any]]]] = {}
    running: dict[str, str] = {}
    counted = previous.running if previous is not None else {}
    started: list[tuple[str, ...]] = []
    for job in jobs:
        state = "pending" if job.state in _PENDING else "running" if job.state in _RUNNING else None
        if state is None:
            continue
        if state == "running":
            running[job.job_id] = job.nodes
            if job.job_id not in counted and job.datasets:
                started.append(job.datasets)
        for name in job.datasets:
            row: dict[str, Any] = {"job_id": job.job_id, "user": job.user, "partition": job.partition}
            if state == "pending":
                row.update(priority=job.priority, start=job.start_time, nodes=job.sched_nodes,
                           held=job.reason.startswith("JobHeld"))
                mark = datawait.marker(job.admin_comment)
                if mark is not None and mark.waiting:
                    row["waiting"] = mark.since
            else:
                row.update(nodes=job.nodes)
            datasets.setdefault(name, {"pending": [], "running": []})[state].append(row)
    for rows in datasets.values():
        rows["pending"].sort(key=lambda r: (r["start"] is None, r["start"] or 0, -r["priority"], r["job_id"]))
    uses = count_starts(previous.uses if previous else {}, previous.time if previous else 0.0, now, started)
    return Snapshot(time=now, datasets=datasets, running=running, uses=uses, host=host, backend=backend,
                    copies=dict(copies or {}))


def copies_from(reports: Iterable[Mapping[str, Any]], now: float, max_age: float) -> dict[str, dict[str, str]]:
    """dataset -> version -> the nodes (a hostlist) whose report, younger than ``max_age``,
    shows that version ready, current or not (a job may be pinned to the one before); reports
    are other hosts' writes, read as data: a report whose node name is not a plain one (no
    hostlist syntax) or not its file's (``file_node``, dsstage.cluster.reports) is skipped."""
    from dsstage.fs.layout import job_id_ok
    from dsstage.hostlist import fold_nodes
    held: dict[str, dict[str, list[str]]] = {}
    for rep in reports:
        node, when = rep.get("node"), rep.get("time")
        rows = rep.get("copies")
        if not isinstance(node, str) or not job_id_ok(node) or rep.get("file_node", node) != node \
                or not isinstance(when, (int, float)) \
                or not 0 <= now - when <= max_age or not isinstance(rows, list):
            continue
        for row in rows:
            if isinstance(row, dict) and row.get("state") == "ready" \
                    and isinstance(row.get("dataset"), str) and isinstance(row.get("version"), str):
                held.setdefault(row["dataset"], {}).setdefault(row["version"], []).append(node)
    return {name: {v: fold_nodes(sorted(set(nodes))) for v, nodes in versions.items()}
            for name, versions in held.items()}


def read(state_dir: str) -> Snapshot:
    """The current snapshot; one with time 0 and a ``problem`` if there is none."""
    p = path(state_dir)
    data = read_json(p)
    if not data:
        return Snapshot(time=0, problem=f"no demand snapshot at {p}: is `dsstage demand-poller` running?")
    why = formats.problem("demand", data, p)
    if why:
        return Snapshot(time=0, problem=why)
    datasets = data.get("datasets") if isinstance(data.get("datasets"), dict) else {}
    running = data.get("running") if isinstance(data.get("running"), dict) else {}
    uses = data.get("uses") if isinstance(data.get("uses"), dict) else {}  # none before dsstage wrote them
    copies = data.get("copies") if isinstance(data.get("copies"), dict) else {}  # none without peers
    return Snapshot(time=_float(data.get("time")) or 0.0, datasets=datasets or {},
                    running={str(k): str(v) for k, v in (running or {}).items()},
                    uses={str(k): f for k, v in (uses or {}).items() if (f := _float(v)) is not None and f > 0},
                    copies={str(k): {str(v): str(n) for v, n in vs.items()} for k, vs in (copies or {}).items()
                            if isinstance(vs, dict)},
                    host=str(data.get("host", "")), backend=str(data.get("backend", "")))


def write(state_dir: str, snap: Snapshot, private: bool = False) -> str:
    """Write the snapshot, and its summary for everyone; ``private`` (Slurm's PrivateData
    hides jobs): the snapshot is readable by its writer only."""
    p = path(state_dir)
    write_json(p, snap.to_dict(), fsync=False, mode=0o600 if private else 0o644)
    write_json(os.path.join(state_dir, SUMMARY), summary(snap), fsync=False)
    return p


def summary(snap: Snapshot) -> dict[str, Any]:
    """What anyone may know of the queue's demand: per dataset, how many jobs want it."""
    return {"format": formats.CURRENT["demand-summary"], "time": snap.time,
            "datasets": {name: {state: len(wants.get(state, [])) for state in ("pending", "running")}
                         for name, wants in sorted(snap.datasets.items())}}


def read_summary(state_dir: str) -> dict[str, dict[str, int]]:
    """Per dataset, the pending and running jobs that want it ({} if unknown)."""
    data = read_json(os.path.join(state_dir, SUMMARY))
    got = data.get("datasets") if formats.readable("demand-summary", data) else None
    if not isinstance(got, dict):
        return {}
    return {str(k): {s: int(v.get(s) or 0) for s in ("pending", "running")} for k, v in got.items()
            if isinstance(v, dict)}
