"""A storm on a small tier: many processes stage, release and evict several datasets at once.

Done when: a storm of concurrent stages, releases and evictions of several datasets on a
small tier (hundreds of operations from many processes) never exceeds the tier's capacity,
never evicts a leased copy, and leaves no staging debris.

The storm runs once (the ``storm`` fixture) and records what it saw; each property is its
own test over that record, so that one failing property does not hide the others. Each
worker is its own Python process driving the library (``Store``) directly, as the Prolog,
Epilog and ``dsstage`` commands of many jobs on one node would: a process per operation
would spend most of the storm starting Python. A thread of the test process watches the
tier's disk meanwhile. After the storm, the tests below it pin each race the storm found
to one deterministic interleaving.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dsstage.fs import layout as fs_layout
from dsstage.node import eviction, inventory, staging
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

CAPACITY = "3MB"  # 3,000,000 bytes: two or three of the five datasets fit at once
#: five datasets of 0.8 to 1.2 MB, two to five files each (random bytes: nothing shared)
SIZES = {
    "alpha": [300_000, 300_000, 200_000],
    "bravo": [400_000, 300_000, 200_000, 100_000],
    "charlie": [500_000, 500_000, 200_000],
    "delta": [250_000, 250_000, 250_000, 250_000, 100_000],
    "echo": [600_000, 350_000],
}
WORKERS = 8
OPS_PER_WORKER = 75
SAMPLE_EVERY = 0.02  # seconds between two looks at the disk

WORKER = textwrap.dedent(r'''
    """One process of the storm: random stages, releases and evictions through the library."""
    import hashlib, json, os, random, sys, time, traceback

    from dsstage.config import load as cfg
    from dsstage.config.catalog import User
    from dsstage.errors import DsstageError
    from dsstage.node.store import Store
    from dsstage.node import eviction, staging

    spec = json.loads(open(sys.argv[1]).read())
    me = spec["worker"]
    rnd = random.Random(spec["seed"])
    store = Store(cfg.load(spec["config"]), spec["node"])
    root = User.lookup(0)
    expected = spec["expected"]  # dataset -> {relative path: sha256}
    names = sorted(expected)
    held = {}  # job id -> (dataset, path of the copy it leases)
    ops = []  # [kind, dataset, outcome, seconds]
    failures = []  # [kind, message]: "lease" (a leased copy changed or went), "op" (an unexpected error)


    def fail(kind, what):
        failures.append([kind, f"worker {me}: {what}"])


    def check_copy(job, full):
        """The copy job ``job`` leases is there and holds the dataset's bytes (all its files, or one)."""
        name, path = held[job]
        files = sorted(expected[name])
        for rel in files if full else [rnd.choice(files)]:
            try:
                with open(os.path.join(path, rel), "rb") as fh:
                    got = hashlib.sha256(fh.read()).hexdigest()
            except OSError as exc:
                fail("lease", f"{name}: the copy {path} leased by job {job} lost {rel}: {exc}")
                return
            if got != expected[name][rel]:
                fail("lease", f"{name}: {rel} of the copy {path} leased by job {job} holds other bytes")
                return


    def stage(name, i):
        job = f"w{me}-{i}"
        try:
            res = staging.stage(store, name, staging.StageRequest(user=root, job_id=job))
        except DsstageError as exc:
            if exc.exit_code == 75:  # NoSpace, LockTimeout: `dsstage stage` exits 75, the job is requeued
                return "75 " + type(exc).__name__
            fail("op", f"stage {name} -> {type(exc).__name__} (exit {exc.exit_code}): {exc}")
            return "error " + type(exc).__name__
        held[job] = (name, res.path)
        check_copy(job, full=True)
        return res.action


    def release(job):
        name, _path = held[job]
        check_copy(job, full=True)
        del held[job]
        if not store.release(name, job):
            fail("lease", f"release {name} job {job}: the lease was gone")
            return "lease gone"
        return "released"


    def evict(name):
        try:
            result = eviction.evict(store, name)
        except Exception as exc:
            fail("op", f"evict {name} -> {type(exc).__name__}: {exc}")
            return "error " + type(exc).__name__
        for job, (ds, path) in held.items():
            if ds != name:
                continue
            version = os.path.basename(path)
            for e in result:
                if e.version == version and e.action == "evicted":
                    fail("lease", f"evict {name}: version {version} leased by job {job} was evicted")
            if not os.path.isdir(path):
                fail("lease", f"evict {name}: the copy {path} leased by job {job} is gone")
            else:
                check_copy(job, full=False)
        return "+".join(sorted({e.action for e in result})) or "nothing"


    kept = []
    try:
        for i in range(spec["ops"]):
            r = rnd.random()
            t0 = time.monotonic()
            if held and (r < 0.5 or len(held) >= 2):
                job = rnd.choice(sorted(held))
                ops.append(["release", held[job][0], release(job)])
            elif r < 0.75:
                name = rnd.choice(names)
                ops.append(["stage", name, stage(name, i)])
            else:
                name = rnd.choice(names)
                ops.append(["evict", name, evict(name)])
            ops[-1].append(round(time.monotonic() - t0, 4))
            if held:  # a copy this worker leases is still whole, whatever the others did meanwhile
                check_copy(rnd.choice(sorted(held)), full=False)
            time.sleep(rnd.random() * 0.01)
        if spec["keep_one"] and not held:  # some workers end holding one lease: the final eviction must keep it
            for i, name in enumerate(rnd.sample(names, len(names))):
                ops.append(["stage", name, stage(name, f"end{i}"), 0.0])
                if held:
                    break
        for job in sorted(held):
            if spec["keep_one"] and not kept:
                check_copy(job, full=True)
                kept.append([held[job][0], job, held[job][1]])
            else:
                ops.append(["release", held[job][0], release(job), 0.0])
    except Exception:
        fail("op", "crashed: " + traceback.format_exc())
    json.dump({"ops": ops, "failures": failures, "kept": kept}, open(spec["out"], "w"))
