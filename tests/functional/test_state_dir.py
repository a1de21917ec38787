"""The shared state directory's layout (dsstage.node.statedir): `dsstage state-dir init` makes
it and gives each directory its writer; check-config tries each as that writer and names the
fix. (Where NFS squashes root, the writer is report.user: nobody here stands for it.)"""

from __future__ import annotations

import json
import os
import pwd

import pytest
from helpers import Env, reachable_above

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown and the writers' identities need root")


@pytest.fixture
def reachable(env: Env):
    with reachable_above(env.state):
        yield


def test_state_dir_init_gives_each_directory_its_writer_and_check_config_tries_them(env: Env, reachable):
    env.extra["report"] = {"user": "nobody"}
    env.extra["burst_buffer"] = {"user": "daemon"}
    env.add("coco", {"a": b"1"})
    env.write()
    out = json.loads(env.cli("state-dir", "init", "--json").stdout)
    assert any(line.startswith("made ") for line in out["done"]), out
    nobody, daemon = pwd.getpwnam("nobody").pw_uid, pwd.getpwnam("daemon").pw_uid
    for rel in ("", "nodes", "jobs", "staging", "sources", "budget", "manifests"):
        st = (env.state / rel).stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (nobody, 0o755), rel
    assert (env.state / "bb").stat().st_uid == daemon
    assert json.loads(env.cli("state-dir", "init", "--json").stdout)["done"] == []  # nothing left to do
    res = env.cli("check-config", "--json", check=False)
    assert not [p for p in json.loads(res.stdout)["problems"] if p["key"].startswith("state_dir")], res.stdout
    # the layout an older guide gave: jobs/ root's, so the nodes (as nobody) cannot record a job
    os.chown(env.state / "jobs", 0, 0)
    res = env.cli("check-config", check=False)
    assert res.returncode != 0, res.stdout
    assert f"state_dir/jobs: {env.state / 'jobs'} (a multi-node job's versions, hold claim and shard plan) cannot " \
           "be written by nobody" in res.stderr and "dsstage state-dir init" in res.stderr, res.stderr
    assert not [p for p in os.listdir(env.state / "jobs") if p.startswith(".dsstage-probe")]
