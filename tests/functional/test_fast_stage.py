"""The fast ``dsstage stage`` and ``dsstage verify`` of a ready copy (dsstage.cli.fast)
against a real store: they answer as the full command does, and leave everything else to it."""

from __future__ import annotations

import json
import os

import pytest
from dsstage.cli import fast
from dsstage.cli import main as cli_main
from dsstage.config import load
from dsstage.fs import runfiles, safe
from dsstage.node.lease import LeaseBook
from dsstage.ready import lease as ready_lease
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")


@pytest.fixture
def ready(env: Env, monkeypatch):
    env.add("coco", {"a": b"1" * 10, "b/c": b"2"})
    env.add("secret", {"s": b"s"}, groups=["daemon"])
    for name in ("coco", "secret"):
        env.cli("manifest", "build", name)
    env.cli("stage", "coco,secret", "--job-id", "1")  # the full command stages; it leaves the cache
    full = env.cli_json("-v", "stage", "coco,secret", "--job-id", "1")  # -v: the full command, on ready copies
    assert [r["action"] for r in full] == ["cached", "cached"]
    for k, v in env.env().items():
        monkeypatch.setenv(k, v)
    return full


def leases(env: Env, name: str = "coco") -> dict[str, object]:
    with safe.RootDir(str(env.tier_root())) as tier:
        return {x.job_id: x for x in LeaseBook(tier).of_dataset(name)}


