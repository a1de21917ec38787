import json
import logging
import multiprocessing
import os
import stat
import subprocess
import sys

import pytest
from dsstage.node import metrics
from prometheus_client.parser import text_string_to_metric_families


def parsed(path):
    """{(sample name, sorted labels): value} and {family name: type} of a textfile."""
    with open(path) as fh:
        families = list(text_string_to_metric_families(fh.read()))
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    return values, {f.name: f.type for f in families}


def test_count_and_read_back(tmp_path):
    run = str(tmp_path / "run")
    metrics.count(run, "n1", [("hits", {"dataset": "imagenet"}, 1)])
    since = metrics.counters(run, "n1")["since"]
    metrics.count(run, "n1", [("hits", {"dataset": "imagenet"}, 1), ("hits", {"dataset": "coco"}, 1),
                              ("staged_seconds", {"dataset": "coco"}, 2.5),
                              ("evictions", {"dataset": "coco", "reason": "idle"}, 1),
                              ("evictions", {"reason": "pressure", "dataset": "coco"}, 2)])
    metrics.count(run, "n2", [("misses", {"dataset": "imagenet"}, 1)])
    record = metrics.counters(run, "n1")
    assert record["counters"] == {"hits": {"imagenet": 2, "coco": 1}, "staged_seconds": {"coco": 2.5},
                                  "evictions": {"coco": {"idle": 1, "pressure": 2}}}
    assert record["node"] == "n1" and record["since"] == since
    assert metrics.counters(run, "n2")["counters"] == {"misses": {"imagenet": 1}}  # per node, one run dir
    assert sorted(metrics.samples(record)) == [
        ("evictions", ("coco", "idle"), 1.0), ("evictions", ("coco", "pressure"), 2.0),
        ("hits", ("coco",), 1.0), ("hits", ("imagenet",), 2.0), ("staged_seconds", ("coco",), 2.5)]
    assert sorted(os.listdir(tmp_path / "run" / "n1")) == ["metrics.json", "metrics.lock"]  # no temporary left
    assert metrics.counters(str(tmp_path / "none"), "n1") == {"counters": {}}
    assert not (tmp_path / "none").exists()


def _increment(run, n):
    for _ in range(n):
        metrics.count(run, "n1", [("hits", {"dataset": "imagenet"}, 1),
                                  ("staged_bytes", {"dataset": "imagenet"}, 10)])


def test_concurrent_processes_lose_no_increment(tmp_path):
    run = str(tmp_path / "run")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_increment, args=(run, 200)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert metrics.counters(run, "n1")["counters"] == {"hits": {"imagenet": 800}, "staged_bytes": {"imagenet": 8000}}


@pytest.mark.parametrize("event, match", [
    (("hit", {"dataset": "coco"}, 1), "unknown metric 'hit'"),
    (("hits_total", {"dataset": "coco"}, 1), "unknown metric"),
    (("hits", {}, 1), "takes labels"),
    (("hits", {"dataset": "coco", "node": "n1"}, 1), "takes labels"),
    (("evictions", {"dataset": "coco"}, 1), "takes labels"),
    (("hits", {"dataset": "../coco"}, 1), "bad dataset label"),
    (("evictions", {"dataset": "coco", "reason": "Old Version"}, 1), "bad reason label"),
    (("hits", {"dataset": "coco"}, -1), "only grows"),
    (("hits", {"dataset": "coco"}, float("nan")), "only grows"),
    (("hits", {"dataset": "coco"}, "1"), "only grows"),
    (("hits", {"dataset": "coco"}), "is \\(name, labels, value\\)"),
])
def test_bad_events_raise_before_counting(tmp_path, event, match):
    run = str(tmp_path / "run")
    with pytest.raises(ValueError, match=match):
        metrics.count(run, "n1", [("hits", {"dataset": "coco"}, 1), event])
    assert not (tmp_path / "run").exists()


def test_bad_node_name_raises(tmp_path):
    with pytest.raises(ValueError, match="node name"):
        metrics.count(str(tmp_path), "../n1", [("hits", {"dataset": "coco"}, 1)])


