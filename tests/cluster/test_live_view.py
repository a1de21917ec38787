"""``start: at-once`` on real Slurm: a job on a cold dataset from a slow mounted source (2 MiB/s)
starts on a live view within 2 s of its allocation, reads every file right while the stage runs,
and the view ends with every entry a hard link into the verified copy."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from datetime import datetime
from pathlib import Path

import latencyfs
import pytest

pytestmark = pytest.mark.cluster

#: 48 files of 256 KiB (12 MiB): about 6 s from the slow source
FILES = {f"train/{i:03d}": bytes([i]) * (256 << 10) for i in range(48)}
SCRIPT = ('date +%s.%N\necho "$DSSTAGE_DATASET_DIR"\n'
          'cd "$DSSTAGE_DATASET_DIR" && find . \\( -type f -o -type l \\) | sort | xargs md5sum\n')


def allocation_time(cluster, job: str) -> float:
    """When slurmctld allocated the job's nodes: its log line's time (milliseconds; Slurm's
    default LogTimeFormat), "Allocate JobId=N" from the main scheduler or "Started JobId=N"
    from backfill."""
    import re
    for line in (cluster.dir / "log" / "slurmctld.log").read_text(errors="replace").splitlines():
        m = re.match(r"\[([0-9T:.-]+)\] .*(?:Allocate|Started) JobId=" + job + r" ", line)
        if m:
            return datetime.fromisoformat(m.group(1)).timestamp()
    raise AssertionError(f"no allocation of job {job} in slurmctld.log")


def test_an_at_once_job_starts_within_2s_reads_every_file_and_ends_on_the_verified_copy(cluster):
    latencyfs.require()
    fs = cluster.slowfs
    backing = Path(fs.backing) / "livedemo"
    for rel, data in FILES.items():
        (backing / rel).parent.mkdir(parents=True, exist_ok=True)
        (backing / rel).write_bytes(data)
    cluster.add_dataset("livedemo", {}, src=Path(fs.mountpoint) / "livedemo", start="at-once")
    before = cluster.configure(start_budget=0.5)
    try:
        job = cluster.submit(SCRIPT, "--dataset=livedemo", "-w", "n1", user="daemon")
        info = cluster.wait(job)
        out = cluster.output(job).splitlines()
        assert info["JobState"] == "COMPLETED", (info, out)
        started = float(out[0])
        allocated = allocation_time(cluster, job)
        print(f"job {job}: first line {started - allocated:.2f}s after its allocation (Slurm {cluster.series})")
        assert started - allocated < 2.0, (started, allocated, info["StartTime"])
        view = out[1]
        assert view.startswith(str(cluster.dir / "nvme" / "n1" / "live" / "livedemo") + "/"), out
        sums = {line.split()[1][2:]: line.split()[0] for line in out[2:]}
        assert sums == {rel: hashlib.md5(data).hexdigest() for rel, data in FILES.items()}, out
        record = Path(view + ".json")
        deadline = time.monotonic() + 60
        while json.loads(record.read_text()).get("state") != "whole" and time.monotonic() < deadline:
            time.sleep(0.2)
        rec = json.loads(record.read_text())
        assert rec["state"] == "whole" and rec["local"] == len(FILES), rec
        copy = cluster.dir / "nvme" / "n1" / "datasets" / "livedemo" / Path(view).name
        for rel in FILES:
            st, cst = os.lstat(Path(view, rel)), os.lstat(copy / rel)
            assert stat.S_ISREG(st.st_mode) and st.st_ino == cst.st_ino, rel
        log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
        assert f"job {job}: livedemo: starting on a live view" in log, log[-3000:]
        assert f"job {job}: the live view of livedemo version" in log, log[-3000:]
    finally:
        cluster.configure(**before)
