"""`dsstage status`: what is cached where, what is staging, and what the queue wants.

Compute nodes' stores are not visible from a login node: each node publishes a report
(see dsstage.node.report) to ``<state_dir>/nodes/<node>.json``, and status reads those, or,
with ``--live``, asks every node over SSH for a report built there and then. The queue's
demand comes from the demand poller's snapshot when it is fresh; else status asks Slurm
once (the same query the poller makes). One more Slurm call (``sinfo``) tells which nodes
are down: their reports, like reports older than ``report.max_age``, are stale, shown as
such and never counted as fact.

``collect`` gathers, ``select`` filters, ``to_json`` is the stable machine-readable form
(documented in docs/admin-guide.md, "Status and node reports"), ``sections`` turns it into
titled tables that ``render_plain`` (80 columns, no colour: pipes, logs, the golden test)
and ``render_rich`` (a terminal) lay out, and ``explain_job`` answers "why is my job's data
(not) ready" in one paragraph.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsstage import privatedata
from dsstage.cluster import reports as reports_of
from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.hostlist import expand_nodes
from dsstage.hostlist import fold_nodes as fold
from dsstage.node import breaker, report
from dsstage.policy import demand
from dsstage.policy.demand import Snapshot
from dsstage.slurm.client import SlurmClient
from dsstage.slurm.records import down_nodes
from dsstage.units import human, human_duration

JSON_FORMAT = 1


@dataclass
class Status:
    time: float
    nodes: list[dict[str, Any]] = field(default_factory=list)  # one normalized report per node, plus "stale"
    queue: list[dict[str, Any]] = field(default_factory=list)  # jobs that want datasets
    demand_time: float = 0.0
    demand_source: str = ""  # "snapshot", "slurm" or "" (not asked)
    queue_error: str = ""
    queue_note: str = ""  # the queue is shown, but from a stale snapshot: why it may be out of date
    unreachable: dict[str, str] = field(default_factory=dict)  # --live: node -> why
    down_error: str = ""  # sinfo failed: down nodes unknown
    #: Slurm's PrivateData hides other users' jobs: per dataset, how many pending and running
    #: jobs of others want it (None: nothing is hidden)
    hidden: dict[str, dict[str, int]] | None = None
    #: sharded datasets: name -> shards (their copies are summed up as coverage)
    sharded: dict[str, int] = field(default_factory=dict)
    #: sources whose breaker is open (dsstage.node.breaker): key -> its record
    breakers: dict[str, dict[str, Any]] = field(default_factory=dict)


def collect(config: Config, slurm: SlurmClient | None, clock: Callable[[], float] = time.time, *,
            reports: Iterable[Mapping[str, Any]] | None = None,
            unreachable: Mapping[str, str] | None = None, offline: bool = False) -> Status:
    """The cluster's state: the published reports (or ``reports``, from --live), which
    are stale, and the queue's demand (unless ``slurm`` is None). ``offline``: from
    dsstage's own files only, never asking Slurm (what a Slurm callback may do): the
    demand snapshot whatever its age (a note says when it is stale), and no list of down
    nodes (reports are stale by their age alone)."""
    now = clock()
    st = Status(time=now, unreachable=dict(unreachable or {}),
                sharded={name: ds.shards for name, ds in config.datasets.items() if ds.shards})
    st.breakers = breaker.all_open(config.state_dir)
    raw = reports_of.read_all(config.state_dir) if reports is None else [reports_of.normalize(r) for r in reports]
    down: dict[str, str] = {}
    if slurm is not None and not offline:
        try:
            down = down_nodes(slurm.nodes())
        except DsstageError as exc:
            st.down_error = str(exc)
    for r in raw:
        r["stale"] = reports_of.stale_reason(r, now, config.report.max_age, down) or None
        st.nodes.append(r)
    if slurm is None and not offline:
        return st
    snap = demand.read(config.state_dir)
    st.demand_source = "snapshot"
    if offline and not snap.time:
        st.queue_error = snap.problem or "there is no demand snapshot: is the demand poller running?"
        st.demand_source = ""
        return st
    if snap.stale(now, config.retention.demand_max_age):
        if offline or slurm is None:
            st.queue_note = (f"the demand snapshot is {human_duration(now - snap.time)} old, older than "
                             "retention.demand_max_age: is the demand poller running?")
        else:
            try:
                snap = demand.build(slurm.queue(), now)
                st.demand_source = "slurm"
            except DsstageError as exc:
                st.queue_error = str(exc)
                st.demand_source = ""
                return st
    st.demand_time = snap.time
    st.queue = queue_rows(snap)
    return st


def sees_all_jobs(config: Config, uid: int) -> bool:
    """Whether ``uid`` sees every user's jobs where Slurm's PrivateData hides them: root, and
    Slurm's SlurmUser (``burst_buffer.user``), as in Slurm itself."""
    if uid == 0:
        return True
    if config.burst_buffer.user:
        import pwd
        try:
            return pwd.getpwnam(config.burst_buffer.user).pw_uid == uid
        except KeyError:
            return False
    return False