def test_broken_run_dir_does_not_raise(tmp_path, caplog):
    event = [("hits", {"dataset": "coco"}, 1)]
    caplog.set_level(logging.WARNING, logger="dsstage.node.metrics")
    (tmp_path / "file").write_text("")
    metrics.count(str(tmp_path / "file"), "n1", event)  # not a directory (UnsafeStore)
    metrics.count(str(tmp_path / "file" / "run"), "n1", event)
    run = tmp_path / "run"
    (run / "n1" / "metrics.json" / "x").mkdir(parents=True)  # the rename cannot replace it
    metrics.count(str(run), "n1", event)
    (run / "n2" / "metrics.lock").mkdir(parents=True)  # the lock cannot be opened
    metrics.count(str(run), "n2", event)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4
    assert all("could not count hits for node n" in r.getMessage() for r in warnings)


def test_unwritable_run_dir_does_not_raise(tmp_path, caplog):
    run = tmp_path / "run"
    metrics.count(str(run), "n1", [("hits", {"dataset": "coco"}, 1)])
    # root writes through any mode; a read-only mount is what stops it: /sys is one
    caplog.set_level(logging.WARNING, logger="dsstage.node.metrics")
    metrics.count("/sys/dsstage-metrics-test", "n1", [("hits", {"dataset": "coco"}, 1)])
    assert not os.path.exists("/sys/dsstage-metrics-test")
    assert "could not count" in caplog.text


def test_damaged_counters_start_again(tmp_path):
    run = tmp_path / "run"
    metrics.count(str(run), "n1", [("hits", {"dataset": "coco"}, 1)])
    (run / "n1" / "metrics.json").write_text('{"counters": {"hits": {"coco": "x"}, "misses": [1]}, "since": 5}')
    metrics.count(str(run), "n1", [("hits", {"dataset": "coco"}, 1), ("misses", {"dataset": "coco"}, 1)])
    assert metrics.counters(str(run), "n1")["counters"] == {"hits": {"coco": 1}, "misses": {"coco": 1}}
    (run / "n1" / "metrics.json").write_text("{not json")
    metrics.count(str(run), "n1", [("hits", {"dataset": "coco"}, 1)])
    assert metrics.counters(str(run), "n1")["counters"] == {"hits": {"coco": 1}}


TIERS = [{"tier": "nvme", "capacity": 3_500_000_000_000, "used": 1_200_000_000_000, "reserved": 50_000_000_000,
          "high": 0.9, "low": 0.8},
         {"tier": "ram", "capacity": 200_000_000_000, "used": 0, "reserved": None}]
COPIES = [
    {"tier": "nvme", "dataset": "imagenet", "version": "0123456789abcdef", "state": "ready", "bytes": 150_000_000_000,
     "leases": [{"job_id": "101", "user": "alice", "since": 1.0}, {"job_id": "102", "user": "bob", "since": 2.0}]},
    {"tier": "nvme", "dataset": "imagenet", "version": "fedcba9876543210", "state": "ready", "bytes": 149_000_000_000,
     "leases": ["102", "103"]},
    {"tier": "nvme", "dataset": "coco", "version": "00000000000000aa", "state": "staging", "bytes": 5_000,
     "leases": []},
]


