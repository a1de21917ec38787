"""How ``dsstage status`` lays out: titled sections (datasets, tiers, staging, the queue) that
``render_plain`` prints in 80 columns without colour (pipes, logs, the golden test) and
``render_rich`` on a terminal.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsstage.cluster.status import Status, _expand, _progress_text, dataset_rows, versions
from dsstage.hostlist import fold_nodes as fold
from dsstage.units import human, human_duration

#: at most this many rows per section in the text view (the JSON has everything)
MAX_ROWS = 20
WIDTH = 80


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
    if st.breakers:
        out.insert(0, _breakers_section(st))
    if show_queue:
        out.append(_queue_section(st, limit))
    return out


def _breakers_section(st: Status) -> Section:
    """The sources whose breaker is open (dsstage.node.breaker): jobs that need them decide at once."""
    rows: list[tuple[str, ...]] = [
        (key, f"{human_duration(st.time - float(r.get('since') or st.time))} ago", str(r.get("by") or "?"),
         str(r.get("reason") or "")) for key, r in sorted(st.breakers.items())]
    return Section("Sources not answering (breaker open)", ("source", "since", "found by", "why"), rows, flex=3,
                   notes=["Jobs that must stage from them get their on_failure at once; the next Prolog that needs "
                          "one probes it, and the first answer closes the breaker."])


def headline(st: Status) -> str:
    stale = sum(1 for r in st.nodes if r["stale"])
    text = f"{len(st.nodes)} node{'s' if len(st.nodes) != 1 else ''} reporting"
    if stale:
        text += f", {stale} stale"
    if st.unreachable:
        text += f", {len(st.unreachable)} unreachable"
    running = versions(st)
    if len(running) > 1:  # an upgrade one node at a time, under way or stopped halfway
        text += "; dsstage " + ", ".join(f"{v} on {fold(sorted(n))}" for v, n in sorted(running.items()))
    if st.demand_source == "snapshot":
        text += f"; queue from the demand snapshot ({human_duration(st.time - st.demand_time)} old" + \
            (", stale)" if st.queue_note else ")")
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
        if g.get("shards"):
            state = f"{g['shards']['count']} {state}"  # of the version's shards: "980 ready"
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
                what += _live_text(c.get("live"))
                rows.append((r["node"], str(c.get("dataset")), str(c.get("version"))[:12], what,
                             str(c.get("job_id") or "-")))
    rows, notes = _cut(sorted(rows), limit, "rows")
    return Section("Staging", ("node", "dataset", "version", "progress", "job"), rows, flex=3, notes=notes,
                   empty="Nothing is staging.")


def _live_text(view: object) -> str:
    """A live view's part of a staging row (jobs read it while the stage runs: dsstage.node.live);
    why it failed is in ``--json`` (the copy's ``live``) and the hooks' log."""
    if not isinstance(view, dict):
        return ""
    state = view.get("state")
    return f"; live {view.get('local') or 0}/{view.get('files') or 0} local" + (
        f", {state}" if state in ("failed", "stopped") else "")


def _queue_section(st: Status, limit: int | None) -> Section:
    if st.queue_error:
        return Section("Wanted by the queue", (), [], empty=f"The queue is unavailable: {st.queue_error}")
    ready = _ready_index(st)
    rows: list[tuple[str, ...]] = []
    for q in st.queue:
        nodes = _expand(q["nodes"])
        have = [n for n in nodes if all((d, n) in ready for d in q["datasets"])]
        data = f"{len(have)}/{len(nodes)} ready" if nodes else "-"
        if q["state"] == "pending" and q.get("waiting") is not None:
            # the poller's bounded wait (placement.wait_for_data): it may start only on nodes holding its data
            data = f"{data}, waiting for it" if nodes else "waiting for it"
        if q["state"] == "pending":
            when = ("in " + human_duration(q["start"] - st.time)) if q["start"] and q["start"] > st.time else \
                "now" if q["start"] else "unknown"
        else:
            when = "running"
        rows.append((q["job_id"], q["user"], when, ",".join(q["datasets"]), q["nodes"] or "-", data))
    rows, notes = _cut(rows, limit, "jobs")
    if st.queue_note:
        notes = [f"Out of date? {st.queue_note}", *notes]
    if st.hidden is not None:
        counts = "; ".join(f"{name}: {n['pending']} pending, {n['running']} running"
                           for name, n in sorted(st.hidden.items()))
        notes = [*notes, "Other users' jobs are not shown (Slurm's PrivateData=jobs)"
                 + (f"; they want {counts}" if counts else "; none wants a dataset")]
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
        else:
            lines += _table(s, width)
        for n in s.notes:  # a note is a sentence: wrapped, never cut
            lines += textwrap.wrap(n, width, initial_indent="  ", subsequent_indent="    ")
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
            for n in s.notes:
                console.print(f"  [dim]{n}[/]")
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
