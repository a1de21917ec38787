"""Prometheus metrics for node_exporter's textfile collector.

Two halves, because they run in different places:

* ``count`` adds to counters. It runs in the Prolog's warm path (a whole warm Prolog takes
  about 35 ms), so it imports only the standard library (prometheus_client costs ~80 ms,
  logging ~15 ms: both are imported only when needed) and does one lock, one small read
  and one write, without fsync. Each Prolog and Epilog is its own short process and
  several run at once on a node, so the counters live in a file, per node, in the run
  directory, changed by read-modify-write under an exclusive flock(2) on a lock file
  beside it: no increment is lost.
* ``export`` writes the textfile (prometheus_client, atomically): the counters as stored,
  and gauges computed from the rows the caller passes (tiers and copies).

Per node, in the run directory (``runfiles.RUN_DIR``; reached through ``fs_safe.RootDir``,
so nothing a user plants is followed)::

    <run_dir>/<node>/metrics.json          the counters
    <run_dir>/<node>/metrics.lock          flock: count's read-modify-write
    <run_dir>/<node>/metrics-export.lock   flock: one export at a time

The run directory is a tmpfs: the counters start again from zero when the node boots,
which Prometheus expects of a counter (``rate()`` and ``increase()`` handle resets).
"""

from __future__ import annotations

import math
import os
import time

from dsstage.errors import DsstageError
from dsstage.fs import layout
from dsstage.fs import safe as fs_safe
from dsstage.fs.safe import RootDir

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping, Sequence
    from typing import Any

    Event = tuple[str, Mapping[str, str], float]  # for the type checker only: annotations are strings

PREFIX = "dsstage_"
COUNTERS_FILE = "metrics.json"
COUNT_LOCK = "metrics.lock"
EXPORT_LOCK = "metrics-export.lock"

#: counter (without prefix and _total): its label names, in order, and its help text
COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "hits": (("dataset",), "Jobs that found the dataset ready on the node (the Prolog staged nothing)."),
    "misses": (("dataset",), "Jobs for which the Prolog had to stage the dataset."),
    "staged_bytes": (("dataset",), "Bytes copied onto the node by stages of the dataset."),
    "staged_seconds": (("dataset",), "Seconds spent staging the dataset."),
    "evictions": (("dataset", "reason"), "Copies of the dataset evicted from the node, by reason."),
    "evicted_bytes": (("dataset", "reason"), "Bytes freed by evicting copies of the dataset, by reason."),
    "verify_failures": (("dataset",), "Staged copies of the dataset that failed verification."),
    "fallbacks": (("dataset",), "Jobs sent to the dataset's source because staging failed."),
    "holds": (("dataset",), "Jobs held because the dataset could not be provided."),
    "prefetches": (("dataset", "result"), "Prefetches of the dataset for pending jobs, by result (staged, cached, "
                   "skipped, yielded, abandoned, failed)."),
    "prefetched_bytes": (("dataset",), "Bytes copied onto the node by prefetches of the dataset."),
    "hooks_abandoned": (("hook",), "Prologs and Epilogs that stopped waiting for their work at prolog_budget (the "
                        "shared filesystem or a source stopped answering) and decided without it."),
}

#: histogram (without prefix and _seconds suffixes as named): its label names, help text and
#: bucket bounds (seconds; +Inf is implied)
HISTOGRAMS: dict[str, tuple[tuple[str, ...], str, tuple[float, ...]]] = {
    "hook_seconds": (("hook",), "Seconds each Prolog and Epilog took on the node (the hook slurmd waits for, "
                     "warm path included).",
                     (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 180, 240, 300, 600, 1800)),
}
HOOKS = ("prolog", "epilog")

_REASON_MAX = 32
_REASON_FIRST = frozenset("abcdefghijklmnopqrstuvwxyz")
_REASON = _REASON_FIRST | frozenset("0123456789_")


# -- counting (the warm path: standard library only) ---------------------------------------------

