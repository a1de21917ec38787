"""`#SBATCH --dataset=` end to end on a real Slurm (three slurmd on this machine)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from dsstage.config import manifest as config_manifest

pytestmark = pytest.mark.cluster

HASH_JOB = """#SBATCH --dataset=sample
{extra}
python3 - <<'EOF'
import hashlib, json, os
root = os.environ.get("DSSTAGE_DATASET_DIR", "")
files = {{}}
for d, _, names in os.walk(root):
    for n in names:
        p = os.path.join(d, n)
        files[os.path.relpath(p, root)] = open(p, "rb").read()
print(json.dumps({{"dir": root, "sample": os.environ.get("DSSTAGE_PATH_SAMPLE"),
                  "node": os.environ.get("SLURMD_NODENAME"), "count": len(files),
                  "sizes": {{k: len(v) for k, v in files.items()}}}}))
EOF
{after}
"""


def hash_job(extra: str = "", after: str = "") -> str:
    return HASH_JOB.format(extra=extra, after=after)


def manifest_of(cluster, name: str) -> config_manifest.Manifest:
    return config_manifest.Catalog(str(cluster.dir / "dsstage-state")).load(name)


def test_job_reads_the_verified_local_copy(cluster):
    job = cluster.submit(hash_job(), "-w", "n1")
    assert cluster.wait(job)["JobState"] == "COMPLETED"
    seen = json.loads(cluster.output(job).strip().splitlines()[-1])
    assert seen["node"] == "n1"
    assert seen["dir"] == seen["sample"]
    assert seen["dir"].startswith(str(cluster.dir / "nvme" / "n1" / "datasets" / "sample") + "/")
    m = manifest_of(cluster, "sample")
    assert seen["sizes"] == {e.path: e.size for e in m.entries}
    # the job read what the manifest names: re-hash the copy it saw
    import blake3
    for e in m.entries[:50]:
        assert blake3.blake3((Path(seen["dir"]) / e.path).read_bytes()).hexdigest() == e.hash


def test_two_jobs_on_one_node_share_one_copy(cluster):
    marker = cluster.dir / "jobs" / "release-share"
    wait_marker = f"for i in $(seq 300); do [ -e {marker} ] && break; sleep 0.2; done"
    a = cluster.submit(hash_job(after=wait_marker), "-w", "n2")
    b = cluster.submit(hash_job(after=wait_marker), "-w", "n2")
    leases = cluster.dir / "nvme" / "n2" / "leases" / "sample"
    try:
        for _ in range(300):
            if leases.exists() and {p.stem for p in leases.iterdir()} >= {a, b}:
                break
            import time
            time.sleep(0.2)
        assert {p.stem for p in leases.iterdir()} >= {a, b}, "both running jobs hold a lease"
    finally:
        marker.write_text("go")
    assert cluster.wait(a)["JobState"] == cluster.wait(b)["JobState"] == "COMPLETED"
    seen_a = json.loads(cluster.output(a).strip().splitlines()[-1])
    seen_b = json.loads(cluster.output(b).strip().splitlines()[-1])
    assert seen_a["dir"] == seen_b["dir"]
    versions = os.listdir(cluster.dir / "nvme" / "n2" / "datasets" / "sample")
    assert len(versions) == 1
    log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
    ours = [line for line in log.splitlines() if f"job {a}:" in line or f"job {b}:" in line]
    staged = [line for line in ours if "sample staged" in line]
    cached = [line for line in ours if "sample cached" in line]
    assert len(staged) == 1 and len(cached) == 1, log[-2000:]
    # the Epilog released both leases
    assert not leases.exists() or not ({p.stem for p in leases.iterdir()} & {a, b})


def test_unknown_dataset_is_rejected_by_sbatch(cluster):
    res = cluster.sbatch("true\n", "--dataset=sampel", check=False)
    assert res.returncode != 0
    assert "sbatch: error: dsstage: unknown dataset 'sampel' (did you mean 'sample'?)" in res.stderr


@pytest.mark.parametrize("value,needle", [
    ("../etc", "dataset names use lower-case letters"),
    ("sample,", "empty dataset name"),
])
def test_malformed_dataset_values_are_rejected(cluster, value, needle):
    res = cluster.sbatch("true\n", f"--dataset={value}", check=False)
    assert res.returncode != 0 and needle in res.stderr


def test_forbidden_dataset_is_rejected(cluster):
    cluster.add_dataset("private", {"a.bin": b"p" * 100}, groups=["daemon"])
    res = cluster.sbatch("true\n", "--dataset=private", check=False, user="nobody")
    assert res.returncode != 0
    assert "dsstage: dataset 'private' is restricted to group(s) daemon; you are in none of them" in res.stderr
    ok = cluster.sbatch("true\n", "--dataset=private", user="daemon")
    assert ok.returncode == 0


def test_unreadable_source_with_fallback_runs_from_the_source_and_node_stays_up(cluster):
    src = cluster.add_dataset("flaky", {"x/1.bin": b"1" * 1000})
    gone = Path(str(src) + ".away")
    src.rename(gone)
    try:
        job = cluster.submit("#SBATCH --dataset=flaky\necho DIR=$DSSTAGE_DATASET_DIR\n", "-w", "n3")
        assert cluster.wait(job)["JobState"] == "COMPLETED"
    finally:
        gone.rename(src)
    out = cluster.output(job)
    assert "dsstage: warning: could not stage 'flaky'" in out and "is not reachable from this node" in out
    assert f"DIR={src}\n" in out
    assert cluster.node_state("n3") == "idle"


def test_unreadable_source_with_hold_requeues_and_holds(cluster):
    src = cluster.add_dataset("strict", {"x/1.bin": b"1" * 1000}, on_failure="hold")
    gone = Path(str(src) + ".away")
    src.rename(gone)
    try:
        job = cluster.submit("#SBATCH --dataset=strict\necho RAN\n", "-w", "n3")
        info = cluster.wait(job, held=True)
    finally:
        gone.rename(src)
    assert info["JobState"] == "PENDING" and "held" in info["Reason"].lower()
    # the reason goes where only admins write (the user's Comment stays theirs): see test_hold.py
    reason = info.get("AdminComment", "")
    assert "dsstage held this job" in reason and "is not reachable from this node" in reason
    assert cluster.node_state("n3") == "idle"
    assert not (cluster.jobs / f"{job}.out").exists() or "RAN" not in cluster.output(job)
    # once the source is back, releasing the job is all it takes
    cluster.run("scontrol", "release", job)
    cluster.start_now(job, "n3")  # skip Slurm's requeue delay, not in the kill's second
    assert cluster.wait(job)["JobState"] == "COMPLETED"
    assert "RAN" in cluster.output(job)


def test_a_source_that_stops_answering_costs_the_budget_not_the_node(cluster):
    """The source's reads hang (latencyfs ``hang``: a hard NFS mount whose server is gone).
    slurmd's Prolog ends within prolog_budget (the hook leaves its blocked work behind), the
    job runs on its fallback with the reason, and the node stays up; the next job probes the
    source once; once the source answers, the first job after the breaker's cooldown stages it."""
    import latencyfs
    latencyfs.require()
    fs = cluster.hangfs
    assert fs is not None, "the cluster fixture mounts it where latencyfs runs"
    files = {"a.bin": b"a" * 3000, "d/b.bin": b"b" * 200_000}
    for rel, data in files.items():
        (Path(fs.backing) / "hung" / rel).parent.mkdir(parents=True, exist_ok=True)
        (Path(fs.backing) / "hung" / rel).write_bytes(data)
    src = Path(fs.mountpoint) / "hung"
    cluster.add_dataset("hung", {}, src=src, on_failure="fallback")
    before = cluster.configure(prolog_budget=15)
    fs.hang()
    try:
        t = time.monotonic()
        job = cluster.submit("#SBATCH --dataset=hung\necho DIR=$DSSTAGE_DATASET_DIR\n", "-w", "n3")
        info = cluster.wait(job, timeout=120)
        took = time.monotonic() - t
        # its hook tripped the source's breaker: the next job, on another node, pays a probe at most
        t = time.monotonic()
        second = cluster.submit("#SBATCH --dataset=hung\necho DIR=$DSSTAGE_DATASET_DIR\n", "-w", "n2")
        second_info = cluster.wait(second, timeout=120)
        second_took = time.monotonic() - t
    finally:
        fs.answer()
        cluster.configure(**before)
    assert second_info["JobState"] == "COMPLETED", second_info
    assert "the breaker of dataset.hung is open" in cluster.output(second), cluster.output(second)
    assert second_took < took and second_took < 30, (second_took, took)
    assert info["JobState"] == "COMPLETED", info
    out = cluster.output(job)
    assert f"DIR={src}\n" in out, out
    assert "did not finish within prolog_budget (15s)" in out and "stopped answering" in out, out
    assert took < 60, took  # the Prolog gave up after 10 s; without the bound it waits for the source
    assert cluster.node_state("n3") == "idle"
    # the second job's failed probe cooled the breaker down (dsstage.node.breaker.COOLDOWN): no
    # node probes before its end, and the first stage after it probes, closes it and stages
    from dsstage.node import breaker
    record = breaker.read(str(cluster.dir / "dsstage-state"), "dataset.hung")
    assert record is not None and record.get("failed_probes") == 1, record
    time.sleep(max(0.0, float(record["probe_after"]) - time.time()))
    again = cluster.submit("#SBATCH --dataset=hung\necho DIR=$DSSTAGE_DATASET_DIR\n", "-w", "n3")
    assert cluster.wait(again)["JobState"] == "COMPLETED"
    staged = cluster.output(again).split("DIR=", 1)[1].split("\n", 1)[0]
    assert staged != str(src) and "/datasets/hung/" in staged, cluster.output(again)