def as_seen_by(config: Config, st: Status, uid: int | None) -> Status:
    """``st`` as Slurm would show it to ``uid`` (None: a caller nobody knows, as Slurm 22.05's
    bbstat): whole, unless PrivateData hides jobs and the caller is neither root nor SlurmUser."""
    if not privatedata.hides_jobs() or (uid is not None and sees_all_jobs(config, uid)):
        return st
    return private_view(st, _user_name(uid), demand.read_summary(config.state_dir))


def _user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    import pwd
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def private_view(st: Status, user: str | None, counts: Mapping[str, Mapping[str, int]]) -> Status:
    """``st`` as Slurm's PrivateData=jobs lets ``user`` see it (None: a caller nobody knows):
    their own jobs, and how many jobs of others want each dataset (``counts``: the demand
    summary's totals, the caller's own jobs taken out)."""
    own = [q for q in st.queue if user is not None and q["user"] == user]
    hidden: dict[str, dict[str, int]] = {}
    for name, n in counts.items():
        left = {state: max(0, int(n.get(state, 0)) - sum(1 for q in own if q["state"] == state
                                                            and name in q["datasets"]))
                for state in ("pending", "running")}
        if left["pending"] or left["running"]:
            hidden[name] = left
    nodes = [privatedata.redact_report(r) for r in st.nodes]
    return Status(time=st.time, nodes=nodes, queue=own, demand_time=st.demand_time, demand_source=st.demand_source,
                  queue_error=st.queue_error, queue_note=st.queue_note, unreachable=st.unreachable,
                  down_error=st.down_error, hidden=hidden, sharded=st.sharded)


def queue_rows(snap: Snapshot) -> list[dict[str, Any]]:
    """One row per job that wants datasets: pending first by expected start, then running."""
    jobs: dict[str, dict[str, Any]] = {}
    for name, wants in snap.datasets.items():
        for state in ("pending", "running"):
            for w in wants.get(state, []):
                job_id = str(w.get("job_id", ""))
                row = jobs.setdefault(job_id, {
                    "job_id": job_id, "user": str(w.get("user", "")), "state": state,
                    "partition": str(w.get("partition", "")), "priority": w.get("priority"),
                    "held": bool(w.get("held")), "waiting": _since(w.get("waiting")),
                    "start": w.get("start"), "nodes": str(w.get("nodes") or ""), "datasets": []})
                row["datasets"].append(name)
    for row in jobs.values():
        row["datasets"].sort()
    return sorted(jobs.values(), key=lambda r: (r["state"] != "pending", r["start"] or float("inf"),
                                                _job_key(r["job_id"])))