def count(run_dir: str, node: str, events: Iterable[Event], observed: Iterable[Event] = ()) -> None:
    """Add each event's value to its counter: ``count(run_dir, node, [("hits", {"dataset":
    "imagenet"}, 1)])``. Names are without prefix and ``_total`` (see COUNTERS). Each of
    ``observed`` is a value put in its histogram (HISTOGRAMS): ``("hook_seconds", {"hook":
    "prolog"}, 0.04)``.

    Raises ValueError, before touching anything, for an unknown name, a label set other than
    the counter's, a label value that is not a dataset name (``dataset``) or a short key
    (``reason``: ``[a-z][a-z0-9_]*``, at most 32: old_version, idle, pressure, make_room,
    forced, bad), a negative or infinite value, or an invalid node name: those are bugs.
    Pass catalog dataset names only: a name a user typed would let anyone add series. Any
    failure of the run directory (OSError, an unsafe run directory) is logged as a warning
    and swallowed: metrics never fail a job."""
    todo = [_checked(event) for event in events]
    values = [_checked(value, HISTOGRAMS) for value in observed]
    parts = _node_parts(node)
    if not todo and not values:
        return
    try:
        with RootDir(run_dir) as run:
            fd = run.dir(*parts)
            with fs_safe.Flock(fd, COUNT_LOCK):
                record = fs_safe.read_json_at(fd, COUNTERS_FILE)
                _add(record, todo, node)
                _observe(record, values)
                fs_safe.write_json_at(fd, COUNTERS_FILE, record, fsync=False)
    except (OSError, DsstageError) as exc:
        import logging
        logging.getLogger(__name__).warning(
            "metrics: could not count %s for node %s in %s: %s",
            ", ".join(sorted({name for name, _, _ in todo + values})), node or "node", run_dir, exc)


def counters(run_dir: str, node: str) -> dict[str, Any]:
    """What is stored for ``node``: ``{"node", "since" (time of the first count since the
    run directory was created, i.e. since boot), "counters": {name: nested by label values
    in COUNTERS order: value}}``, e.g. ``{"hits": {"imagenet": 3}, "evictions": {"imagenet":
    {"idle": 1}}}``. ``{"counters": {}}`` if nothing was counted. Raises OSError or
    UnsafeStore if the run directory cannot be read."""
    parts = _node_parts(node)
    try:
        with RootDir(run_dir, create=False) as run:
            record = fs_safe.read_json_at(run.has_dir(*parts), COUNTERS_FILE)
    except FileNotFoundError:
        record = {}
    if not isinstance(record.get("counters"), dict):
        record["counters"] = {}
    return record


def samples(record: Mapping[str, Any]) -> Iterator[tuple[str, tuple[str, ...], float]]:
    """(name, label values, value) of every counter in a stored record (what ``counters``
    returns); entries this version does not know, or that are damaged, are skipped."""
    stored = record.get("counters")
    if not isinstance(stored, dict):
        return
    for name, (labels, _help) in COUNTERS.items():
        yield from ((name, values, float(value)) for values, value in _leaves(stored.get(name), len(labels))
                    if _numbers([value]))


def _leaves(tree: Any, depth: int, above: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(label values, what is stored under them) of a tree nested ``depth`` labels deep."""
    if not isinstance(tree, dict):
        return
    for key, sub in sorted(tree.items()):
        if depth > 1:
            yield from _leaves(sub, depth - 1, (*above, key))
        else:
            yield (*above, key), sub


def _checked(event: Event, known: Mapping[str, tuple[Any, ...]] = COUNTERS) -> tuple[str, tuple[str, ...], float]:
    try:
        name, labels, value = event
    except (TypeError, ValueError):
        raise ValueError(f"a metrics event is (name, labels, value), not {event!r}") from None
    spec = known.get(name)
    if spec is None:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(known)}")
    names = spec[0]
    if not isinstance(labels, dict) or sorted(labels) != sorted(names):
        raise ValueError(f"metric {name!r} takes labels {list(names)}, not {labels!r}")
    values = tuple(labels[k] for k in names)
    for key, label in zip(names, values):
        ok = layout.name_ok(label) if key == "dataset" else label in HOOKS if key == "hook" else _reason_ok(label)
        if not ok:
            raise ValueError(f"bad {key} label {label!r} for metric {name!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"metric {name!r}: a counter only grows, {value!r} is not a finite number >= 0")
    return name, values, value


def _reason_ok(key: Any) -> bool:
    return isinstance(key, str) and 0 < len(key) <= _REASON_MAX and key[0] in _REASON_FIRST \
        and all(c in _REASON for c in key)


def _node_parts(node: str) -> tuple[str]:
    """The node's directory in the run directory, as dsstage.fs.runfiles lays out the task files."""
    name = node or "node"
    if not layout.job_id_ok(name):
        raise ValueError(f"node name {node!r} is not valid")
    return (name,)


def _add(record: dict[str, Any], todo: Sequence[tuple[str, tuple[str, ...], float]], node: str) -> None:
    record["node"] = node or "node"
    if not isinstance(record.get("since"), (int, float)):
        record["since"] = time.time()
    stored = _subdict(record, "counters")
    for name, values, value in todo:
        level = _subdict(stored, name)
        for label in values[:-1]:
            level = _subdict(level, label)
        old = level.get(values[-1])
        if isinstance(old, bool) or not isinstance(old, (int, float)) or not math.isfinite(old):
            old = 0  # damaged: start again (Prometheus sees a counter reset)
        level[values[-1]] = old + value


def _observe(record: dict[str, Any], todo: Sequence[tuple[str, tuple[str, ...], float]]) -> None:
    """Put each value in its histogram: stored per label values as ``{"buckets": [count per
    bucket, +Inf last], "sum", "count"}`` (counts per bucket, not cumulative)."""
    stored = _subdict(record, "histograms") if todo else {}
    for name, values, value in todo:
        bounds = HISTOGRAMS[name][2]
        level = _subdict(stored, name)
        for label in values[:-1]:
            level = _subdict(level, label)
        h = _subdict(level, values[-1])
        if not _whole(h, bounds):
            h.update(buckets=[0] * (len(bounds) + 1), sum=0, count=0)  # new, damaged or re-bucketed: start again
        h["buckets"][next((i for i, b in enumerate(bounds) if value <= b), len(bounds))] += 1
        h["sum"] += value
        h["count"] += 1


def _whole(h: Any, bounds: Sequence[float]) -> bool:
    """Whether ``h`` is a stored histogram of these bucket bounds, undamaged."""
    buckets = h.get("buckets") if isinstance(h, dict) else None
    return isinstance(buckets, list) and len(buckets) == len(bounds) + 1 and _numbers(buckets) \
        and _numbers([h.get("sum"), h.get("count")])


def _numbers(items: Sequence[Any]) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in items)


