"""An upgrade one node at a time on a real Slurm (issue 54, item 5): two nodes on the previous
release (packaging/releases, built from the checkout's git history by packaging/devcluster's
DEVCLUSTER_PREVIOUS_NODES) and one on this checkout run multi-node jobs, whole and sharded,
fetching from each other; then the next node is upgraded and keeps its copies; then every
node is rolled back to the previous release and keeps them too."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import dsstage
import pytest
import yaml
from conftest import ROOT, hangable_mount
from helpers import releases

pytestmark = pytest.mark.cluster

FILES = {f"train/part-{i:05d}-of-00012": bytes([i + 1]) * 8192 for i in range(12)}  # 3 shards

WHOLE = ("srun -N3 -n3 --ntasks-per-node=1 bash -c '"
         'cd "$DSSTAGE_DATASET_DIR" && echo "WHOLE $SLURMD_NODENAME $(find . -type f | wc -l)"\'\n')
SHARDED = ("srun -N3 -n3 --ntasks-per-node=1 bash -c '"
           'while read -r f; do echo "FILE $SLURMD_NODENAME ${f#$DSSTAGE_DATASET_DIR/} '
           '$(md5sum < "$f" | cut -c1-32)"; done < "$DSSTAGE_FILES_PARTS"\'\n')


def previous_release() -> tuple[str, str]:
    """The last release packaging/releases lists: its version and commit."""
    listed = releases()
    assert listed, "packaging/releases lists no release: nothing to upgrade from"
    version, commit, _day = listed[-1]
    return version, commit


def versions(c) -> dict[str, str]:
    """node -> the dsstage its published report says wrote it."""
    out = {}
    for node in ("n1", "n2", "n3"):
        report = json.loads((c.dir / "dsstage-state" / "nodes" / f"{node}.json").read_text())
        out[node] = report.get("dsstage")
    return out


def hook_lines(c, job: str) -> list[str]:
    return [x for x in (c.dir / "log" / "dsstage-hooks.log").read_text().splitlines() if f" job {job}: " in x]


def run_whole(c, name: str = "sample", files: int | None = None) -> str:
    job = c.submit(f"#SBATCH --dataset={name}\n#SBATCH -N3\n" + WHOLE, user="daemon")
    info = c.wait(job)
    out = c.output(job)
    assert info["JobState"] == "COMPLETED", (info, out, hook_lines(c, job))
    if files is None:
        files = sum(1 for p in (c.dir / "data" / name).rglob("*") if p.is_file())
    seen = dict(re.findall(r"^WHOLE (\S+) (\d+)$", out, re.M))
    assert seen == {n: str(files) for n in ("n1", "n2", "n3")}, out  # every node its whole local copy
    return job


def run_sharded(c) -> str:
    job = c.submit("#SBATCH --dataset=parts\n#SBATCH -N3\n" + SHARDED, user="daemon")
    info = c.wait(job)
    out = c.output(job)
    assert info["JobState"] == "COMPLETED", (info, out, hook_lines(c, job))
    got: dict[str, str] = {}
    nodes = set()
    for node, rel, md5 in re.findall(r"^FILE (\S+) (\S+) (\S+)$", out, re.M):
        assert rel not in got, f"{rel} listed on two nodes: {out}"
        got[rel] = md5
        nodes.add(node)
    assert nodes == {"n1", "n2", "n3"}, out  # one plan for the job, a part on each node
    assert got == {rel: hashlib.md5(data).hexdigest() for rel, data in FILES.items()}, out
    return job


def test_an_upgrade_one_node_at_a_time_and_a_rollback(another_devcluster):
    version, commit = previous_release()
    shipped = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:lib/dsstage/__init__.py"],
                             capture_output=True, text=True)
    assert shipped.returncode == 0, f"the previous release's commit is not in this checkout's history: {shipped.stderr}"
    assert f'__version__ = "{version}"' in shipped.stdout
    assert version != dsstage.__version__
    import latencyfs
    latencyfs.require()
    with hangable_mount("dsstage-upgrade-slow", rate=256 << 10, allow_other=True) as slow, \
            another_devcluster("dsstage-upgrade-test", 30817, sample_files=40, previous="n1,n2") as c:
        assert slow is not None, "mounted where latencyfs runs"
        c.add_dataset("parts", FILES, shards=3)

        # halfway: n1 and n2 on the previous release, n3 on this one; n1 writes the sharded
        # job's plan that n3 reads, and each node fetches from the others
        whole = run_whole(c)
        assert versions(c) == {"n1": version, "n2": version, "n3": dsstage.__version__}
        assert any("from peers" in x for x in hook_lines(c, whole)), hook_lines(c, whole)
        run_sharded(c)
        # the source's budget, the cluster's, of one request in flight: without peers each node
        # stages from a slow source in turn, the two that wait counting the grant of the one
        # that reads (of the other release, for one of them at least), and all give it back
        conf = yaml.safe_load((c.etc / "dsstage.yaml").read_text())
        c.configure(peers={**conf["peers"], "enabled": False},
                    sources={"slow": {"prefix": f"{slow.mountpoint}/", "max_in_flight": 1}})
        files = {f"f{i:03d}": bytes([i]) * 16384 for i in range(40)}  # 640 KiB: 2.5 s at 256 KiB/s
        for rel, data in files.items():
            (Path(slow.backing) / "cold" / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(slow.backing) / "cold" / rel).write_bytes(data)
        c.add_dataset("cold", {}, src=Path(slow.mountpoint) / "cold")
        job = run_whole(c, "cold", len(files))
        lines = hook_lines(c, job)
        took = [x for x in lines if "at most 1 request(s) in flight from this stage (sources.slow: 1 in " in x]
        waited = [x for x in lines if "all 1 request(s) in flight are taken by other stages: waiting" in x]
        assert (len(took), len(waited)) == (3, 2), lines
        assert not list((c.dir / "dsstage-state" / "budget" / "slow").glob("*.json"))
        c.configure(peers=conf["peers"], sources=None)
        status = c.dsstage("status", "--json")
        assert {n["node"]: n["dsstage"] for n in json.loads(status.stdout)["nodes"]} == versions(c)
        text = c.dsstage("status", "--no-queue").stdout
        assert f"dsstage {version} on n[1-2], {dsstage.__version__} on n3" in text.splitlines()[0]

        # the next step: n1 upgraded; its copies (written by the previous release) are reused
        said = c.up_again(PREVIOUS_NODES="n2")
        assert f"n2 on the previous release, dsstage {version}" in said
        whole = run_whole(c)
        assert versions(c) == {"n1": dsstage.__version__, "n2": version, "n3": dsstage.__version__}
        assert sum("sample cached at" in x for x in hook_lines(c, whole)) == 3, hook_lines(c, whole)
        run_sharded(c)

        # a rollback: every node back on the previous release, which takes what this one wrote
        c.up_again(PREVIOUS_NODES="n1,n2,n3")
        whole = run_whole(c)
        assert versions(c) == dict.fromkeys(("n1", "n2", "n3"), version)
        assert sum("sample cached at" in x for x in hook_lines(c, whole)) == 3, hook_lines(c, whole)
        run_sharded(c)
