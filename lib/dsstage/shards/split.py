"""A dataset version's files split into N shards, the same on every node.

A shard is a contiguous run of files in manifest order (sorted by path), so that a
dataset's record files (``train-00000-of-01024`` ...) stay together; the runs are balanced
by bytes and by file count at once: each file weighs half its share of the bytes plus half
its share of the files, and the cuts fall where the running weight crosses k/N. A shard's
identity is the BLAKE3 of its manifest lines (``digest``), so a new version of the dataset
that leaves a shard's files as they were leaves that shard as it was, and its copies on the
nodes carry over.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from dsstage.config.manifest import Entry, compute_digest
from dsstage.errors import ManifestError
from dsstage.shards.indexfile import Shard

__all__ = ["Shard", "cuts", "least_nodes", "per_node_bytes", "split", "unevenness", "worst_unevenness"]


def cuts(sizes: Sequence[int], n: int) -> list[int]:
    """The n + 1 boundaries (0 first, len(sizes) last) of n contiguous, non-empty runs of files
    of these sizes, balanced by bytes and by file count; ValueError if there are fewer files
    than runs."""
    files = len(sizes)
    if n < 1 or files < n:
        raise ValueError(f"{files} files cannot be split into {n} non-empty shards")
    total = sum(sizes)
    # weights scaled by 2 * files * total (integers: the same cuts on every machine)
    weights = [s * files + total for s in sizes] if total else [1] * files
    running = list(accumulate(weights))
    whole = running[-1]
    bounds = [0]
    for k in range(1, n):
        # run k - 1 ends at whichever side of the file that crosses k/n of the whole is nearer ...
        target = whole * k / n
        i = bisect_left(running, target)
        before = running[i - 1] if i else 0
        at = i + 1 if running[i] - target <= target - before else i
        # ... unless a run would be empty: each run keeps at least one file, and leaves one for each after it
        bounds.append(min(max(at, bounds[-1] + 1), files - (n - k)))
    bounds.append(files)
    return bounds


def split(entries: Sequence[Entry], n: int, name: str = "") -> list[Shard]:
    """The dataset's ``n`` shards; ManifestError if it has fewer files than shards."""
    try:
        bounds = cuts([e.size for e in entries], n)
    except ValueError as exc:
        raise ManifestError(f"dataset {name!r}: {exc}: lower its shards: setting") from None
    out = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        part = entries[a:b]
        out.append(Shard(i, a, b, b - a, sum(e.size for e in part), compute_digest(part)))
    return out


def per_node_bytes(shards: Sequence[Shard], nodes: int) -> int:
    """The most bytes one of ``nodes`` nodes holds when each holds floor or ceil of
    shards/nodes shards (at least one): the sum of the largest ceil(shards/nodes) shards, a
    bound that holds whichever shards a node gets."""
    if nodes < 1:
        raise ValueError("a job has at least one node")
    most = max(1, -(-len(shards) // nodes))
    return sum(sorted((s.bytes for s in shards), reverse=True)[:most])


def least_nodes(shards: Sequence[Shard], room: int) -> int | None:
    """The fewest nodes that hold every shard when each node has ``room`` bytes for them
    (per_node_bytes), or None if one shard alone does not fit."""
    if not shards or max(s.bytes for s in shards) > room:
        return None
    for nodes in range(1, len(shards) + 1):
        if per_node_bytes(shards, nodes) <= room:
            return nodes
    return len(shards)


def unevenness(shards: int, nodes: int) -> float:
    """How much more one node of a job on ``nodes`` nodes holds than another, in shards: the
    ceil over the floor of shards/nodes, less one (0.5: some nodes hold 50 % more; 0 when it
    divides, or when there are more nodes than shards and each holds one)."""
    low, high = shards // nodes, -(-shards // nodes)
    return 0.0 if low == 0 else high / low - 1


def worst_unevenness(shards: int, largest_job: int) -> tuple[float, int]:
    """The most uneven split over jobs of 2 to ``largest_job`` nodes, and the node count it
    happens at (0.0, 0 when every job size divides evenly, or for one-node jobs only)."""
    worst = (0.0, 0)
    for nodes in range(2, min(largest_job, shards) + 1):
        worst = max(worst, (unevenness(shards, nodes), nodes))
    return worst