def _since(value: Any) -> float | None:
    """A pending job's ``waiting`` (when its bounded wait for its data began), or None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _job_key(job_id: str) -> tuple[int, str]:
    head = job_id.split("_")[0].split("+")[0]
    return (int(head) if head.isdigit() else 0, job_id)


@dataclass(frozen=True)
class Filter:
    datasets: frozenset[str] = frozenset()
    nodes: frozenset[str] = frozenset()
    users: frozenset[str] = frozenset()
    job: str = ""

    @classmethod
    def parse(cls, *, dataset: str | None = None, nodes: str | None = None, user: str | None = None,
              job: str | None = None) -> Filter:
        try:
            node_names = frozenset(expand_nodes(nodes)) if nodes else frozenset()
        except ValueError as exc:
            raise DsstageError(f"--node: {exc}; write a Slurm hostlist such as n[1-8,10]") from None
        return cls(frozenset(x for x in (dataset or "").split(",") if x), node_names,
                   frozenset(x for x in (user or "").split(",") if x), job or "")

    def __bool__(self) -> bool:
        return bool(self.datasets or self.nodes or self.users or self.job)


def select(st: Status, f: Filter) -> Status:
    """``st`` narrowed to what ``f`` asks for. A job narrows to its datasets and to the
    nodes it runs on or is planned on; a user to their jobs and the copies they lease."""
    queue = st.queue
    datasets, nodes = set(f.datasets), set(f.nodes)
    if f.job:
        queue = [q for q in queue if q["job_id"] == f.job]
        for q in queue:
            datasets |= set(q["datasets"])
            if q["nodes"]:
                nodes |= set(_expand(q["nodes"]))
    if f.users:
        queue = [q for q in queue if q["user"] in f.users]
    if datasets:
        queue = [q for q in queue if datasets & set(q["datasets"])]
    if nodes and not f.job:
        queue = [q for q in queue if not q["nodes"] or nodes & set(_expand(q["nodes"]))]
    out = []
    for r in st.nodes:
        if nodes and r["node"] not in nodes:
            continue
        copies = [c for c in r["copies"] if (not datasets or c.get("dataset") in datasets)
                  and (not f.users or f.users & {x.get("user") for x in c["leases"]})]
        out.append({**r, "copies": copies})
    return Status(time=st.time, nodes=out, queue=queue, demand_time=st.demand_time, demand_source=st.demand_source,
                  queue_error=st.queue_error, queue_note=st.queue_note, hidden=st.hidden,
                  unreachable={n: w for n, w in st.unreachable.items() if not nodes or n in nodes},
                  down_error=st.down_error, sharded=st.sharded)


def _expand(hostlist: str) -> list[str]:
    try:
        return expand_nodes(hostlist)
    except ValueError:
        return []


def to_json(st: Status) -> dict[str, Any]:
    """The stable JSON of ``dsstage status --json`` (format 1; fields are only ever added)."""
    return {
        "format": JSON_FORMAT, "time": st.time,
        "nodes": [{"node": r["node"], "dsstage": r.get("dsstage") or None, "time": r["time"],
                   "age": max(0.0, st.time - r["time"]), "stale": r["stale"], "tiers": r["tiers"]} for r in st.nodes],
        "copies": [{"node": r["node"], "stale": r["stale"] is not None, **c} for r in st.nodes for c in r["copies"]],
        "unreachable": st.unreachable,
        "queue": {"source": st.demand_source or None, "time": st.demand_time or None,
                  "age": (st.time - st.demand_time) if st.demand_time else None, "error": st.queue_error or None,
                  "jobs": st.queue, "hidden": st.hidden},
        "datasets": dataset_rows(st),
        "sources_not_answering": {k: {"since": r.get("since"), "by": r.get("by"), "reason": r.get("reason")}
                                  for k, r in sorted(st.breakers.items())},
    }


def versions(st: Status) -> dict[str, list[str]]:
    """Which dsstage each node that reports now runs: version -> its nodes ("before 0.2.0"
    for a report that does not say). More than one key means an upgrade is under way."""
    out: dict[str, list[str]] = {}
    for r in st.nodes:
        if not r["stale"]:
            out.setdefault(r.get("dsstage") or "before 0.2.0", []).append(r["node"])
    return out


def dataset_rows(st: Status) -> list[dict[str, Any]]:
    """Copies grouped by (dataset, version, state) with the nodes that hold them; the
    copies of stale reports grouped apart as "stale" (not known to be there). A sharded
    dataset's current shards are summed up per state: how many of its shards, on which nodes
    (``shards``: {"count", "of"}; ``version``: "N shards")."""
    groups: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
    for r in st.nodes:
        for c in r["copies"]:
            state = "stale" if r["stale"] else str(c.get("state"))
            name, version, current = str(c.get("dataset")), str(c.get("version")), bool(c.get("current"))
            shards = st.sharded.get(name) if current else None
            key = (name, f"{shards} shards" if shards else version, state, current)
            g = groups.setdefault(key, {"dataset": key[0], "version": key[1], "state": state, "current": key[3],
                                        "bytes": 0 if shards else int(c.get("bytes") or 0), "nodes": []})
            g["nodes"].append(r["node"])
            if shards:
                held = g.setdefault("_shards", {})
                held[version] = int(c.get("bytes") or 0)
    out = []
    for g in groups.values():
        g["count"] = len(set(g["nodes"]))
        g["nodes"] = fold(sorted(set(g["nodes"])))
        held = g.pop("_shards", None)
        if held is not None:
            g["shards"] = {"count": len(held), "of": st.sharded[g["dataset"]]}
            g["bytes"] = sum(held.values())
        out.append(g)
    order = {s: i for i, s in enumerate(report.STATES)}
    return sorted(out, key=lambda g: (g["dataset"], not g["current"], order.get(g["state"], 99), g["version"]))


def job_of(st: Status, job_id: str) -> tuple[dict[str, Any] | None, list[str]]:
    """Job ``job_id`` of the queue's demand (None if it is not there) and its nodes."""
    job = next((q for q in st.queue if q["job_id"] == job_id), None)
    return job, _expand(job["nodes"]) if job else []


