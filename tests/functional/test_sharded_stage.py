"""A node's part of a sharded dataset: the shards a job gave it staged as copies of their own,
held by the job's one lease, and shown as one read-only view of exactly those files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from dsstage.config.catalog import User
from dsstage.node import eviction, sharded, views
from dsstage.node.lease import LeaseBook
from dsstage.node.store import open_tier
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

FILES = {f"d{i % 3}/train-{i:05d}-of-00018": bytes([65 + i]) * (500 + 7 * i) for i in range(18)}


@pytest.fixture
def big(env: Env) -> dict:
    env.add("big", FILES, shards=6)
    return env.cli_json("manifest", "build", "big")


def test_a_nodes_part_is_its_shards_and_nothing_else(env: Env, big):
    store = env.store()
    index = sharded.shards_of(store, "big", big["digest"])
    mine = [index.shards[i].id for i in (4, 0, 2)]  # given in any order: staged and shown in shard order
    part = sharded.stage_part(store, "big", big["digest"], mine, user=User.lookup(0), job_id="7")
    assert part.action == "staged" and [s.index for s in part.shards] == [0, 2, 4]
    expected = {p for s in part.shards for p in sorted(FILES)[s.start:s.stop]}
    view = Path(part.view.path)
    seen = {str(p.relative_to(view)) for p in view.rglob("*") if p.is_file()}
    assert seen == expected and all((view / p).read_bytes() == FILES[p] for p in seen)
    listed = views.listing(part.view)
    assert [os.path.relpath(p, view) for p in listed] == [p for s in part.shards for p in sorted(FILES)[s.start:s.stop]]
    assert stat.S_IMODE(os.stat(view).st_mode) == 0o755 and os.stat(view).st_uid == 0
    # one lease holds the three shards; the version itself has no copy
    with open_tier(store.layout("nvme")) as tier:
        (lease,) = LeaseBook(tier).of_job("7")
        assert lease.digest == big["digest"] and sorted(lease.shards) == sorted(s.digest for s in part.shards)
        assert sorted(tier.names("datasets", "big")) == sorted(mine)
    # a second job with the same shards finds them, and the same view
    again = sharded.stage_part(store, "big", big["digest"], mine, user=User.lookup(0), job_id="8")
    assert again.action == "cached" and again.view == part.view
    # leased shards stay; once released, evicting a shard takes its views with it
    assert {e.action for e in eviction.evict(store, "big", force=True)} == {"kept"}
    store.release_job("7")
    store.release_job("8")
    gone = eviction.evict(store, "big", force=True)
    assert {e.action for e in gone} == {"evicted"} and not view.exists()
    with open_tier(store.layout("nvme")) as tier:
        assert tier.names("views", "big") == []


def test_shards_of_another_version_are_refused(env: Env, big):
    from dsstage.errors import ManifestError
    with pytest.raises(ManifestError, match="are not shards of version"):
        sharded.stage_part(env.store(), "big", big["digest"], ["0123456789abcdef"], user=User.lookup(0), job_id="7")


def test_a_jobs_nodes_agree_on_one_shard_plan(env: Env, big):
    from dsstage.hooks import jobrecord
    store = env.store()
    ids = [s.id for s in sharded.shards_of(store, "big", big["digest"]).shards]
    nodes = ["n1", "n2", "n3"]
    assert jobrecord.plan_for(str(env.state), "50", ["n1"], "n1", {"big": ids}) == {"big": {"n1": ids}}
    env.state.mkdir(exist_ok=True)
    first = jobrecord.plan_for(str(env.state), "51", nodes, "n2", {"big": ids})
    assert sorted(s for v in first["big"].values() for s in v) == sorted(ids)
    assert all(len(v) == 2 for v in first["big"].values())
    for node in ("n1", "n3"):  # the others read the first node's plan
        assert jobrecord.plan_for(str(env.state), "51", nodes, node, {"big": ids}) == first
    jobrecord.forget(str(env.state), "51")
    assert not (env.state / "jobs" / "51.shards.json").exists()


def test_more_exports_name_each_dataset_and_the_first():
    from dsstage.errors import StoreError
    from dsstage.fs import runfiles
    assert runfiles.more_exports("image-net", [("FILES", "/x/list"), ("SHARDS", "0,2")], first=True) == [
        "export DSSTAGE_FILES_IMAGE_NET=/x/list", "export DSSTAGE_FILES=/x/list",
        "export DSSTAGE_SHARDS_IMAGE_NET=0,2", "export DSSTAGE_SHARDS=0,2"]
    assert runfiles.more_exports("b", [("FILES", "/y")], first=False) == ["export DSSTAGE_FILES_B=/y"]
    with pytest.raises(StoreError):
        runfiles.more_exports("b", [("FILES", "/y\nexport X=1")], first=False)