def test_multi_node_job_gets_the_dataset_on_every_node(cluster):
    job = cluster.submit("#SBATCH --dataset=sample\n#SBATCH -N 3\n"
                         "srun -N 3 -n 3 bash -c 'echo $SLURMD_NODENAME=$DSSTAGE_DATASET_DIR "
                         "$(find $DSSTAGE_DATASET_DIR -type f | wc -l)'\n")
    assert cluster.wait(job)["JobState"] == "COMPLETED"
    lines = sorted(line for line in cluster.output(job).splitlines() if "=" in line)
    m = manifest_of(cluster, "sample")
    assert len(lines) == 3
    for node, line in zip(["n1", "n2", "n3"], lines):
        name, rest = line.split("=", 1)
        path, count = rest.split()
        assert name == node
        assert path.startswith(str(cluster.dir / "nvme" / node / "datasets" / "sample") + "/")
        assert int(count) == m.files


def test_a_three_node_job_reads_its_dataset_from_the_source_once(cluster):
    """peers are on in the devcluster: each node's Prolog copies a share from the source and
    fetches the others' from their daemons; every copy ends verified."""
    import re
    files = {f"part{i % 4}/f{i:03d}.bin": os.urandom(50_000 + i) for i in range(120)}
    cluster.add_dataset("fanout", files)
    job = cluster.submit("#SBATCH --dataset=fanout\n#SBATCH -N 3\nsrun -N 3 -n 3 true\n")
    assert cluster.wait(job)["JobState"] == "COMPLETED"
    log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
    staged = re.findall(rf"job {job}: fanout staged at \S+/nvme/(n\d)/\S+ in \S+ \((\d+) files, (\d+) bytes from "
                        r"the source; (\d+) files, (\d+) bytes from peers\)", log)
    assert sorted(n for n, *_ in staged) == ["n1", "n2", "n3"], log[-3000:]
    total = sum(len(v) for v in files.values())
    assert sum(int(b) for _n, _f, b, _pf, _pb in staged) == total  # the source served it once
    for node, sf, _sb, pf, _pb in staged:
        assert int(pf) > 0 and int(sf) + int(pf) == len(files), staged
        verify = json.loads(cluster.dsstage("--node", node, "verify", "fanout", "--full", "--json").stdout)
        assert verify["ok"] is True, verify