def test_export_writes_what_prometheus_parses(tmp_path):
    run, out = str(tmp_path / "run"), tmp_path / "prom"
    out.mkdir()
    metrics.count(run, "n1", [("hits", {"dataset": "imagenet"}, 1), ("hits", {"dataset": "imagenet"}, 1),
                              ("misses", {"dataset": "coco"}, 1), ("staged_bytes", {"dataset": "coco"}, 5_000),
                              ("staged_seconds", {"dataset": "coco"}, 1.5),
                              ("evictions", {"dataset": "coco", "reason": "make_room"}, 1),
                              ("evicted_bytes", {"dataset": "coco", "reason": "make_room"}, 4_000)])
    metrics.count(run, "n2", [("holds", {"dataset": "coco"}, 1)])
    metrics.export(str(out / "n1.prom"), run, "n1", TIERS, COPIES, now=1_700_000_000.5)
    metrics.export(str(out / "n2.prom"), run, "n2", [], [], now=1_700_000_001.0)
    assert sorted(os.listdir(out)) == ["n1.prom", "n2.prom"]  # renamed into place, no temporary left
    assert stat.S_IMODE(os.stat(out / "n1.prom").st_mode) == 0o644

    values, types = parsed(out / "n1.prom")
    assert values == {
        ("dsstage_hits_total", (("dataset", "imagenet"),)): 2.0,
        ("dsstage_misses_total", (("dataset", "coco"),)): 1.0,
        ("dsstage_staged_bytes_total", (("dataset", "coco"),)): 5000.0,
        ("dsstage_staged_seconds_total", (("dataset", "coco"),)): 1.5,
        ("dsstage_evictions_total", (("dataset", "coco"), ("reason", "make_room"))): 1.0,
        ("dsstage_evicted_bytes_total", (("dataset", "coco"), ("reason", "make_room"))): 4000.0,
        ("dsstage_tier_capacity_bytes", (("tier", "nvme"),)): 3.5e12,
        ("dsstage_tier_capacity_bytes", (("tier", "ram"),)): 2e11,
        ("dsstage_tier_used_bytes", (("tier", "nvme"),)): 1.2e12,
        ("dsstage_tier_used_bytes", (("tier", "ram"),)): 0.0,
        ("dsstage_tier_reserved_bytes", (("tier", "nvme"),)): 5e10,
        ("dsstage_tier_high_watermark_ratio", (("tier", "nvme"),)): 0.9,
        ("dsstage_tier_low_watermark_ratio", (("tier", "nvme"),)): 0.8,
        ("dsstage_copy_bytes", (("dataset", "imagenet"), ("state", "ready"), ("tier", "nvme"),
                                ("version", "0123456789abcdef"))): 1.5e11,
        ("dsstage_copy_bytes", (("dataset", "imagenet"), ("state", "ready"), ("tier", "nvme"),
                                ("version", "fedcba9876543210"))): 1.49e11,
        ("dsstage_copy_bytes", (("dataset", "coco"), ("state", "staging"), ("tier", "nvme"),
                                ("version", "00000000000000aa"))): 5000.0,
        ("dsstage_copies", (("state", "ready"), ("tier", "nvme"))): 2.0,
        ("dsstage_copies", (("state", "staging"), ("tier", "nvme"))): 1.0,
        ("dsstage_leases", (("dataset", "imagenet"), ("tier", "nvme"))): 3.0,  # jobs 101, 102, 103
        ("dsstage_leases", (("dataset", "coco"), ("tier", "nvme"))): 0.0,
        ("dsstage_metrics_updated_timestamp_seconds", ()): 1_700_000_000.5,
    }
    assert types["dsstage_hits"] == "counter" and types["dsstage_copies"] == "gauge"
    assert parsed(out / "n2.prom")[0] == {("dsstage_holds_total", (("dataset", "coco"),)): 1.0,
                                          ("dsstage_metrics_updated_timestamp_seconds", ()): 1_700_000_001.0}

    metrics.count(run, "n1", [("hits", {"dataset": "imagenet"}, 1)])
    metrics.export(str(out / "n1.prom"), run, "n1", [], [])
    values, _ = parsed(out / "n1.prom")
    assert values[("dsstage_hits_total", (("dataset", "imagenet"),))] == 3.0
    assert not any(name.startswith("dsstage_tier_") for name, _ in values)


def test_export_raises_when_the_textfile_cannot_be_written(tmp_path):
    with pytest.raises(OSError):
        metrics.export(str(tmp_path / "missing" / "dsstage.prom"), str(tmp_path / "run"), "n1", [], [])
    assert not (tmp_path / "missing").exists()