''')


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def same_files(copy: Path, files: dict[str, str]) -> bool:
    try:
        return {rel: sha(copy / rel) for rel in files} == files
    except OSError:
        return False


Files = dict[tuple[int, int], tuple[str, int]]


def files_on_disk(root: Path) -> Files:
    """Every regular file of the tier that holds data (datasets/, staging/, trash/), each
    inode once: {(dev, ino): (path, apparent size)}. Files may vanish during the walk."""
    found: Files = {}
    for sub in ("datasets", "staging", "trash"):
        for dirpath, _dirs, names in os.walk(root / sub):  # follows no link; ignores what vanished
            for n in names:
                p = os.path.join(dirpath, n)
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.setdefault((st.st_dev, st.st_ino), (p, st.st_size))
    return found


def bytes_on_disk(root: Path) -> int:
    return sum(size for _p, size in files_on_disk(root).values())


def still_there(found: Files) -> Files:
    """The files of a walk that are still at the same path as the same inode (with the
    smaller of the two sizes). Each existed at its first look, during the walk, and at its
    second, after it: all of them existed together at the moment the walk ended."""
    out = {}
    for key, (p, size) in found.items():
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) == key:
            out[key] = (p, min(size, st.st_size))
    return out


def accounting(root: Path) -> str:
    """The tier's space records and ready marks as they are now (for failure messages)."""
    out = []
    for r in sorted(os.listdir(root / "reserved")):
        try:
            out.append(f"{r}={json.loads((root / 'reserved' / r).read_text()).get('bytes')}")
        except (OSError, ValueError):
            out.append(f"{r}=(gone)")
    for name in sorted(os.listdir(root / "ready")):
        for m in sorted(m for m in os.listdir(root / "ready" / name) if not m.startswith(".dsstage-")):
            try:
                out.append(f"mark {name}/{m}={json.loads((root / 'ready' / name / m).read_text()).get('bytes')}")
            except (OSError, ValueError):
                out.append(f"mark {name}/{m}=(gone)")
    return ", ".join(out)


class Monitor(threading.Thread):
    """Samples the tier's real use of the disk every SAMPLE_EVERY seconds.

    The measure is the apparent size (st_size) of every regular file under datasets/,
    staging/ and trash/, each inode once. That is what the capacity bounds: the space
    accounting (space.py) counts the bytes of manifests and marks, i.e. apparent sizes.
    st_blocks would add each file's rounding to the block size, which the capacity is not
    meant to cover (and with it the test would blame dsstage for the filesystem's slack).

    A walk is not an instant: a copy seen in datasets/ may be evicted and another dataset
    staged before the walk ends. So a walk over the capacity is looked at again
    (still_there) and counts as an overshoot only if the files it summed provably existed
    at one moment."""

    def __init__(self, root: Path, capacity: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.capacity = capacity
        self.halt = threading.Event()
        self.samples = 0
        self.peak = 0
        self.unconfirmed = 0
        self.overshoots: list[str] = []

    def run(self) -> None:
        while not self.halt.is_set():
            found = files_on_disk(self.root)
            total = sum(size for _p, size in found.values())
            self.samples += 1
            if total > self.capacity:
                sure = still_there(found)
                total = sum(size for _p, size in sure.values())
                if total > self.capacity:
                    self.overshoots.append(self.describe(total, sure))
                else:
                    self.unconfirmed += 1
            self.peak = max(self.peak, total)
            self.halt.wait(SAMPLE_EVERY)

    def describe(self, total: int, sure: Files) -> str:
        by_copy: Counter[str] = Counter()
        for p, size in sure.values():
            rel = Path(p).relative_to(self.root).parts
            by_copy["/".join(rel[:3] if rel[0] == "datasets" else rel[:2])] += size
        return (f"{total} bytes on disk > capacity {self.capacity}: "
                + ", ".join(f"{k} {v}" for k, v in sorted(by_copy.items()))
                + f"; accounting now: {accounting(self.root)}")


def background_running(root: Path) -> list[int]:
    """Detached flushes and purges (python -m dsstage.node.background) working on this tier."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dsstage.node.background" in argv and str(root).encode() in argv:
            pids.append(int(entry))
    return pids


def settle(root: Path, timeout: float = 60) -> str:
    """Wait (bounded) for the detached flushes and purges to end and the trash to empty;
    what is still going on after ``timeout``, or ""."""
    deadline = time.monotonic() + timeout
    idle = 0  # looks in a row with no background process running
    while True:
        running, trash = background_running(root), sorted(os.listdir(root / "trash"))
        if not running and not trash:
            return ""
        idle = 0 if running else idle + 1
        if time.monotonic() > deadline or idle > 60:
            why = "no purge is left to delete it (a purge died racing another? see " \
                  "test_a_purge_racing_another_purge_still_deletes_what_was_evicted_later)" if idle > 60 \
                else f"after {timeout:g}s, background processes {running}"
            return f"trash {trash}, reserved {sorted(os.listdir(root / 'reserved'))}: {why}"
        time.sleep(0.05)


def small_tier(env: Env, capacity: str, lock_timeout: int = 60) -> None:
    env.extra = {"lock_timeout": lock_timeout}
    env.write()
    env.config_path.write_text(env.config_path.read_text().replace("100GiB", capacity))


def lease_files(root: Path) -> set[tuple[str, str]]:
    leases = root / "leases"
    return {(d.name, f.stem) for d in leases.iterdir() for f in d.iterdir()} if leases.exists() else set()


@dataclass
class Storm:
    """What the storm and the clean-up after it saw."""

    capacity: int
    seconds: float = 0.0
    ops: list[list[Any]] = field(default_factory=list)
    failures: list[list[str]] = field(default_factory=list)  # [kind, message]
    overshoots: list[str] = field(default_factory=list)
    #: after the storm, everything quiet again
    quiet: str = ""  # what settle() still waited for
    usage: tuple[int, int] = (0, 0)  # the accounting: (copies, reserved)
    on_disk: int = 0
    reserved: list[str] = field(default_factory=list)
    staging_areas: list[str] = field(default_factory=list)
    staging_files: list[str] = field(default_factory=list)
    leases: set[tuple[str, str]] = field(default_factory=set)
    kept: dict[tuple[str, str], str] = field(default_factory=dict)  # leases the workers ended with
    #: after evicting every dataset (the kept leases still held)
    evicted: dict[str, Any] = field(default_factory=dict)
    #: after releasing those and evicting again
    emptied: dict[str, Any] = field(default_factory=dict)

    def problems(self, kind: str) -> list[str]:
        return [msg for k, msg in self.failures if k == kind]

    def summary(self) -> Counter[tuple[str, str]]:
        return Counter((kind, outcome) for kind, _name, outcome, _s in self.ops)


def run_storm(env: Env) -> Storm:
    expected: dict[str, dict[str, str]] = {}
    for name, sizes in SIZES.items():
        files = {(f"part{i}.bin" if i % 2 else f"sub/part{i}.bin"): os.urandom(n) for i, n in enumerate(sizes)}
        src = env.add(name, files)
        expected[name] = {rel: sha(src / rel) for rel in files}
    small_tier(env, CAPACITY)
    for name in SIZES:
        env.cli("manifest", "build", name)
    capacity = env.config().tiers["nvme"].capacity
    assert capacity == 3_000_000 and sum(map(sum, SIZES.values())) > 1.5 * capacity
    root = env.tier_root()
    script = env.tmp / "storm_worker.py"
    script.write_text(WORKER)

    storm = Storm(capacity)
    monitor = Monitor(root, capacity)
    procs: list[subprocess.Popen[str]] = []
    started = time.monotonic()
    monitor.start()
    try:
        for w in range(WORKERS):
            spec = env.tmp / f"worker{w}.json"
            spec.write_text(json.dumps({
                "worker": w, "seed": 1000 + w, "config": str(env.config_path), "node": env.node,
                "ops": OPS_PER_WORKER, "expected": expected, "keep_one": w % 3 == 0,
                "out": str(env.tmp / f"worker{w}.out.json")}))
            procs.append(subprocess.Popen([sys.executable, str(script), str(spec)], env=env.env(), text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for w, p in enumerate(procs):
            _out, err = p.communicate(timeout=240)
            if p.returncode != 0:
                storm.failures.append(["op", f"worker {w} exited {p.returncode}: {err[-2000:]}"])
                continue
            result = json.loads((env.tmp / f"worker{w}.out.json").read_text())
            storm.ops += result["ops"]
            storm.failures += result["failures"]
            storm.kept.update({(name, job): path for name, job, path in result["kept"]})
        storm.seconds = time.monotonic() - started
        storm.quiet = settle(root)
    finally:
        monitor.halt.set()
        monitor.join()
        for p in procs:
            if p.poll() is None:
                p.kill()
    storm.overshoots = monitor.overshoots

    from dsstage.node import space
    from dsstage.node.store import open_tier

    # the storm is over and the background work done: what is left, and what is counted
    storm.on_disk = bytes_on_disk(root)
    with open_tier(fs_layout.Layout(str(root)), create=False) as tier:
        use = space.usage(tier)
    storm.usage = (use.copies, use.reserved)
    storm.reserved = sorted(os.listdir(root / "reserved"))
    storm.staging_areas = sorted(os.listdir(root / "staging"))
    storm.staging_files = sorted(str(p) for p in (root / "staging").rglob("*") if not p.is_dir())
    storm.leases = lease_files(root)

    # evict every dataset: only the copies the workers still lease stay
    store = env.store()
    for name in SIZES:
        eviction.evict(store, name)
    ev: dict[str, Any] = {"quiet": settle(root), "staging": sorted(os.listdir(root / "staging")),
                          "reserved": sorted(os.listdir(root / "reserved")),
                          "trash": sorted(os.listdir(root / "trash")), "copies": {}}
    with open_tier(fs_layout.Layout(str(root)), create=False) as tier:
        for name, files in expected.items():
            d = root / "datasets" / name
            digest = store.current(name)
            ev["copies"][name] = {
                "versions": sorted(os.listdir(d)) if d.exists() else [],
                "current": fs_layout.version_id(digest),
                "ready": fs_layout.not_ready(tier, name, digest) is None,
                "intact": all(same_files(Path(path), files) for (ds, _job), path in storm.kept.items() if ds == name)}
        ev["usage"] = space.usage(tier).total
    storm.evicted = ev

    for name, job in storm.kept:
        store.release(name, job)
    for name in SIZES:
        eviction.evict(store, name)
    storm.emptied = {"quiet": settle(root), "bytes": bytes_on_disk(root),
                     "reserved": sorted(os.listdir(root / "reserved")),
                     "staging": sorted(os.listdir(root / "staging")),
                     "versions": sorted(str(p) for d in (root / "datasets").iterdir() for p in d.iterdir())}

    summary = storm.summary()
    print(f"\nstorm: {len(storm.ops)} operations from {WORKERS} processes in {storm.seconds:.1f}s; "
          f"{monitor.samples} looks at the disk, peak {monitor.peak} of {capacity} bytes, "
          f"{len(storm.overshoots)} over the capacity ({monitor.unconfirmed} walks over it not confirmed as one "
          f"moment); {len(storm.staging_areas)} empty staging areas left, {len(storm.kept)} leases kept to the end")
    for (kind, outcome), n in sorted(summary.items()):
        print(f"  {kind:8s} {outcome:28s} {n:4d}")
    return storm


@pytest.fixture(scope="module")
def storm(tmp_path_factory: pytest.TempPathFactory) -> Storm:
    return run_storm(Env(tmp_path_factory.mktemp("storm")))


@pytest.mark.slow
def test_storm_is_hundreds_of_operations_that_all_end_as_they_may(storm: Storm):
    """Every stage ends with a copy (0) or with NoSpace/LockTimeout (75); every evict and release works."""
    assert not storm.problems("op"), "\n".join(storm.problems("op"))
    summary = storm.summary()
    assert len(storm.ops) >= WORKERS * OPS_PER_WORKER
    # it was a storm: copies were staged, found ready, refused for space, evicted, kept for their leases
    assert summary[("stage", "staged")] >= 5 and summary[("stage", "cached")] >= 20
    assert summary[("stage", "75 NoSpace")] >= 5
    # stages make room themselves (through the retention planner, under the same protocol), so
    # fewer copies are left for the evict operations than before: a few suffice
    assert sum(n for (kind, outcome), n in summary.items() if kind == "evict" and "evicted" in outcome) >= 1
    assert sum(n for (kind, outcome), n in summary.items() if kind == "evict" and "kept" in outcome) >= 5
    assert storm.seconds < 60


@pytest.mark.slow
def test_storm_never_exceeds_the_tier_capacity(storm: Storm):
    assert not storm.overshoots, f"{len(storm.overshoots)} looks over the capacity, the first:\n" + \
        "\n".join(storm.overshoots[:3])


@pytest.mark.slow
def test_storm_never_evicts_a_leased_copy(storm: Storm):
    assert not storm.problems("lease"), "\n".join(storm.problems("lease"))
    assert storm.kept, "no worker ended holding a lease: the final eviction tested nothing"
    assert storm.leases == set(storm.kept)  # every lease left is one a worker still holds
    leased = {name for name, _job in storm.kept}
    for name, copy in storm.evicted["copies"].items():
        if name in leased:  # the leased copy stayed, ready and whole
            assert copy["versions"] == [copy["current"]] and copy["ready"] and copy["intact"], (name, copy)
        else:  # nothing else did
            assert copy["versions"] == [], (name, copy)
    assert storm.evicted["usage"] == sum(sum(SIZES[n]) for n in leased)


@pytest.mark.slow
def test_storm_leaves_no_staging_debris(storm: Storm):
    assert storm.quiet == "", storm.quiet
    # quiet again: nothing half-staged, nothing still reserved, and the accounting is what is on disk
    assert storm.staging_files == []
    assert storm.reserved == [] and storm.usage[1] == 0
    assert storm.usage[0] == storm.on_disk
    # evicting every dataset leaves no staging area, reservation or trash
    ev = storm.evicted
    assert ev["quiet"] == "" and ev["staging"] == [] and ev["trash"] == [], ev
    assert not [r for r in ev["reserved"] if r.startswith("stage-")], ev["reserved"]
    # and once the last leases are released, the tier is empty
    assert storm.emptied == {"quiet": "", "bytes": 0, "reserved": [], "staging": [], "versions": []}


# -- the races the storm found, one interleaving each --------------------------------------------


def one_file_dataset(env: Env, name: str, size: int) -> None:
    env.add(name, {"data.bin": os.urandom(size)})


def test_a_stage_cannot_take_the_space_of_a_copy_being_evicted(env: Env, monkeypatch: pytest.MonkeyPatch):
    for name in ("a", "b", "c"):
        one_file_dataset(env, name, 1_000_000)
    small_tier(env, "2MB")
    for name in ("a", "b", "c"):
        env.cli("manifest", "build", name)
    from dsstage.config.catalog import User
    from dsstage.node.lease import LeaseBook
    root, user = env.tier_root(), User.lookup(0)
    store = env.store()
    staging.stage(store, "a", staging.StageRequest(user=user, job_id="1"))
    staging.stage(store, "b", staging.StageRequest(user=user, job_id="2"))  # the tier is full: both copies leased
    other: list[subprocess.Popen[str]] = []
    real = LeaseBook.of_dataset

    def of_dataset(self: LeaseBook, dataset: str) -> list[Any]:
        if dataset == "a" and not other:  # evict("a") has taken a's mark away: another job stages c now
            other.append(env.popen("stage", "c", "--job-id", "3"))
            try:
                other[0].wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # it waits for a lock evict holds: fair, it stages (or not) once evict is done
        return real(self, dataset)

    monkeypatch.setattr(LeaseBook, "of_dataset", of_dataset)
    assert [e.action for e in eviction.evict(store, "a")] == ["kept"]  # job 1 holds a
    _out, err = other[0].communicate(timeout=120)
    on_disk = bytes_on_disk(root)
    assert other[0].returncode == 75 and on_disk <= 2_000_000, \
        f"the stage of c exited {other[0].returncode} ({err.strip()}): {on_disk} bytes on a 2 MB tier " \
        f"({accounting(root)})"


def test_a_purge_racing_another_purge_still_deletes_what_was_evicted_later(env: Env, monkeypatch: pytest.MonkeyPatch):
    for name in ("x", "y"):
        one_file_dataset(env, name, 10_000)
        env.cli("manifest", "build", name)
    from dsstage.config.catalog import User
    from dsstage.node import background
    root, user = env.tier_root(), User.lookup(0)
    monkeypatch.setattr(background, "purge_later", lambda layout: None)  # the purges are ours to run
    store = env.store()
    for name in ("x", "y"):
        staging.stage(store, name, staging.StageRequest(user=user, job_id="1"))
        store.release(name, "1")
        assert [e.action for e in eviction.evict(store, name)] == ["evicted"]
    trash = sorted(os.listdir(root / "trash"))
    assert [t.split(".")[0] for t in trash] == ["x", "y"]
    real_unlink = os.unlink
    raced: list[str] = []

    def unlink(path: Any, *, dir_fd: int | None = None) -> None:
        if path == "data.bin" and dir_fd is not None and not raced \
                and f"/trash/{trash[0]}" in os.readlink(f"/proc/self/fd/{dir_fd}"):
            raced.append(path)
            real_unlink(path, dir_fd=dir_fd)  # the other purge, working on the same entry, was first
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    try:
        background.purge(str(root))
        crashed = None
    except OSError as exc:
        crashed = exc
    monkeypatch.undo()
    assert raced
    # the other purge started before y was evicted: it lists x only, and finishes it
    y_left = [t for t in os.listdir(root / "trash") if t.startswith("y.")]
    y_records = [r for r in os.listdir(root / "reserved") if r.startswith("trash-y.")]
    assert crashed is None and y_left == [] and y_records == [], \
        f"the purge ended with {crashed!r}; y's copy is still in the trash ({y_left}) and counted ({y_records})"


def test_a_stage_refused_for_space_leaves_no_staging_area(env: Env):
    one_file_dataset(env, "ds", 5000)
    small_tier(env, "4KiB")
    env.cli("manifest", "build", "ds")
    res = env.cli("stage", "ds", "--job-id", "1", check=False)
    assert res.returncode == 75 and "needs 4.9 KiB more" in res.stderr
    rows = [(r["dataset"], r["state"]) for r in inventory.build(env.store())["copies"]]
    assert sorted(os.listdir(env.tier_root() / "staging")) == [] and rows == [], rows
