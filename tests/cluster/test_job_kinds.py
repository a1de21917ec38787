"""Job arrays and heterogeneous jobs asking for a dataset: each task of an array, and each
component of a heterogeneous job, reads its data on its own nodes (each runs its own Prolog
and Epilog, as a job of its own)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cluster

COUNT = 'echo "$SLURMD_NODENAME $(ls "${DSSTAGE_DATASET_DIR:-/nonexistent}/train" 2>/dev/null | wc -l)"\n'


def files_in(cluster, name: str) -> int:
    return sum(1 for p in (cluster.dir / "data" / name / "train").iterdir())


def test_each_task_of_an_array_reads_the_dataset_on_its_node(cluster):
    first = cluster.submit(COUNT, "--dataset=sample", "--array=0-2", "-N1",
                           "-o", str(cluster.jobs / "%A_%a.out"), user="daemon")  # the last -o counts
    want = files_in(cluster, "sample")
    for task in range(3):
        job = f"{first}_{task}"
        info = cluster.wait(job)
        out = (cluster.jobs / f"{job}.out").read_text()
        assert info["JobState"] == "COMPLETED", (info, out)
        node, count = out.split()
        assert node in ("n1", "n2", "n3") and int(count) == want, out


def test_every_component_of_a_heterogeneous_job_reads_the_dataset_on_its_own_nodes(cluster):
    """--dataset is one for the whole job (SPANK options are: the command line's, else the
    first component's line); each component's Prolog stages it on that component's nodes,
    and a step of any component reads the copy of the node it runs on, not the batch host's."""
    where = 'echo "$SLURMD_NODENAME $DSSTAGE_DATASET_DIR $DSSTAGE_PATH_SAMPLE"'
    script = ("#SBATCH -N1 -w n1 --dataset=sample\n#SBATCH hetjob\n#SBATCH -N1 -w n2\n"
              f"srun --het-group=0 bash -c '{COUNT.strip()}'\nsrun --het-group=1 bash -c '{COUNT.strip()}'\n"
              f"srun --het-group=1 bash -c '{where}'\n")
    job = cluster.submit(script, user="daemon")
    info = cluster.wait(job)
    assert info["JobState"] == "COMPLETED", (info, cluster.output(job))
    lines = cluster.output(job).splitlines()
    want = files_in(cluster, "sample")
    assert lines[:2] == [f"n1 {want}", f"n2 {want}"], lines
    node, dataset_dir, sample = lines[2].split()
    assert node == "n2" and dataset_dir == sample, lines
    assert dataset_dir.startswith(str(cluster.dir / "nvme" / "n2" / "datasets" / "sample") + "/"), lines
    log = (cluster.dir / "log" / "dsstage-hooks.log").read_text()
    assert f"job {job}: sample staged" in log or f"job {job}: sample cached" in log, log[-3000:]
    assert f"job {int(job) + 1}: sample" in log, log[-3000:]  # the second component's own Prolog, on n2


@pytest.mark.parametrize("argv", [["srun", "-w", "n1"], ["salloc", "-w", "n2", "srun"]], ids=["srun", "salloc"])
def test_an_interactive_job_reads_the_dataset(cluster, argv):
    res = cluster.run(argv[0], "--dataset=sample", *argv[1:], "bash", "-c", COUNT.strip(), user="daemon", timeout=110)
    assert res.stdout.split() == [argv[2], str(files_in(cluster, "sample"))], res.stdout + res.stderr