def histograms(record: Mapping[str, Any]) -> Iterator[tuple[str, tuple[str, ...], list[tuple[float, float]], float]]:
    """(name, label values, [(bound, cumulative count)] ending with inf, sum) of every
    histogram in a stored record; damaged entries are skipped."""
    stored = record.get("histograms")
    if not isinstance(stored, dict):
        return
    for name, (labels, _help, bounds) in HISTOGRAMS.items():
        for values, h in _leaves(stored.get(name), len(labels)):
            if not _whole(h, bounds):
                continue
            total, cumulative = 0.0, []
            for bound, n in zip([*map(float, bounds), math.inf], h["buckets"]):
                total += n
                cumulative.append((bound, total))
            yield name, values, cumulative, float(h["sum"])


def _subdict(parent: dict[str, Any], key: str) -> dict[str, Any]:
    sub = parent.get(key)
    if not isinstance(sub, dict):
        sub = parent[key] = {}
    return sub


# -- export (prometheus_client: imported here only) ------------------------------------------------

#: gauge (with prefix): its label names and help text
GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "tier_capacity_bytes": (("tier",), "Bytes the tier may use on the node (its capacity)."),
    "tier_used_bytes": (("tier",), "Bytes the tier uses on the node."),
    "tier_reserved_bytes": (("tier",), "Bytes reserved in the tier by stages under way."),
    "tier_high_watermark_ratio": (("tier",), "Fraction of the capacity above which the tier evicts."),
    "tier_low_watermark_ratio": (("tier",), "Fraction of the capacity the tier evicts down to."),
    "copy_bytes": (("tier", "dataset", "version", "state"), "Bytes of one copy of a dataset version."),
    "copies": (("tier", "state"), "Copies in the tier, by state."),
    "leases": (("tier", "dataset"), "Jobs holding a lease on a copy of the dataset in the tier."),
    "metrics_updated_timestamp_seconds": ((), "When dsstage last wrote this file (Unix time)."),
}

_TIER_FIELDS = (("capacity", "tier_capacity_bytes"), ("used", "tier_used_bytes"), ("reserved", "tier_reserved_bytes"),
                ("high", "tier_high_watermark_ratio"), ("low", "tier_low_watermark_ratio"))

Family = tuple[str, str, str, tuple[str, ...], list[tuple[tuple[str, ...], float]]]