def test_a_later_job_on_another_node_fetches_from_the_node_that_holds_the_dataset(cluster):
    """Peers across jobs: a one-node job stages on n1; a one-node job of its own on n2 then
    reads nothing from the source: n1's published report shows the copy ready, and n2 fetches
    every file from n1's daemon, verified."""
    import re
    files = {f"part{i % 3}/f{i:03d}.bin": os.urandom(40_000 + i) for i in range(60)}
    cluster.add_dataset("across", files)
    first = cluster.submit("#SBATCH --dataset=across\ntrue\n", "-w", "n1")
    assert cluster.wait(first)["JobState"] == "COMPLETED"
    second = cluster.submit("#SBATCH --dataset=across\ntrue\n", "-w", "n2")
    assert cluster.wait(second)["JobState"] == "COMPLETED"
    log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
    staged = re.findall(rf"job {second}: across staged at \S+/nvme/n2/\S+ in \S+ \((\d+) files, (\d+) bytes from "
                        r"the source; (\d+) files, (\d+) bytes from peers\)", log)
    assert staged == [("0", "0", str(len(files)), str(sum(len(v) for v in files.values())))], log[-3000:]
    verify = json.loads(cluster.dsstage("--node", "n2", "verify", "across", "--full", "--json").stdout)
    assert verify["ok"] is True, verify