def test_a_ready_copy_is_leased_without_the_configuration(env: Env, ready, monkeypatch, capsys):
    assert (env.run / runfiles.CONFIG_CACHE).exists()

    def no_load(*a, **k):
        raise AssertionError("the fast path loaded the configuration")
    monkeypatch.setattr(load, "load", no_load)
    assert cli_main.main(["stage", "coco,secret", "--job-id", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    for mine, theirs in zip(got, ready, strict=True):
        assert {**mine, "seconds": 0, "job_id": "1"} == {**theirs, "seconds": 0}  # what the full command says
    lease = leases(env)["2"]
    assert (lease.user, lease.node, lease.pid) == ("root", env.node, 0)
    assert "2" in leases(env, "secret")  # root may use a restricted dataset, as with the full command
    report = json.loads((env.run / "reports" / f"{env.node}.json").read_text())
    row = next(r for r in report["copies"] if r["dataset"] == "coco")
    assert "2" in {x["job_id"] for x in row["leases"]}


def test_the_text_line_and_the_shells_lease(env: Env, ready, capsys):
    assert fast.answer(["stage", "coco"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"coco: {ready[0]['path']}  (already here, ") and "lease pid-" in out
    held = [x for j, x in leases(env).items() if j.startswith("pid-")]
    assert [x.pid for x in held] == [os.getppid()]  # the calling shell holds it, as with the full command


@pytest.mark.parametrize("case", ["not ready", "config changed", "unknown", "malformed", "full verify", "sharded",
                                  "lost race", "not root", "no cache"])
def test_anything_else_falls_through(env: Env, ready, monkeypatch, case):
    name = "coco"
    if case == "not ready":
        for mark in (env.tier_root() / "ready" / "coco").iterdir():
            mark.unlink()
    elif case == "config changed":
        os.utime(env.config_path, None)
    elif case == "unknown":
        name = "cocoa"
    elif case == "malformed":
        name = "coco,../x"
    elif case == "full verify":
        env.datasets["coco"]["verify"] = "full"
        env.write()
        from dsstage.hooks.configcache import write_config_cache
        write_config_cache(str(env.run), env.config())
    elif case == "sharded":
        env.datasets["coco"]["shards"] = 2
        env.write()
        from dsstage.hooks.configcache import write_config_cache
        write_config_cache(str(env.run), env.config())
    elif case == "lost race":
        monkeypatch.setattr(ready_lease, "still_ready", lambda p: False)  # an eviction came first
    elif case == "not root":
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    elif case == "no cache":
        (env.run / runfiles.CONFIG_CACHE).unlink()
    assert fast.answer(["stage", name, "--job-id", "3"]) is None
    assert "3" not in leases(env)


def test_a_cache_written_before_tiers_were_in_it_falls_through(env: Env, ready):
    cache = json.loads((env.run / runfiles.CONFIG_CACHE).read_text())
    for ds in cache["datasets"].values():
        del ds["tier"]
    (env.run / runfiles.CONFIG_CACHE).write_text(json.dumps(cache))
    assert fast.answer(["stage", "coco", "--job-id", "4"]) is None
    assert env.cli_json("stage", "coco", "--job-id", "4")["action"] == "cached"  # the full command rewrites it
    assert fast.answer(["stage", "coco", "--job-id", "5"]) == 0


def test_a_cache_of_another_version_or_with_a_wrong_type_falls_through_and_is_rewritten(env: Env, ready):
    """The warm configuration is versioned and typed (dsstage.ready.warmconf): an older
    dsstage's cache, or a field of the wrong type, is no cache; the full command writes it anew."""
    path = env.run / runfiles.CONFIG_CACHE
    for damage in ({"version": 1}, {"hash_threads": "2"}, {"datasets": {"coco": {"root": 5}}}):
        cache = json.loads(path.read_text())
        if "datasets" in damage:
            cache["datasets"]["coco"]["root"] = 5
        else:
            cache.update(damage)
        path.write_text(json.dumps(cache))
        assert fast.answer(["stage", "coco", "--job-id", "4"]) is None, damage
        assert env.cli_json("stage", "coco", "--job-id", "4")["action"] == "cached"
        assert fast.answer(["stage", "coco", "--job-id", "5"]) == 0, damage


def test_a_quick_verify_of_a_ready_copy_answers_as_the_full_command(env: Env, ready, monkeypatch, capsys):
    full = env.cli_json("-v", "verify", "coco")
    text = env.cli("-v", "verify", "coco").stdout
    monkeypatch.setattr(load, "load", lambda *a, **k: pytest.fail("the fast path loaded the configuration"))
    assert cli_main.main(["verify", "coco", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == full
    assert cli_main.main(["verify", "coco"]) == 0
    assert capsys.readouterr().out == text


def test_a_verify_of_a_copy_not_ready_is_the_full_commands(env: Env, ready):
    for mark in (env.tier_root() / "ready" / "coco").iterdir():
        mark.unlink()
    assert fast.answer(["verify", "coco"]) is None
    res = env.cli("verify", "coco", check=False)
    assert res.returncode == 1 and "NOT READY" in res.stdout


def test_the_fast_path_imports_nothing_heavy(env: Env, ready):
    """The real command, started as its entry point starts it (``from dsstage.cli.main import
    main``; ``python -m dsstage`` adds runpy's own imports, collections and contextlib among
    them), answered by the fast path imports none of what tests/unit/test_warm_imports.py
    keeps out."""
    import subprocess
    import sys

    from helpers import WARM_HEAVY
    for argv in (["stage", "coco", "--job-id", "5"], ["verify", "coco"]):
        entry = "import sys; from dsstage.cli.main import main; sys.exit(main())"
        res = subprocess.run([sys.executable, "-X", "importtime", "-c", entry, *argv], env=env.env(),
                             capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
        assert "dsstage.cli.fast" in imported and "dsstage.config.load" not in imported
        assert not imported & set(WARM_HEAVY), (argv, sorted(imported & set(WARM_HEAVY)))


def test_a_full_verify_of_a_matching_copy_answers_as_the_full_command_under_the_lock(env: Env, ready, monkeypatch,
                                                                                      capsys):
    """``verify --full`` of a copy whose every file matches: the full command's answer, the
    copy hashed under the dataset's lock (its owner recorded, as the full command records
    it), without the configuration; the lock is free and the owner file gone after."""
    from dsstage.node import lock
    from dsstage.transfer import check
    full = env.cli_json("-v", "verify", "coco", "--full")
    text = env.cli("-v", "verify", "coco", "--full").stdout
    path = str(env.tier_root() / "locks" / "coco.lock")
    checked = []

    def check_tree(fd, entries, threads=0, progress=None):
        checked.append((lock.is_held(path), lock.read_owner(path).get("action"), len(entries)))
        return real(fd, entries, threads, progress)
    real = check.check_tree
    monkeypatch.setattr(check, "check_tree", check_tree)
    monkeypatch.setattr(load, "load", lambda *a, **k: pytest.fail("the fast path loaded the configuration"))
    assert cli_main.main(["verify", "coco", "--full", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == full
    assert full["mode"] == "full" and full["checked_files"] == 2
    assert cli_main.main(["verify", "--full", "coco"]) == 0
    assert capsys.readouterr().out == text
    assert checked == [(True, "verify", 2)] * 2
    assert not lock.is_held(path) and not os.path.exists(path + ".owner")


@pytest.mark.parametrize("case", ["wrong", "missing", "extra", "locked", "lock replaced", "old cache"])
def test_a_full_verify_that_finds_anything_wrong_is_the_full_commands(env: Env, ready, monkeypatch, case):
    """A wrong, missing or extra file is left as found for the full command, which checks
    again, repairs and says so; a lock another holds (or a lock file replaced while it was
    being locked) and a cache from before the fast ``verify --full`` leave it to the full
    command too."""
    from dsstage.node.lock import DatasetLock
    copy = ready[0]["path"]
    if case == "wrong":
        fd = os.open(os.path.join(copy, "a"), os.O_WRONLY)  # root writes the read-only file
        os.write(fd, b"9")
        os.close(fd)
    elif case == "missing":
        os.unlink(os.path.join(copy, "b", "c"))
    elif case == "extra":
        with open(os.path.join(copy, "b", "planted"), "w") as f:
            f.write("x")
    elif case == "old cache":
        cache = json.loads((env.run / runfiles.CONFIG_CACHE).read_text())
        del cache["hash_threads"]
        (env.run / runfiles.CONFIG_CACHE).write_text(json.dumps(cache))
    elif case == "lock replaced":  # between the open and the flock: the flock is of a file no longer there
        import fcntl
        lock_path, real_flock = env.tier_root() / "locks" / "coco.lock", fcntl.flock

        def flock(fd, op):
            (lock_path.parent / "new").write_text("")
            os.replace(lock_path.parent / "new", lock_path)
            return real_flock(fd, op)
        monkeypatch.setattr(fcntl, "flock", flock)
        assert fast.answer(["verify", "coco", "--full"]) is None
        monkeypatch.undo()
        assert not (lock_path.parent / "coco.lock.owner").exists()
        assert env.cli_json("verify", "coco", "--full")["ok"]
        return
    if case == "locked":
        with DatasetLock(str(env.tier_root() / "locks" / "coco.lock"), timeout=1, action="stage"):
            assert fast.answer(["verify", "coco", "--full"]) is None
        assert env.cli_json("verify", "coco", "--full")["ok"]
        return
    before = sorted(p.name for p in (env.tier_root() / "datasets").rglob("*"))
    assert fast.answer(["verify", "coco", "--full"]) is None
    assert sorted(p.name for p in (env.tier_root() / "datasets").rglob("*")) == before  # nothing changed
    got = env.cli_json("verify", "coco", "--full")
    assert got["ok"] and got["mode"] == "full"
    assert got["repaired"] == {"wrong": ["a"], "missing": ["b/c"]}.get(case, [])
    assert got["removed_extras"] == (1 if case == "extra" else 0)
    if case == "old cache":
        env.cli("stage", "coco", "--job-id", "9", "--full")  # the full stage writes the cache again
        assert fast.answer(["verify", "coco", "--full"]) == 0


def test_the_fast_full_verify_imports_neither_the_configuration_nor_the_store(env: Env, ready):
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "dsstage", "verify", "coco", "--full"],
                         env=env.env(), capture_output=True, text=True, check=False)
    assert res.returncode == 0 and "OK (full)" in res.stdout, res.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "dsstage.node.treecheck" in imported and "dsstage.transfer.check" in imported
    assert not imported & {"dsstage.config.load", "dsstage.node.store", "yaml", "argparse", "filelock"}, \
        sorted(imported & {"dsstage.config.load", "dsstage.node.store", "yaml", "argparse", "filelock"})


def test_a_rebuild_during_the_fast_full_verify_leaves_the_copy_ready_in_the_report(env: Env, ready, monkeypatch):
    """A report rebuilt while the fast ``verify --full`` held the lock shows the copy
    "verifying" (dsstage.node.inventory); the fast path sets it back, in both copies of the
    report, as the full command's rebuild at its end would."""
    from dsstage.transfer import check
    real = check.check_tree
    vid = os.path.basename(ready[0]["path"])

    def state(path):
        rows = json.loads(path.read_text())["copies"]
        return next(r["state"] for r in rows if (r["dataset"], r["version"]) == ("coco", vid))
    seen = []

    def check_tree(fd, entries, threads=0, progress=None):
        env.cli("report")  # a rebuild now (the report timer's) sees the lock held for "verify"
        seen.append(state(env.run / "reports" / f"{env.node}.json"))
        return real(fd, entries, threads, progress)
    monkeypatch.setattr(check, "check_tree", check_tree)
    assert fast.answer(["verify", "coco", "--full"]) == 0
    assert seen == ["verifying"]  # what the rebuild wrote
    assert state(env.run / "reports" / f"{env.node}.json") == "ready"
    assert state(env.state / "nodes" / f"{env.node}.json") == "ready"


def test_a_fast_full_verify_that_cannot_remove_its_owner_file_still_lets_the_lock_go(env: Env, ready, monkeypatch):
    from dsstage.node import lock
    real = safe.unlink_at

    def unlink_at(dir_fd, name):
        if name.endswith(".lock.owner"):
            raise OSError(30, "Read-only file system")
        return real(dir_fd, name)
    monkeypatch.setattr(safe, "unlink_at", unlink_at)
    assert fast.answer(["verify", "coco", "--full"]) == 0
    assert not lock.is_held(str(env.tier_root() / "locks" / "coco.lock"))


@pytest.mark.parametrize("case", ["link", "empty directory", "fifo"])
def test_anything_the_manifest_does_not_list_is_the_full_commands_to_remove(env: Env, ready, case):
    copy = ready[0]["path"]
    if case == "link":
        os.symlink("/etc/shadow", os.path.join(copy, "b", "shadow"))
    elif case == "empty directory":
        os.mkdir(os.path.join(copy, "empty"))
    else:
        os.mkfifo(os.path.join(copy, "b", "fifo"))
    assert fast.answer(["verify", "coco", "--full"]) is None
    got = env.cli_json("verify", "coco", "--full")
    assert got["ok"] and got["removed_extras"] == 1 and got["repaired"] == []
    assert fast.answer(["verify", "coco", "--full"]) == 0  # clean again: the fast path answers


def test_a_copy_evicted_while_the_lock_was_taken_is_the_full_commands(env: Env, ready, monkeypatch):
    real = fast._try_lock

    def try_lock(locks, name):
        got = real(locks, name)
        for mark in (env.tier_root() / "ready" / name).iterdir():  # an eviction got there first
            mark.unlink()
        return got
    monkeypatch.setattr(fast, "_try_lock", try_lock)
    assert fast.answer(["verify", "coco", "--full"]) is None
    assert not (env.tier_root() / "locks" / "coco.lock.owner").exists()


@pytest.mark.parametrize("case", ["verify full", "sharded"])
def test_the_fast_full_verify_takes_any_whole_dataset_and_no_sharded_one(env: Env, ready, case):
    """A dataset staged with full verification is answered too (the option is about every
    stage, not about this command); a sharded one is the full command's (its shards)."""
    from dsstage.hooks.configcache import write_config_cache
    if case == "verify full":
        env.datasets["coco"]["verify"] = "full"
    else:
        env.datasets["coco"]["shards"] = 2
    env.write()
    write_config_cache(str(env.run), env.config())
    assert fast.answer(["verify", "coco", "--full"]) == (0 if case == "verify full" else None)


def test_the_fast_full_verify_warns_as_the_full_command_does(env: Env, ready, tmp_path):
    import subprocess
    import sys
    untrusted = tmp_path / "dsstage-copy"  # anyone may write it: refused, with a warning
    untrusted.write_text("#!/bin/sh\n")
    untrusted.chmod(0o777)
    res = subprocess.run([sys.executable, "-m", "dsstage", "verify", "coco", "--full"],
                         env={**env.env(), "DSSTAGE_NATIVE_COPY": str(untrusted)},
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0 and "OK (full)" in res.stdout, res.stderr
    assert res.stderr.startswith("dsstage: WARNING: not running the native copier"), res.stderr