def families(record: Mapping[str, Any], tiers: Sequence[Mapping[str, Any]],
             copies: Sequence[Mapping[str, Any]], now: float) -> list[Family]:
    """What ``export`` writes, as plain data: (name with prefix, "counter" or "gauge", help,
    label names, [(label values, value)]); a family without samples is left out."""
    out: list[Family] = []
    by_counter: dict[str, list[tuple[tuple[str, ...], float]]] = {}
    for name, values, value in samples(record):
        by_counter.setdefault(name, []).append((values, value))
    for name, (labels, text) in COUNTERS.items():
        if by_counter.get(name):
            out.append((PREFIX + name, "counter", text, labels, by_counter[name]))

    gauges: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in GAUGES}
    for row in tiers:
        for field, gauge in _TIER_FIELDS:
            if row.get(field) is not None:
                gauges[gauge][(str(row["tier"]),)] = float(row[field])
    leases: dict[tuple[str, str], set[str]] = {}
    for row in copies:
        tier, dataset, state = str(row["tier"]), str(row["dataset"]), str(row["state"])
        key = (tier, dataset, str(row["version"]), state)
        gauges["copy_bytes"][key] = gauges["copy_bytes"].get(key, 0.0) + float(row.get("bytes") or 0)
        gauges["copies"][(tier, state)] = gauges["copies"].get((tier, state), 0.0) + 1
        leases.setdefault((tier, dataset), set()).update(
            str(job.get("job_id") if isinstance(job, dict) else job) for job in row.get("leases") or ())
    gauges["leases"] = {key: float(len(jobs)) for key, jobs in leases.items()}
    gauges["metrics_updated_timestamp_seconds"][()] = now
    for name, (labels, text) in GAUGES.items():
        if gauges[name]:
            out.append((PREFIX + name, "gauge", text, labels, sorted(gauges[name].items())))
    return out


def export(path: str, run_dir: str, node: str, tiers: Sequence[Mapping[str, Any]],
           copies: Sequence[Mapping[str, Any]], *, now: float | None = None) -> None:
    """Write the textfile at ``path`` for node_exporter: the node's counters and gauges
    from ``tiers`` rows ({"tier", "capacity", "used", "reserved"}: bytes; optional "high",
    "low": the watermarks as fractions of the capacity; a missing or None field is left
    out) and ``copies`` rows ({"tier", "dataset", "version", "state", "bytes", "leases":
    [job ids, or lease records with "job_id"]}: the node report's rows fit as they are).
    ``now``: the time written as dsstage_metrics_updated_timestamp_seconds.

    ``path`` is final: the configured ``metrics.textfile`` may contain ``{node}`` (several
    nodes on one machine, like the devcluster's, each need their own file) and the caller
    substitutes it. It should end in ``.prom`` (node_exporter reads nothing else). The file
    is replaced atomically: prometheus_client writes ``<path>.<pid>.<thread id>`` beside
    it, which no other process or path can share and node_exporter ignores, then renames.
    Exports of one node take turns (a lock in the run directory), so a slower export never
    replaces a newer file with older counters, which Prometheus would take for a reset.

    Raises OSError if the file cannot be written (or the run directory read), UnsafeStore
    if the run directory is not safe: the caller logs it, a job never fails for metrics."""
    from prometheus_client import CollectorRegistry, write_to_textfile
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.utils import floatToGoString

    class Collected:
        def __init__(self, metrics: list[Metric]) -> None:
            self.metrics = metrics

        def collect(self) -> Iterator[Metric]:
            return iter(self.metrics)

    parts = _node_parts(node)
    with RootDir(run_dir) as run:
        fd = run.dir(*parts)
        with fs_safe.Flock(fd, EXPORT_LOCK):
            record = fs_safe.read_json_at(fd, COUNTERS_FILE)
            metrics: list[Metric] = []
            for name, kind, text, labels, rows in families(record, tiers, copies,
                                                           time.time() if now is None else now):
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                    name, text, labels=labels)
                for values, value in rows:
                    family.add_metric(values, value)
                metrics.append(family)
            by_histogram: dict[str, HistogramMetricFamily] = {}
            for name, values, buckets, total in histograms(record):
                if name not in by_histogram:
                    labels, text, _bounds = HISTOGRAMS[name]
                    by_histogram[name] = HistogramMetricFamily(PREFIX + name, text, labels=labels)
                by_histogram[name].add_metric(list(values), [(floatToGoString(b), n) for b, n in buckets], total)
            metrics += by_histogram.values()
            registry = CollectorRegistry(auto_describe=False)
            registry.register(Collected(metrics))
            write_to_textfile(path, registry)
            os.chmod(path, 0o644)  # node_exporter runs as its own user, whatever our umask
