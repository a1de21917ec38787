"""`packaging/devcluster down` stops every daemon of its cluster, whatever its pid files say.

From Slurm 23.11 on, `scontrol reconfigure` re-executes slurmctld and slurmd under new pids.
A daemon that outlives `down` keeps the cluster's ports, and the next cluster on them (the
next Slurm series' cluster tests) cannot start.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.cluster


def test_down_stops_daemons_a_reconfigure_moved_or_a_stale_pid_file_hides(another_devcluster, daemons_of):
    with another_devcluster("dsstage-down-test", 28817, sample_files=5) as cluster:
        before = set(daemons_of(cluster.dir))
        cluster.run("scontrol", "reconfigure")
        deadline = time.monotonic() + 60
        while cluster.run("scontrol", "ping", check=False).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert daemons_of(cluster.dir), "the cluster runs"
        # the window a reconfigure opens: the pid file still names a process that is gone
        (cluster.dir / "run" / "slurmctld.pid").write_text("999999999\n")
        (cluster.dir / "run" / "slurmd.n2.pid").write_text("999999998\n")
        directory = cluster.dir
    # another_devcluster's exit ran `devcluster down` and fails if anything of it was left
    assert not daemons_of(directory)
    assert before, "the cluster's daemons were found by their command lines"
