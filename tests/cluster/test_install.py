"""What users run or load comes from an installed copy, never from the checkout.

sbatch loads the SPANK plugin as the submitting user and slurmstepd runs the TaskProlog as
the job's user, so a checkout only root can enter (say under /root, mode 0700) must still
give a working cluster; and the TaskProlog must take no path from the job's environment.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def copy_checkout(dest: Path) -> None:
    """The working tree as a clone would have it, with what is not committed yet: tracked and
    untracked files that git does not ignore (no .venv, no build outputs)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def slurm_conf_paths(cluster) -> list[str]:
    conf = (cluster.etc / "slurm.conf").read_text().splitlines()
    paths = [line.split("=", 1)[1] for line in conf if line.split("=", 1)[0] in ("Prolog", "Epilog", "TaskProlog")]
    plugstack = (cluster.etc / "plugstack.conf").read_text().split()
    return paths + [w for w in plugstack if w.startswith("/")]


def test_devcluster_from_a_checkout_only_root_can_enter(another_devcluster, tmp_path):
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    top = private / "project"
    copy_checkout(top)
    with another_devcluster("dsstage-install-test", 27817, top=top, sample_files=20) as cluster:
        installed = slurm_conf_paths(cluster)
        assert len(installed) == 4
        for path in map(Path, installed):
            assert path.is_relative_to(cluster.dir) and not path.is_relative_to(top)
            st = path.stat()
            assert st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            assert st.st_mode & stat.S_IROTH, f"{path}: users must read it"

        res = cluster.sbatch("true\n", "--dataset=sampel", check=False, user="nobody")
        assert res.returncode != 0
        assert "sbatch: error: dsstage: unknown dataset 'sampel' (did you mean 'sample'?)" in res.stderr

        job = cluster.submit('#SBATCH --dataset=sample\necho "DIR=$DSSTAGE_DATASET_DIR"; id -un\n'
                             'head -n 1 "$DSSTAGE_DATASET_DIR/labels.txt"\n', user="nobody")
        assert cluster.wait(job)["JobState"] == "COMPLETED", cluster.output(job)
        out = cluster.output(job).splitlines()
        assert out[0].startswith(f"DIR={cluster.dir}/nvme/") and "/datasets/sample/" in out[0]
        assert out[1:] == ["nobody", "n00000000 class 0"]


def test_taskprolog_ignores_paths_in_the_jobs_environment(cluster, tmp_path):
    """A user sets DSSTAGE_RUN_DIR / DSSTAGE_DEFAULTS for the job (sbatch --export): the
    installed TaskProlog still reads the run directory the cluster configured, so the hold
    mark still stops the task and the user's own task file is never printed."""
    job_id = "990001"
    task = cluster.dir / "dsstage-run" / "n1" / "jobs" / f"{job_id}.task"
    task.parent.mkdir(parents=True, exist_ok=True)
    task.write_text("print dsstage: error: held for the test\n# dsstage: hold\n")
    task.chmod(0o444)
    evil = cluster.jobs / f"evil-{os.getpid()}"
    (evil / "n1" / "jobs").mkdir(parents=True)
    (evil / "n1" / "jobs" / f"{job_id}.task").write_text("export LD_PRELOAD=/tmp/evil.so\n")
    (evil / "defaults").write_text(f"DSSTAGE_RUN_DIR={evil}\n")
    for p in [evil, *evil.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    taskprolog = cluster.dir / "hooks" / "dsstage-taskprolog"
    try:
        for attack in ([f"DSSTAGE_RUN_DIR={evil}"], [f"DSSTAGE_DEFAULTS={evil}/defaults"],
                       [f"DSSTAGE_RUN_DIR={evil}", f"DSSTAGE_DEFAULTS={evil}/defaults"]):
            res = cluster.run("env", f"SLURM_JOB_ID={job_id}", "SLURMD_NODENAME=n1", *attack, str(taskprolog),
                              user="nobody", check=False)
            assert res.returncode == 1, (attack, res)
            assert res.stdout == task.read_text(), attack
        for bad in ("SLURM_JOB_ID=../../jobs/990001", "SLURMD_NODENAME=../n1"):
            res = cluster.run("env", f"SLURM_JOB_ID={job_id}", "SLURMD_NODENAME=n1", bad, str(taskprolog),
                              user="nobody", check=False)
            assert res.returncode == 1 and "no task started" in res.stdout and "LD_PRELOAD" not in res.stdout
    finally:
        task.unlink()
        shutil.rmtree(evil)
