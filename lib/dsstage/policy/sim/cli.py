"""``dsstage simulate``: replay a job trace through retention policies and placements, side by side.

A scheduler (FIFO with EASY backfill) places the jobs, cache-unaware or preferring the
nodes that hold a job's dataset, while each policy decides what the nodes' tiers keep, with
or without peers (a stage reads from a node that holds the dataset); the report gives, per
policy, placement and peers, the bytes staged (and staged again beyond each node's first
stage of a dataset, and how many of them the source served), the hit ratio, the queue wait
and the wait that staging causes. The baseline is LRU with unaware placement: a site without dsstage. See
docs/simulation.md for the model, the rules and the keys of ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from dsstage.config.model import HIGH_WATERMARK, LOW_WATERMARK
from dsstage.errors import DsstageError
from dsstage.policy import retention as rt
from dsstage.policy.sim import trace as tr
from dsstage.policy.sim.bound import Bound, lower_bound
from dsstage.policy.sim.planner import Planner, Snapshot
from dsstage.policy.sim.replay import (
    PLACEMENTS,
    JobEnd,
    Lru,
    Offline,
    Policy,
    QueueOracle,
    Result,
    Setup,
    simulate,
)
from dsstage.policy.sim.sched import Schedule, schedule
from dsstage.units import parse_size

POLICIES = ("planner", "lru", "job-end", "queue-oracle", "offline")
#: the policies whose known future is the unaware schedule: replayed with placement unaware only
ORACLES = ("offline",)
#: with placement prefer the schedule depends on the caches: the queue-oracle's known future is
#: the schedule of its previous replay, from the unaware one, until it repeats (at most this many replays)
ORACLE_ROUNDS = 4
PEERS = ("off", "on")
QUEUE_ORACLE_METHOD = ("Belady farthest-next-use over the pending queue only (each submitted job's start and "
                       "nodes known as they will happen, nothing of jobs not yet submitted; copies no submitted "
                       "job uses go first, least recently used first): a feasible policy, so an UPPER bound on "
                       "what the best queue-aware policy stages: the planner's target")
OFFLINE_METHOD = ("Belady farthest-next-use (future requests per node known; evict the copy needed "
                  "farthest ahead, never-again first): a feasible policy, so an UPPER bound on the optimum")
BOUND_METHOD = ("fractional relaxation (a copy may be kept in part) of the offline problem, solved exactly by "
                "interval packing (FOO-style flow, byte cost): a LOWER bound on the optimum and on every policy "
                "(but for requests it counts as no room)")
#: the project's goal, reported as met or not: the planner with placement prefer against the
#: baseline (LRU, unaware) in bytes staged again, and in mean queue wait
GOAL_VS_BASELINE, GOAL_WAIT = 0.6, 1.02
BASELINE = ("lru", "unaware")

#: a row's key: policy, placement, peers (off or on)
Key = tuple[str, str, str]

#: the bounded wait the simulator measures by default (what the example suggests a site turns on)
WAIT_FOR_DATA = 1800.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsstage simulate",
        description="Replay a job trace through retention policies (dsstage's planner, LRU, job-end clean-up, "
                    "an offline policy) and placements (cache-unaware, or preferring the nodes that hold a job's "
                    "dataset) on a simulated cluster and compare the bytes they stage and the waits.")
    t = p.add_argument_group("trace")
    t.add_argument("--trace", metavar="FILE", help="an SWF log (.swf or .swf.gz); default: a generated trace")
    t.add_argument("--seed", type=int, default=1, help="seed of the generated trace and the dataset rule (1)")
    t.add_argument("--jobs", type=int, default=3000, help="jobs of the generated trace (3000)")
    t.add_argument("--load", type=float, default=0.9, help="offered load of the generated trace (0.9)")
    t.add_argument("--datasets", type=int, default=40, help="datasets in the catalogue (40)")
    t.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of dataset popularity (1.0)")
    t.add_argument("--size-median", default="300GB", help="median dataset size (300GB)")
    t.add_argument("--size-sigma", type=float, default=1.0, help="sigma of the lognormal sizes (1.0)")
    t.add_argument("--size-min", default="50GB", help="smallest dataset (50GB)")
    t.add_argument("--size-max", default="4TB", help="largest dataset (4TB)")
    t.add_argument("--other-dataset", type=float, default=0.1, metavar="P",
                   help="SWF: probability that a job reads another dataset than its user's (0.1)")
    t.add_argument("--cores-per-node", type=int, default=2, help="SWF: processors per node (2)")
    t.add_argument("--start", type=int, default=0, metavar="N", help="SWF: skip the first N job records")
    t.add_argument("--limit", type=int, metavar="N", help="SWF: replay at most N jobs")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, help="nodes (16 for a generated trace; SWF: MaxProcs / --cores-per-node)")
    c.add_argument("--capacity", default="0.33", metavar="SIZE|FRACTION",
                   help="tier size per node: a size (3.5TB) or a fraction <= 1 of the working set, the bytes of "
                        "the datasets the trace uses (0.33)")
    c.add_argument("--bandwidth", default="2GB", metavar="SIZE",
                   help="staging bandwidth per node, per second (2GB)")
    c.add_argument("--peers", default="both", metavar="off|on|both",
                   help="on: a stage reads from another node that holds the dataset (ready or arriving), the "
                        "source only for a dataset no node holds, as dsstage's peers across jobs do; off: every "
                        "stage reads the source; both (the default)")
    c.add_argument("--peer-bandwidth", metavar="SIZE",
                   help="with peers: the bandwidth of a stage from a peer, per second (default: --bandwidth)")
    c.add_argument("--backfill-depth", type=int, default=100, help="pending jobs the scheduler backfills (100)")
    c.add_argument("--placement", default="both", metavar="unaware|prefer|both",
                   help="unaware: the scheduler ignores the caches; prefer: a job starts on free nodes that hold "
                        "its dataset (their ds_<dataset> feature, as the poller last set it) where there are "
                        "enough, anywhere otherwise, as Slurm does with dsstage's --prefer; both (the default)")
    c.add_argument("--wait-for-data", type=float, default=WAIT_FOR_DATA, metavar="SECONDS",
                   help="with prefer: a job the poller saw pending waits for the nodes that hold its dataset when "
                        "enough of them do and are free or expected (by their jobs' time limits) to be free within "
                        f"SECONDS, at most SECONDS in all, as placement.wait_for_data makes it on a cluster "
                        f"({WAIT_FOR_DATA:g}, the value a site turns it on with; off by default there); 0: never, "
                        "as Slurm's --prefer alone")
    r = p.add_argument_group("policies")
    r.add_argument("--policies", default=",".join(POLICIES), help=f"which, comma-separated ({','.join(POLICIES)})")
    r.add_argument("--no-bound", action="store_true", help="do not compute the lower bound")
    r.add_argument("--high", type=float, default=HIGH_WATERMARK,
                   help=f"planner: high watermark ({HIGH_WATERMARK}, the configuration's default)")
    r.add_argument("--low", type=float, default=LOW_WATERMARK,
                   help=f"planner: low watermark ({LOW_WATERMARK}, the configuration's default)")
    r.add_argument("--min-keep", type=float, default=rt.Policy().min_keep,
                   help="planner: seconds a used copy is safe from eviction for space (600)")
    r.add_argument("--snapshot-interval", type=float, default=30.0, metavar="SECONDS",
                   help="the poller's round: the demand snapshot and the nodes' features are taken every "
                        "SECONDS of simulated time; 0: fresh at every call (30, the poller's default)")
    r.add_argument("--demand-max-age", type=float, default=300.0, metavar="SECONDS",
                   help="planner: an older snapshot is stale and counts for nothing (300)")
    r.add_argument("--last-copy", action=argparse.BooleanOptionalAction, default=True,
                   help="planner, with peers: the snapshot says which nodes hold each dataset, and a node evicts "
                        "a copy other nodes hold before the one the cluster keeps of each version, whatever the "
                        "demand (retention.keeper), as dsstage does with peers.enabled (on)")
    r.add_argument("--plan-depth", type=int, default=100, metavar="N",
                   help="planner: the first N pending jobs have an expected start and planned nodes in the "
                        "snapshot, the others none (100, like Slurm's bf_max_job_test)")
    p.add_argument("--json", action="store_true", help="machine-readable output (keys in docs/simulation.md)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dsstage simulate``; the exit code."""
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except DsstageError as exc:
        print(f"dsstage simulate: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0


class OptionError(DsstageError):
    """An option of ``dsstage simulate`` is out of range."""

    exit_code = 2


def load_trace(args: argparse.Namespace) -> tr.Trace:
    try:
        sizes = tr.SizeModel(parse_size(args.size_median), args.size_sigma, parse_size(args.size_min),
                             parse_size(args.size_max))
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    if args.datasets < 1:
        raise OptionError("--datasets must be at least 1")
    draws = tr.Draws(args.datasets, args.zipf_s, args.seed, sizes)
    if args.trace:
        return tr.read_swf(args.trace, nodes=args.nodes, cores_per_node=args.cores_per_node, draws=draws,
                           other=args.other_dataset, start=args.start, limit=args.limit)
    return tr.generate(jobs=args.jobs, nodes=args.nodes or 16, draws=draws, load=args.load)


def capacity_of(text: str, working_set: int) -> tuple[int, float]:
    """(bytes, fraction of the working set) from ``--capacity``: a bare number up to 1 is a
    fraction, anything else a size."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if 0 < value <= 1:
        return int(value * working_set), value
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise OptionError(f"--capacity: {exc}, or a fraction of the working set such as 0.33") from None
    if size <= 0:
        raise OptionError("--capacity must be positive")
    return size, size / working_set if working_set else 0.0


def make_policy(name: str, args: argparse.Namespace, sched: Schedule, capacity: int, peers: bool = False) -> Policy:
    """A fresh policy; ``sched``: the schedule an oracle knows; ``peers``: the planner's
    snapshot carries which nodes hold each dataset (``--last-copy``)."""
    if name == "lru":
        return Lru()
    if name == "job-end":
        return JobEnd()
    if name == "offline":
        return Offline(sched.runs)
    if name == "queue-oracle":
        return QueueOracle(sched.runs)
    snapshot = Snapshot(args.snapshot_interval, args.plan_depth, args.demand_max_age, peers and args.last_copy)
    return Planner(sched.nodes, sched.slots_per_node, capacity, high=args.high, low=args.low,
                   policy=rt.Policy(min_keep=args.min_keep), snapshot=snapshot)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load, schedule, replay; the report as plain data (what ``--json`` prints)."""
    t0 = time.perf_counter()
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise OptionError(f"unknown policy {', '.join(unknown) or '(none)'}: choose from {', '.join(POLICIES)}")
    if args.placement not in (*PLACEMENTS, "both"):
        raise OptionError(f"unknown placement {args.placement}: choose from {', '.join(PLACEMENTS)} or both")
    if not 0 < args.low < args.high <= 1:
        raise OptionError("the watermarks must satisfy 0 < --low < --high <= 1")
    try:
        bandwidth = parse_size(args.bandwidth)
    except ValueError as exc:
        raise OptionError(f"--bandwidth: {exc}") from None
    if bandwidth <= 0:
        raise OptionError("--bandwidth must be positive")
    if args.peers not in (*PEERS, "both"):
        raise OptionError(f"unknown --peers {args.peers}: choose from off, on or both")
    try:
        peer_bandwidth = parse_size(args.peer_bandwidth) if args.peer_bandwidth else bandwidth
    except ValueError as exc:
        raise OptionError(f"--peer-bandwidth: {exc}") from None
    if peer_bandwidth <= 0:
        raise OptionError("--peer-bandwidth must be positive")
    if not 0 <= args.wait_for_data < float("inf"):
        raise OptionError("--wait-for-data must be a number of seconds, 0 or more")
    trace = load_trace(args)
    t_trace = time.perf_counter() - t0
    working_set = trace.working_set()
    capacity, fraction = capacity_of(args.capacity, working_set)
    t1 = time.perf_counter()
    sched = schedule(trace.jobs, trace.nodes, trace.slots_per_node, args.backfill_depth)
    t_sched = time.perf_counter() - t1
    placements = PLACEMENTS if args.placement == "both" else (args.placement,)
    peers = PEERS if args.peers == "both" else (args.peers,)
    results: dict[Key, Result] = {}
    extra: dict[Key, dict[str, Any]] = {}
    for key in ((n, p, q) for q in peers for p in placements for n in names):
        name, placement, peer = key
        if name in ORACLES and placement != "unaware":
            continue  # the known future is the unaware schedule's
        known, happened = sched, False  # the future an oracle knows; whether it was the one that happened
        for rounds in range(1, ORACLE_ROUNDS + 1):
            policy = make_policy(name, args, known, capacity, peer == "on")
            setup = Setup(placement, args.snapshot_interval, args.backfill_depth, args.wait_for_data,
                          peer_bandwidth if peer == "on" else None)
            res, out = simulate(trace.jobs, trace.nodes, trace.slots_per_node, trace.sizes, capacity, bandwidth,
                                policy, setup)
            happened = out.runs == known.runs
            if name != "queue-oracle" or happened:
                break
            known = out
        if name == "queue-oracle":
            extra[key] = {"replays": rounds, "future_as_it_happened": happened}
        results[key] = res
        if isinstance(policy, Planner):
            extra[key] = {
                "plan_calls": policy.calls,
                "planned_jobs": policy.planned_jobs,
                "planned_nodes_right": (policy.planned_nodes_right / policy.planned_jobs
                                        if policy.planned_jobs else None),
            }
    bound: Bound | None = None
    t_bound = 0.0
    if not args.no_bound:
        t2 = time.perf_counter()
        bound = lower_bound(sched, trace.sizes, capacity)
        t_bound = time.perf_counter() - t2
    cluster = {"nodes": trace.nodes, "slots_per_node": trace.slots_per_node, "capacity_bytes": capacity,
               "capacity_fraction": fraction, "bandwidth_bytes_per_s": bandwidth,
               "peer_bandwidth_bytes_per_s": peer_bandwidth}
    return _report(args, trace, sched, working_set, cluster, (results, extra, bound),
                   {"trace": t_trace, "schedule": t_sched, "bound": t_bound, "total": time.perf_counter() - t0})


def _goal(results: dict[Key, Result], extra: dict[Key, dict[str, Any]], bound: Bound | None) -> dict[str, Any]:
    """Each row against the baseline (LRU, unaware, peers off), and the planner against the
    queue-oracle: the share of the gap between LRU and the queue-oracle it closes (unaware)."""
    goal: dict[str, Any] = {"baseline": "/".join(BASELINE), "planner_prefer_vs_baseline_max": GOAL_VS_BASELINE,
                            "wait_vs_baseline_max": GOAL_WAIT}
    base = results.get((*BASELINE, "off"))
    if base is None:
        return goal
    for (name, placement, peers), r in results.items():
        tag = f"{name}_{placement}" + ("_peers" if peers == "on" else "")
        goal[f"{tag}_vs_baseline"] = r.bytes_staged_again / base.bytes_staged_again if base.bytes_staged_again \
            else None
        goal[f"{tag}_wait_vs_baseline"] = r.queue_wait_mean / base.queue_wait_mean if base.queue_wait_mean else None
        if peers == "on":
            goal[f"{tag}_source_vs_baseline"] = r.bytes_from_source / base.bytes_from_source \
                if base.bytes_from_source else None
            goal[f"{tag}_source_vs_first_ever"] = r.bytes_from_source / r.bytes_first_ever \
                if r.bytes_first_ever else None
    best = results.get(("planner", "prefer", "off"))
    if bound is not None and best is not None and bound.bytes_staged_again:
        goal["planner_prefer_vs_bound"] = best.bytes_staged_again / bound.bytes_staged_again
    for placement in PLACEMENTS:
        planner, lru, oracle = (results.get((n, placement, "off")) for n in ("planner", "lru", "queue-oracle"))
        if planner is not None and lru is not None and oracle is not None:
            gap = lru.bytes_staged_again - oracle.bytes_staged_again
            closed = (lru.bytes_staged_again - planner.bytes_staged_again) / gap if gap > 0 else None
            # against an oracle whose known future was not what happened: no bound, an estimate
            exact = extra.get(("queue-oracle", placement, "off"), {}).get("future_as_it_happened", True)
            goal[f"planner_{placement}_gap_closed"] = closed if exact else None
            goal[f"planner_{placement}_gap_closed_approx"] = None if exact else closed
    return goal


def _report(args: argparse.Namespace, trace: tr.Trace, sched: Schedule, working_set: int,
            cluster: dict[str, Any], found: tuple[dict[Key, Result], dict[Key, dict[str, Any]], Bound | None],
            seconds: dict[str, float]) -> dict[str, Any]:
    results, extra, bound = found
    rows: list[dict[str, Any]] = []
    for (name, placement, peers), r in results.items():
        row: dict[str, Any] = {
            "policy": name,
            "placement": placement,
            "peers": peers,
            "bytes_staged": r.bytes_staged,
            "bytes_from_source": r.bytes_from_source,
            "bytes_from_peers": r.bytes_from_peers,
            "bytes_staged_again": r.bytes_staged_again,
            "bytes_compulsory": r.bytes_compulsory,
            "bytes_first_ever": r.bytes_first_ever,
            "requests": r.requests,
            "hits": r.hits,
            "hit_ratio": r.hit_ratio,
            "wait_mean_s": r.queue_wait_mean,
            "wait_p95_s": r.queue_wait_p95,
            "stage_wait_total_s": r.wait_total,
            "stage_wait_mean_s": r.wait_mean,
            "stage_wait_max_s": r.wait_max,
            "jobs_delayed": r.jobs_delayed,
            "stages": r.requests - r.hits,
            "stages_evicting": r.stages_evicting,
            "jobs_on_preferred_nodes": r.on_preferred if placement == "prefer" else None,
            "jobs_waited_for_data": r.waited_for_data if placement == "prefer" else None,
            "evictions": r.evictions,
            "bytes_evicted": r.bytes_evicted,
            "bypassed": r.bypassed,
            "no_room": r.no_room,
            "seconds": r.seconds,
        }
        if name == "offline":
            row.update(method="belady-farthest-next-use", bound_on_optimum="upper")
        row.update(extra.get((name, placement, peers), {}))
        if name == "queue-oracle":  # a bound only where the future it knew is the one that happened
            row.update(method="belady-over-the-queue",
                       bound_on_queue_aware_optimum="upper" if row.get("future_as_it_happened") else None)
        rows.append(row)
    return {
        "trace": {
            "source": trace.source,
            "file": args.trace,
            "seed": args.seed,
            "jobs": len(trace.jobs),
            "skipped": trace.skipped,
            "datasets": len(trace.sizes),
            "datasets_used": len({j.dataset for j in trace.jobs}),
            "working_set_bytes": working_set,
            "rules": trace.rules,
        },
        "cluster": cluster,
        "scheduler": {
            "method": "FIFO with EASY backfill; planned nodes from running jobs' time limits; the figures below "
                      "are the unaware schedule's (the offline policy's and the bound's)",
            "placements": list(dict.fromkeys(p for _, p, _ in results)),
            "backfill_depth": args.backfill_depth,
            "wait_for_data_s": args.wait_for_data,
            "backfilled": sched.backfilled,
            "mean_queue_wait_s": sched.mean_wait(),
            "max_queue": sched.max_queue,
            "utilisation": sched.utilisation(),
        },
        "planner": {
            "high": args.high, "low": args.low, "min_keep_s": args.min_keep,
            "snapshot_interval_s": args.snapshot_interval, "demand_max_age_s": args.demand_max_age,
            "plan_depth": args.plan_depth, "last_copy_with_peers": args.last_copy,
        },
        "rows": rows,
        "offline_method": OFFLINE_METHOD,
        "queue_oracle_method": QUEUE_ORACLE_METHOD,
        "bound": None if bound is None else {
            "method": BOUND_METHOD,
            "bound_on_optimum": "lower",
            "bytes_staged": bound.bytes_staged,
            "bytes_staged_again": bound.bytes_staged_again,
            "bytes_compulsory": bound.bytes_compulsory,
            "gaps": bound.gaps,
            "gap_bytes_kept": bound.gap_bytes_kept,
        },
        "goal": _goal(results, extra, bound),
        "seconds": seconds,
    }


def _tb(n: float) -> str:
    return f"{n / 1e12:,.1f} TB"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(rep: dict[str, Any]) -> str:
    """The report as text: the trace's rules, then one row per policy and placement."""
    tr_, cl, sc, pl = rep["trace"], rep["cluster"], rep["scheduler"], rep["planner"]
    out = ["trace:"] + [f"  {line}" for line in tr_["rules"]]
    out.append(f"  working set {_tb(tr_['working_set_bytes'])} ({tr_['datasets_used']} of {tr_['datasets']} "
               f"datasets), {tr_['jobs']} jobs")
    out.append(f"cluster: {cl['nodes']} nodes x {cl['slots_per_node']} slots; tier {_tb(cl['capacity_bytes'])} "
               f"per node ({cl['capacity_fraction']:.2f} of the working set); staging "
               f"{cl['bandwidth_bytes_per_s'] / 1e9:g} GB/s per node from the source, "
               f"{cl['peer_bandwidth_bytes_per_s'] / 1e9:g} GB/s from a peer, one stage at a time")
    waits = f" (a job waits up to {sc['wait_for_data_s']:g} s for its data's nodes)" if sc["wait_for_data_s"] else ""
    out.append(f"scheduler: FIFO with EASY backfill, placement {' and '.join(sc['placements'])}{waits}; "
               f"unaware: mean queue wait {sc['mean_queue_wait_s'] / 3600:.2f} h, longest queue {sc['max_queue']}, "
               f"{sc['backfilled']} backfilled, utilisation {sc['utilisation']:.0%}")
    out.append(f"planner: retention.plan, watermarks {pl['high']:.0%}/{pl['low']:.0%}, "
               f"min_keep {pl['min_keep_s']:g} s, snapshot every {pl['snapshot_interval_s']:g} s, "
               f"first {pl['plan_depth']} pending jobs planned")
    out.append("")
    head = ("policy", "placement", "peers", "staged", "staged again", "vs base", "from source", "hit ratio",
            "queue wait", "p95", "stage wait", "jobs delayed", "evictions", "bypassed", "no room")
    rows = []
    base = next((r for r in rep["rows"] if (r["policy"], r["placement"], r["peers"]) == (*BASELINE, "off")), None)
    again = base["bytes_staged_again"] if base else None
    for r in rep["rows"]:
        rows.append((r["policy"], r["placement"], r["peers"], _tb(r["bytes_staged"]), _tb(r["bytes_staged_again"]),
                     _ratio(r["bytes_staged_again"] / again) if again else "-", _tb(r["bytes_from_source"]),
                     f"{r['hit_ratio']:.3f}",
                     f"{r['wait_mean_s'] / 3600:,.2f} h", f"{r['wait_p95_s'] / 3600:,.1f} h",
                     f"{r['stage_wait_mean_s']:,.0f} s", str(r["jobs_delayed"]), str(r["evictions"]),
                     str(r["bypassed"]), str(r["no_room"])))
    b = rep["bound"]
    if b is not None:
        rows.append(("bound", "unaware", "-", _tb(b["bytes_staged"]), _tb(b["bytes_staged_again"]),
                     _ratio(b["bytes_staged_again"] / again) if again else "-", "-", "-", "-", "-", "-", "-", "-",
                     "-", "-"))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    out.append(fmt(head))
    out.extend(fmt(r) for r in rows)
    out.append("")
    out.append(f"base: {'/'.join(BASELINE)}, what a site has without dsstage; queue wait: mean submission to start, "
               "p95 its 95th percentile; stage wait: per job, start until its data is on all its nodes")
    if any(r["policy"] == "queue-oracle" for r in rep["rows"]):
        out.append(f"queue-oracle: {rep['queue_oracle_method']}")
    if any(r["policy"] == "offline" for r in rep["rows"]):
        out.append(f"offline: {rep['offline_method']}")
    if b is not None:
        out.append(f"bound: {b['method']}")
    g = rep["goal"]
    if g.get("planner_prefer_vs_baseline") is not None:
        x, w = g["planner_prefer_vs_baseline"], g.get("planner_prefer_wait_vs_baseline")
        met = x <= GOAL_VS_BASELINE and (w is None or w <= GOAL_WAIT)
        text = (f"goal: planner/prefer stages {x:.2f}x the base's bytes again (<= {GOAL_VS_BASELINE})"
                + (f", mean queue wait {w:.3f}x the base's (<= {GOAL_WAIT})" if w is not None else "")
                + f": {'met' if met else 'NOT met'}")
        lru = g.get("lru_prefer_vs_baseline")
        if lru is not None:
            text += f"; lru/prefer {lru:.2f}x (what placement alone gives)"
        out.append(text)
    for placement in PLACEMENTS:
        closed, approx = g.get(f"planner_{placement}_gap_closed"), g.get(f"planner_{placement}_gap_closed_approx")
        if closed is not None or approx is not None:
            out.append(f"queue-oracle gap: planner/{placement} closes {(closed if closed is not None else approx):.0%} "
                       f"of the gap between lru/{placement} and the queue-oracle in bytes staged again"
                       + ("" if closed is not None else " (an estimate: the queue-oracle's known future with "
                                                          "prefer did not repeat, so it is no bound there)"))
    if g.get("planner_prefer_peers_source_vs_baseline") is not None:
        out.append(f"peers: planner/prefer with peers reads {g['planner_prefer_peers_source_vs_baseline']:.2f}x "
                   "the base's bytes from the source"
                   + (f", {g['planner_prefer_peers_source_vs_first_ever']:.2f}x the first read of each dataset "
                      "(the least any policy reads)" if g.get("planner_prefer_peers_source_vs_first_ever") else ""))
    for r in rep["rows"]:
        if r["policy"] == "planner" and r["peers"] == "off":
            right = r.get("planned_nodes_right")
            out.append(f"planner/{r['placement']}: {r.get('plan_calls', 0)} calls of retention.plan; "
                       f"{r.get('planned_jobs', 0)} jobs had planned nodes before they started"
                       + (f", {right:.0%} of their nodes as planned" if right is not None else "")
                       + (f"; {r['jobs_on_preferred_nodes']} jobs started on nodes that held their data"
                          if r.get("jobs_on_preferred_nodes") is not None else "")
                       + (f"; {r['jobs_waited_for_data']} waited for them"
                          if r.get("jobs_waited_for_data") else ""))
    s = rep["seconds"]
    out.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in s.items() if k != "total")
               + "; " + ", ".join(f"{r['policy']}/{r['placement']}{'/peers' if r['peers'] == 'on' else ''} "
                                  f"{r['seconds']:.1f} s" for r in rep["rows"])
               + f"; total {s['total']:.1f} s")
    return "\n".join(out)
