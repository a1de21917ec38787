"""Fleet operations and `status --live` over SSH on the devcluster: a real OpenSSH server
listening on every node's address (the devcluster's nodes have their own loopback addresses,
Slurm's NodeAddr; key auth, a non-default port, stopped by its pid) stands for every node's
sshd (the remote dsstage is told its node with --node). n4 is no node of the cluster: its
name does not resolve, so it is the unreachable node."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from servers import SshServer  # noqa: E402

pytestmark = pytest.mark.cluster

DATASET = "fleetds"
FILES = {f"part{i}/{j:02d}.bin": bytes([i * 16 + j]) * 30_000 for i in range(3) for j in range(10)}


@pytest.fixture(scope="module")
def fleet(cluster, tmp_path_factory) -> Iterator[object]:
    listed = cluster.run("sinfo", "-h", "-N", "-o", "%o").stdout.split()
    sshd = SshServer(tmp_path_factory.mktemp("sshd"), tuple(dict.fromkeys(["127.0.0.1", *listed])))
    conf_path = cluster.etc / "dsstage.yaml"
    original = conf_path.read_text()
    try:
        known = sshd.key.parent / "known_hosts"
        known.write_text(sshd.known_hosts_line + "\n")
        conf = yaml.safe_load(original)
        conf["fleet"] = {"user": "root", "port": sshd.port, "key": str(sshd.key), "known_hosts": str(known),
                         "connect_timeout": 5, "parallel": 4,
                         "command": ["/usr/bin/env", f"DSSTAGE_RUN_DIR={cluster.dir / 'dsstage-run'}",
                                     str(cluster.venv_bin / "dsstage"), "--config", str(conf_path)]}
        conf_path.write_text(yaml.safe_dump(conf))
        os.chmod(conf_path, 0o644)
        cluster.add_dataset(DATASET, FILES)
        yield sshd
    finally:
        conf = yaml.safe_load(conf_path.read_text())
        conf.pop("fleet", None)
        conf_path.write_text(yaml.safe_dump(conf))
        sshd.stop()


def dsstage(cluster, *args: str, check: bool = True):
    return cluster.run(str(cluster.venv_bin / "dsstage"), *args, check=check)


def test_warm_on_three_nodes_and_one_unreachable(cluster, fleet):
    res = dsstage(cluster, "warm", DATASET, "--nodes", "n[1-4]", "--json", check=False)
    assert res.returncode == 1, res.stderr  # one node failed
    out = json.loads(res.stdout)
    assert {n for n, a in out.items() if a["ok"]} == {"n1", "n2", "n3"}
    assert all(out[n]["result"]["action"] in ("staged", "cached") for n in ("n1", "n2", "n3"))
    assert out["n4"]["ok"] is False and "unreachable" in out["n4"]["error"]
    for node in ("n1", "n2", "n3"):
        assert (cluster.dir / "nvme" / node / "datasets" / DATASET).is_dir()
    st = json.loads(cluster.dsstage("status", "--json", "--dataset", DATASET, "--no-queue").stdout)
    ready = {c["node"] for c in st["copies"] if c["state"] == "ready" and c["current"]}
    assert ready == {"n1", "n2", "n3"}
    assert all(not c["leases"] for c in st["copies"])  # warm keeps no lease
    text = dsstage(cluster, "warm", DATASET, "--nodes", "n[1-3]").stdout  # the summary, piped
    assert "3 nodes: 3 ok" in text


def test_status_live_asks_the_nodes(cluster, fleet):
    res = dsstage(cluster, "status", "--live", "--node", "n[1-4]", "--json", "--dataset", DATASET)
    st = json.loads(res.stdout)
    assert sorted(n["node"] for n in st["nodes"]) == ["n1", "n2", "n3"]
    assert list(st["unreachable"]) == ["n4"]
    assert {c["node"] for c in st["copies"] if c["state"] == "ready"} == {"n1", "n2", "n3"}
    plain = dsstage(cluster, "status", "--live", "--node", "n[1-4]", "--no-queue").stdout
    assert "1 unreachable" in plain.splitlines()[0] and "unreachable: " in plain


def test_verify_full_on_the_nodes(cluster, fleet):
    dsstage(cluster, "warm", DATASET, "--nodes", "n[1-3]", "--json")
    out = json.loads(dsstage(cluster, "verify", DATASET, "--nodes", "n[1-3]", "--full", "--json").stdout)
    assert all(a["ok"] and a["result"]["mode"] == "full" for a in out.values()), out
    damaged = cluster.dir / "nvme" / "n2" / "datasets" / DATASET
    victim = next(p for p in sorted(damaged.rglob("*.bin")))
    os.chmod(victim, 0o644)
    victim.write_bytes(b"rotten")  # a disk error on n2
    out = json.loads(dsstage(cluster, "verify", DATASET, "--nodes", "n[1-3]", "--full", "--json").stdout)
    assert out["n2"]["ok"] and out["n2"]["result"]["repaired"] == [str(victim.relative_to(damaged)).split("/", 1)[1]]


def test_evict_refuses_wanted_and_leased_copies(cluster, fleet):
    dsstage(cluster, "warm", DATASET, "--nodes", "n[1-3]", "--json")
    marker = cluster.jobs / "release-fleet"
    leaser = cluster.submit(f"#SBATCH --dataset={DATASET}\n"
                            f"for i in $(seq 600); do [ -e {marker} ] && break; sleep 0.2; done\n", "-w", "n1")
    waiting = cluster.submit(f"#SBATCH --dataset={DATASET}\ntrue\n", "--hold")
    snap = cluster.dir / "dsstage-state" / "demand.json"
    before = snap.read_bytes() if snap.exists() else None
    try:
        leases = cluster.dir / "nvme" / "n1" / "leases" / DATASET
        import time
        deadline = time.monotonic() + 60
        while not (leases / f"{leaser}.json").exists():
            assert time.monotonic() < deadline, "the job never leased the dataset"
            time.sleep(0.2)
        cluster.dsstage("demand-poller", "--once")
        out = json.loads(dsstage(cluster, "evict", DATASET, "--nodes", "n[1-3]", "--json").stdout)
        for node in ("n1", "n2", "n3"):
            assert [e["action"] for e in out[node]["result"]] == ["kept"], out[node]
        assert "not evicted without --force" in out["n2"]["result"][0]["reason"]
        assert "leased by job" in out["n1"]["result"][0]["reason"]
        refused = dsstage(cluster, "evict", DATASET, "--nodes", "n[2-3]", "--force", check=False)
        assert refused.returncode != 0 and "--reason" in refused.stderr
        out = json.loads(dsstage(cluster, "evict", DATASET, "--nodes", "n[1-3]", "--force", "--reason",
                                 "fleet test", "--json").stdout)
        assert out["n1"]["result"][0]["action"] == "kept"  # a lease holds even against --force
        assert [e["action"] for e in out["n2"]["result"]] == ["evicted"]
        assert (leases / f"{leaser}.json").exists()
    finally:
        marker.write_text("go")
        cluster.run("scancel", waiting, check=False)
        if before is None:  # the other tests take their own snapshots, or none
            snap.unlink(missing_ok=True)
        else:
            snap.write_bytes(before)
    assert cluster.wait(leaser)["JobState"] == "COMPLETED"
