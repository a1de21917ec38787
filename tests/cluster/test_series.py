"""The Slurm series of this pass (packaging/run-tests runs the cluster tests once per series:
22.05 here, 24.11 and 26.05 in Debian roots of their own, DEVCLUSTER_SLURM; a series whose
packages cannot be fetched fails the session's cluster, never skips): the cluster is that
series for root and for ordinary users, and a SPANK plugin built for another series is
found by check-config and costs only --dataset."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_cluster_runs_the_series_asked_for_and_an_ordinary_user_reads_staged_data(cluster):
    assert cluster.series == (os.environ.get("DEVCLUSTER_SLURM") or "22.05")
    for user in (None, "daemon"):  # as a login node of that series has them, for everyone
        assert cluster.run("sinfo", "--version", user=user).stdout.split()[-1].startswith(cluster.series)
    want = sum(1 for _ in (cluster.dir / "data" / "sample" / "train").iterdir())
    job = cluster.submit('ls "$DSSTAGE_DATASET_DIR/train" | wc -l\n', "--dataset=sample", "-w", "n1", user="daemon")
    bb = cluster.submit('#BB_LUA dataset=sample\nls "$DSSTAGE_PATH_SAMPLE/train" | wc -l\n', "-w", "n2",
                        user="daemon")
    typo = cluster.sbatch("true\n", "--dataset=sampel", user="daemon", check=False)
    assert typo.returncode != 0 and "did you mean 'sample'?" in typo.stderr, typo.stderr
    for j in (job, bb):
        info = cluster.wait(j)
        assert info["JobState"] == "COMPLETED", (info, cluster.output(j))
        assert cluster.output(j).strip() == str(want), cluster.output(j)
    # bbstat, with the uid and gid the series passes (or not) before the words
    out = cluster.bbstat("dataset", "sample", user="daemon")
    assert "sample" in out.split("Tiers")[0] and "ready" in out, out


def other_series_plugin(cluster, tmp_path) -> tuple[str, str]:
    """A dsstage_spank.so built for another series than the cluster's: this machine's 22.05
    headers for a newer cluster; for a 22.05 cluster, the same headers with slurm_version.h
    saying 24.11 (what Slurm's loader and check-config read), so that no other root is needed."""
    other = "22.05" if cluster.series != "22.05" else "24.11"
    out = tmp_path / "dsstage_spank.so"
    argv = ["gcc", "-O2", "-shared", "-fPIC", "-o", str(out), os.path.join(ROOT, "sbatch_ext", "dsstage_spank.c")]
    if other != "22.05":
        fake = tmp_path / "include" / "slurm"
        fake.mkdir(parents=True)
        for header in os.listdir("/usr/include/slurm"):
            if header != "slurm_version.h":
                (fake / header).symlink_to(f"/usr/include/slurm/{header}")
        (fake / "slurm_version.h").write_text(
            "#define SLURM_VERSION_NUMBER 0x180b06\n#define SLURM_VERSION_NUM(a,b,c) (((a) << 16) + ((b) << 8) + (c))\n"
            "#define SLURM_VERSION_MAJOR(a) (((a) >> 16) & 0xff)\n#define SLURM_VERSION_MINOR(a) (((a) >> 8) & 0xff)\n"
            "#define SLURM_VERSION_MICRO(a) ((a) & 0xff)\n")
        argv[1:1] = ["-I", str(tmp_path / "include")]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    return other, str(out)


def test_a_plugin_built_for_another_series_costs_only_dataset_and_check_config_says_rebuild(cluster, tmp_path):
    other, plugin = other_series_plugin(cluster, tmp_path)
    etc = cluster.dir / "etc-stale-plugin"  # where every user reads, and the series' root sees
    etc.mkdir(mode=0o755)
    shutil.copy(plugin, etc / "dsstage_spank.so")
    plugin = str(etc / "dsstage_spank.so")
    (etc / "plugstack.conf").write_text(f"optional {plugin}\n")
    conf = (cluster.etc / "slurm.conf").read_text()
    (etc / "slurm.conf").write_text(conf.replace(f"PlugStackConfig={cluster.etc}/plugstack.conf", "")
                                    + f"\nPlugStackConfig={etc}/plugstack.conf\n")
    env = {"SLURM_CONF": str(etc / "slurm.conf")}
    check = cluster.run("env", f"SLURM_CONF={env['SLURM_CONF']}", str(cluster.venv_bin / "dsstage"), "check-config",
                        check=False)
    assert check.returncode == 78, check.stdout + check.stderr
    assert f"was built for Slurm {other}" in check.stderr and "rebuild it against this Slurm" in check.stderr, \
        check.stderr
    # an optional plugin Slurm refuses: jobs without --dataset are submitted, --dataset is unknown
    plain = cluster.run("env", f"SLURM_CONF={env['SLURM_CONF']}", "sbatch", "--parsable", "-o", "/dev/null",
                        "--wrap", "true", user="daemon")
    # 22.05 and 24.11: "spank: ...: Incompatible plugin version"; 26.05: "Incompatible Slurm plugin ..."
    assert plain.stdout.strip().isdigit() and "Incompatible" in plain.stderr and plugin in plain.stderr, \
        plain.stderr
    refused = cluster.run("env", f"SLURM_CONF={env['SLURM_CONF']}", "sbatch", "--dataset=sample", "--wrap", "true",
                          user="daemon", check=False)
    assert refused.returncode != 0 and "unrecognized option '--dataset=sample'" in refused.stderr, refused.stderr
    cluster.wait(plain.stdout.strip())
