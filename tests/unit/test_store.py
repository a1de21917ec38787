"""The node's store in-process on ``tmp_path``: stage, reuse, lease, verify, make room, a new
version, a source that lies. As root (CI) and as an ordinary user alike: dsstage.fs.safe
trusts root and the caller's own directories, so a developer's ``pytest tests/unit`` runs
the store's decisions without root (tests/functional/test_ordinary_user.py runs this module
as an unprivileged user in CI). What needs root (other owners, a job's group, the CLI's
root verbs) is in tests/functional."""

from __future__ import annotations

import os
import time
from pathlib import Path

import blake3
import pytest
import yaml
from dsstage.config import manifest as config_manifest
from dsstage.config.catalog import User
from dsstage.errors import NoSpace, SourceError
from dsstage.fs import safe
from dsstage.node import eviction, staging, verifying
from dsstage.node.lease import LeaseBook
from dsstage.node.store import Store, open_tier
from dsstage.policy import demand
from dsstage.slurm.records import Job
from dsstage.transfer import build as transfer_build
from helpers import Env


def manifest(env: Env, name: str) -> str:
    """Build and publish ``name``'s manifest in-process (what `dsstage manifest build` does)."""
    conf = env.config()
    ds = conf.datasets[name]
    report = transfer_build.build(name, ds.source.raw, source=ds.source.raw, previous=None,
                                  how=transfer_build.ReadOptions(None, 2, 2))
    config_manifest.Catalog(conf.state_dir).publish(report.manifest)
    return report.manifest.digest


def request(job: str) -> staging.StageRequest:
    return staging.StageRequest(user=User.lookup(), job_id=job)


def hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): blake3.blake3(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def on_node(env: Env) -> list[str]:
    top = env.tier_root() / "datasets"
    return sorted(p.name for p in top.iterdir() if any(p.iterdir()))


def test_a_stage_makes_a_sealed_copy_and_the_next_job_leases_it_without_a_transfer(env: Env):
    src = env.add("coco", {"a.jpg": b"a" * 1000, "sub/b.jpg": b"b" * 2000, "sub/deeper/c": b"c"})
    manifest(env, "coco")
    store = env.store()
    first = staging.stage(store, "coco", request("101"))
    assert (first.action, first.transferred_files, first.transferred_bytes) == ("staged", 3, 3001)
    path = Path(first.path)
    assert path.parent == env.tier_root() / "datasets" / "coco" and hashes(path) == hashes(src)
    for p in [path, *path.rglob("*")]:
        st = p.lstat()
        assert safe.trusted(st.st_uid) and safe.sealed(st), p  # nobody else may write any of it
        assert not st.st_mode & 0o222 or p.is_dir(), p  # the files are read-only for their owner too
    second = staging.stage(store, "coco", request("102"))
    assert (second.action, second.transferred_bytes, second.path) == ("cached", 0, first.path)
    with open_tier(store.layout("nvme")) as tier:
        assert sorted(x.job_id for x in LeaseBook(tier).of_dataset("coco")) == ["101", "102"]
    assert verifying.verify(store, "coco").ok
    store.release("coco", "101")
    assert sorted(p.name for p in (env.tier_root() / "leases" / "coco").iterdir()) == ["102.json"]


def test_a_flipped_byte_is_found_by_a_full_verify_and_repaired(env: Env):
    src = env.add("ds", {f"f{i}": os.urandom(3000) for i in range(8)})
    manifest(env, "ds")
    store = env.store()
    path = Path(staging.stage(store, "ds", request("1")).path)
    victim = path / "f5"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    if os.geteuid() != 0:
        path.chmod(0o755)
    victim.chmod(0o644)
    victim.write_bytes(bytes(data))
    victim.chmod(0o444)
    assert verifying.verify(store, "ds").ok  # quick trusts the ready mark: that is its contract
    full = verifying.verify(store, "ds", full=True)
    assert full.ok and full.repaired == ["f5"] and "f5" in full.reason
    assert victim.read_bytes() == (src / "f5").read_bytes() and not victim.stat().st_mode & 0o222
    assert verifying.verify(store, "ds", full=True).repaired == []


def test_a_source_changed_after_its_manifest_publishes_nothing_and_says_so(env: Env):
    src = env.add("ds", {"a": b"1" * 100, "b": b"2" * 100})
    manifest(env, "ds")
    (src / "b").write_bytes(b"X" * 100)  # same size, other bytes
    with pytest.raises(SourceError, match="'b' differs in content from the manifest") as exc:
        staging.stage(env.store(), "ds", request("1"))
    assert "dsstage manifest build ds" in str(exc.value)
    published = env.tier_root() / "datasets" / "ds"
    assert not published.exists() or not any(published.iterdir())
    assert not (env.tier_root() / "leases" / "ds").exists()
    manifest(env, "ds")
    assert staging.stage(env.store(), "ds", request("1")).action == "staged"


def test_a_new_version_links_the_unchanged_files_and_leaves_the_old_one_to_its_job(env: Env):
    src = env.add("ds", {f"f{i}": os.urandom(4000) for i in range(6)})
    manifest(env, "ds")
    store = env.store()
    old = staging.stage(store, "ds", request("1"))
    (src / "f3").write_bytes(os.urandom(4000))
    manifest(env, "ds")
    new = staging.stage(env.store(), "ds", request("2"))
    assert new.path != old.path and (new.linked_files, new.transferred_files) == (5, 1)
    assert hashes(Path(new.path)) == hashes(src)
    assert (Path(old.path) / "f3").read_bytes() != (src / "f3").read_bytes()
    assert os.stat(Path(old.path) / "f0").st_ino == os.stat(Path(new.path) / "f0").st_ino


@pytest.fixture
def small(env: Env) -> Env:
    """Three datasets of 3 000 bytes on a tier of 10 000 (above 9 000 evict down to 4 000)."""
    for name in ("x", "y", "z"):
        env.add(name, {"f": name.encode() * 3000})
    env.extra = {"retention": {"min_keep": 0}}
    data = yaml.safe_load(env.write().read_text())
    data["tiers"]["nvme"].update(capacity=10000, high_watermark="90%", low_watermark="40%")
    env.config_path.write_text(yaml.safe_dump(data))
    for name in ("x", "y", "z"):
        manifest(env, name)
    return env


def x_and_y_released_y_wanted(env: Env) -> Store:
    """x and y staged and released, a pending job planned here wants y, and a stage in
    progress holds 2 000: 8 000 of 10 000, so z's 3 000 do not fit without evicting."""
    store = env.store()
    for job, name in (("1", "x"), ("2", "y")):
        staging.stage(store, name, request(job))
        store.release(name, job)
    demand.write(str(env.state), demand.build([Job("9", "u", "PENDING", ("y",), sched_nodes=env.node)],
                                              time.time()))
    with open_tier(store.layout("nvme")) as tier:
        from dsstage.node import space
        space.hold(tier, "stage-other.json", 2000, "a stage in progress")
    return store


def test_a_stage_evicts_what_no_job_wants_and_keeps_what_a_pending_job_wants(small: Env):
    store = x_and_y_released_y_wanted(small)
    assert staging.stage(store, "z", request("3")).action == "staged"
    assert on_node(small) == ["y", "z"]  # x had no demand; y is wanted by job 9


def test_a_stage_that_cannot_make_room_says_what_holds_it_and_evicts_nothing(small: Env):
    store = small.store()
    staging.stage(store, "x", request("1"))
    staging.stage(store, "y", request("2"))
    with open_tier(store.layout("nvme")) as tier:
        from dsstage.node import space
        space.hold(tier, "stage-other.json", 2000, "a stage in progress")
    with pytest.raises(NoSpace) as exc:
        staging.stage(store, "z", request("3"))
    assert "leased by job 1" in str(exc.value) and "reserved by stages in progress" in str(exc.value)
    assert on_node(small) == ["x", "y"]


def test_evict_refuses_a_leased_copy_and_removes_a_released_one(small: Env):
    store = small.store()
    staging.stage(store, "x", request("1"))
    demand.write(str(small.state), demand.build([], time.time()))
    [kept] = eviction.evict(store, "x")
    assert kept.action == "kept" and "leased by job 1" in kept.reason and on_node(small) == ["x"]
    store.release("x", "1")
    assert [e.action for e in eviction.evict(store, "x")] == ["evicted"]
    assert on_node(small) == [] and not verifying.verify(store, "x").ok


def tier_files(env: Env) -> list[tuple[str, int]]:
    root = env.tier_root()
    return sorted((str(p.relative_to(root)), p.lstat().st_ino) for p in root.rglob("*"))


def test_the_dry_run_names_the_evictions_the_stage_then_makes_and_does_nothing(small: Env):
    """dsstage prolog --dry-run and the Prolog decide with the same plan (staging.plan_fill,
    eviction.room_for): what the dry run says it would evict is what the stage evicts."""
    from dsstage.hooks import dryrun
    store = x_and_y_released_y_wanted(small)
    before = tier_files(small)
    [step] = dryrun.prolog(small.config(), store, Job("3", User.lookup().name, "RUNNING", ("z",), nodes=small.node))
    assert (step.verdict.action, step.verdict.reason) == ("local", "staged"), step.notes
    evicts = [n for n in step.notes if n.startswith("make room: evict ")]
    assert len(evicts) == 1 and evicts[0].startswith("make room: evict x "), step.notes
    assert tier_files(small) == before  # no lease, no lock file, no eviction, no staging area
    staging.stage(store, "z", request("3"))
    assert on_node(small) == ["y", "z"]


def test_the_dry_run_of_a_dataset_whose_source_breaker_is_open_falls_back_as_the_stage_does(env: Env):
    from dsstage.hooks import dryrun
    from dsstage.node import breaker
    src = env.add("ds", {"a": b"1" * 100})
    manifest(env, "ds")
    conf = env.config()
    key = breaker.key_of(conf, conf.datasets["ds"])
    now = time.time()
    breaker.write(conf.state_dir, key, {"source": key, "by": "n9", "since": now - 30, "reason": "timed out",
                                        "probe_after": now + 600, "probe_by": "n9"})
    [step] = dryrun.prolog(conf, env.store(), Job("1", User.lookup().name, "RUNNING", ("ds",), nodes=env.node))
    assert step.verdict.action == "fallback" and step.verdict.path == str(src), step.verdict
    assert f"the breaker of {key} is open" in step.verdict.reason
    with pytest.raises(SourceError, match=f"the breaker of {key} is open"):
        staging.stage(env.store(), "ds", request("1"))
