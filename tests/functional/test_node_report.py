"""Node reports on a real store: concurrent writers, progress while staging, publishing as
``report.user``, what a report says, links planted in the run directory, and the metrics
the hooks count and export."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pwd
import random
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from dsstage.config import load
from dsstage.config.catalog import User
from dsstage.errors import DsstageError
from dsstage.fs import layout, safe
from dsstage.hooks import job as hooks
from dsstage.hooks import warm
from dsstage.node import inventory, metrics, report, staging
from dsstage.node.lease import Lease, LeaseBook
from dsstage.slurm.fake import FakeSlurm
from helpers import Env, random_tree, wait_flushed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

NODE = "n1"
MiB = 2**20
PROGRESS_KEYS = {"phase", "unit", "done", "total", "rate", "eta", "since"}


# -- helpers ------------------------------------------------------------------------------------

@pytest.fixture
def run(env: Env) -> Path:
    """The node's run directory (never the real /run/dsstage)."""
    return env.tmp / "run"


def store_of(env: Env, run: Path) -> Any:
    return env.store(run_dir=str(run))


def root_user() -> User:
    return User.lookup(0)


def vid(env: Env, name: str) -> str:
    return layout.version_id(env.store().current(name))


def local_report(run: Path) -> dict[str, Any]:
    return json.loads((run / "reports" / f"{NODE}.json").read_text())


def published(env: Env) -> Path:
    return env.state / "nodes" / f"{NODE}.json"


