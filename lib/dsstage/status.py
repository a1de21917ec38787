"""`dsstage status`: what is cached where, what is staging, and what the queue wants.

Compute nodes' stores are not visible from a login node: each node publishes a report
(see dsstage.report) to ``<state_dir>/nodes/<node>.json``, and status reads those, or,
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

from . import demand, report
from .config import Config
from .demand import Snapshot
from .errors import DsstageError
from .slurm import SlurmClient, down_nodes, expand_nodes
from .slurm import fold_nodes as fold
from .units import human, human_duration

JSON_FORMAT = 1
#: at most this many rows per section in the text view (the JSON has everything)
MAX_ROWS = 20
WIDTH = 80


@dataclass
class Status:
    time: float
    nodes: list[dict[str, Any]] = field(default_factory=list)  # one normalized report per node, plus "stale"
    queue: list[dict[str, Any]] = field(default_factory=list)  # jobs that want datasets
    demand_time: float = 0.0
    demand_source: str = ""  # "snapshot", "slurm" or "" (not asked)
    queue_error: str = ""
    unreachable: dict[str, str] = field(default_factory=dict)  # --live: node -> why
    down_error: str = ""  # sinfo failed: down nodes unknown


# -- gathering ------------------------------------------------------------------------------

def collect(config: Config, slurm: SlurmClient | None, clock: Callable[[], float] = time.time, *,
            reports: Iterable[Mapping[str, Any]] | None = None,
            unreachable: Mapping[str, str] | None = None) -> Status:
    """The cluster's state: the published reports (or ``reports``, from --live), which
    are stale, and the queue's demand (unless ``slurm`` is None)."""
    now = clock()
    st = Status(time=now, unreachable=dict(unreachable or {}))
    raw = report.read_all(config.state_dir) if reports is None else [report.normalize(r) for r in reports]
    down: dict[str, str] = {}
    if slurm is not None:
        try:
            down = down_nodes(slurm.nodes())
        except DsstageError as exc:
            st.down_error = str(exc)
    for r in raw:
        r["stale"] = report.stale_reason(r, now, config.report.max_age, down) or None
        st.nodes.append(r)
    if slurm is None:
        return st
    snap = demand.read(config.state_dir)
    st.demand_source = "snapshot"
    if snap.stale(now, config.retention.demand_max_age):
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
                    "start": w.get("start"), "nodes": str(w.get("nodes") or ""), "datasets": []})
                row["datasets"].append(name)
    for row in jobs.values():
        row["datasets"].sort()
    return sorted(jobs.values(), key=lambda r: (r["state"] != "pending", r["start"] or float("inf"),
                                                _job_key(r["job_id"])))


def _job_key(job_id: str) -> tuple[int, str]:
    head = job_id.split("_")[0].split("+")[0]
    return (int(head) if head.isdigit() else 0, job_id)


# -- filtering ------------------------------------------------------------------------------

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
                  queue_error=st.queue_error, unreachable={n: w for n, w in st.unreachable.items()
                                                           if not nodes or n in nodes},
                  down_error=st.down_error)


def _expand(hostlist: str) -> list[str]:
    try:
        return expand_nodes(hostlist)
    except ValueError:
        return []


# -- the machine-readable form --------------------------------------------------------------

def to_json(st: Status) -> dict[str, Any]:
    """The stable JSON of ``dsstage status --json`` (format 1; fields are only ever added)."""
    return {
        "format": JSON_FORMAT, "time": st.time,
        "nodes": [{"node": r["node"], "time": r["time"], "age": max(0.0, st.time - r["time"]), "stale": r["stale"],
                   "tiers": r["tiers"]} for r in st.nodes],
        "copies": [{"node": r["node"], "stale": r["stale"] is not None, **c} for r in st.nodes for c in r["copies"]],
        "unreachable": st.unreachable,
        "queue": {"source": st.demand_source or None, "time": st.demand_time or None,
                  "age": (st.time - st.demand_time) if st.demand_time else None, "error": st.queue_error or None,
                  "jobs": st.queue},
        "datasets": dataset_rows(st),
    }


def dataset_rows(st: Status) -> list[dict[str, Any]]:
    """Copies grouped by (dataset, version, state) with the nodes that hold them; the
    copies of stale reports grouped apart as "stale" (not known to be there)."""
    groups: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
    for r in st.nodes:
        for c in r["copies"]:
            state = "stale" if r["stale"] else str(c.get("state"))
            key = (str(c.get("dataset")), str(c.get("version")), state, bool(c.get("current")))
            g = groups.setdefault(key, {"dataset": key[0], "version": key[1], "state": state, "current": key[3],
                                        "bytes": int(c.get("bytes") or 0), "nodes": []})
            g["nodes"].append(r["node"])
    out = []
    for g in groups.values():
        g["count"] = len(g["nodes"])
        g["nodes"] = fold(g["nodes"])
        out.append(g)
    order = {s: i for i, s in enumerate(report.STATES)}
    return sorted(out, key=lambda g: (g["dataset"], not g["current"], order.get(g["state"], 99), g["version"]))


