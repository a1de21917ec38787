"""``start: at-once`` (dsstage.node.live): the job starts on a live view of a dataset still being
staged from a slow mounted source (latencyfs with a bandwidth limit), reads every file right
while the stage runs, and ends with every entry a hard link into the verified copy; a stage that
fails leaves the source's links and the next job resumes it; nothing unverified is ever linked.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest
from dsstage.node import live
from helpers import Env, write_tree
from helpers import run_hook as hook
from latencyfs import LatencyFS, require

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

#: 24 files of 256 KiB (6 MiB) from a source that delivers 1 MiB/s: about 6 s to stage
FILES = {f"d{i % 3}/f{i:02d}": bytes([i]) * (256 << 10) for i in range(24)}
RATE = 1 << 20
START_BUDGET = 1


def log(env: Env) -> str:
    path = env.tmp / "hooks.log"
    return path.read_text() if path.exists() else ""


@pytest.fixture
def slow_source(env: Env, tmp_path: Path):
    require()
    write_tree(tmp_path / "backing", FILES)
    with LatencyFS(tmp_path / "backing", tmp_path / "mnt", delay_us=0, rate=RATE) as fs:
        env.extra.update(prolog_budget=60, start_budget=START_BUDGET)
        env.add("coco", None, source=fs.mountpoint, start="at-once")
        env.cli("manifest", "build", "coco")
        yield fs
        wait_worker(env, fs)  # nothing may read the source once it is gone


def exported(lines: list[str], key: str = "DSSTAGE_DATASET_DIR") -> str:
    return next(line.split("=", 1)[1] for line in lines if line.startswith(f"export {key}="))


def record(env: Env, view: str) -> dict:
    import json
    path = Path(view).parent / f"{Path(view).name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def wait_worker(env: Env, fs: LatencyFS, timeout: float = 60) -> None:
    """Until every live view of coco is whole or failed (a view filling without a worker for
    3 s straight counts as stopped: its worker is gone)."""
    import json
    top = env.tier_root() / "live" / "coco"
    deadline = time.monotonic() + timeout
    idle_since = None
    while time.monotonic() < deadline:
        filling = [p.stem for p in top.glob("*.json") if json.loads(p.read_text()).get("state") == live.FILLING] \
            if top.exists() else []
        if not filling:
            return
        if any(worker_running(top, vid) for vid in filling):
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > 3:
            return
        time.sleep(0.1)
    raise AssertionError(f"the live view's worker did not end within {timeout}s: {log(env)}")


def worker_running(top: Path, vid: str) -> bool:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return live.worker_alive(fd, vid)
    finally:
        os.close(fd)


def kinds(view: str) -> dict[str, str]:
    out = {}
    for rel in FILES:
        st = os.lstat(os.path.join(view, rel))
        out[rel] = "link" if stat.S_ISLNK(st.st_mode) else "local" if stat.S_ISREG(st.st_mode) else "other"
    return out


def test_a_job_starts_at_once_reads_everything_while_it_stages_and_ends_on_the_verified_copy(env: Env,
                                                                                         slow_source: LatencyFS):
    rc, took, lines = hook(env, "prolog", "5")
    assert rc == 0, log(env)
    assert took < START_BUDGET + 3, (took, log(env))  # not the 6 s the stage takes
    view = exported(lines)
    assert view.startswith(str(env.tier_root() / "live" / "coco")), lines
    assert exported(lines, "DSSTAGE_LIVE_COCO") == view + ".json", lines
    seen = kinds(view)
    assert "link" in seen.values(), seen  # the source's files first
    # every file reads right while the stage runs, whichever it is now
    mixed = False
    for rel, data in FILES.items():
        assert Path(view, rel).read_bytes() == data, rel
        now = set(kinds(view).values())
        mixed = mixed or now == {"link", "local"}
    wait_worker(env, slow_source)
    rec = record(env, view)
    assert rec["state"] == live.WHOLE and rec["local"] == rec["files"] == len(FILES), (rec, log(env))
    copy = env.tier_root() / "datasets" / "coco" / Path(view).name
    for rel, data in FILES.items():
        st, cst = os.lstat(os.path.join(view, rel)), os.lstat(copy / rel)
        assert stat.S_ISREG(st.st_mode) and (st.st_ino, st.st_dev) == (cst.st_ino, cst.st_dev), rel
        assert Path(view, rel).read_bytes() == data
    assert mixed or slow_source.stats()["bytes_read"] >= sum(map(len, FILES.values())), \
        "files switched one by one while the job read (or the reads were all from the source)"
    # the view is root's and nobody else may change it
    for d, _dirs, _files in os.walk(view):
        st = os.lstat(d)
        assert st.st_uid == 0 and not st.st_mode & 0o022, d
    # the job's lease held the version from the start; the Epilog releases it
    assert (env.tier_root() / "leases" / "coco" / "5.json").exists()
    rc, _took, _ = hook(env, "epilog", "5")
    assert rc == 0 and not (env.tier_root() / "leases" / "coco" / "5.json").exists(), log(env)
    # the next job gets the ordinary copy at once
    rc, took, lines = hook(env, "prolog", "6")
    assert rc == 0 and exported(lines) == str(copy), lines


def test_files_switch_one_by_one_while_the_stage_runs(env: Env, slow_source: LatencyFS):
    rc, _took, lines = hook(env, "prolog", "5")
    assert rc == 0, log(env)
    view = exported(lines)
    states = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        k = kinds(view)
        states.append(sum(v == "local" for v in k.values()))
        if states[-1] == len(FILES):
            break
        time.sleep(0.2)
    wait_worker(env, slow_source)
    partial = [n for n in states if 0 < n < len(FILES)]
    assert len(set(partial)) >= 2, (states, log(env))  # more than one step between none and all
    assert states[-1] == len(FILES), (states, log(env))


def test_a_stage_that_fails_halfway_keeps_the_source_links_and_the_next_job_resumes_it(env: Env,
                                                                                     slow_source: LatencyFS):
    rc, _took, lines = hook(env, "prolog", "5")
    assert rc == 0, log(env)
    view = exported(lines)
    time.sleep(1.5)
    slow_source.fail_reads()
    wait_worker(env, slow_source)
    rec = record(env, view)
    assert rec["state"] == live.FAILED and "the next job's Prolog resumes" in rec["reason"], (rec, log(env))
    k = kinds(view)
    assert "link" in k.values(), k
    slow_source.fail_reads(False)
    for rel, data in FILES.items():  # every file still reads, local or from the source
        assert Path(view, rel).read_bytes() == data, rel
    shown = env.cli("status", "--no-queue").stdout
    assert "; live " in shown and "local, failed" in shown, shown
    import json
    copies = json.loads(env.cli("status", "--no-queue", "--json").stdout)["copies"]
    assert any((c.get("live") or {}).get("state") == live.FAILED for c in copies), copies
    # the next job of the same version: the same view, and a worker that resumes the stage
    rc, _took, lines = hook(env, "prolog", "6")
    assert rc == 0 and exported(lines) == view, (lines, log(env))
    wait_worker(env, slow_source)
    assert record(env, view)["state"] == live.WHOLE, (record(env, view), log(env))
    assert set(kinds(view).values()) == {"local"}


def test_a_file_that_fails_verification_is_never_linked(env: Env, slow_source: LatencyFS, tmp_path: Path):
    bad = "d1/f04"
    (tmp_path / "backing" / bad).write_bytes(b"x" * (256 << 10))  # the source lies about one file now
    rc, _took, lines = hook(env, "prolog", "5")
    assert rc == 0, log(env)
    view = exported(lines)
    wait_worker(env, slow_source)
    rec = record(env, view)
    assert rec["state"] == live.FAILED and bad in rec["reason"], (rec, log(env))
    k = kinds(view)
    assert k[bad] == "link", k  # still the source's: nothing unverified is linked
    for rel, kind in k.items():
        if kind == "local":
            assert Path(view, rel).read_bytes() == FILES[rel], rel


def test_at_once_is_refused_for_a_source_a_job_cannot_read(env: Env):
    env.add("remote", {"a": b"1"}, source="host:/export/remote", start="at-once")
    out = env.cli("check-config", check=False)
    assert out.returncode != 0, out.stdout
    assert "datasets.remote.start" in out.stdout + out.stderr and "not mounted" in out.stdout + out.stderr, out
    env.datasets["remote"].pop("start")
    env.extra["start"] = "at-once"  # the site's default: the datasets it can do
    env.write()
    conf = env.config()
    assert conf.datasets["remote"].start == "wait"


def test_a_source_that_hangs_keeps_the_view_and_the_next_job_starts_at_once(env: Env, slow_source: LatencyFS):
    """The worker's reads stop answering: the next job on the node finds the view and its worker
    at it (the dataset's lock held), and starts on the same view within its start budget; once
    the source answers again, the stage ends and every entry is local."""
    rc, _took, lines = hook(env, "prolog", "5")
    assert rc == 0, log(env)
    view = exported(lines)
    time.sleep(0.5)
    slow_source.hang()
    try:
        rc, took, lines = hook(env, "prolog", "6")
        assert rc == 0 and took < START_BUDGET + 3, (took, log(env))
        assert exported(lines) == view, lines
        assert record(env, view)["state"] == live.FILLING
    finally:
        slow_source.answer()
    wait_worker(env, slow_source)
    assert record(env, view)["state"] == live.WHOLE, (record(env, view), log(env))
    assert set(kinds(view).values()) == {"local"}


def worker_pid(env: Env, view: str, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = record(env, view).get("pid")
        if pid:
            return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"no worker noted in {view}.json: {log(env)}")


@pytest.mark.parametrize("reboot", [False, True], ids=["worker-killed", "node-rebooted"])
def test_a_worker_that_dies_is_replaced_by_the_next_job_and_a_view_of_another_boot_is_remade(
        env: Env, slow_source: LatencyFS, reboot: bool):
    rc, _took, lines = hook(env, "prolog", "5")
    assert rc == 0, log(env)
    view = exported(lines)
    os.kill(worker_pid(env, view), signal.SIGKILL)  # as a reboot stops it
    time.sleep(0.5)
    with _tier(env) as tier:
        assert live.read(tier, "coco", Path(view).name)["state"] == live.STOPPED
    before = os.lstat(view).st_ino
    if reboot:  # what the view linked may not have reached the disk: it is not trusted
        path = Path(view + ".json")
        path.write_text(path.read_text().replace(live.fs_layout.boot_id(), "another-boot"))
    rc, _took, lines = hook(env, "prolog", "6")
    assert rc == 0 and exported(lines) == view, (lines, log(env))
    remade = os.lstat(view).st_ino != before
    assert remade is reboot
    if reboot:  # the old view went into the trash
        assert any(p.name.startswith(live.TRASH_PREFIX) for p in (env.tier_root() / "trash").iterdir())
    wait_worker(env, slow_source)
    assert record(env, view)["state"] == live.WHOLE, (record(env, view), log(env))
    copy = env.tier_root() / "datasets" / "coco" / Path(view).name
    for rel, data in FILES.items():
        assert os.lstat(os.path.join(view, rel)).st_ino == os.lstat(copy / rel).st_ino
        assert Path(view, rel).read_bytes() == data


def _tier(env: Env):
    from dsstage.fs.safe import RootDir
    return RootDir(str(env.tier_root()), create=False)


def test_jobs_that_start_together_make_one_view(env: Env, slow_source: LatencyFS):
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda job: hook(env, "prolog", job), ["5", "6", "7", "8"]))
    assert all(rc == 0 for rc, _t, _l in runs), log(env)
    paths = {exported(lines) for _rc, _t, lines in runs}
    assert len(paths) == 1 and "/live/" in next(iter(paths)), (paths, log(env))  # none fell back
    top = env.tier_root() / "live" / "coco"
    assert sorted(p.name for p in top.iterdir() if not p.name.endswith((".lock", ".worker", ".links", ".json"))) == \
        [Path(next(iter(paths))).name]  # no half-made view left
    wait_worker(env, slow_source)
    assert record(env, next(iter(paths)))["state"] == live.WHOLE, log(env)


def test_a_view_never_made_whole_goes_when_no_job_holds_it(env: Env, slow_source: LatencyFS):
    rc, _took, lines = hook(env, "prolog", "5")
    view = exported(lines)
    slow_source.fail_reads()
    wait_worker(env, slow_source)
    assert record(env, view)["state"] == live.FAILED
    slow_source.fail_reads(False)
    rc, _took, _ = hook(env, "epilog", "5")
    assert rc == 0 and not Path(view).exists() and not Path(view + ".json").exists(), log(env)
    assert "dropped the live view of coco" in log(env)


def test_entries_whose_local_file_is_gone_point_at_the_source_again(env: Env, slow_source: LatencyFS):
    """A view whose copy was taken out of service (here: a failed stage's area removed) is
    given to the next job with no entry left on a file the stage no longer holds."""
    rc, _took, lines = hook(env, "prolog", "5")
    view = exported(lines)
    time.sleep(2)
    slow_source.fail_reads()
    wait_worker(env, slow_source)
    assert "local" in kinds(view).values(), kinds(view)  # some had landed
    import shutil
    for area in (env.tier_root() / "staging").iterdir():  # as an admin's `dsstage evict` does
        shutil.rmtree(area)
    slow_source.fail_reads(False)
    slow_source.hang()  # the next worker cannot bring them back yet
    try:
        rc, _took, lines = hook(env, "prolog", "6")
        assert rc == 0 and exported(lines) == view, log(env)
        assert set(kinds(view).values()) == {"link"}, kinds(view)
    finally:
        slow_source.answer()
    wait_worker(env, slow_source)
    assert record(env, view)["state"] == live.WHOLE, (record(env, view), log(env))


def test_a_restricted_datasets_view_follows_its_groups(env: Env, slow_source: LatencyFS):
    import grp
    group = grp.getgrgid(0).gr_name
    env.datasets["coco"]["groups"] = [group]
    env.write()
    rc, _took, lines = hook(env, "prolog", "5")
    assert rc == 0, log(env)
    top = env.tier_root() / "live" / "coco"
    assert stat.S_IMODE(top.stat().st_mode) == 0o750 and top.stat().st_gid == 0
    env.datasets["coco"].pop("groups")  # opened to everyone: the next refresh reaches the view too
    env.write()
    env.cli("report")
    assert stat.S_IMODE(top.stat().st_mode) == 0o755
