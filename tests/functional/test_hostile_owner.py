"""A hostile data owner (issue 51): trusted with their own dataset's bytes and manifest
directory (``<state_dir>/manifests/<name>``), nothing else. What they write there is data that
root reads without blocking, following links or trusting sizes. Each test plants one thing
in the owner's directory of dataset ``evil`` and runs, side by side, what root runs for the
other datasets on the node and the cluster: the Prolog and Epilog of a job of ``coco``, the
report refresh, the retention plan, the demand poller's rounds (with the manifest GC) and the
export of the catalog. None may hang (each runs under a timeout far below the Prolog's
budget), none may drain the node (exit 0), ``coco`` stays staged and served, and ``evil``'s
own jobs get its ``on_failure``, with a line that names the file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dsstage.cluster import manifests_gc
from dsstage.config import manifest as config_manifest
from dsstage.config.manifest import Entry, Manifest
from helpers import Env, run_hook

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

#: every command here answers within this (the Prolog's budget is 5 minutes): a hang fails
QUICK = 60


@pytest.fixture
def two(env: Env) -> Env:
    """``coco`` (an honest dataset) and ``evil`` (its owner's directory is the attack), both
    built; the jobs of ``evil`` fall back to its source."""
    env.add("coco", {"a": b"1" * 5000, "d/b": b"2" * 700})
    env.add("evil", {"x": b"x" * 100}, on_failure="fallback")
    env.cli("manifest", "build", "coco")
    env.cli("manifest", "build", "evil")
    return env


def owner_dir(env: Env) -> Path:
    return env.state / "manifests" / "evil"


def plant_current(env: Env, what: str) -> None:
    current = owner_dir(env) / "CURRENT"
    current.unlink()
    if what == "fifo":
        os.mkfifo(current)
    elif what == "link":
        current.symlink_to("/dev/zero")
    elif what == "huge":
        with open(current, "wb") as fh:
            fh.truncate(2**40)  # sparse: a terabyte that costs nothing


def the_rest_keeps_working(env: Env, job: str) -> list[str]:
    """Everything root runs for the other datasets, each bounded: the Prolog and Epilog of a
    job of coco, the report, the retention plan, two poller rounds, the GC and the catalog;
    the task lines of the coco job."""
    rc, took, lines = run_hook(env, "prolog", job, "coco", timeout=QUICK)
    assert rc == 0 and took < QUICK, (rc, took, (env.tmp / "hooks.log").read_text())
    assert any(line.startswith("export DSSTAGE_PATH_COCO=" + str(env.tier_root())) for line in lines), lines
    assert run_hook(env, "epilog", job, "coco", timeout=QUICK)[0] == 0
    env.cli("report", timeout=QUICK)
    env.cli("status", "--no-queue", timeout=QUICK)
    env.cli("evict", "--dry-run", timeout=QUICK)
    env.cli("export-catalog", "-o", str(env.tmp / "catalog.lua"), timeout=QUICK)
    # two rounds of the demand poller (the leader's next one as well: it did not stop after
    # one) and the GC, in a child: a hang must fail the test, not stop the suite
    res = subprocess.run([sys.executable, "-c", POLLER_ROUNDS, str(env.config_path)], capture_output=True, text=True,
                         timeout=QUICK, env=env.env())
    assert res.returncode == 0 and res.stdout.split() == ["coco", "coco"], res.stderr
    return lines


POLLER_ROUNDS = """
import sys, time
from dsstage.cluster import manifests_gc, poller
from dsstage.config import load
from dsstage.slurm.fake import FakeSlurm
from dsstage.slurm.records import Job
conf = load.load(sys.argv[1])
slurm = FakeSlurm()
slurm.submit(Job("90", "alice", "PENDING", ("coco",), partition="debug"))
for _round in range(2):
    print(" ".join(sorted(poller.poll_once(conf, slurm).datasets)))
manifests_gc.prune(conf, time.time() + 10 * 365 * 86400)
"""


@pytest.mark.parametrize("what", ["fifo", "link", "huge"])
def test_a_current_that_is_not_a_small_file_costs_only_its_own_dataset(two: Env, what: str):
    plant_current(two, what)
    the_rest_keeps_working(two, "11")
    rc, took, lines = run_hook(two, "prolog", "12", "evil", timeout=QUICK)
    assert rc == 0 and took < QUICK  # never a drain, never the whole budget
    assert any(line == f"export DSSTAGE_PATH_EVIL={two.source('evil')}" for line in lines), lines  # its on_failure
    assert "CURRENT" in (two.tmp / "hooks.log").read_text()
    res = two.cli("ls", "--json", check=False, timeout=QUICK)
    assert "CURRENT" in res.stdout + res.stderr


def test_a_manifest_linked_to_dev_zero_is_refused_not_read(two: Env):
    digest = config_manifest.Catalog(str(two.state)).current("evil")
    path = owner_dir(two) / f"{digest}.manifest"
    path.unlink()
    path.symlink_to("/dev/zero")
    the_rest_keeps_working(two, "21")
    rc, _took, lines = run_hook(two, "prolog", "22", "evil", timeout=QUICK)
    assert rc == 0 and any(line == f"export DSSTAGE_PATH_EVIL={two.source('evil')}" for line in lines), lines
    assert "symbolic link" in (two.tmp / "hooks.log").read_text()
    with pytest.raises(config_manifest.ManifestError, match="symbolic link"):
        config_manifest.read_header(str(path))


def lying(env: Env, sizes: list[int]) -> Manifest:
    """A manifest of evil whose digest is right for lines with these sizes (an owner can write
    any such file), made current."""
    entries = [Entry(f"f{i}", size, 0, "0" * 64) for i, size in enumerate(sizes)]
    m = Manifest(name="evil", digest=config_manifest.compute_digest(entries), entries=entries,
                 total_bytes=sum(sizes), created=time.time(), source=str(env.source("evil")))
    config_manifest.Catalog(str(env.state)).publish(m)
    return m


@pytest.mark.parametrize("sizes", [[-(2**60) + 10, 2**60], [64 * 2**20, -64 * 2**20]], ids=["2**60", "64MiB"])
def test_a_manifest_with_a_negative_size_is_refused_by_line_and_never_drains(two: Env, sizes: list[int]):
    m = lying(two, sizes)
    line = 2 + next(i for i, size in enumerate(sizes) if size < 0)  # the header is line 1
    with pytest.raises(config_manifest.ManifestError, match=rf"evil/[0-9a-f]{{64}}\.manifest:{line}: the size '-"):
        config_manifest.read(config_manifest.Catalog(str(two.state)).path("evil", m.digest))
    rc, _took, lines = run_hook(two, "prolog", "31", "evil", timeout=QUICK)
    assert rc == 0, (two.tmp / "hooks.log").read_text()  # the node is not drained
    assert any(line == f"export DSSTAGE_PATH_EVIL={two.source('evil')}" for line in lines), lines
    assert not (two.tier_root() / "datasets" / "evil").exists() or \
        not any((two.tier_root() / "datasets" / "evil").iterdir())  # nothing landed on the tier
    the_rest_keeps_working(two, "32")


def test_a_directory_named_like_a_manifest_does_not_stop_the_gc_for_the_datasets_after_it(two: Env):
    catalog = config_manifest.Catalog(str(two.state))
    old_coco = catalog.current("coco")
    (two.source("coco") / "new").write_bytes(b"n")
    two.cli("manifest", "build", "coco")  # coco's first version is now superseded and held by nobody
    (owner_dir(two) / ("e" * 64 + ".manifest")).mkdir()
    os.utime(catalog.dir("coco") + "/CURRENT", (0, 0))
    os.utime(catalog.dir("evil") + "/CURRENT", (0, 0))
    removed = manifests_gc.prune(two.config(), time.time())
    assert ("coco", old_coco) in removed  # "coco" < "evil": a dataset sorted after it too
    two.add("zeta", {"z": b"z"})
    two.cli("manifest", "build", "zeta")
    old_zeta = catalog.current("zeta")
    (two.source("zeta") / "z").write_bytes(b"zz")
    two.cli("manifest", "build", "zeta")
    os.utime(catalog.dir("zeta") + "/CURRENT", (0, 0))
    assert ("zeta", old_zeta) in manifests_gc.prune(two.config(), time.time())
    assert (owner_dir(two) / ("e" * 64 + ".manifest")).is_dir()  # the owner's directory: theirs to remove


def test_a_shard_index_that_is_a_fifo_is_that_datasets_error(env: Env):
    env.add("parts", {f"p{i}": bytes([i]) * 100 for i in range(4)}, shards=2)
    env.add("coco", {"a": b"1"})
    env.cli("manifest", "build", "parts")
    env.cli("manifest", "build", "coco")
    digest = config_manifest.Catalog(str(env.state)).current("parts")
    index = env.state / "manifests" / "parts" / f"{digest}.shards-2.json"
    index.unlink()
    os.mkfifo(index)
    res = env.cli("export-catalog", "-o", str(env.tmp / "c.lua"), timeout=QUICK)
    assert "FIFO" in res.stderr
    assert run_hook(env, "prolog", "41", "coco", timeout=QUICK)[0] == 0
