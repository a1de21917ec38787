"""The README's first command, `packaging/demo`, on a devcluster of its own with every service
running (demand poller, prefetch and report refresh on each node, peer daemons): each step
of its story holds, as the demo itself checks, and the output shows what the README says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]

CLAIMS = [
    r"check: refused at submit, with a suggestion",
    r"check: job \d+ asked for no node and ran on n3, where sample was ready",
    r"check: job \d+ shared the copy job \d+ staged: nothing was copied again",
    r"check: sample is ready on n2 and job \d+ is still PENDING: staged while it waited",
    r"check: job \d+ started warm: its Prolog found sample cached",
    r"check: the Epilog evicted dropme \(nobody wants it\) and kept keepme \(job \d+ wants it\)",
    r"check: job \d+ ran from the copy the Epilog kept",
    r"check: refused at submit: bigset needs 3 nodes, and the error says so",
    r"check: each node saw only its part \(8 of the 24 files\); together the parts are the whole dataset",
]


def test_the_demo_tells_the_whole_story_and_its_checks_hold(another_devcluster):
    # another_devcluster: skipped where the cluster tests are (not root, DSSTAGE_SKIP_CLUSTER);
    # the demo brings up its own cluster, with the services
    directory = Path(f"/var/tmp/dsstage-demo-test-{os.getpid()}")
    env = dict(os.environ, DEVCLUSTER_DIR=str(directory), DEVCLUSTER_PORT="28817", DEVCLUSTER_SAMPLE_FILES="200")
    env.pop("DEVCLUSTER_SERVICES", None)
    try:
        res = subprocess.run([str(ROOT / "packaging" / "demo")], env=env, text=True, capture_output=True,
                             timeout=900, stdin=subprocess.DEVNULL)
        out = res.stdout
        assert res.returncode == 0, f"{out}\n{res.stderr}"
        for claim in CLAIMS:
            assert re.search(claim, out), f"missing {claim!r} in:\n{out}"
        # the story's own evidence, beside the checks
        assert re.search(r"job \d+: sample staged at .*/nvme/n3/", out)
        assert re.search(r"job \d+: evicted dropme \w+ \(over high watermark", out)
        assert re.search(r"demo keepme \w+ \([^)]*\): kept: wanted by pending job \d+", out)
        assert re.search(r"bigset is [0-9.]+ [kMG]i?B in 6 shards; .*ask for at least 3 nodes \(--nodes=3\)", out), out
        status = out.split("$ dsstage status\n")[1]
        assert re.search(r"bigset +6 shards +6 ready +3 ", status), status
        assert "Datasets on nodes" in status and "Wanted by the queue" in status
        job_answer = out.split("$ dsstage status --job ")[-1]
        assert job_answer.split("\n", 1)[1].startswith("Job "), "status --job prints its paragraph alone"
        assert "Datasets on nodes" not in job_answer
        services = subprocess.run([str(ROOT / "packaging" / "devcluster"), "status"], env=env, text=True,
                                  capture_output=True).stdout
        for name in ("poller", "prefetch.n1", "report.n3", "peers.n2"):
            assert f"{name}: running" in services, services
    finally:
        subprocess.run([str(ROOT / "packaging" / "devcluster"), "down"], env=env, timeout=120)
        leftovers = subprocess.run(["pgrep", "-f", str(directory)], capture_output=True, text=True).stdout.split()
        shutil.rmtree(directory, ignore_errors=True)
    assert not leftovers, f"processes of the demo's cluster outlived down: {leftovers}"
