"""A dataset larger than one node on a real Slurm: 6 shards on a tier that holds a little more
than half of it. A 1-node job is refused at submit with the node count to ask for; a 2-node
and then a 3-node job each see, on every node, exactly the files of their list, byte-equal to
the source, the lists disjoint and together the whole dataset; the 3-node job stages only what
its new node needs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cluster

FILES = {f"train/part-{i:05d}-of-00024": bytes([i]) * 16384 for i in range(24)}  # 6 shards of 64 KiB
# 240000 B up to the 90 % high watermark: 216000 B a node, room for 3 shards, not for 6
TIER = {"capacity": "240000B", "high_watermark": "90%", "low_watermark": "80%", "root_filesystem": True}

LOOK = ("srun -N{n} -n{n} --ntasks-per-node=1 bash -c '"
        'cd "$DSSTAGE_DATASET_DIR" || exit 1; '
        'echo "NODE $SLURMD_NODENAME $DSSTAGE_SHARDS_BIG $DSSTAGE_NODE_FILES_BIG $DSSTAGE_MIN_FILES_BIG"; '
        'while read -r f; do echo "FILE $SLURMD_NODENAME ${{f#$DSSTAGE_DATASET_DIR/}} '
        '$(md5sum < "$f" | cut -c1-32)"; done < "$DSSTAGE_FILES_BIG"; '
        'echo "ALL $SLURMD_NODENAME $(find . -type f | wc -l)"\'\n')


@pytest.fixture(scope="module")
def big(cluster):
    conf_path = cluster.etc / "dsstage.yaml"
    before = conf_path.read_text()
    conf = yaml.safe_load(before)
    conf["tiers"]["half"] = {"path": str(cluster.dir / "half") + "/{node}", **TIER}
    for spec in conf["datasets"].values():  # a second tier: the others name theirs
        spec.setdefault("tier", "nvme")
    conf_path.write_text(yaml.safe_dump(conf))
    cluster.add_dataset("big", FILES, tier="half", shards=6)
    yield cluster
    conf_path.write_text(before)
    cluster.dsstage("export-catalog", "-o", str(cluster.etc / "dsstage_catalog.lua"))


def parts(out: str) -> dict[str, dict[str, str]]:
    """node -> {relative path: md5} of what each node's task listed and read."""
    got: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        if line.startswith("FILE "):
            _f, node, rel, md5 = line.split()
            got.setdefault(node, {})[rel] = md5
    for line in out.splitlines():
        if line.startswith("ALL "):
            _a, node, count = line.split()
            assert int(count) == len(got.get(node, {})), f"{node}'s view holds other files than its list: {out}"
    return got


def held(cluster, node: str) -> set[str]:
    where = cluster.dir / "half" / node / "datasets" / "big"
    return set(os.listdir(where)) if where.exists() else set()


def run_job(cluster, n: int) -> dict[str, dict[str, str]]:
    job = cluster.submit(f"#SBATCH --dataset=big\n#SBATCH -N {n}\n" + LOOK.format(n=n), user="daemon")
    info = cluster.wait(job)
    assert info["JobState"] == "COMPLETED", (info, cluster.output(job))
    got = parts(cluster.output(job))
    assert len(got) == n, cluster.output(job)
    want = {rel: hashlib.md5(data).hexdigest() for rel, data in FILES.items()}
    seen: dict[str, str] = {}
    for node, files in got.items():
        assert not set(files) & set(seen), f"{node} holds files another node holds: {cluster.output(job)}"
        seen.update(files)
    assert seen == want  # together the whole dataset, byte-equal to the source
    return got


def test_a_dataset_larger_than_a_node_is_spread_over_the_jobs_nodes(big):
    cluster = big
    one = cluster.sbatch("true\n", "--dataset=big", check=False, user="daemon")
    assert one.returncode != 0 and "ask for at least 2 nodes (--nodes=2)" in one.stderr, one.stderr
    first = run_job(cluster, 2)
    before = {node: held(cluster, node) for node in ("n1", "n2", "n3")}
    assert all(len(before[n]) == 3 for n in first) and sum(map(len, before.values())) == 6
    second = run_job(cluster, 3)
    after = {node: held(cluster, node) for node in ("n1", "n2", "n3")}
    new = next(n for n in ("n1", "n2", "n3") if n not in first)
    for node in first:
        assert after[node] == before[node], "a node of the first job staged again"
    assert len(after[new] - before[new]) == 2  # the new node stages its two shards, nothing more
    reused = sum(len(second[n]) for n in first)
    assert reused >= 0.6 * len(FILES), second
    # the same three nodes again: each node's part and view are there, and the warm Prolog
    # (dsstage.hooks.warm, under the real slurmd's environment) answers on every node
    third_job = cluster.submit("#SBATCH --dataset=big\n#SBATCH -N 3\n" + LOOK.format(n=3), user="daemon")
    info = cluster.wait(third_job)
    assert info["JobState"] == "COMPLETED", (info, cluster.output(third_job))
    third = parts(cluster.output(third_job))
    assert {n: set(f) for n, f in third.items()} == {n: set(f) for n, f in second.items()}
    log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
    warm = [line for line in log.splitlines() if f"job {third_job}: big cached at " in line and "(warm path)" in line]
    assert len(warm) == 3, [line for line in log.splitlines() if f"job {third_job}:" in line]
    assert Path(cluster.dir / "half").exists()