def rows(rep: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    return [r for r in rep.get("copies") or [] if r.get("dataset") == dataset]


def one_row(rep: dict[str, Any], dataset: str, version: str) -> dict[str, Any]:
    found = [r for r in rows(rep, dataset) if r.get("version") == version]
    assert len(found) == 1, (dataset, version, rep.get("copies"))
    return found[0]


def prolog_env(request: str, job: str, uid: int = 0, user: str = "root") -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_UID": str(uid), "SLURM_JOB_GID": "0", "SLURM_JOB_USER": user,
            "SLURMD_NODENAME": NODE, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": request}


def epilog_env(request: str, job: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURMD_NODENAME": NODE, "SPANK_DSSTAGE_DATASETS": request}


def set_capacity(env: Env, capacity: str) -> None:
    """Give the tier a capacity the test's filesystem can hold (a report shows the
    filesystem's room instead when that is less)."""
    data = yaml.safe_load(env.config_path.read_text())
    data["tiers"]["nvme"]["capacity"] = capacity
    env.config_path.write_text(yaml.safe_dump(data))


# -- 1. concurrent writers lose nothing ----------------------------------------------------------

WRITERS = 6
JOBS_EACH = 15


def job_id(writer: int, i: int) -> str:
    return f"{writer + 1}{i:03d}"


def _writer(run_dir: str, tier_root: str, dataset: str, digest: str, writer: int, take_lease: bool,
            start: Any, out: str) -> None:
    """One Prolog after another of one writer: (a lease in the store, then) the warm path's
    note. After each note, every job this writer noted so far must still be in the report:
    later notes keep other jobs' leases, and a rebuild sees every lease in the store."""
    rnd = random.Random(writer)
    version = layout.version_id(digest)
    missing: list[list[str]] = []
    start.wait(30)
    noted: list[str] = []
    for i in range(JOBS_EACH):
        job = job_id(writer, i)
        if take_lease:
            with safe.RootDir(tier_root, create=False) as tier:
                LeaseBook(tier).take(Lease(dataset=dataset, digest=digest, job_id=job, user=f"user{writer}",
                                           node=NODE, taken=time.time()))
        report.note_leases(run_dir, NODE, job, f"user{writer}", [(dataset, version)], None)
        noted.append(job)
        here = {x.get("job_id") for r in rows(report.local(run_dir, NODE), dataset) for x in r.get("leases") or []}
        gone = [j for j in noted if j not in here]
        if gone:
            missing.append(gone)
        time.sleep(rnd.random() * 0.004)
    Path(out).write_text(json.dumps(missing))


def _refresher(config_path: str, run_dir: str, start: Any, stop: Any, count: Any) -> None:
    from dsstage.node.store import Store
    store = Store(load.load(config_path), NODE, run_dir=run_dir)
    start.wait(30)
    while not stop.is_set():
        if inventory.refresh(store, run_dir):
            with count.get_lock():
                count.value += 1


@pytest.fixture
def leased_copy(env: Env, run: Path) -> tuple[str, str]:
    env.add("coco", {"a": b"a" * 1000, "b/c": b"c" * 10})
    env.cli("manifest", "build", "coco")
    store = store_of(env, run)
    staging.stage(store, "coco", staging.StageRequest(user=root_user(), job_id="1"))
    store.release("coco", "1")
    rep = inventory.refresh(store)  # the first report: the warm path's notes change it
    assert one_row(rep, "coco", vid(env, "coco"))["leases"] == []
    return "coco", env.store().current("coco")


def run_writers(env: Env, run: Path, dataset: str, digest: str, *, take_lease: bool,
                refresh: bool) -> int:
    """The writers (and a process rebuilding the report in a loop) at once; how many
    rebuilds were written while the writers ran."""
    ctx = multiprocessing.get_context("fork")
    start, stop = ctx.Event(), ctx.Event()
    count = ctx.Value("i", 0)
    outs = [env.tmp / f"writer{w}.json" for w in range(WRITERS)]
    procs = [ctx.Process(target=_writer, args=(str(run), str(env.tier_root()), dataset, digest, w, take_lease,
                                               start, str(outs[w]))) for w in range(WRITERS)]
    refresher = ctx.Process(target=_refresher, args=(str(env.config_path), str(run), start, stop, count)) \
        if refresh else None
    for p in [*procs, *([refresher] if refresher else [])]:
        p.start()
    start.set()
    try:
        for p in procs:
            p.join(60)
            assert p.exitcode == 0, f"writer {p.name} exit code {p.exitcode}"
    finally:
        stop.set()
        if refresher:
            refresher.join(60)
    if refresher:
        assert refresher.exitcode == 0
    lost = {w: sorted({j for gone in json.loads(o.read_text()) for j in gone}) for w, o in enumerate(outs)}
    assert not any(lost.values()), f"jobs missing from the report after their writer noted them: {lost}"
    return int(count.value)


def expected_leases() -> dict[str, str]:
    return {job_id(w, i): f"user{w}" for w in range(WRITERS) for i in range(JOBS_EACH)}


def test_concurrent_lease_notes_lose_nothing(env: Env, run: Path, leased_copy):
    dataset, digest = leased_copy
    run_writers(env, run, dataset, digest, take_lease=False, refresh=False)
    version = layout.version_id(digest)
    row = one_row(local_report(run), dataset, version)
    leases = [(x["job_id"], x["user"]) for x in row["leases"]]
    assert len(leases) == len(set(leases))  # one lease per job
    assert dict(leases) == expected_leases()  # every writer's every note, with its user
    # a job noted again (a rebuild may have put its lease there already) has one lease
    report.note_leases(str(run), NODE, job_id(0, 0), "user0", [(dataset, version)], None)
    again = [x["job_id"] for x in one_row(local_report(run), dataset, version)["leases"]]
    assert sorted(again) == sorted(expected_leases())


def test_notes_and_rebuilds_at_once_lose_no_lease(env: Env, run: Path, leased_copy):
    dataset, digest = leased_copy
    rebuilds = run_writers(env, run, dataset, digest, take_lease=True, refresh=True)
    assert rebuilds >= 2, "the rebuilds did not run alongside the writers"
    version = layout.version_id(digest)
    row = one_row(local_report(run), dataset, version)
    leases = [(x["job_id"], x["user"]) for x in row["leases"]]
    assert len(leases) == len(set(x for x, _u in leases))  # a note replaces the job's lease a rebuild put there
    assert dict(leases) == expected_leases()
    assert row["state"] == "ready"
    # the report's leases are the store's: a rebuild now changes none of them
    rebuilt = one_row(inventory.refresh(store_of(env, run)), dataset, version)
    assert {x["job_id"]: x["user"] for x in rebuilt["leases"]} == expected_leases()


# -- 2. progress while staging -------------------------------------------------------------------

FILES, FILE_SIZE = 1024, 2048  # random_tree adds 8 bytes to each file
LIMIT = 1024 * 1024  # bytes/s: transfer.bwlimit 1024 KiB/s, one stream


@dataclass
class Staged:
    env: Env
    run: Path
    total: int
    version: str
    rc: int | None = None
    local: list[dict[str, Any]] = field(default_factory=list)  # the dataset's row, each time it changed
    published: list[dict[str, Any]] = field(default_factory=list)
    after_local: dict[str, Any] = field(default_factory=dict)
    after_published: dict[str, Any] = field(default_factory=dict)


def _poll(path: Path, dataset: str, into: list[dict[str, Any]], done: threading.Event) -> None:
    last = None
    while not done.is_set():
        try:
            rep = json.loads(path.read_text())
        except (OSError, ValueError):
            rep = {}
        found = rows(rep, dataset)
        if found and found[0] != last:
            last = found[0]
            into.append(last)
        time.sleep(0.01)


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Staged:
    """A Prolog staging 2 MiB at 1 MiB/s with report.interval 0.1 s, its reports watched."""
    env = Env(tmp_path_factory.mktemp("progress"))
    random_tree(env.source("big"), FILES, FILE_SIZE)
    env.add("big")
    env.extra = {"report": {"interval": 0.1}, "transfer": {"bwlimit": LIMIT // 1024, "streams": 1}}
    env.write()
    built = env.cli_json("manifest", "build", "big")
    run = env.tmp / "run"
    s = Staged(env, run, int(built["bytes"]), layout.version_id(env.store().current("big")))
    assert s.total == FILES * (FILE_SIZE + 8)
    done = threading.Event()
    watchers = [threading.Thread(target=_poll, args=(run / "reports" / f"{NODE}.json", "big", s.local, done)),
                threading.Thread(target=_poll, args=(published(env), "big", s.published, done))]
    for t in watchers:
        t.start()
    try:
        s.rc = hooks.prolog(prolog_env("big", "41"), run_dir=str(run), slurm=FakeSlurm(), load_config=env.config)
    finally:
        done.set()
        for t in watchers:
            t.join()
    s.after_local, s.after_published = local_report(run), json.loads(published(env).read_text())
    return s


def with_progress(seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in seen if r.get("state") == "staging" and r.get("progress")]


def test_progress_is_in_the_report_while_staging(staged: Staged):
    assert staged.rc == 0
    for seen in (staged.local, staged.published):  # the node's report and its published copy
        moving = with_progress(seen)
        midway = [r for r in moving if 0 < r["progress"]["done"] < staged.total]
        assert midway, f"no report showed the stage midway: {seen}"
        for r in moving:
            p = r["progress"]
            assert set(p) == PROGRESS_KEYS
            assert (p["phase"], p["unit"], p["total"]) == ("copying", "bytes", staged.total)
            assert r["version"] == staged.version and r["current"] is True and r["job_id"] == "41"
            assert 0 < p["done"] <= staged.total and p["rate"] > 0
            assert isinstance(p["eta"], (int, float)) and p["eta"] >= 0
        done = [r["progress"]["done"] for r in moving]
        assert done == sorted(done)  # never goes back


def test_after_the_prolog_the_copy_is_ready_without_progress(staged: Staged):
    for rep in (staged.after_local, staged.after_published):
        row = one_row(rep, "big", staged.version)
        assert row["state"] == "ready" and row["progress"] is None and row["current"] is True
        assert row["bytes"] == staged.total and row["files"] == FILES
        assert [x["job_id"] for x in row["leases"]] == ["41"]
    assert staged.after_local == staged.after_published


def test_progress_rate_is_the_real_transfer_rate(staged: Staged):
    # the copier holds the stage to LIMIT bytes/s: a rate well above it (and the ETA that
    # follows from it) is not what the node is doing
    rates = [r["progress"]["rate"] for r in with_progress(staged.local)]
    assert rates and max(rates) <= 1.5 * LIMIT, rates


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


VERSION = "0123456789abcdef"


@pytest.fixture
def note(env: Env, run: Path) -> tuple[report.ProgressNote, Clock, list[tuple[str, int, int]]]:
    """A stage's progress note on a clock the test moves (report.interval 1 s), after a
    first report (a note changes a report, it never starts one)."""
    env.add("coco", {"a": b"a"})
    assert inventory.refresh(store_of(env, run))["copies"] == []
    clock, seen = Clock(1000.0), []
    return report.ProgressNote(str(run), NODE, ("nvme", "coco", VERSION), "7", interval=1.0, publish_to=None,
                               clock=clock, also=lambda *a: seen.append(a)), clock, seen


def progress_now(run: Path) -> dict[str, Any] | None:
    found = rows(local_report(run), "coco")
    return found[0] if found else None


def test_progress_is_written_at_most_every_interval_and_at_the_end(run: Path, note):
    note_, clock, seen = note
    calls = [(1000.5, "copying", 100, 1000), (1001.2, "copying", 100, 1000), (1001.5, "copying", 100, 1000),
             (1002.3, "copying", 100, 1000), (1002.4, "copying", 600, 1000), (1002.5, "verifying", 4, 10)]
    written = []
    for when, phase, delta, total in calls:
        clock.now = when
        note_(phase, delta, total)
        row = progress_now(run)
        written.append(None if row is None else (row["state"], row["progress"]["phase"], row["progress"]["unit"],
                                                 row["progress"]["done"], row["progress"]["total"]))
    assert written == [
        None,  # 0.5 s after the stage began: not yet
        ("staging", "copying", "bytes", 200, 1000),  # 1.2 s: written
        ("staging", "copying", "bytes", 200, 1000),  # 0.3 s later: not again
        ("staging", "copying", "bytes", 400, 1000),  # 1.1 s later
        ("staging", "copying", "bytes", 1000, 1000),  # done: written at once
        ("staging", "copying", "bytes", 1000, 1000),  # verifying, 0.1 s later: not yet
    ]
    row = progress_now(run)
    assert row is not None
    assert (row["tier"], row["version"], row["current"], row["job_id"]) == ("nvme", VERSION, True, "7")
    clock.now = 1003.6
    note_("verifying", 6, 10)
    row = progress_now(run)
    assert row is not None and row["state"] == "verifying"
    assert {k: row["progress"][k] for k in ("phase", "unit", "done", "total")} == \
        {"phase": "verifying", "unit": "files", "done": 10, "total": 10}
    assert seen == [(phase, delta, total) for _w, phase, delta, total in calls] + [("verifying", 6, 10)]


def test_a_stage_of_empty_files_writes_its_progress_once_not_per_file(run: Path, note, monkeypatch):
    """A byte total of 0 is 'at the end' at every file: the note was rewritten under the report's
    lock for each of 30,000 empty files (30,010 flock calls). Its end is written once."""
    note_, clock, _seen = note
    writes = []
    real = report.update
    monkeypatch.setattr(report, "update", lambda *a, **kw: (writes.append(a[2]), real(*a, **kw))[1])
    for i in range(2000):
        clock.now = 1000.0 + i * 1e-4  # 2,000 files in 0.2 s
        note_("copying", 0, 0)
    assert len(writes) == 1
    row = progress_now(run)
    assert row is not None and row["progress"]["done"] == 0 and row["progress"]["total"] == 0
    clock.now = 1001.5  # an interval later the state is written again, once
    note_("copying", 0, 0)
    note_("copying", 0, 0)
    assert len(writes) == 2


def test_progress_rate_counts_from_the_start_of_the_stage(run: Path, note):
    note_, clock, _seen = note
    for when in (1000.5, 1001.2):  # the stage began at 1000: 200 bytes in 1.2 s
        clock.now = when
        note_("copying", 100, 1000)
    row = progress_now(run)
    assert row is not None
    assert row["progress"]["rate"] == pytest.approx(200 / 1.2)
    assert row["progress"]["eta"] == pytest.approx(800 / (200 / 1.2))
    assert row["progress"]["since"] == 1000.0


def test_after_dsstage_stage_the_copy_is_ready_without_progress(env: Env, run: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    env.add("coco", {"a": b"a" * 5000})
    env.cli("manifest", "build", "coco")
    monkeypatch.setenv("DSSTAGE_RUN_DIR", str(run))
    assert env.cli_json("stage", "coco", "--job-id", "3")["action"] == "staged"
    row = one_row(local_report(run), "coco", vid(env, "coco"))
    assert (row["state"], row["progress"]) == ("ready", None), row
    assert [x["job_id"] for x in row["leases"]] == ["3"]


# -- 3. publishing as report.user ----------------------------------------------------------------

@pytest.fixture
def shared(env: Env) -> Iterator[Path]:
    """A state directory nobody can reach (tmp_path's parents are root's 0700), as an NFS
    export is: root's, 0755."""
    top = Path(tempfile.mkdtemp(prefix="dsstage-report-", dir="/tmp"))
    os.chmod(top, 0o755)
    env.state = top / "state"
    env.extra = {"report": {"user": "nobody"}}
    env.add("coco", {"a": b"a" * 100})
    env.cli("manifest", "build", "coco")
    os.chmod(env.state, 0o755)
    yield env.state
    shutil.rmtree(top, ignore_errors=True)


def test_report_is_published_as_report_user(env: Env, run: Path, shared: Path):
    nobody = pwd.getpwnam("nobody")
    nodes = shared / "nodes"
    nodes.mkdir()
    os.chown(nodes, nobody.pw_uid, nobody.pw_gid)
    os.chmod(nodes, 0o755)
    store = store_of(env, run)
    staging.stage(store, "coco", staging.StageRequest(user=root_user(), job_id="3"))
    rep = inventory.refresh(store)

    st = os.lstat(published(env))
    assert stat.S_ISREG(st.st_mode) and st.st_uid == nobody.pw_uid  # written with nobody's fs identity
    assert json.loads(published(env).read_text()) == rep == local_report(run)
    assert [x["job_id"] for x in one_row(rep, "coco", vid(env, "coco"))["leases"]] == ["3"]
    assert os.stat(run / "reports" / f"{NODE}.json").st_uid == 0  # the node-local one stays root's

    # the warm path's note is published the same way
    report.note_leases(str(run), NODE, "8", "alice", [("coco", vid(env, "coco"))],
                       report.publish_target(store.config))
    assert os.lstat(published(env)).st_uid == nobody.pw_uid
    row = one_row(json.loads(published(env).read_text()), "coco", vid(env, "coco"))
    assert {x["job_id"]: x["user"] for x in row["leases"]} == {"3": "root", "8": "alice"}


def test_publishing_where_report_user_may_not_write_warns_and_keeps_the_local_report(
        env: Env, run: Path, shared: Path, caplog: pytest.LogCaptureFixture):
    nodes = shared / "nodes"
    nodes.mkdir(mode=0o755)  # root's: root could write here, nobody cannot
    os.chmod(nodes, 0o755)
    store = store_of(env, run)
    staging.stage(store, "coco", staging.StageRequest(user=root_user(), job_id="3"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        rep = inventory.refresh(store)  # no exception
    assert f"cannot publish the node report {published(env)}" in caplog.text
    assert "Permission denied" in caplog.text
    assert os.listdir(nodes) == []  # nothing written there, not even a temporary file
    assert rep and local_report(run) == rep
    assert [x["job_id"] for x in one_row(rep, "coco", vid(env, "coco"))["leases"]] == ["3"]


# -- 4. what a report says ------------------------------------------------------------------------

def test_report_shows_tiers_copies_leases_and_decisions(env: Env, run: Path):
    env.add("alpha", {"a": b"a" * 3000, "d/b": b"b" * 1000})
    env.add("beta", {"x": b"x" * 2000})
    set_capacity(env, "64MiB")
    for name in ("alpha", "beta"):
        env.cli("manifest", "build", name)
    nobody = User.lookup("nobody")
    store = store_of(env, run)
    before = time.time()
    staging.stage(store, "alpha", staging.StageRequest(user=nobody, job_id="11"))  # stays leased
    staging.stage(store, "beta", staging.StageRequest(user=root_user(), job_id="12"))
    store.release("beta", "12")
    old = vid(env, "beta")
    (env.source("beta") / "x").write_bytes(b"y" * 2500)  # a new version, no file in common
    env.cli("manifest", "build", "beta")
    new = vid(env, "beta")
    assert new != old
    staging.stage(store, "beta", staging.StageRequest(user=root_user(), job_id="13"))
    store.release("beta", "13")

    rep = inventory.refresh(store)

    assert rep == local_report(run) == json.loads(published(env).read_text())
    assert (rep["format"], rep["node"]) == (2, NODE)
    (tier,) = rep["tiers"]
    assert (tier["tier"], tier["path"], tier["capacity"]) == ("nvme", str(env.tier_root()), 64 * MiB)
    assert tier["used"] == 4000 + 2000 + 2500 and tier["reserved"] == 0
    fs = os.statvfs(env.tier_root())
    assert 0 < tier["free"] <= fs.f_blocks * fs.f_frsize
    assert 0 < tier["low"] < tier["high"] <= 1

    assert sorted((r["dataset"], r["version"]) for r in rep["copies"]) == sorted(
        [("alpha", vid(env, "alpha")), ("beta", old), ("beta", new)])
    assert all(r["state"] == "ready" and r["progress"] is None and r["tier"] == "nvme" for r in rep["copies"])

    alpha = one_row(rep, "alpha", vid(env, "alpha"))
    assert (alpha["current"], alpha["bytes"], alpha["files"]) == (True, 4000, 2)
    (lease,) = alpha["leases"]
    assert (lease["job_id"], lease["user"]) == ("11", "nobody") and before <= lease["since"] <= time.time()
    assert alpha["decision"] == {"action": "keep", "reason": "leased by job 11"}
    assert alpha["last_used"] is not None

    beta_old = one_row(rep, "beta", old)
    assert (beta_old["current"], beta_old["bytes"], beta_old["leases"]) == (False, 2000, [])
    assert beta_old["decision"]["action"] == "evict"
    assert beta_old["decision"]["reason"].startswith("old version"), beta_old["decision"]

    beta_new = one_row(rep, "beta", new)
    assert (beta_new["current"], beta_new["bytes"], beta_new["leases"]) == (True, 2500, [])
    assert beta_new["decision"]["action"] == "keep"


# -- 5. links planted in the run directory ------------------------------------------------------

@pytest.mark.parametrize("entry", ["reports", f"reports/{NODE}.json", f"reports/{NODE}.lock"])
def test_link_planted_in_the_run_directory_is_never_followed(env: Env, run: Path, entry: str):
    env.add("coco", {"a": b"a" * 100})
    env.cli("manifest", "build", "coco")
    store = store_of(env, run)
    staging.stage(store, "coco", staging.StageRequest(user=root_user(), job_id="3"))
    assert inventory.refresh(store)  # the run directory and its report, as dsstage made them
    # what a planted report would make root publish: a copy row a lease note would change
    planted = {"format": 2, "node": NODE, "planted": True, "tiers": [],
               "copies": [{"tier": "nvme", "dataset": "coco", "version": vid(env, "coco"), "leases": []}]}
    elsewhere = env.tmp / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{NODE}.json").write_text(json.dumps(planted))
    link = run / entry
    if entry == "reports":
        shutil.rmtree(link)
        target = elsewhere
    elif entry.endswith(".json"):
        link.unlink()
        target = elsewhere / f"{NODE}.json"
    else:  # dangling: opening it with O_CREAT, following it, would create the target
        link.unlink()
        target = elsewhere / "created-through-the-link"
    os.symlink(target, link)

    def untouched() -> None:
        assert os.path.islink(link) and os.readlink(link) == str(target)
        assert sorted(os.listdir(elsewhere)) == [f"{NODE}.json"]
        assert json.loads((elsewhere / f"{NODE}.json").read_text()) == planted

    assert report.local(str(run), NODE).get("planted") is None  # a reader does not follow it either
    try:
        report.note_leases(str(run), NODE, "9", "alice", [("coco", vid(env, "coco"))], None)
    except (DsstageError, OSError):
        pass  # refused
    if os.path.islink(link):
        untouched()
    else:  # the link was replaced by a report, not one built on what the link pointed at
        assert entry.endswith(".json") and "planted" not in local_report(run)

    rep = inventory.refresh(store)

    if entry.endswith(".json"):  # the link is replaced by the node's report
        assert not os.path.islink(link) and local_report(run) == rep
        assert rep and "planted" not in rep
        assert sorted(os.listdir(elsewhere)) == [f"{NODE}.json"]
        assert json.loads((elsewhere / f"{NODE}.json").read_text()) == planted
    else:  # refused: no report through the link
        assert rep == {}
        untouched()


# -- 6. metrics ---------------------------------------------------------------------------------------

def test_hooks_count_hits_and_evictions_and_the_report_exports_them(env: Env, run: Path):
    prom_dir = env.tmp / "prom" / NODE
    prom_dir.mkdir(parents=True)
    env.extra = {"metrics": {"textfile": str(env.tmp / "prom" / "{node}" / "dsstage.prom")}}
    env.add("coco", {"a": b"a" * 1000, "b": b"b" * 500})
    set_capacity(env, "64MiB")
    env.cli("manifest", "build", "coco")
    old = vid(env, "coco")
    slurm = FakeSlurm()

    def counters() -> dict[str, Any]:
        return metrics.counters(str(run), NODE)["counters"]

    # the full Prolog stages (a miss) and leaves the configuration cache the warm path needs
    assert hooks.prolog(prolog_env("coco", "2"), run_dir=str(run), slurm=slurm, load_config=env.config) == 0
    assert counters().get("misses") == {"coco": 1} and "hits" not in counters()
    assert warm.prolog(prolog_env("coco", "77"), str(run), str(env.config_path)) == 0
    assert counters()["hits"] == {"coco": 1}
    assert counters()["misses"] == {"coco": 1}

    for job in ("2", "77"):
        assert hooks.epilog(epilog_env("coco", job), run_dir=str(run), load_config=env.config) == 0
    (env.source("coco") / "b").write_bytes(b"c" * 700)
    env.cli("manifest", "build", "coco")
    assert vid(env, "coco") != old
    assert hooks.prolog(prolog_env("coco", "5"), run_dir=str(run), slurm=slurm, load_config=env.config) == 0
    assert counters()["misses"] == {"coco": 2}
    assert "evictions" not in counters()
    wait_flushed(env)
    assert hooks.epilog(epilog_env("coco", "5"), run_dir=str(run), load_config=env.config) == 0
    assert old not in os.listdir(env.tier_root() / "datasets" / "coco")  # the Epilog evicted it
    assert counters()["evictions"] == {"coco": {"old_version": 1}}
    assert counters()["evicted_bytes"] == {"coco": {"old_version": 1500}}

    rep = inventory.refresh(store_of(env, run))
    assert rep
    from prometheus_client.parser import text_string_to_metric_families
    text = (prom_dir / "dsstage.prom").read_text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("dsstage_tier_capacity_bytes", (("tier", "nvme"),))] == 64 * MiB
    assert samples[("dsstage_tier_used_bytes", (("tier", "nvme"),))] == rep["tiers"][0]["used"]
    assert samples[("dsstage_hits_total", (("dataset", "coco"),))] == 1
    assert samples[("dsstage_misses_total", (("dataset", "coco"),))] == 2
    assert samples[("dsstage_evictions_total", (("dataset", "coco"), ("reason", "old_version")))] == 1
    assert samples[("dsstage_copies", (("state", "ready"), ("tier", "nvme")))] == 1
