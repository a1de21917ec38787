"""A latency-bound source (latencyfs: every lookup, open and read waits one round trip):
the copier and the manifest build put many requests in flight there, and never more than
``transfer.max_parallel``."""

from __future__ import annotations

import os
from pathlib import Path

import latencyfs
import pytest
from helpers import Env
from latencyfs import LatencyFS

DELAY_US = 3000  # a slow network filesystem: more in flight pays off whatever the machine's noise
FILES = 400


@pytest.fixture
def slow_source(env: Env, tmp_path):
    """Dataset "remote" whose configured source is a latencyfs mount over its files."""
    latencyfs.require()
    backing = tmp_path / "backing"
    for d in range(4):
        (backing / f"d{d}").mkdir(parents=True)
        for i in range(FILES // 4):
            (backing / f"d{d}" / f"f{i:03d}.bin").write_bytes(os.urandom(20_000))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with LatencyFS(backing, mnt, delay_us=DELAY_US) as fs:
        env.add("remote", source=str(mnt))
        yield fs, backing


def stage_with(env: Env, source: tuple[LatencyFS, Path], bound: int) -> dict:
    fs, backing = source
    env.extra["transfer"] = {"max_parallel": bound}
    env.write()
    for i, f in enumerate(sorted(backing.rglob("*.bin"))):  # a new version: every file is hashed again
        os.utime(f, ns=(bound * 10**9 + i, bound * 10**9 + i))
    fs.remount()
    fs.reset()
    env.cli("manifest", "build", "remote")
    build = fs.stats()
    fs.remount()
    fs.reset()
    done = env.cli_json("stage", "remote", "--job-id", "1")
    assert done["action"] == "staged" and done["transferred_files"] == FILES
    copy = fs.stats()
    env.cli("release", "remote", "--job-id", "1")
    env.cli("evict", "remote", "--force")
    fs.remount()
    fs.reset()
    return {"build": build, "copy": copy}


def test_the_copier_and_the_manifest_build_respect_max_parallel(env: Env, slow_source: tuple[LatencyFS, Path]):
    bounded = stage_with(env, slow_source, 3)
    # the emulation counts every request the kernel sends it: opens in flight are files in flight
    assert 2 <= bounded["copy"]["peak_opens_in_flight"] <= 3, bounded["copy"]
    assert bounded["build"]["peak_opens_in_flight"] <= 3 and bounded["build"]["ops"]["open"] == FILES
    assert bounded["copy"]["ops"]["open"] == FILES
    # the same stage allowed 64: it climbs past 3 (so the bound above is what held it)
    free = stage_with(env, slow_source, 64)
    assert free["copy"]["peak_opens_in_flight"] > 3, free["copy"]
    assert free["build"]["peak_opens_in_flight"] > 3, free["build"]


def test_max_parallel_is_checked(env: Env):
    env.add("x", {"a": b"a"})
    for bad in (0, 2.5, 5000, "many"):
        env.extra["transfer"] = {"max_parallel": bad}
        env.write()
        res = env.cli("check-config", check=False)
        assert res.returncode != 0 and "transfer.max_parallel" in res.stderr, (bad, res.stderr)


def test_three_nodes_staging_at_once_share_the_sources_budget(env: Env, slow_source: tuple[LatencyFS, Path]):
    """sources.<name>.max_in_flight is the source's budget for all nodes at once: the three
    nodes of a job staging together stay within it, while one node alone still climbs past a
    third of it (up to all of it)."""
    import threading

    from dsstage.config.catalog import User
    from dsstage.node import staging
    fs, backing = slow_source
    env.extra["sources"] = {"nfs": {"prefix": str(fs.mountpoint), "max_in_flight": 12}}
    env.write()
    env.cli("manifest", "build", "remote")
    root = User.lookup(0)

    def stage_on(nodes: tuple[str, ...], job: str) -> dict:
        fs.remount()
        fs.reset()
        errors: list[BaseException] = []

        def one(node: str) -> None:
            try:
                staging.stage(env.store(node=node), "remote",
                              staging.StageRequest(user=root, job_id=job, nodes=",".join(nodes)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=one, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        return fs.stats()

    together = stage_on(("n1", "n2", "n3"), "1")
    assert together["peak_opens_in_flight"] <= 12, together  # 4 each
    alone = stage_on(("n4",), "2")
    assert alone["peak_opens_in_flight"] > 12 // 3, alone  # the whole budget is its own
    assert alone["peak_opens_in_flight"] <= 12, alone


def test_separate_jobs_on_separate_nodes_stay_within_the_sources_budget_together(env: Env,
                                                                                slow_source: tuple[LatencyFS, Path]):
    """The budget is the cluster's, not one job's: two one-node jobs of their own staging from
    the source at once on two nodes keep within max_in_flight together (before, each took the
    whole budget: twice it in flight); the grants are given back when the stages end."""
    import threading

    from dsstage.config.catalog import User
    from dsstage.node import staging
    fs, _backing = slow_source
    env.extra["sources"] = {"nfs": {"prefix": str(fs.mountpoint), "max_in_flight": 6}}
    env.write()
    env.cli("manifest", "build", "remote")
    fs.remount()
    fs.reset()
    errors: list[BaseException] = []

    def one(node: str, job: str) -> None:
        try:
            staging.stage(env.store(node=node), "remote", staging.StageRequest(user=User.lookup(0), job_id=job))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(n, j)) for n, j in (("n1", "11"), ("n2", "12"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stats = fs.stats()
    assert stats["peak_opens_in_flight"] <= 6, stats
    assert not [p for p in (env.state / "budget" / "nfs").iterdir() if p.name.endswith(".json")]
