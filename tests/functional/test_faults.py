"""Faults injected where they happen: every one ends in a decision (local, fallback, hold,
drain), only a failing local store drains, and no job runs with an empty path in silence."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from dsstage.config import manifest as config_manifest
from dsstage.config.catalog import User
from dsstage.errors import NoSpace, OutOfTime, StateError, UnsafeStore
from dsstage.fs import runfiles, safe
from dsstage.hooks import bounded
from dsstage.hooks import job as hooks
from dsstage.node import inventory, space, staging
from dsstage.node.store import open_tier
from dsstage.slurm.fake import FakeSlurm
from dsstage.transfer import copier
from helpers import Env, python_copier

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")


def job_env(env: Env, request: str = "coco", job: str = "42") -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
            "SLURMD_NODENAME": env.node, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": request}


def task_lines(run: Path, env: Env, job: str = "42") -> list[str]:
    return (run / env.node / "jobs" / f"{job}.task").read_text().splitlines()


@pytest.fixture
def coco(env: Env) -> Path:
    src = env.add("coco", {"a": b"1" * 1000, "d/b": b"2" * 3000})
    env.cli("manifest", "build", "coco")
    return src


def prolog(env: Env, run: Path, slurm: FakeSlurm | None = None, **kw) -> int:
    return hooks.prolog(job_env(env, **{k: kw.pop(k) for k in ("request", "job") if k in kw}), run_dir=str(run),
                        slurm=slurm or FakeSlurm(), load_config=env.config, **kw)


def test_estale_on_the_state_directory_falls_back_with_a_warning(env: Env, coco: Path, tmp_path, monkeypatch):

    def stale(state_dir: str, name: str) -> str:
        raise OSError(errno.ESTALE, "Stale file handle")
    monkeypatch.setattr(config_manifest, "read_current", stale)
    run = tmp_path / "run"
    assert prolog(env, run) == 0  # never a drain
    lines = task_lines(run, env)
    assert f"export DSSTAGE_DATASET_DIR={coco}" in lines  # the source, never an empty path
    assert any(line.startswith("print dsstage: warning:") and "Stale file handle" in line for line in lines)


def test_state_directory_error_is_the_sites(env: Env, coco: Path, monkeypatch):
    monkeypatch.setattr(config_manifest, "read_current", lambda *_a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    from dsstage.config.catalog import User
    with pytest.raises(StateError, match="shared state directory") as err:
        staging.stage(env.store(), "coco", staging.StageRequest(user=User.lookup(0), job_id="1"))
    assert err.value.blame == "site"


def test_eio_reading_the_source_falls_back_or_holds_never_drains(env: Env, coco: Path, tmp_path, monkeypatch):
    python_copier(monkeypatch)  # its reads fail here; the native copier's: test_native_copier.py
    real = os.read

    def eio(fd: int, n: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(coco)):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n)
    monkeypatch.setattr(copier.os, "read", eio)
    run, slurm = tmp_path / "run", FakeSlurm()
    assert prolog(env, run, slurm) == 0
    assert f"export DSSTAGE_DATASET_DIR={coco}" in task_lines(run, env) and slurm.held == {}
    env.add("strict", {"x": b"x"}, on_failure="hold")
    env.cli("manifest", "build", "strict")
    monkeypatch.setattr(copier.os, "read", lambda fd, n: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    assert prolog(env, run, slurm, request="strict", job="43") == 0
    assert "I/O" in slurm.held["43"] and runfiles.HOLD_MARK in task_lines(run, env, "43")


def test_eio_reading_the_local_copy_is_the_nodes_fault(env: Env, coco: Path, tmp_path, monkeypatch):
    """A failing NVMe under a ready copy is a broken local store (StoreError: the Prolog drains),
    never a mismatch blamed on the source ("run manifest build") that is fetched again. The
    Python hashing path (the native one meets a real failing disk in test_native_check)."""
    from dsstage.config.catalog import User
    from dsstage.errors import StoreError
    from dsstage.node import verifying
    from dsstage.transfer import hashing
    python_copier(monkeypatch)
    store = env.store()
    path = staging.stage(store, "coco", staging.StageRequest(user=User.lookup(0), job_id="1")).path
    real = os.pread

    def eio(fd: int, n: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(path):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)
    monkeypatch.setattr(hashing.os, "pread", eio)
    with pytest.raises(StoreError, match="Input/output error") as err:
        verifying.verify(store, "coco", full=True)
    assert err.value.blame == "node"
    monkeypatch.setattr(hashing.os, "pread", real)
    assert verifying.verify(store, "coco", full=True).ok  # nothing was removed or fetched again meanwhile


def test_a_tier_without_posix_acls_holds_a_several_group_dataset_never_drains(env: Env, tmp_path, monkeypatch):
    """A dataset restricted to several groups needs a POSIX ACL on its tier. A filesystem
    without them is a configuration problem: check-config says so where the tier is, and a
    Prolog that meets it holds the job with the reason; the node stays up."""
    import grp

    from dsstage.cli.admin import tier_problems
    groups = sorted(g.gr_name for g in grp.getgrall())[:2]
    env.add("shared", {"x": b"x" * 100}, groups=groups, on_failure="hold")
    env.cli("manifest", "build", "shared")
    (env.tier_root()).mkdir(parents=True)
    assert tier_problems(env.config(), env.node) == []  # this test's disk has POSIX ACLs
    real = os.setxattr

    def no_acl(path, name, value, *a, **k):
        if name == "system.posix_acl_access":
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real(path, name, value, *a, **k)
    monkeypatch.setattr(os, "setxattr", no_acl)
    [problem] = tier_problems(env.config(), env.node)
    assert (problem.level, problem.key) == ("error", "tiers.nvme")
    assert "without POSIX ACLs" in problem.message and "shared name several groups" in problem.message
    from dsstage.cli import main as cli
    assert cli.main(["--config", str(env.config_path), "--node", env.node, "check-config"]) == 78  # EX_CONFIG
    run, slurm = tmp_path / "run", FakeSlurm()
    assert prolog(env, run, slurm, request="shared") == 0  # never a drain
    assert "no POSIX ACLs" in slurm.held["42"] and "mount -o acl" in slurm.held["42"]
    assert runfiles.HOLD_MARK in task_lines(run, env)


def test_a_stage_that_does_not_fit_the_budget_decides_in_time_and_resumes(env: Env, tmp_path, monkeypatch):
    python_copier(monkeypatch)  # slowed below; the native copier's deadline: test_native_copier.py
    src = env.add("big", {f"f{i:03d}": os.urandom(20_000) for i in range(200)})
    env.cli("manifest", "build", "big")
    store = env.store()
    from dsstage.config.catalog import User
    real = copier._copy_one
    copied = []

    def slow(*args, **kw):
        time.sleep(0.1)  # a slow source: even with many files in flight, 200 take over 0.3 s
        copied.append(1)
        return real(*args, **kw)
    copier._copy_one, saved = slow, copier._copy_one
    try:
        with pytest.raises(OutOfTime, match="next stage resumes"):
            staging.stage(store, "big",
                          staging.StageRequest(user=User.lookup(0), job_id="1", deadline=time.monotonic() + 0.3))
    finally:
        copier._copy_one = saved
    staging_dir = env.tier_root() / "staging"
    kept = [p for p in staging_dir.rglob("*") if p.is_file()]
    assert 0 < len(kept) < 200 and not (env.tier_root() / "ready" / "big").exists()
    # the Prolog with a budget already spent: decides at once, per policy, and keeps the work
    run = tmp_path / "run"
    t = time.monotonic()
    assert prolog(env, run, request="big", started=time.monotonic() - 10_000) == 0
    assert time.monotonic() - t < 5
    assert f"export DSSTAGE_DATASET_DIR={src}" in task_lines(run, env)
    # the next stage resumes: it copies only what is missing
    again = env.cli_json("stage", "big", "--job-id", "2")
    assert again["action"] == "staged" and again["transferred_files"] <= 200 - len(kept)


def test_a_full_tier_mid_copy_is_no_space_and_the_left_staging_area_is_counted(env: Env, coco: Path, tmp_path,
                                                                                 monkeypatch):
    python_copier(monkeypatch)  # its writes fail here; the native copier's: test_native_copier.py
    real = safe.write_all
    staging = str(env.tier_root() / "staging")

    def enospc(fd: int, data: bytes) -> None:  # the tier's filesystem is full, nothing else
        if os.readlink(f"/proc/self/fd/{fd}").startswith(staging):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)
    monkeypatch.setattr(copier.safe, "write_all", enospc)
    run, slurm = tmp_path / "run", FakeSlurm()
    assert prolog(env, run, slurm) == 0 and slurm.held == {}
    assert any("filesystem is full" in line for line in task_lines(run, env))
    reserved = os.listdir(env.tier_root() / "reserved")
    assert reserved and all(r.startswith("stage-coco.") for r in reserved)  # counted until resumed or removed
    monkeypatch.undo()
    assert env.cli_json("stage", "coco", "--job-id", "2")["action"] == "staged"
    assert os.listdir(env.tier_root() / "reserved") == []  # the mark counts it now
    evicted = env.cli_json("evict", "coco")
    assert [e["action"] for e in evicted] == ["kept"]


def test_a_full_tier_as_the_copy_is_published_leaves_it_resumable_and_counted_once(env: Env, coco: Path,
                                                                                   tmp_path, monkeypatch):
    """The filesystem fills exactly when the ready mark is written: nothing is published, the
    copy goes back to its staging area (which its reservation counts) and the next stage
    publishes it without copying again; no reservation outlives it."""
    real = safe.write_json_at
    ready = str(env.tier_root() / "ready")

    def enospc(fd: int, name: str, data, **kw) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(ready):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, name, data, **kw)
    monkeypatch.setattr(safe, "write_json_at", enospc)
    with pytest.raises(NoSpace):
        staging.stage(env.store(), "coco", staging.StageRequest(user=User.lookup(0), job_id="1"))
    monkeypatch.undo()
    tier = env.tier_root()
    assert os.listdir(tier / "datasets" / "coco") == []  # nothing published
    areas = os.listdir(tier / "staging")
    assert [f"stage-{a}.json" for a in areas] == os.listdir(tier / "reserved"), (areas, os.listdir(tier / "reserved"))
    again = env.cli_json("stage", "coco", "--job-id", "2")
    assert again["action"] == "staged" and again["transferred_files"] == 0, again
    assert os.listdir(tier / "reserved") == []


def test_a_reservation_of_a_gone_stage_that_left_nothing_is_reclaimed(env: Env, coco: Path):
    """A stage killed between its reservation and its staging area (or one that took its area
    away) leaves a record nothing holds: it counts for nothing and the next stage removes it.
    A gone stage's area that still holds data keeps counting until the dataset's next stage."""
    env.cli("stage", "coco", "--job-id", "1")
    tier = env.tier_root()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    reserved = tier / "reserved"
    (reserved / "stage-gone.0123456789abcdef.json").write_text(json.dumps(
        {"bytes": 10**9, "pid": int(dead), "since": time.time() - 5, "what": "dataset 'gone'"}))
    (tier / "staging" / "left.0123456789abcdef").mkdir(mode=0o700)
    (reserved / "stage-left.0123456789abcdef.json").write_text(json.dumps(
        {"bytes": 5, "pid": int(dead), "since": time.time() - 5, "what": "dataset 'left'"}))
    (reserved / "stage-live.0123456789abcdef.json").write_text(json.dumps(
        {"bytes": 7, "pid": os.getpid(), "since": time.time(), "what": "dataset 'live'"}))
    with open_tier(env.store().layout("nvme")) as root:
        assert space.usage(root).reserved == 12  # the gone stage's record without an area: nothing
    (coco / "new").write_bytes(b"n")
    env.cli("manifest", "build", "coco")
    env.cli("stage", "coco", "--job-id", "2")  # its reservation reclaims the orphan
    assert sorted(os.listdir(reserved)) == ["stage-left.0123456789abcdef.json", "stage-live.0123456789abcdef.json"]


def test_a_prolog_that_stops_waiting_for_a_stage_names_its_budget(env: Env, coco: Path, tmp_path):
    """Another stage holds the dataset's lock past what is left of the Prolog's budget: the job
    falls back, and the reason names the budget, not lock_timeout (6 h, not what ended the wait)."""
    from dsstage.node.lock import DatasetLock
    store = env.store()
    budget = store.config.prolog_budget
    run = tmp_path / "run"
    with DatasetLock(store.layout("nvme").lock("coco"), timeout=5, what="coco"):
        assert prolog(env, run, started=time.monotonic() - budget + bounded.DECIDE_MARGIN + 1.5) == 0
    lines = task_lines(run, env)
    assert any(f"prolog_budget: {budget:g}s" in line for line in lines), lines
    assert not any("lock_timeout" in line for line in lines), lines


def test_superseded_staging_areas_are_removed_and_shown(env: Env, coco: Path):
    left = env.tier_root() / "staging" / "coco.0123456789abcdef"
    env.cli("stage", "coco", "--job-id", "1")
    left.mkdir(mode=0o700)
    (left / "partial").write_bytes(b"p")
    rows = inventory.build(env.store())["copies"]
    assert {"dataset": "coco", "version": "0123456789abcdef", "state": "interrupted"}.items() <= \
        next(r for r in rows if r["version"] == "0123456789abcdef").items()
    (coco / "new").write_bytes(b"n")
    env.cli("manifest", "build", "coco")
    env.cli("stage", "coco", "--job-id", "2")  # a new version: the left area of another is removed
    assert not left.exists()


def test_broken_run_directory_still_holds_an_unknown_dataset(env: Env, coco: Path, tmp_path):
    run = tmp_path / "run"
    run.write_text("not a directory")
    slurm = FakeSlurm()
    assert prolog(env, run, slurm, request="cocoa") == 0
    assert "unknown dataset 'cocoa'" in slurm.held["42"] and "run directory" in slurm.held["42"]


def test_a_store_directory_replaced_by_a_file_ends_in_a_decision(env: Env, coco: Path, tmp_path):
    env.cli("stage", "coco", "--job-id", "1")
    leases = env.tier_root() / "leases" / "coco"
    for p in leases.iterdir():
        p.unlink()
    leases.rmdir()
    leases.write_text("x")
    run, slurm = tmp_path / "run", FakeSlurm()
    assert prolog(env, run, slurm) == 0
    lines = task_lines(run, env)
    assert f"export DSSTAGE_DATASET_DIR={coco}" in lines  # fell back, with the reason
    assert any("leases/coco" in line and "not a directory" in line for line in lines)


def test_an_unexpected_error_holds_the_job(env: Env, coco: Path, tmp_path, monkeypatch):
    slurm = FakeSlurm()
    monkeypatch.setattr(hooks, "_slurm", lambda: slurm)
    monkeypatch.setattr(hooks, "prolog", lambda *a, **k: 1 / 0)
    for k, v in {**job_env(env), "DSSTAGE_RUN_DIR": str(tmp_path / "run"), "DSSTAGE_CONFIG": str(env.config_path),
                 "DSSTAGE_LOG": str(tmp_path / "log")}.items():
        monkeypatch.setenv(k, v)
    assert hooks.main(["prolog"]) == 0
    assert "ZeroDivisionError" in slurm.held["42"] and runfiles.HOLD_MARK in task_lines(tmp_path / "run", env)


def test_verify_full_that_cannot_repair_leaves_no_ready_copy(env: Env, coco: Path):
    path = Path(env.cli_json("stage", "coco", "--job-id", "1")["path"])
    victim = path / "a"
    os.chmod(victim, 0o644)
    victim.write_bytes(b"X" * 1000)
    (coco / "a").write_bytes(b"Y" * 1000)  # the source cannot repair it either
    res = env.cli("verify", "coco", "--full", check=False)
    assert res.returncode == 65 and "flagged bad" in res.stderr
    quick = env.cli("verify", "coco", "--json", check=False)
    assert quick.returncode == 1 and json.loads(quick.stdout)["ok"] is False and "known to be damaged" in quick.stdout
    assert env.cli("stage", "coco", "--job-id", "2", check=False).returncode == 65


def test_unsafe_tier_is_refused_with_the_path_and_never_drains(env: Env, coco: Path, tmp_path):
    tier = env.tier_root()
    tier.mkdir(parents=True)
    os.chmod(tier, 0o777)
    res = env.cli("stage", "coco", "--job-id", "1", check=False)
    assert res.returncode == UnsafeStore.exit_code and f"{tier} is writable by group or others" in res.stderr
    assert res.stderr.count("\n") == 1
    run, slurm = tmp_path / "run", FakeSlurm()
    assert prolog(env, run, slurm) == 0 and f"export DSSTAGE_DATASET_DIR={coco}" in task_lines(run, env)


def test_a_dataset_of_many_directories_stages_under_a_low_descriptor_limit(env: Env, tmp_path):
    """One directory per sample (1,500 of them) under RLIMIT_NOFILE=1024, as slurmd may give its
    Prolog: the staging area's directories are held open a bounded number at a time."""
    import resource
    env.add("persample", {f"class{i:04d}/img.jpg": bytes([i % 256]) * 64 for i in range(1500)})
    env.cli("manifest", "build", "persample")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    res = subprocess.run([sys.executable, "-m", "dsstage", "stage", "persample", "--job-id", "7", "--json"],
                         env=env.env(), capture_output=True, text=True, preexec_fn=low_limit, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["transferred_files"] == 1500
    assert env.cli_json("verify", "persample", "--full")["ok"] is True


def test_running_out_of_descriptors_is_never_the_nodes_fault():
    from dsstage.errors import OutOfDescriptors, local_error
    err = local_error(OSError(errno.EMFILE, "Too many open files"), "staging 'x'")
    assert isinstance(err, OutOfDescriptors) and err.blame == "site" and "LimitNOFILE" in str(err)
    assert hooks.on_failure("x", None, err).action == "hold"  # never "drain"


def test_failed_lookups_leave_no_more_than_the_bound_of_directories_open(tmp_path):
    from dsstage.fs.beneath import Tree
    root = tmp_path / "tree"
    for i in range(200):
        (root / f"d{i:03d}" / "sub").mkdir(parents=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Tree(fd, max_open=16) as tree:
            for i in range(200):
                with pytest.raises(FileNotFoundError):
                    with tree.opened(f"d{i:03d}/sub/missing"):
                        pass
                assert tree.open_count() <= 16
    finally:
        os.close(fd)


def test_a_tier_on_the_root_filesystem_is_an_unmounted_disk_the_node_drains_and_nothing_is_written(
        env: Env, coco: Path, tmp_path, on_root_filesystem: Path):
    """/local/nvme not mounted: its directory is on /. A tier not meant to be there
    (no root_filesystem: true) is refused before anything is created: the Prolog exits 1 (the
    node's store is broken: drain), with the reason, and the tier's directory is never made."""
    env.nvme = on_root_filesystem / "nvme"  # (not under tmp_path: /tmp may be a tmpfs)
    env.write()
    data = yaml.safe_load(env.config_path.read_text())
    data["tiers"]["nvme"]["root_filesystem"] = False
    env.config_path.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    slurm = FakeSlurm()
    assert prolog(env, run, slurm) == 1
    assert not env.nvme.exists()  # no directory of the tier was created on /
    # the reason, where the admin reads it (sinfo -R)
    assert "tier nvme: " in slurm.drained[env.node] and "is the disk mounted?" in slurm.drained[env.node]
    problem = safe.root_filesystem_problem(str(env.tier_root()))
    assert problem and f"{env.tier_root()} (missing; {on_root_filesystem} exists) is on the root filesystem: " \
        "is the disk mounted?" in problem
    with pytest.raises(Exception, match="tier nvme: .* is on the root filesystem: is the disk mounted"):
        from dsstage.config.catalog import User
        staging.stage(env.store(), "coco", staging.StageRequest(user=User.lookup(0), job_id="1"))
    assert not env.nvme.exists()


def test_root_filesystem_problem_walks_up_to_what_exists():
    devs = {"/": 1, "/local": 1, "/local/nvme": 2, "/mnt": 1}

    def lstat(path: str) -> os.stat_result:
        if path not in devs:
            raise FileNotFoundError(path)
        return os.stat_result((0o40755, 0, devs[path], 2, 0, 0, 0, 0, 0, 0))
    assert safe.root_filesystem_problem("/local/nvme/dsstage", lstat) is None  # mounted: its own device
    assert safe.root_filesystem_problem("/local/nvme", lstat) is None
    problem = safe.root_filesystem_problem("/mnt/nvme/dsstage", lstat)
    assert problem and problem.startswith("/mnt/nvme/dsstage (missing; /mnt exists) is on the root filesystem")
    devs["/local/nvme"] = 1  # not mounted: the mount point is a directory of /
    assert "/local/nvme/dsstage (missing; /local/nvme exists) is on the root filesystem" in \
        (safe.root_filesystem_problem("/local/nvme/dsstage", lstat) or "")


def test_a_resumed_staging_area_keeps_what_it_holds_and_loses_what_was_planted(tmp_path):
    """fill() reads what a staging area holds from its directories' listings (no stat of each
    file): files already there are checked, not copied again; a link, a FIFO, a stray file
    and a stray directory are removed, and nothing is followed out of the area."""
    from dsstage.config.model import Source
    from dsstage.errors import StoreError
    from dsstage.fs.beneath import Tree
    from dsstage.node import stager
    from dsstage.transfer import build
    from dsstage.transfer.transport import Area, for_source
    src = tmp_path / "src"
    for i in range(30):
        (src / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 3}" / f"f{i}").write_bytes(os.urandom(i * 100))
    manifest = build.build("ds", str(src)).manifest
    area = tmp_path / "staging"
    (area / "d0").mkdir(parents=True)
    (area / "d0" / "f0").write_bytes(b"")  # the copier's own, from an interrupted stage
    os.utime(area / "d0" / "f0", ns=(next(e for e in manifest.entries if e.path == "d0/f0").mtime_ns,) * 2)
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (area / "d1").symlink_to(outside / "keep")  # where a directory of the dataset belongs
    os.mkfifo(area / "d0" / "pipe")
    (area / "stray").mkdir()
    (area / "stray" / "x").write_bytes(b"x")
    (area / "d0" / "f3-extra").write_bytes(b"y")
    kept = os.stat(area / "d0" / "f0").st_ino
    fd = os.open(area, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Tree(fd) as tree:
            kinds = {rel: kind for _fd, found in tree.listing() for _n, rel, kind in found}
        assert kinds["d1"] == 0 and kinds["d0/pipe"] == 0 and kinds["d0/f0"] == stat.S_IFREG
        assert kinds["stray"] == stat.S_IFDIR and "stray/x" in kinds
        with Tree(fd) as tree:  # the lookup the peers' rounds use: the same answers, one path at a time
            assert tree.exists("d0/f0") and tree.exists("d0/pipe") and tree.exists("stray")
            assert not tree.exists("d0/f3") and not tree.exists("d2/f2")
            (outside / "keep" / "f1").write_bytes(b"z")
            assert not tree.exists("d1/f1")  # behind the link: never followed
            (outside / "keep" / "f1").unlink()
        where = Area(fd, str(area))
        transport = for_source(Source(str(src), "local", str(src)), where)
        with pytest.raises(StoreError, match="making its directories: Not a directory"):  # never followed
            stager.fill(where, manifest, transport)
        os.unlink(area / "d1")
        report = stager.fill(where, manifest, transport)
    finally:
        os.close(fd)
    assert report.transferred.files == 29 and os.stat(area / "d0" / "f0").st_ino == kept  # checked, not copied
    assert report.removed_extras == 3  # the FIFO, the stray file, the stray directory (with its file)
    assert not any((outside / "keep").iterdir())
    got = sorted(str(p.relative_to(area)) for p in area.rglob("*") if p.is_file())
    assert got == sorted(e.path for e in manifest.entries)
    assert all((area / e.path).read_bytes() == (src / e.path).read_bytes() for e in manifest.entries)
