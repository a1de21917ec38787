"""A job's shards given to its nodes, decided once per job.

Each of the job's M nodes gets floor(N/M) or ceil(N/M) of the N shards (one each when there
are more nodes than shards: the shards are then replicated, each on floor(M/N) or
ceil(M/N) nodes). A shard goes first to a node of the job that holds it already (from an
earlier job or a prefetch), within that node's quota; the rest by rendezvous hashing (the
node with the highest hash of shard and node name that has room), so that a shard returns
to the same node whenever that node is in a job, and a node set that changes a little moves
only the shards of the nodes that changed. Keyed by node name, never by task rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence, Set


def score(shard: str, node: str) -> int:
    """The rendezvous weight of ``shard`` on ``node``: the same on every machine and run."""
    return int.from_bytes(hashlib.blake2b(f"{shard}\0{node}".encode(), digest_size=8).digest(), "big")


def quotas(shards: int, nodes: Sequence[str], holding: Mapping[str, int] | None = None) -> dict[str, int]:
    """How many shards each node gets: floor or ceil of shards/nodes (at least one). The
    larger quotas go where they save a transfer: to the nodes that hold the most of the
    shards (``holding``: node -> how many), then in name order."""
    holding = holding or {}
    ordered = sorted(nodes, key=lambda n: (-holding.get(n, 0), n))
    base, extra = divmod(shards, len(ordered))
    if base == 0:
        return dict.fromkeys(ordered, 1)
    return {n: base + (i < extra) for i, n in enumerate(ordered)}


def assign(shards: Sequence[str], nodes: Sequence[str],
           held: Mapping[str, Set[str]] | None = None) -> dict[str, list[str]]:
    """node -> the shard ids it holds for the job, in shard order. ``held``: node -> the
    shard ids it holds ready now. Every shard goes to at least one node."""
    if not nodes:
        raise ValueError("a job has at least one node")
    if len(set(shards)) != len(shards) or len(set(nodes)) != len(nodes):
        raise ValueError("shard ids and node names must be distinct")
    held = held or {}
    order = {s: i for i, s in enumerate(shards)}
    if len(nodes) > len(shards):
        return _replicated(shards, nodes, held, order)
    wanted = set(shards)
    room = quotas(len(shards), nodes, {n: len(wanted & set(held.get(n, ()))) for n in nodes})
    got: dict[str, list[str]] = {n: [] for n in nodes}
    left = []
    for shard in shards:  # first, each shard to a node that holds it, the best-scored one with room
        holders = sorted((n for n in nodes if shard in held.get(n, ())), key=lambda n: -score(shard, n))
        to = next((n for n in holders if len(got[n]) < room[n]), None)
        if to is None:
            left.append(shard)
        else:
            got[to].append(shard)
    for shard in left:  # then by rendezvous hashing among the nodes with room
        to = max((n for n in nodes if len(got[n]) < room[n]), key=lambda n: score(shard, n))
        got[to].append(shard)
    return {n: sorted(v, key=order.__getitem__) for n, v in got.items()}


def _replicated(shards: Sequence[str], nodes: Sequence[str], held: Mapping[str, Set[str]],
                order: Mapping[str, int]) -> dict[str, list[str]]:
    """More nodes than shards: one shard per node, each shard on floor or ceil of nodes/shards nodes."""
    copies = quotas(len(nodes), shards)  # shard -> how many nodes hold it
    got: dict[str, list[str]] = {}
    count = dict.fromkeys(shards, 0)
    # first, each shard on the nodes that hold it (the best-scored ones, within its copies)
    for shard in shards:
        for n in sorted((n for n in nodes if shard in held.get(n, ())), key=lambda n: -score(shard, n)):
            if n not in got and count[shard] < copies[shard]:
                got[n] = [shard]
                count[shard] += 1
    # then every shard to at least one node, then the rest of the nodes, by rendezvous hashing
    for shard in sorted(shards, key=lambda s: (count[s], order[s])):
        if count[shard] == 0:
            free = [n for n in nodes if n not in got]
            n = max(free, key=lambda n: score(shard, n))
            got[n] = [shard]
            count[shard] += 1
    for n in sorted((n for n in nodes if n not in got)):
        shard = max((s for s in shards if count[s] < copies[s]), key=lambda s: score(s, n))
        got[n] = [shard]
        count[shard] += 1
    return {n: got[n] for n in nodes}


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