def test_job_without_dataset_gets_nothing(cluster):
    job = cluster.submit("env | grep -E '^DSSTAGE_(PATH|DATASET)' || echo NONE\n", "-w", "n1")
    assert cluster.wait(job)["JobState"] == "COMPLETED"
    assert cluster.output(job).strip() == "NONE"


def test_status_shows_copies_and_queue(cluster):
    res = cluster.dsstage("status", "--json")
    st = json.loads(res.stdout)
    nodes = {c["node"] for c in st["copies"] if c["dataset"] == "sample" and c["state"] == "ready"}
    assert {"n1", "n2"} <= nodes
    assert st["queue"]["error"] is None and st["queue"]["source"] in ("snapshot", "slurm")
    assert all(n["stale"] is None for n in st["nodes"])  # every node reported, and is up
    plain = cluster.dsstage("status").stdout  # piped: the plain 80-column view
    assert "Datasets on nodes" in plain and all(len(line) <= 80 for line in plain.splitlines())


def test_reclaim_removes_leases_of_gone_jobs_only(cluster):
    import time
    marker = cluster.dir / "jobs" / "release-reclaim"
    job = cluster.submit(hash_job(after=f"for i in $(seq 300); do [ -e {marker} ] && break; sleep 0.2; done"),
                         "-w", "n3")
    leases = cluster.dir / "nvme" / "n3" / "leases" / "sample"
    try:
        for _ in range(300):
            if (leases / f"{job}.json").exists():
                break
            time.sleep(0.2)
        ghost = json.loads((leases / f"{job}.json").read_text())
        ghost["job_id"] = "999999"  # a job Slurm does not know: its Epilog never ran
        (leases / "999999.json").write_text(json.dumps(ghost))
        out = json.loads(cluster.dsstage("--node", "n3", "reclaim", "--json").stdout)
        assert [x["job_id"] for x in out] == ["999999"]
        assert (leases / f"{job}.json").exists()  # the running job keeps its lease
    finally:
        marker.write_text("go")
    assert cluster.wait(job)["JobState"] == "COMPLETED"


