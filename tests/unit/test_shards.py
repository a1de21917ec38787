"""dsstage.shards: a dataset's files split into balanced contiguous shards, and a job's
shards given to its nodes (quotas, reuse of what nodes hold, stability)."""

from __future__ import annotations

import random

import pytest
from dsstage.config.manifest import Entry
from dsstage.errors import ManifestError
from dsstage.shards import assign as a
from dsstage.shards import split as s


def entries(sizes: list[int]) -> list[Entry]:
    return [Entry(f"train-{i:05d}-of-{len(sizes):05d}", size, 0, f"{i:064x}") for i, size in enumerate(sizes)]


@pytest.mark.parametrize("seed", range(20))
def test_shards_are_contiguous_nonempty_and_balanced(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 6, 16, 64])
    files = rng.randint(n, 3000)
    sizes = [rng.choice([0, 1, 100, 10_000, 150_000_000]) if rng.random() < 0.1 else rng.randint(90_000, 130_000)
             for _ in range(files)]
    shards = s.split(entries(sizes), n)
    assert len(shards) == n and shards[0].start == 0 and shards[-1].stop == files
    assert all(x.stop == y.start for x, y in zip(shards, shards[1:])) and all(x.files >= 1 for x in shards)
    assert sum(x.bytes for x in shards) == sum(sizes)
    # each run is within one file of the ideal share of the mixed weight (half bytes, half files)
    total = sum(sizes)
    biggest = max(sizes) / total / 2 + 1 / files / 2 if total else 1 / files
    for x in shards:
        share = (x.bytes / total / 2 if total else 0) + x.files / files / (2 if total else 1)
        assert abs(share - 1 / n) <= 2 * biggest + 1e-9, (x, share)


def test_even_files_split_evenly_and_the_same_everywhere():
    es = entries([1000] * 1024)
    shards = s.split(es, 8)
    assert [x.files for x in shards] == [128] * 8
    assert [x.id for x in shards] == [x.id for x in s.split(list(es), 8)]  # deterministic
    assert len({x.digest for x in shards}) == 8


def test_a_new_version_keeps_the_shards_whose_files_did_not_change():
    es = entries([1000] * 100)
    before = s.split(es, 4)
    changed = list(es)
    changed[90] = changed[90]._replace(hash="f" * 64)  # one file of the last shard changes
    after = s.split(changed, 4)
    assert [x.id for x in before[:3]] == [x.id for x in after[:3]] and before[3].id != after[3].id


def test_fewer_files_than_shards_is_said():
    with pytest.raises(ManifestError, match="3 files cannot be split into 4"):
        s.split(entries([1, 2, 3]), 4, "tiny")


def test_what_a_node_holds_at_most_and_the_least_nodes():
    shards = s.split(entries([100] * 60), 6)  # 6 shards of 1000 bytes
    assert s.per_node_bytes(shards, 2) == 3000 and s.per_node_bytes(shards, 4) == 2000
    assert s.per_node_bytes(shards, 9) == 1000
    assert s.least_nodes(shards, 2500) == 3 and s.least_nodes(shards, 6000) == 1
    assert s.least_nodes(shards, 999) is None


def shard_ids(n: int) -> list[str]:
    return [f"{i:016x}" for i in range(n)]


@pytest.mark.parametrize("n,m", [(6, 2), (6, 3), (6, 4), (1024, 9), (7, 7), (3, 8), (2, 5)])
def test_every_shard_goes_somewhere_within_quotas(n, m):
    shards, nodes = shard_ids(n), [f"n{i}" for i in range(m)]
    got = a.assign(shards, nodes)
    assert set(got) == set(nodes)
    counts = sorted(len(v) for v in got.values())
    assert counts[-1] - counts[0] <= 1 and counts[0] == max(1, n // m)
    assert {x for v in got.values() for x in v} == set(shards)
    if n >= m:  # no replicas: a partition
        assert sum(counts) == n
    else:  # one shard per node, replicas balanced
        per_shard = sorted(sum(x in v for v in got.values()) for x in shards)
        assert per_shard[-1] - per_shard[0] <= 1


def test_shards_a_node_holds_stay_there():
    shards, nodes = shard_ids(6), ["n1", "n2", "n3"]
    held = {"n3": {shards[0], shards[1]}, "n1": {shards[5]}}
    got = a.assign(shards, nodes, held)
    assert {shards[0], shards[1]} <= set(got["n3"]) and shards[5] in got["n1"]
    # a node holding more than its quota keeps as many as its quota allows
    greedy = a.assign(shards, nodes, {"n2": set(shards)})
    assert len(greedy["n2"]) == 2 and all(len(v) == 2 for v in greedy.values())
    # the larger quota goes to the node that holds the most
    assert len(a.assign(shard_ids(7), nodes, {"n3": set(shard_ids(7)[:3])})["n3"]) == 3


def test_a_changed_node_set_moves_few_shards():
    shards = shard_ids(1024)
    nodes = [f"n{i:02d}" for i in range(8)]
    before = a.assign(shards, nodes)
    held = {n: set(v) for n, v in before.items()}
    after = a.assign(shards, [*nodes[1:], "n99"], held)  # one node replaced by another
    moved = sum(1 for n, v in after.items() for x in v if x not in held.get(n, ()))
    assert moved == len(before[nodes[0]])  # only the departed node's shards move
    # without what the nodes hold, rendezvous hashing alone keeps most shards in place
    fresh = a.assign(shards, [*nodes[1:], "n99"])
    kept = sum(1 for n, v in fresh.items() for x in v if x in held.get(n, ()))
    assert kept >= 0.6 * 1024


def test_assignment_is_keyed_by_name_not_order():
    shards = shard_ids(10)
    assert a.assign(shards, ["b", "a", "c"]) == a.assign(shards, ["c", "b", "a"])
    with pytest.raises(ValueError):
        a.assign(shards, [])
    with pytest.raises(ValueError):
        a.assign(shards, ["a", "a"])


def test_how_uneven_a_jobs_parts_get():
    assert s.unevenness(1024, 8) == 0 and s.unevenness(6, 4) == 1.0 and s.unevenness(3, 8) == 0
    assert s.worst_unevenness(1024, 1) == (0.0, 0)
    worst, at = s.worst_unevenness(64, 400)
    assert worst == 1.0 and at >= 33  # 64 shards over 33 to 63 nodes: 1 or 2 shards each
    assert s.worst_unevenness(4000, 40)[0] <= 0.1
