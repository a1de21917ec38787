"""Which node of a job holds which shards, from what the nodes hold now: the plan a job's
first node records (dsstage.node.jobrecord) and the part a prefetch stages on a pending
job's planned node (dsstage.cluster.prefetch), the same function so that what a prefetch
staged is what the job's plan gives that node. Light: the warm Prolog uses it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsstage.node import report
from dsstage.shards.assign import assign


def plan(state_dir: str, name: str, shard_ids: Sequence[str], nodes: Sequence[str]) -> dict[str, list[str]]:
    """node -> shard ids of ``name`` for a job on ``nodes`` (dsstage.shards.assign), preferring
    what each node's published report shows ready now."""
    return assign(shard_ids, nodes, report.ready_in_reports(state_dir, nodes, name, shard_ids))


def plans(state_dir: str, name: str, shard_ids: Sequence[str],
          jobs: Sequence[Sequence[str]]) -> list[dict[str, list[str]]]:
    """``plan`` for several jobs (each given by its nodes), each node's report read once."""
    everyone = sorted({n for nodes in jobs for n in nodes})
    held = report.ready_in_reports(state_dir, everyone, name, shard_ids)
    return [assign(shard_ids, nodes, {n: held[n] for n in nodes if n in held}) for nodes in jobs]


def replicas(plan: Mapping[str, Sequence[str]], mine: Sequence[str]) -> dict[str, str]:
    """shard id -> the nodes (a Slurm hostlist) that hold it in ``plan``, for each of
    ``mine`` that more than one node holds (a job of more nodes than shards): they share its
    transfer through the peers."""
    from dsstage.hostlist import fold_nodes
    out = {}
    for shard in mine:
        holders = [node for node, ids in plan.items() if shard in ids]
        if len(holders) > 1:
            out[shard] = fold_nodes(holders)
    return out
