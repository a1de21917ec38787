"""The cluster's load, not one job's: an array of one-node jobs on eight cold nodes of a
devcluster of its own (each node on its own loopback address, its peer daemon bound there),
reading a dataset from a counting source (latencyfs, 4 MB/s, uncached: the nodes never share
a read through this machine's page cache, as separate NFS clients do not): the shared
filesystem serves the dataset about once, not once per node."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

NODES = 8
FILES = {f"part{i % 4}/f{i:03d}.bin": os.urandom(30_000 + 17 * i) for i in range(160)}


@pytest.fixture(scope="module")
def eight(request):
    """A devcluster of eight nodes, and a latencyfs source mounted before it starts (a series'
    root sees only the mounts that were there when its slurmd started)."""
    import latencyfs
    from conftest import devcluster, skip_without_cluster
    skip_without_cluster()
    latencyfs.require()
    top = Path(f"/tmp/dsstage-scale-{os.getpid()}")
    for rel, data in FILES.items():
        p = top / "backing" / "wave" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    try:
        with latencyfs.LatencyFS(top / "backing", top / "mnt", delay_us=0, rate=4_000_000,
                                 extra_options="uncached") as fs, \
                devcluster("dsstage-scale-test", 27817, nodes=NODES, sample_files=20) as cluster:
            cluster.wavefs = fs
            yield cluster
    finally:
        shutil.rmtree(top, ignore_errors=True)


def run_array(cluster, name: str) -> tuple[list[tuple[str, ...]], float]:
    """An array of eight one-node exclusive jobs on ``name``: each task's stage line from the
    hooks' log, and the seconds from submission until the last task ended."""
    t = time.monotonic()
    job = cluster.submit(f"#SBATCH --dataset={name}\n#SBATCH --array=1-{NODES}\n#SBATCH -N 1\n#SBATCH --exclusive\n"
                         'test -n "$DSSTAGE_DATASET_DIR" && ls -R "$DSSTAGE_DATASET_DIR" | wc -l\n')
    deadline = time.monotonic() + 300
    while cluster.run("squeue", "-h", "-j", job, "-o", "%i").stdout.strip():
        assert time.monotonic() < deadline, cluster.run("squeue", "-h", "-j", job).stdout
        time.sleep(0.5)
    took = time.monotonic() - t
    log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
    staged = re.findall(rf"job (\d+): {name} staged at \S+/nvme/(n\d+)/\S+ in \S+ \((\d+) files, (\d+) bytes from "
                        r"the source; (\d+) files, (\d+) bytes from peers\)", log)
    assert len(staged) == NODES and len({n for _j, n, *_ in staged}) == NODES, log[-4000:]
    return staged, took


def test_an_array_of_one_node_jobs_on_eight_cold_nodes_reads_the_source_once(eight, request):
    """With peers on, the source serves the dataset about once; the baseline, the same array
    on a copy of the dataset with peers off in the same run, once per node."""
    cluster, fs = eight, eight.wavefs
    total = sum(len(v) for v in FILES.values())
    cluster.add_dataset("wave", {}, src=Path(fs.mountpoint) / "wave")
    fs.reset()
    staged, took = run_array(cluster, "wave")
    from_source = sum(int(b) for _j, _n, _f, b, _pf, _pb in staged)
    served = fs.stats()["bytes_read"]
    assert from_source <= 1.1 * total, (from_source, total, staged)  # one read per node: 8x
    assert served <= 1.1 * total, fs.stats()
    for node in sorted({n for _j, n, *_ in staged}):
        assert cluster.dsstage("--node", node, "verify", "wave", "--full").returncode == 0
    # the baseline, same run: peers off, another name for the same files (nothing cached)
    import yaml
    conf_path = cluster.etc / "dsstage.yaml"
    original = conf_path.read_text()
    request.addfinalizer(lambda: conf_path.write_text(original))
    conf = yaml.safe_load(original)
    conf["peers"]["enabled"] = False
    conf_path.write_text(yaml.safe_dump(conf))
    cluster.add_dataset("wave0", {}, src=Path(fs.mountpoint) / "wave")
    fs.reset()
    _staged0, took0 = run_array(cluster, "wave0")
    served0 = fs.stats()["bytes_read"]
    assert served0 >= 4 * total, served0  # the count works: without peers every node reads it
    print(f"\narray of {NODES} one-node jobs on cold nodes, source at 4 MB/s: the source served "
          f"{served / total:.2f}x the dataset with peers ({took:.1f} s to the last task's end), "
          f"{served0 / total:.2f}x without ({took0:.1f} s)")
