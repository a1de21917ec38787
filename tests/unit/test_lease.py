import os
import subprocess

import pytest
from dsstage.errors import StoreError
from dsstage.fs.safe import RootDir
from dsstage.node.lease import Lease, LeaseBook, holder_alive


@pytest.fixture
def book(tmp_path):
    with RootDir(str(tmp_path / "tier")) as tier:
        yield LeaseBook(tier)


def lease(job, **kw):
    kw.setdefault("digest", "d" * 64)
    return Lease(dataset=kw.pop("dataset", "coco"), job_id=job, user="alice", node="n1", taken=1.0, **kw)


def test_take_release_and_list(book):
    book.take(lease("101"))
    book.take(lease("102"))
    book.take(lease("101", dataset="imagenet"))
    assert sorted(x.job_id for x in book.of_dataset("coco")) == ["101", "102"]
    assert sorted(x.dataset for x in book.of_job("101")) == ["coco", "imagenet"]
    assert book.release("coco", "101") is True
    assert book.release("coco", "101") is False
    assert [x.job_id for x in book.of_dataset("coco")] == ["102"]


def test_job_ids_cannot_escape(book):
    with pytest.raises(StoreError, match="job id '../x' is not valid"):
        book.take(lease("../x"))


def test_reclaim_stale_job_and_process_leases(book):
    dead = subprocess.Popen(["true"])
    dead.wait()
    book.take(lease("101"))
    book.take(lease("102"))
    book.take(lease("pid-here-1", pid=dead.pid, host=os.uname().nodename))
    book.take(lease("pid-here-2", pid=os.getpid(), host=os.uname().nodename))
    gone, damaged = book.reclaim("coco", lambda x: holder_alive(x, lambda job: job == "102"))
    assert sorted(x.job_id for x in gone) == ["101", "pid-here-1"] and damaged == []
    assert sorted(x.job_id for x in book.of_dataset("coco")) == ["102", "pid-here-2"]


def test_process_lease_on_another_host_counts_as_alive():
    assert holder_alive(lease("pid-x", pid=1, host="elsewhere.invalid"), job_alive=lambda _j: False)


def test_damaged_lease_file_is_ignored_and_reclaim_removes_it(book, tmp_path):
    book.take(lease("101"))
    leases = tmp_path / "tier" / "leases" / "coco"
    (leases / "bad.json").write_text("{not json")
    (leases / "202.json").write_text('{"dataset": "other", "job_id": "202"}')  # not what its name says
    (leases / "303.json").mkdir()
    assert [x.job_id for x in book.of_dataset("coco")] == ["101"]
    gone, damaged = book.reclaim("coco", lambda x: True)
    assert gone == [] and sorted(damaged) == ["202.json", "303.json", "bad.json"]
    assert sorted(p.name for p in leases.iterdir()) == ["101.json"]
