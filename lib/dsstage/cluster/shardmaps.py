"""Which node of a job holds (or, for a pending job, would hold) which shards of its sharded
datasets: what ``dsstage status --job`` adds to its answer for such a job.

A running job's plan is the one its first node recorded (``<state_dir>/jobs/<job>.shards.json``,
dsstage.node.jobrecord); a pending job planned on nodes gets the plan its first node would
make now (dsstage.node.shardplan, from the nodes' published reports), which may still change
with what the nodes hold when it starts. Shards are shown by number, in shard order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsstage.config.manifest import Catalog
from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.hostlist import fold_nodes
from dsstage.node import jobrecord
from dsstage.shards import index as shard_index

#: nodes named in the sentence; the rest are counted (``status --json`` has them all)
SHOWN = 8


def for_job(conf: Config, job: Mapping[str, Any], planned: Sequence[str]) -> dict[str, dict[str, Any]]:
    """dataset -> {"recorded": bool, "nodes": {node: [shard numbers]}} for the job's sharded
    datasets whose map is known; a dataset whose map cannot be worked out is left out."""
    out: dict[str, dict[str, Any]] = {}
    job_id = str(job.get("job_id") or "")
    running = job.get("state") == "running"
    # read and checked as the job's nodes read them (one reader of the records: node.jobrecord)
    versions, plans = jobrecord.recorded(conf.state_dir, job_id, planned, conf.report.user)
    recorded = plans if running else None
    catalog = Catalog(conf.state_dir)
    for name in job.get("datasets") or ():
        ds = conf.datasets.get(name)
        if ds is None or not ds.shards or not planned:
            continue
        try:
            version = str(versions.get(name) or catalog.require_current(name))
            index = shard_index.load(catalog, name, version, ds.shards)
        except (DsstageError, OSError):
            continue
        number = {s.id: s.index for s in index.shards}
        plan = recorded.get(name) if isinstance(recorded, dict) else None
        made = not isinstance(plan, dict)
        if made and running and len(planned) == 1:  # a one-node job holds every shard; nothing is recorded
            plan, made = {planned[0]: list(number)}, False
        elif made:
            plan = jobrecord.plan(conf.state_dir, name, list(number), list(planned))
        assert isinstance(plan, dict)
        out[name] = {"recorded": not made,
                     "nodes": {str(n): sorted(number[s] for s in ids if s in number) for n, ids in plan.items()
                               if isinstance(ids, list)}}
    return out


def sentence(name: str, entry: Mapping[str, Any]) -> str:
    """``bigset's shards by node: n1 0,3; n2 1,2; n3 4,5.`` (a pending job: "would be")."""
    by_node = entry["nodes"]
    groups: dict[str, list[str]] = {}
    for node, numbers in by_node.items():
        groups.setdefault(_ranges(numbers), []).append(node)
    parts = sorted((fold_nodes(nodes), numbers) for numbers, nodes in groups.items())
    shown = "; ".join(f"{nodes} {numbers}" for nodes, numbers in parts[:SHOWN])
    more = f"; and {len(parts) - SHOWN} more (status --json has them all)" if len(parts) > SHOWN else ""
    how = "shards by node" if entry["recorded"] else "shards by node, as its plan would be if it started now"
    return f"{name}'s {how}: {shown}{more}."


def _ranges(numbers: Sequence[int]) -> str:
    """0,1,2,5 -> "0-2,5"."""
    out: list[tuple[int, int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out) or "none"