# -- "why is my job's data (not) ready" ------------------------------------------------------

def explain_job(st: Status, job_id: str) -> str:
    """One paragraph on job ``job_id``'s datasets: where they are, what is staging, what
    happens next. ``st`` is the unfiltered status."""
    job = next((q for q in st.queue if q["job_id"] == job_id), None)
    if job is None:
        if st.queue_error:
            return f"Job {job_id}: the queue could not be read ({st.queue_error}), so its datasets are unknown."
        return (f"Job {job_id} is not in the queue's demand: it requests no dataset, it has ended, or it was "
                f"submitted after the demand snapshot ({human_duration(st.time - st.demand_time)} old) was taken.")
    planned = _expand(job["nodes"])
    where = {"pending": "pending", "running": "running"}[job["state"]]
    parts = [f"Job {job_id} ({job['user'] or 'unknown user'}, {where}"
             + (f" in {job['partition']}" if job["partition"] else "") + f") wants {_and(job['datasets'])}."]
    if job["state"] == "pending":
        when = f"in {human_duration(job['start'] - st.time)}" if job["start"] and job["start"] > st.time else \
            "as soon as it can" if job["start"] else ""
        parts.append(f"Slurm expects it to start {when} on {job['nodes']}." if planned and when else
                     f"Slurm has planned it on {job['nodes']}." if planned else
                     f"Slurm expects it to start {when}; its nodes are not planned yet." if when else
                     "Slurm has not planned when or where it starts yet.")
    else:
        parts.append(f"It runs on {job['nodes']}." if planned else "")
    by_node = {r["node"]: r for r in st.nodes}
    for name in job["datasets"]:
        parts.append(_dataset_sentence(name, planned, by_node, job))
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
        text.append(f"not yet on {fold(missing)}")
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


# -- the text view: sections of rows, laid out plain or with rich ---------------------------

@dataclass
class Section:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    flex: int = -1  # the column that is cut when the width is short
    notes: list[str] = field(default_factory=list)
    empty: str = ""


def sections(st: Status, *, show_queue: bool, plain: bool, all_rows: bool = False) -> list[Section]:
    limit = None if all_rows else MAX_ROWS
    out = [_datasets_section(st, limit), _tiers_section(st, plain, limit), _staging_section(st, limit)]
    if show_queue:
        out.append(_queue_section(st, limit))
    return out


def headline(st: Status) -> str:
    stale = sum(1 for r in st.nodes if r["stale"])
    text = f"{len(st.nodes)} node{'s' if len(st.nodes) != 1 else ''} reporting"
    if stale:
        text += f", {stale} stale"
    if st.unreachable:
        text += f", {len(st.unreachable)} unreachable"
    if st.demand_source == "snapshot":
        text += f"; queue from the demand snapshot ({human_duration(st.time - st.demand_time)} old)"
    elif st.demand_source == "slurm":
        text += "; queue from Slurm (the demand snapshot is stale or missing)"
    return text


def _cut(rows: list[tuple[str, ...]], limit: int | None, what: str) -> tuple[list[tuple[str, ...]], list[str]]:
    if limit is None or len(rows) <= limit:
        return rows, []
    return rows[:limit], [f"... and {len(rows) - limit} more {what} (narrow with --dataset, --node, --user, "
                          "or show all with --all)"]


def _datasets_section(st: Status, limit: int | None) -> Section:
    rows: list[tuple[str, ...]] = []
    for g in dataset_rows(st):
        state = g["state"] if g["current"] or g["state"] in ("stale", "evicting") else f"{g['state']} (old)"
        rows.append((g["dataset"], g["version"][:12], state, str(g["count"]), human(g["bytes"]), g["nodes"]))
    rows, notes = _cut(rows, limit, "rows")
    return Section("Datasets on nodes", ("dataset", "version", "state", "nodes", "size", "where"), rows, flex=5,
                   notes=notes, empty="No node has reported a dataset copy.")


def _bar(fraction: float, width: int, plain: bool) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    full = round(fraction * width)
    return ("#" * full + "." * (width - full)) if plain else ("█" * full + "░" * (width - full))


def _tiers_section(st: Status, plain: bool, limit: int | None) -> Section:
    rows: list[tuple[float, tuple[str, ...]]] = []
    for r in st.nodes:
        if r["stale"]:
            rows.append((2.0, (r["node"], "-", "", "", "", f"stale: {r['stale']}")))
            continue
        for t in r["tiers"]:
            cap = int(t.get("capacity") or 0)
            used = int(t.get("used") or 0) + int(t.get("reserved") or 0)
            frac = used / cap if cap else 0.0
            note = "above high watermark" if cap and frac > float(t.get("high") or 1) else ""
            rows.append((frac, (r["node"], str(t.get("tier")), _bar(frac, 12, plain) + f" {100 * frac:3.0f}%",
                                human(used), human(cap), note)))
    for node, why in sorted(st.unreachable.items()):
        rows.append((3.0, (node, "-", "", "", "", f"unreachable: {why}")))
    ordered = [row for _f, row in sorted(rows, key=lambda x: (-x[0], x[1][0], x[1][1]))]
    ordered, notes = _cut(ordered, limit, "node tiers, fullest first")
    return Section("Tiers", ("node", "tier", "use", "used", "capacity", "note"), ordered, flex=5, notes=notes,
                   empty="No node has reported its tiers.")


