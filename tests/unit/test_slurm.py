from pathlib import Path

from dsstage import slurm, status
from dsstage.slurm import Job

DATA = Path(__file__).resolve().parent.parent / "data"


def test_parse_saved_scontrol_show_job():
    jobs = slurm.parse_show_job((DATA / "scontrol-show-job.txt").read_text())
    assert [(j.job_id, j.state, j.datasets) for j in jobs] == [
        ("1", "COMPLETED", ("sample",)), ("2", "PENDING", ("broken",)), ("3", "COMPLETED", ("brokenfb",))]
    assert jobs[0].user == "root" and jobs[0].nodes == "n1" and jobs[0].partition == "debug"


def test_fields_keep_values_with_spaces():
    f = slurm._fields("JobId=7 Comment=dsstage held this job: x=y -- fix it JobState=PENDING")
    assert f["JobId"] == "7" and f["JobState"] == "PENDING"
    assert f["Comment"].startswith("dsstage held this job")


def test_datasets_of_admin_comment():
    assert slurm.datasets_of("site=abc dsstage=coco,imagenet22t") == ("coco", "imagenet22t")
    assert slurm.datasets_of("") == ()
    assert slurm.datasets_of("nodsstage=x") == ()


def test_expand_nodes():
    assert slurm.expand_nodes("n[1-3,5],gpu01") == ["n1", "n2", "n3", "n5", "gpu01"]
    assert slurm.expand_nodes("c[08-10]") == ["c08", "c09", "c10"]
    assert slurm.expand_nodes("") == []


def test_demand_counts_pending_and_running():
    jobs = [Job("1", "a", "PENDING", ("coco",)), Job("2", "a", "RUNNING", ("coco", "in22k")),
            Job("3", "b", "COMPLETED", ("coco",)), Job("4", "b", "PENDING", ())]
    assert status.demand(jobs) == [
        {"dataset": "coco", "pending": 1, "running": 1, "jobs": ["1", "2"]},
        {"dataset": "in22k", "pending": 0, "running": 1, "jobs": ["2"]}]
