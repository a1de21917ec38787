import os
import subprocess

import pytest
from dsstage.errors import StoreError
from dsstage.lease import Lease, LeaseBook, holder_alive


def lease(job, **kw):
    kw.setdefault("digest", "d" * 64)
    return Lease(dataset=kw.pop("dataset", "coco"), job_id=job, user="alice", node="n1", taken=1.0, **kw)


def test_take_release_and_list(tmp_path):
    book = LeaseBook(str(tmp_path))
    book.take(lease("101"))
    book.take(lease("102"))
    book.take(lease("101", dataset="imagenet"))
    assert sorted(x.job_id for x in book.of_dataset("coco")) == ["101", "102"]
    assert sorted(x.dataset for x in book.of_job("101")) == ["coco", "imagenet"]
    assert book.release("coco", "101") is True
    assert book.release("coco", "101") is False
    assert [x.job_id for x in book.of_dataset("coco")] == ["102"]


def test_job_ids_cannot_escape(tmp_path):
    with pytest.raises(StoreError, match="job id '../x' is not valid"):
        LeaseBook(str(tmp_path)).take(lease("../x"))


def test_reclaim_stale_job_and_process_leases(tmp_path):
    book = LeaseBook(str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    book.take(lease("101"))
    book.take(lease("102"))
    book.take(lease("pid-here-1", pid=dead.pid, host=os.uname().nodename))
    book.take(lease("pid-here-2", pid=os.getpid(), host=os.uname().nodename))
    gone = book.reclaim("coco", job_alive=lambda job: job == "102")
    assert sorted(x.job_id for x in gone) == ["101", "pid-here-1"]
    assert sorted(x.job_id for x in book.of_dataset("coco")) == ["102", "pid-here-2"]


def test_process_lease_on_another_host_counts_as_alive():
    assert holder_alive(lease("pid-x", pid=1, host="elsewhere.invalid"), job_alive=lambda _j: False)


def test_damaged_lease_file_is_ignored(tmp_path):
    book = LeaseBook(str(tmp_path))
    book.take(lease("101"))
    (tmp_path / "leases" / "coco" / "bad.json").write_text("{not json")
    assert [x.job_id for x in book.of_dataset("coco")] == ["101"]
