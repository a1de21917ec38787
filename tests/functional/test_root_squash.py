"""The shared state directory on an NFS export with root_squash, emulated: a latencyfs mount
with ``squash`` (every request as its caller, root served as 65534), over a backing directory
that stands for the server's disk, laid out there by `dsstage state-dir init` as an admin
does on the NFS server. report.user is daemon. The poller acts, `disable` works, a multi-node
job records its plan, old manifests are pruned and the nodes read a PrivateData snapshot;
with the layout an older guide gave (only nodes/ given to report.user), they fail, which is
how the emulation shows it squashes."""

from __future__ import annotations

import json
import os
import pwd
import time
from pathlib import Path

import pytest
from helpers import Env, reachable_above
from latencyfs import LatencyFS, require

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts and identities need root")


@pytest.fixture
def squashed(env: Env, tmp_path: Path):
    """env's state_dir on an emulated root_squash export; the layout made on its backing
    directory (the server) with `dsstage state-dir init`; dataset coco built there too."""
    require()
    backing = tmp_path / "server"
    env.extra["report"] = {"user": "daemon"}
    env.extra["retention"] = {"manifest_keep": "1s"}
    env.add("coco", {"a": b"1" * 100})
    env.state = backing
    env.write()
    with reachable_above(backing):
        env.cli("state-dir", "init")
        env.cli("manifest", "build", "coco")  # where it is built (a data mover, not squashed)
        daemon = pwd.getpwnam("daemon")
        for p in (backing / "manifests").rglob("*"):
            os.chown(p, daemon.pw_uid, daemon.pw_gid)  # its builder's, as `manifest build` run as report.user leaves it
        with LatencyFS(backing, tmp_path / "nfs", delay_us=0, squash=True) as fs:
            env.state = Path(fs.mountpoint)
            env.write()
            yield fs


def test_root_is_squashed_on_the_emulated_export(env: Env, squashed: LatencyFS):
    with pytest.raises(PermissionError):
        (env.state / "root-was-here").write_text("x")  # root writes as nobody there
    from dsstage.fs.identity import writing_as
    with writing_as("daemon"):
        (env.state / "daemon-was-here").write_text("x")
    assert (Path(squashed.backing) / "daemon-was-here").stat().st_uid == pwd.getpwnam("daemon").pw_uid


def test_the_poller_acts_and_writes_a_private_snapshot_the_nodes_read(env: Env, squashed: LatencyFS,
                                                                      monkeypatch):
    from dsstage import privatedata
    from dsstage.cluster import leader, poller
    from dsstage.slurm.fake import FakeSlurm
    from dsstage.slurm.records import Job
    monkeypatch.setattr(privatedata, "hides_jobs", lambda: True)  # PrivateData=jobs: demand.json 0600
    conf = env.config()
    fake = FakeSlurm()
    fake.submit(Job("7", "alice", "PENDING", ("coco",), admin_comment="dsstage=coco"))

    def stop(_s: float) -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        poller.run(conf, fake, sleep=stop, me=leader.Me("ctl1", 100), lease_age=lambda _d, _me: None)
    served = Path(squashed.backing)
    daemon = pwd.getpwnam("daemon").pw_uid
    assert (served / "poller.json").stat().st_uid == daemon  # it held the lease: it acted
    snap = served / "demand.json"
    assert snap.stat().st_uid == daemon and snap.stat().st_mode & 0o777 == 0o600
    with pytest.raises(PermissionError):
        (env.state / "demand.json").read_text()  # root on a node: squashed, and the file is daemon's alone
    dem, read = env.store().demand()  # the nodes read it as report.user
    assert read.time and not dem.stale and "coco" in read.datasets


def test_disable_and_enable_work_on_the_export(env: Env, squashed: LatencyFS):
    env.cli("disable", "--reason", "NFS maintenance")
    record = json.loads((Path(squashed.backing) / "disabled.json").read_text())
    assert record["reason"] == "NFS maintenance"
    env.cli("enable")
    assert not (Path(squashed.backing) / "disabled.json").exists()


def test_a_multi_node_job_records_its_versions_and_plan(env: Env, squashed: LatencyFS):
    from dsstage.node import jobrecord
    state = str(env.state)
    assert jobrecord.pin(state, "7", "n[1-2]", "n1", {"coco": "a" * 64}, "daemon") == {"coco": "a" * 64}
    assert jobrecord.pin(state, "7", "n[1-2]", "n2", {"coco": "b" * 64}, "daemon") == {"coco": "a" * 64}
    assert jobrecord.claim_hold(state, "7", "n[1-2]", "n2", "daemon") == (True, "n2")
    plans = jobrecord.plan_for(state, "7", ["n1", "n2"], "n1", {"coco": ["s1", "s2"]}, "daemon")
    assert sorted(s for ids in plans["coco"].values() for s in ids) == ["s1", "s2"]
    # the layout an older guide gave: jobs/ root's on the server; root on the node is squashed
    os.chown(Path(squashed.backing) / "jobs", 0, 0)
    from dsstage.errors import StateError
    with pytest.raises(StateError, match="failed recording job 8's versions"):
        jobrecord.pin(state, "8", "n[1-2]", "n1", {"coco": "a" * 64}, "daemon")


def test_old_manifests_are_pruned_as_their_directorys_owner(env: Env, squashed: LatencyFS):
    from dsstage.cluster import manifests_gc
    served = Path(squashed.backing) / "manifests" / "coco"
    old = served / ("e" * 64 + ".manifest")
    current = next(p for p in served.iterdir() if p.name.endswith(".manifest"))
    old.write_bytes(current.read_bytes())
    os.chown(old, pwd.getpwnam("daemon").pw_uid, -1)
    past = time.time() - 3600
    os.utime(served / "CURRENT", (past, past))
    removed = manifests_gc.prune(env.config(), time.time())
    assert ("coco", "e" * 64) in removed and not old.exists()


def test_check_config_names_a_directory_its_writer_cannot_write(env: Env, squashed: LatencyFS):
    res = env.cli("check-config", "--json", check=False)
    assert not [p for p in json.loads(res.stdout)["problems"] if p["key"].startswith("state_dir")], res.stdout
    os.chown(Path(squashed.backing) / "budget", 0, 0)
    time.sleep(1.2)  # the emulated client's attribute cache (attr_timeout=1)
    res = env.cli("check-config", check=False)
    assert res.returncode != 0 and "state_dir/budget" in res.stderr and "cannot be written by daemon" in res.stderr