def test_counting_imports_neither_prometheus_client_nor_logging(tmp_path):
    """The warm Prolog counts: what it imports is its cost (prometheus_client ~80 ms)."""
    code = ("import sys; from dsstage.node import metrics;"
            "metrics.count(sys.argv[1], 'n1', [('hits', {'dataset': 'coco'}, 1)]);"
            "print(sorted(m for m in ('prometheus_client', 'logging', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
    assert metrics.counters(str(tmp_path / "run"), "n1")["counters"] == {"hits": {"coco": 1}}


DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "packaging", "grafana", "dsstage-dashboard.json")


def test_every_metric_the_grafana_dashboard_queries_is_exported(tmp_path):
    """packaging/grafana/dsstage-dashboard.json: valid, and each series it queries is one a
    node writes (every counter counted once, the gauges of a node with tiers and copies)."""
    import json
    import re
    dash = json.load(open(DASHBOARD))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 12 and all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
    queried = {m for e in exprs for m in re.findall(r"\bdsstage_[a-z_]+", e)}
    run, out = str(tmp_path / "run"), tmp_path / "n1.prom"
    events = [(name, {label: ("make_room" if label == "reason" else "staged" if label == "result"
                              else "prolog" if label == "hook" else "coco")
                      for label in labels}, 1) for name, (labels, _help) in metrics.COUNTERS.items()]
    metrics.count(run, "n1", events, [("hook_seconds", {"hook": "prolog"}, 0.03)])
    metrics.export(str(out), run, "n1", TIERS, COPIES, now=1_700_000_000.0)
    exported = {name for name, _labels in parsed(out)[0]}
    assert queried and not queried - exported, f"queried but never exported: {sorted(queried - exported)}"
    # and the dashboard shows every family a node exports, but none it should not need
    assert {n.removesuffix("_total") for n in exported} <= {n.removesuffix("_total") for n in queried}


def test_hook_durations_are_a_histogram(tmp_path):
    """dsstage_hook_seconds: each hook's duration in its bucket, cumulative on export, with
    its sum and count; a damaged entry starts again; a bad hook label is a bug."""
    run, out = str(tmp_path / "run"), tmp_path / "n1.prom"
    for seconds in (0.03, 0.04, 2.0, 4000.0):
        metrics.count(run, "n1", [], [("hook_seconds", {"hook": "prolog"}, seconds)])
    metrics.count(run, "n1", [("hooks_abandoned", {"hook": "epilog"}, 1)], [("hook_seconds", {"hook": "epilog"}, 7)])
    metrics.export(str(out), run, "n1", [], [], now=1.0)
    values, types = parsed(out)
    assert types["dsstage_hook_seconds"] == "histogram"
    prolog = {dict(labels)["le"]: v for (name, labels), v in values.items()
              if name == "dsstage_hook_seconds_bucket" and dict(labels)["hook"] == "prolog"}
    assert prolog["0.05"] == 2 and prolog["1.0"] == 2 and prolog["2.5"] == 3 and prolog["1800.0"] == 3
    assert prolog["+Inf"] == 4
    assert values[("dsstage_hook_seconds_count", (("hook", "prolog"),))] == 4
    assert values[("dsstage_hook_seconds_sum", (("hook", "prolog"),))] == pytest.approx(4002.07)
    assert values[("dsstage_hooks_abandoned_total", (("hook", "epilog"),))] == 1
    stored = metrics.counters(run, "n1")
    stored["histograms"]["hook_seconds"]["prolog"]["buckets"] = ["x"]
    (tmp_path / "run" / "n1" / "metrics.json").write_text(json.dumps(stored))
    assert [h[0] for h in metrics.histograms(stored)] == ["hook_seconds"]  # the damaged one is skipped
    metrics.count(run, "n1", [], [("hook_seconds", {"hook": "prolog"}, 0.5)])
    again = {h[1]: h[2][-1][1] for h in metrics.histograms(metrics.counters(run, "n1"))}
    assert again == {("epilog",): 1, ("prolog",): 1}
    with pytest.raises(ValueError, match="bad hook label"):
        metrics.count(run, "n1", [], [("hook_seconds", {"hook": "taskprolog"}, 1)])
