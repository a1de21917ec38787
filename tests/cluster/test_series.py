"""The newer Slurm series Debian packages, 24.11 (trixie) and 26.05 (sid), each in a Debian root
of its own (packaging/devcluster with DEVCLUSTER_SLURM; packaging/slurmroot.sh builds the root
once under /var/cache): the cluster comes up on that series, and what an ordinary user does
there works as on 22.05. A series whose packages cannot be fetched fails here, never skips.

Only these checks run on the newer series so far; the whole cluster suite runs on 22.05 (the
admin guide's table of series says what differs).
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("series, port", [("24.11", 29817), ("26.05", 30817)])
def test_an_ordinary_user_stages_and_reads_data_on_slurm(another_devcluster, monkeypatch, series, port):
    monkeypatch.setenv("DEVCLUSTER_SLURM", series)
    monkeypatch.delenv("DSSTAGE_FROM_PACKAGE", raising=False)  # the .debs are built for 22.05: the checkout runs
    with another_devcluster(f"dsstage-series-{series}", port, sample_files=30) as cluster:
        assert cluster.series == series
        for user in (None, "daemon"):  # as a login node of that series has them, for everyone
            assert cluster.run("sinfo", "--version", user=user).stdout.split()[-1].startswith(series)
        job = cluster.submit('ls "$DSSTAGE_DATASET_DIR/train" | wc -l\n', "--dataset=sample", "-w", "n1",
                             user="daemon")
        bb = cluster.submit('#BB_LUA dataset=sample\nls "$DSSTAGE_PATH_SAMPLE/train" | wc -l\n', "-w", "n2",
                            user="daemon")
        typo = cluster.sbatch("true\n", "--dataset=sampel", user="daemon", check=False)
        assert typo.returncode != 0 and "did you mean 'sample'?" in typo.stderr, typo.stderr
        for j in (job, bb):
            info = cluster.wait(j)
            assert info["JobState"] == "COMPLETED", (info, cluster.output(j))
            assert cluster.output(j).strip() == "30", cluster.output(j)
        log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
        assert f"job {job}: sample staged" in log and f"job {bb}: #BB_LUA request sample" in log, log
        # bbstat, with the uid and gid this series passes before the words
        out = cluster.bbstat("dataset", "sample", user="daemon")
        assert "sample" in out.split("Tiers")[0] and "ready" in out, out
        assert os.path.exists(cluster.dir / "bin" / "in-root")