def explain_job(st: Status, job_id: str, maps: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """One paragraph on job ``job_id``'s datasets: where they are, what is staging, what
    happens next. ``st`` is the unfiltered status; ``maps``: the job's shard maps
    (dsstage.cluster.shardmaps.for_job), for its sharded datasets."""
    job, planned = job_of(st, job_id)
    if job is None:
        if st.queue_error:
            return f"Job {job_id}: the queue could not be read ({st.queue_error}), so its datasets are unknown."
        return (f"Job {job_id} is not in the queue's demand: it requests no dataset, it has ended, or it was "
                f"submitted after the demand snapshot ({human_duration(st.time - st.demand_time)} old) was taken.")
    where = {"pending": "pending", "running": "running"}[job["state"]]
    parts = [f"Job {job_id} ({job['user'] or 'unknown user'}, {where}"
             + (f" in {job['partition']}" if job["partition"] else "") + f") wants {_and(job['datasets'])}."]
    if job["state"] == "pending":
        when = f"in {human_duration(job['start'] - st.time)}" if job["start"] and job["start"] > st.time else \
            "as soon as it can" if job["start"] else ""
        held = job.get("held")  # by its user, an admin, or a requeue-hold (squeue's reason JobHeld*)
        parts.append(f"It is held: it starts only once released (scontrol release {job_id}), and Slurm plans "
                     "nothing for it until then." if held else
                     f"Slurm expects it to start {when} on {job['nodes']}." if planned and when else
                     f"Slurm has planned it on {job['nodes']}." if planned else
                     f"Slurm expects it to start {when}; its nodes are not planned yet." if when else
                     "Slurm has not planned when or where it starts yet.")
        if job.get("waiting") is not None and not held:
            parts.append(f"It has been waiting {human_duration(max(0.0, st.time - job['waiting']))} for nodes "
                         "that hold its data (placement.wait_for_data): Slurm keeps it off the other nodes until "
                         "the demand poller lets it go, at the latest after that bound or once those nodes go "
                         "down or lose the data.")
    else:
        parts.append(f"It runs on {job['nodes']}." if planned else "")
    by_node = {r["node"]: r for r in st.nodes}
    for name in job["datasets"]:
        parts.append(_dataset_sentence(name, planned, by_node, job))
        if maps and name in maps:
            from dsstage.cluster import shardmaps
            parts.append(shardmaps.sentence(name, maps[name]))
    if job["state"] == "pending":
        parts.append("Its Prolog stages what is missing on each node before the job starts; if that fails the job "
                     "falls back to the source or is held, as the dataset's on_failure says.")
    return " ".join(p for p in parts if p)


def _dataset_sentence(name: str, planned: Sequence[str], by_node: Mapping[str, Mapping[str, Any]],
                      job: Mapping[str, Any]) -> str:
    ready: list[str] = []
    staging: list[str] = []
    stale: list[str] = []
    elsewhere: list[str] = []
    for node, r in sorted(by_node.items()):
        for c in r["copies"]:
            if c.get("dataset") != name or not c.get("current"):
                continue
            if r["stale"]:
                stale.append(node)
            elif c.get("state") == "ready":
                (ready if not planned or node in planned else elsewhere).append(node)
            elif c.get("state") in ("staging", "verifying") and (not planned or node in planned):
                staging.append(f"{node} ({_progress_text(c.get('progress'))})")
    text = []
    if ready:
        text.append(f"{name} is ready on {fold(ready)}")
    if staging:
        text.append(("it" if ready else name) + f" is staging on {', '.join(staging)}")
    missing = [n for n in planned if n not in ready and not any(s.startswith(n + " ") for s in staging)]
    if planned and missing:
        text.append(f"{'it' if text else name} is not yet on {fold(missing)}")
    if not planned and not ready and not staging:
        text.append(f"{name} is on no node yet" + (f" that reports (also on {fold(elsewhere)})" if elsewhere else ""))
    elif elsewhere and planned:
        text.append(f"also ready on {fold(elsewhere)}")
    if stale:
        text.append(f"reports from {fold(stale)} are stale, so what they hold is unknown")
    if job["state"] == "running" and planned and not missing:
        text.append("leased by the job where it runs" if ready else "")
    return "; ".join(t for t in text if t) + "."


def _and(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _progress_text(p: Any) -> str:
    if not isinstance(p, dict) or not p.get("total"):
        return "starting"
    done, total = float(p.get("done") or 0), float(p["total"])
    text = f"{p.get('phase', '')} {100 * done / total:.0f}%".strip()
    if p.get("unit") == "bytes" and p.get("rate"):
        text += f", {human(int(p['rate']))}/s"
    if p.get("eta") is not None:
        text += f", {human_duration(float(p['eta']))} left"
    return text