def _staging_section(st: Status, limit: int | None) -> Section:
    rows: list[tuple[str, ...]] = []
    for r in st.nodes:
        if r["stale"]:
            continue
        for c in r["copies"]:
            if c.get("state") in ("staging", "verifying", "evicting", "interrupted"):
                what = c["state"] if c["state"] in ("evicting", "interrupted") else _progress_text(c.get("progress"))
                rows.append((r["node"], str(c.get("dataset")), str(c.get("version"))[:12], what,
                             str(c.get("job_id") or "-")))
    rows, notes = _cut(sorted(rows), limit, "rows")
    return Section("Staging", ("node", "dataset", "version", "progress", "job"), rows, flex=3, notes=notes,
                   empty="Nothing is staging.")


def _queue_section(st: Status, limit: int | None) -> Section:
    if st.queue_error:
        return Section("Wanted by the queue", (), [], empty=f"The queue is unavailable: {st.queue_error}")
    ready = _ready_index(st)
    rows: list[tuple[str, ...]] = []
    for q in st.queue:
        nodes = _expand(q["nodes"])
        have = [n for n in nodes if all((d, n) in ready for d in q["datasets"])]
        data = f"{len(have)}/{len(nodes)} ready" if nodes else "-"
        if q["state"] == "pending":
            when = ("in " + human_duration(q["start"] - st.time)) if q["start"] and q["start"] > st.time else \
                "now" if q["start"] else "unknown"
        else:
            when = "running"
        rows.append((q["job_id"], q["user"], when, ",".join(q["datasets"]), q["nodes"] or "-", data))
    rows, notes = _cut(rows, limit, "jobs")
    return Section("Wanted by the queue", ("job", "user", "start", "datasets", "nodes", "data"), rows, flex=4,
                   notes=notes, empty="No queued job requests a dataset.")


def _ready_index(st: Status) -> set[tuple[str, str]]:
    return {(str(c.get("dataset")), r["node"]) for r in st.nodes if not r["stale"]
            for c in r["copies"] if c.get("state") == "ready" and c.get("current")}


def render_plain(st: Status, secs: Sequence[Section], width: int = WIDTH) -> str:
    """The text view without colour, every line at most ``width`` columns."""
    lines = [_clip(headline(st), width)]
    for s in secs:
        lines += ["", s.title]
        if not s.rows:
            lines.append(_clip("  " + s.empty, width))
            continue
        lines += _table(s, width)
        lines += [_clip("  " + n, width) for n in s.notes]
    return "\n".join(lines) + "\n"


def _table(s: Section, width: int) -> list[str]:
    cols = len(s.columns)
    widths = [max(len(s.columns[i]), *(len(r[i]) for r in s.rows)) for i in range(cols)]
    room = width - 2 - 2 * (cols - 1)
    flex = s.flex % cols
    over = sum(widths) - room
    if over > 0:
        widths[flex] = max(len(s.columns[flex]), widths[flex] - over)
    out = []
    for row in [s.columns, *s.rows]:
        cells = [_fit(row[i], widths[i]) for i in range(cols)]
        out.append(_clip(("  " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(cells))).rstrip(), width))
    return out


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(0, width - 1)] + "…"


def _clip(line: str, width: int) -> str:
    return _fit(line, width)


def render_rich(st: Status, secs: Sequence[Section], console: Any) -> None:
    """The text view on a terminal: the same sections as rich tables."""
    from rich import box
    from rich.table import Table
    console.print(f"[bold]dsstage status[/]: {headline(st)}")
    for s in secs:
        if not s.rows:
            console.print(f"[bold]{s.title}[/]: {s.empty}")
            continue
        table = Table(title=s.title, title_justify="left", box=box.SIMPLE_HEAD, title_style="bold")
        for i, col in enumerate(s.columns):
            table.add_column(col, overflow="fold" if i == s.flex % len(s.columns) else "ellipsis")
        for row in s.rows:
            table.add_row(*(_style(cell) for cell in row))
        console.print(table)
        for n in s.notes:
            console.print(f"  [dim]{n}[/]")


def _style(cell: str) -> str:
    from rich.markup import escape
    text = escape(cell)
    if cell.startswith(("stale", "unreachable", "failed")):
        return f"[yellow]{text}[/]"
    if cell == "above high watermark":
        return f"[red]{text}[/]"
    return text