def test_a_tier_whose_disk_is_not_mounted_drains_the_node_and_nothing_is_written(cluster):
    """A tier that is not meant to be on the root filesystem (no root_filesystem: true) whose
    directory is there: the disk is not mounted. The Prolog writes nothing, the node drains
    (its store is broken), the reason is in the log; mounted again (here: the flag), it runs."""
    import yaml
    conf_path = cluster.etc / "dsstage.yaml"
    kept = conf_path.read_text()
    conf = yaml.safe_load(kept)
    conf["tiers"]["unmounted"] = {"path": str(cluster.dir / "unmounted" / "{node}"), "capacity": "1GB"}
    for spec in conf["datasets"].values():
        spec.setdefault("tier", "nvme")
    conf_path.write_text(yaml.safe_dump(conf))
    job = None
    try:
        cluster.add_dataset("unm", {"x/1.bin": b"1" * 1000}, tier="unmounted")
        job = cluster.submit("#SBATCH --dataset=unm\necho RAN\n", "-w", "n3")
        deadline = time.monotonic() + 60
        while "drain" not in cluster.node_state("n3") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "drain" in cluster.node_state("n3"), cluster.node_state("n3")
        assert not (cluster.dir / "unmounted").exists()  # nothing was created on the root filesystem
        reason = cluster.run("sinfo", "-h", "-R", "-n", "n3", "-o", "%E").stdout
        assert "dsstage: the local store of this node is broken: tier unmounted: " in reason and \
            "is the disk mounted?" in reason, reason
        log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
        assert f"job {job}: draining n3: " in log and "tier unmounted: " in log and \
            "is on the root filesystem: is the disk mounted?" in log, log[-3000:]
        out = cluster.jobs / f"{job}.out"
        assert "RAN" not in (out.read_text() if out.exists() else ""), cluster.job(job)
    finally:
        if job:
            cluster.run("scancel", job, check=False)
        conf_path.write_text(kept)
        cluster.dsstage("export-catalog", "-o", str(cluster.etc / "dsstage_catalog.lua"))
        cluster.run("scontrol", "update", "NodeName=n3", "State=RESUME", check=False)
    deadline = time.monotonic() + 60
    while cluster.node_state("n3") != "idle" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.node_state("n3") == "idle"


def test_a_job_of_a_partition_outside_the_pilot_is_as_without_dsstage(cluster, request):
    """rollout.partitions on the controller side: a job of the default partition (debug),
    outside the pilot, gets no dsstage= record and no preference; with outside: refuse its
    --dataset is refused (a job without one goes through); in the pilot it gets both. The
    default partition comes from slurmctld's part_list (flag_default), on each series."""
    catalog = str(cluster.etc / "dsstage_catalog.lua")

    def pilot(rollout):
        cluster.configure(rollout=rollout)
        cluster.dsstage("export-catalog", "-o", catalog)

    request.addfinalizer(lambda: pilot(None))
    submitted: list[str] = []
    request.addfinalizer(lambda: cluster.cancel_active(submitted))
    pilot({"partitions": ["gpu-pilot"]})
    submitted.append(cluster.submit("true\n", "--dataset=sample", "--hold"))
    info = cluster.job(submitted[-1])
    assert "dsstage=" not in info.get("AdminComment", "") and not any("ds_sample" in v for v in info.values()), info
    pilot({"partitions": ["gpu-pilot"], "outside": "refuse"})
    res = cluster.sbatch("true\n", "--dataset=sample", "--hold", check=False)
    assert res.returncode != 0 and "datasets are staged only in partition(s) gpu-pilot" in res.stderr, res.stderr
    submitted.append(cluster.submit("true\n", "--hold"))
    pilot({"partitions": ["debug"], "outside": "refuse"})
    submitted.append(cluster.submit("true\n", "--dataset=sample", "--hold"))
    info = cluster.job(submitted[-1])
    assert "dsstage=sample" in info["AdminComment"] and any("ds_sample" in v for v in info.values()), info
