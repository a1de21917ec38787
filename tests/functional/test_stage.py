"""Staging with real rsync on tmp_path: the node-local store end to end through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import blake3
import pytest
from dsstage.config import manifest as config_manifest
from helpers import Env, random_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")


def tree_hashes(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = blake3.blake3(p.read_bytes()).hexdigest()
    return out


def staged(env: Env, name: str, job: str, *extra: str) -> dict:
    return env.cli_json("stage", name, "--job-id", job, *extra)


def test_stage_makes_a_ready_read_only_copy_and_second_stage_transfers_nothing(env: Env, tree):
    src = env.add("coco", {"a.jpg": b"a" * 1000, "sub/b.jpg": b"b" * 2000, "sub/deeper/c": b"c"})
    env.cli("manifest", "build", "coco")
    first = staged(env, "coco", "101")
    assert first["action"] == "staged" and first["transferred_bytes"] == 3001 and first["transferred_files"] == 3
    path = Path(first["path"])
    assert path.parent == env.tier_root() / "datasets" / "coco"
    assert tree_hashes(path) == tree_hashes(src)
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            assert st.st_uid == 0 and not st.st_mode & 0o222, name
    second = staged(env, "coco", "102")
    assert second["action"] == "cached" and second["transferred_bytes"] == 0 and second["path"] == first["path"]
    leases = sorted(p.name for p in (env.tier_root() / "leases" / "coco").iterdir())
    assert leases == ["101.json", "102.json"]
    assert env.cli_json("verify", "coco")["ok"] is True
    env.cli("release", "coco", "--job-id", "101")
    assert sorted(p.name for p in (env.tier_root() / "leases" / "coco").iterdir()) == ["102.json"]


def test_eight_concurrent_stages_read_the_source_once(env: Env, tmp_path):
    from servers import RsyncDaemon
    module = tmp_path / "export"
    random_tree(module / "imagenet", 300, 20_000)
    daemon = RsyncDaemon(tmp_path, module)
    try:
        env.add("imagenet", None, source=daemon.url("imagenet"))
        env.cli("manifest", "build", "imagenet", "--from", str(module / "imagenet"))
        procs = [env.popen("stage", "imagenet", "--job-id", f"{200 + i}", "--json") for i in range(8)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            results.append(json.loads(out))
        total = sum(f.stat().st_size for f in (module / "imagenet").rglob("*") if f.is_file())
        assert [r["action"] for r in results].count("staged") == 1
        assert sum(r["transferred_bytes"] for r in results) == total
        assert daemon.bytes_sent() == total  # the source's own log: every byte read once
        assert len({r["path"] for r in results}) == 1
        leases = sorted(p.stem for p in (env.tier_root() / "leases" / "imagenet").iterdir())
        assert leases == [str(200 + i) for i in range(8)]
    finally:
        daemon.stop()


@pytest.mark.parametrize("chroot", [False, True], ids=["use-chroot-no", "use-chroot-yes"])
def test_a_dataset_below_a_daemon_module_stages_with_chroot_on_or_off(env: Env, tmp_path, chroot):
    """rsync 3.5.0's daemon, with ``use chroot = no``, answers "file has vanished" for every
    ``--files-from`` name below a module's subdirectory (issue 57): named from the module's
    root (``sub/./name``) the same files arrive, verified, with either setting."""
    from servers import RsyncDaemon
    module = tmp_path / "export"
    files = {"top.bin": b"t" * 3000, "a dir/with space.bin": b"s" * 10, "deep/er/x": b"x",
             "odd\nname": b"n" * 7, "lead-./dot.bin": b"d" * 5}
    for rel, data in files.items():
        (module / "sets" / "coco" / rel).parent.mkdir(parents=True, exist_ok=True)
        (module / "sets" / "coco" / rel).write_bytes(data)
    daemon = RsyncDaemon(tmp_path, module, chroot=chroot)
    try:
        env.add("coco", None, source=daemon.url("sets/coco"))
        env.cli("manifest", "build", "coco", "--from", str(module / "sets" / "coco"))
        res = staged(env, "coco", "150")
        assert res["action"] == "staged" and res["transferred_files"] == len(files)
        assert tree_hashes(Path(res["path"])) == tree_hashes(module / "sets" / "coco")
        assert daemon.bytes_sent() == sum(map(len, files.values()))
        assert "vanished" not in daemon.log.read_text()
    finally:
        daemon.stop()


def test_kill_9_during_stage_resumes_and_never_looks_ready(env: Env):
    src = env.source("big")
    random_tree(src, 60, 1_000_000, fanout=10)
    env.extra = {"transfer": {"bwlimit": 8000, "streams": 2}}  # ~16 MB/s: the stage takes ~4 s
    env.add("big")
    env.cli("manifest", "build", "big")
    proc = env.popen("stage", "big", "--job-id", "301")
    staging = env.tier_root() / "staging"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        files = [f for f in staging.rglob("*.bin")] if staging.exists() else []
        if len(files) >= 10:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the stage did not start writing")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)  # rsync dies with its parent (PR_SET_PDEATHSIG)
    assert not (env.tier_root() / "datasets" / "big").exists() or \
        not any((env.tier_root() / "datasets" / "big").iterdir())
    res = env.cli("verify", "big", "--json", check=False)
    assert res.returncode == 1 and json.loads(res.stdout)["ok"] is False
    partial = sum(f.stat().st_size for f in staging.rglob("*.bin"))
    env.extra = {}
    env.write()
    again = staged(env, "big", "302")
    total = 60 * 1_000_008
    assert again["action"] == "staged"
    assert 0 < again["transferred_bytes"] < total
    assert again["transferred_bytes"] <= total - partial + 1_000_008 * 2  # files rsync was writing may restart
    assert tree_hashes(Path(again["path"])) == tree_hashes(src)
    assert not any(staging.iterdir())


def test_flipped_byte_is_found_by_full_verify_and_repaired(env: Env):
    src = env.add("ds", {f"f{i}": os.urandom(5000) for i in range(20)})
    env.cli("manifest", "build", "ds")
    path = Path(staged(env, "ds", "1")["path"])
    victim = path / "f7"
    data = bytearray(victim.read_bytes())
    data[1234] ^= 0xFF
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    os.chmod(victim, 0o444)
    quick = env.cli_json("verify", "ds")
    assert quick["ok"] is True and quick["mode"] == "quick"  # quick trusts the mark: that is its contract
    full = env.cli_json("verify", "ds", "--full")
    assert full["ok"] is True and full["repaired"] == ["f7"] and "f7" in full["reason"]
    assert victim.read_bytes() == (src / "f7").read_bytes()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o444
    assert env.cli_json("verify", "ds", "--full")["repaired"] == []


def test_full_verify_mode_repairs_on_stage(env: Env):
    src = env.add("ds", {"a": b"1" * 100, "b": b"2" * 100}, verify="full")
    env.cli("manifest", "build", "ds")
    path = Path(staged(env, "ds", "1")["path"])
    (path / "b").unlink()
    (path / "extra").write_bytes(b"junk")
    again = staged(env, "ds", "2")
    assert again["action"] == "repaired"
    assert tree_hashes(path) == tree_hashes(src)


def test_source_changed_without_manifest_rebuild_publishes_nothing(env: Env):
    src = env.add("ds", {"a": b"1" * 100, "b": b"2" * 100, "c": b"3" * 100})
    env.cli("manifest", "build", "ds")
    (src / "b").write_bytes(b"X" * 100)  # same size, other content
    res = env.cli("stage", "ds", "--job-id", "1", check=False)
    assert res.returncode == 65
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert "'b' differs in content from the manifest" in res.stderr
    assert "source changed after its manifest was built" in res.stderr
    assert "dsstage manifest build ds" in res.stderr
    published = env.tier_root() / "datasets" / "ds"
    assert not published.exists() or not any(published.iterdir())
    assert not (env.tier_root() / "leases" / "ds").exists()
    env.cli("manifest", "build", "ds")
    assert staged(env, "ds", "1")["action"] == "staged"
    src2 = env.add("ds2", {"a": b"1" * 100, "c": b"3" * 100})
    env.cli("manifest", "build", "ds2")
    (src2 / "c").unlink()
    res = env.cli("stage", "ds2", "--job-id", "1", check=False)
    assert res.returncode == 65 and "'c' is missing; the source no longer has them" in res.stderr


def test_unreachable_source_is_a_clear_error(env: Env):
    src = env.add("ds", {"a": b"1"})
    env.cli("manifest", "build", "ds")
    os.rename(src, str(src) + ".gone")
    res = env.cli("stage", "ds", "--job-id", "1", check=False)
    assert res.returncode == 69 and "is not reachable from this node" in res.stderr
    env.add("remote", None, source="rsync://127.0.0.1:1/none/x")
    Path(str(src) + ".gone").rename(src)
    env.cli("manifest", "build", "remote", "--from", str(src))
    res = env.cli("stage", "remote", "--job-id", "1", check=False)
    assert res.returncode == 69 and "check that the source is up" in res.stderr


@pytest.mark.parametrize("bad", ["../../etc", "a/b", "Coco", ".hidden"])
def test_traversal_in_dataset_names_is_rejected(env: Env, bad):
    env.add("coco", {"a": b"1"})
    res = env.cli("stage", bad, "--job-id", "1", check=False)
    assert res.returncode == 2 and "is not allowed" in res.stderr
    assert not env.tier_root().exists()


def test_traversal_in_a_manifest_is_rejected_before_writing(env: Env):
    env.add("ds", {"a": b"1"})
    env.cli("manifest", "build", "ds")
    entries = [config_manifest.Entry("../../../escape", 1, 0, "0" * 64)]
    m = config_manifest.Manifest("ds", config_manifest.compute_digest(entries), entries, 1, 0.0)
    config_manifest.Catalog(str(env.state)).publish(m)
    res = env.cli("stage", "ds", "--job-id", "1", check=False)
    assert res.returncode == 65 and "component '..' is not allowed" in res.stderr
    assert not (env.tmp / "escape").exists() and not (env.tier_root().parent / "escape").exists()


@pytest.fixture
def public_nvme(env: Env):
    """A tier outside tmp_path (whose parents are private to root), so other users can reach it."""
    base = Path(tempfile.mkdtemp(prefix="dsstage-test-nvme-"))
    os.chmod(base, 0o755)
    env.nvme = base
    yield base
    shutil.rmtree(base)


def test_group_restricted_dataset(env: Env, public_nvme):
    env.add("secret", {"data.bin": b"s" * 10}, groups=["daemon", "bin"])
    env.add("single", {"data.bin": b"t" * 10}, groups=["daemon"])
    env.cli("manifest", "build", "secret")
    env.cli("manifest", "build", "single")
    res = env.cli("stage", "secret", "--job-id", "1", "--user", "nobody", check=False)
    assert res.returncode == 77
    assert "restricted to group(s) daemon, bin; user 'nobody' is in none of them" in res.stderr
    path = staged(env, "secret", "2", "--user", "daemon")["path"]
    single = staged(env, "single", "3", "--user", "daemon")["path"]

    def can_read(user: str, p: str) -> bool:
        import pwd
        pw = pwd.getpwnam(user)
        r = subprocess.run(["cat", p + "/data.bin"], user=pw.pw_uid, group=pw.pw_gid,
                           extra_groups=os.getgrouplist(user, pw.pw_gid), capture_output=True)
        return r.returncode == 0
    assert can_read("daemon", path) and can_read("bin", path)
    assert not can_read("nobody", path)
    assert can_read("daemon", single) and not can_read("bin", single) and not can_read("nobody", single)


AWKWARD = {
    "with space.jpg": b"1", "-leading-dash": b"2", "--rsync-option-lookalike": b"3",
    "ünïcødé/日本語 ファイル.txt": b"4", "new\nline": b"5", "tab\tname": b"6", "back\\slash": b"7",
    "empty": b"", "sub/empty-too": b"", "*glob?[x]": b"8", ".hidden": b"9",
}


def test_awkward_contents_stage_and_verify(env: Env):
    files = dict(AWKWARD)
    deep = "/".join(f"d{i}" for i in range(120))
    files[deep + "/bottom.txt"] = b"deep"
    src = env.add("odd", files)
    os.symlink("/etc/shadow", src / "sneaky-link")
    env.cli("manifest", "build", "odd")
    r = staged(env, "odd", "1")
    path = Path(r["path"])
    expected = tree_hashes(src)
    expected.pop("sneaky-link")  # links are not part of a dataset
    assert tree_hashes(path) == expected
    assert not (path / "sneaky-link").exists()
    assert env.cli_json("verify", "odd", "--full")["repaired"] == []


def test_zero_byte_dataset(env: Env):
    env.add("void", {})
    env.cli("manifest", "build", "void")
    r = staged(env, "void", "1")
    assert r["action"] == "staged" and os.listdir(r["path"]) == []
    assert staged(env, "void", "2")["action"] == "cached"


def test_new_version_reuses_unchanged_files_and_keeps_the_old_one(env: Env):
    src = env.add("ds", {f"f{i}": os.urandom(10_000) for i in range(10)})
    env.cli("manifest", "build", "ds")
    old = staged(env, "ds", "1")
    (src / "f3").write_bytes(os.urandom(10_000))
    (src / "f11").write_bytes(b"new")
    env.cli("manifest", "build", "ds")
    new = staged(env, "ds", "2")
    assert new["path"] != old["path"] and new["action"] == "staged"
    assert new["linked_files"] == 9 and new["transferred_files"] == 2
    assert tree_hashes(Path(new["path"])) == tree_hashes(src)
    assert (Path(old["path"]) / "f3").read_bytes() != (src / "f3").read_bytes()  # job 1 keeps its version
    assert os.stat(Path(old["path"]) / "f0").st_ino == os.stat(Path(new["path"]) / "f0").st_ino


def test_ssh_source(env: Env, tmp_path):
    from servers import SshServer
    server = SshServer(tmp_path / "sshd")
    try:
        src = env.source("remote")
        random_tree(src, 50, 3000)
        (src / "name with space").write_bytes(b"x")
        env.extra = {"transfer": {"rsh": server.rsh}}
        env.add("remote", None, source=f"127.0.0.1:{src}")
        env.cli("manifest", "build", "remote", "--from", str(src))
        r = staged(env, "remote", "1")
        assert r["transferred_files"] == 51
        assert tree_hashes(Path(r["path"])) == tree_hashes(src)
    finally:
        server.stop()


def test_tier_without_room_is_a_clear_error(env: Env):
    env.add("ds", {"a": b"x" * 5000})
    env.write()
    text = env.config_path.read_text().replace("100GiB", "4KiB")
    env.config_path.write_text(text)
    env.cli("manifest", "build", "ds")
    res = env.cli("stage", "ds", "--job-id", "1", check=False)
    assert res.returncode == 75 and "needs 4.9 KiB more" in res.stderr
    assert "larger than the tier: raise the tier's capacity" in res.stderr


def test_cli_errors_are_one_line(env: Env):
    env.add("coco", {"a": b"1"})
    res = env.cli("stage", "cocoa", "--job-id", "1", check=False)
    assert res.returncode == 2
    assert res.stderr == ("dsstage: error: unknown dataset 'cocoa' (did you mean 'coco'?); "
                          "`dsstage ls` lists the catalog\n")
    res = env.cli("stage", "coco", "--job-id", "1", check=False)
    assert res.returncode == 65 and "no manifest yet" in res.stderr and res.stderr.count("\n") == 1
    os.chmod(env.config_path, 0o666)
    res = env.cli("ls", check=False)
    assert res.returncode == 78 and "writable by group or others" in res.stderr


@pytest.mark.slow
def test_twenty_thousand_small_files(env: Env):
    src = env.source("many")
    random_tree(src, 20_000, 1000, fanout=1000)
    env.add("many")
    built = env.cli_json("manifest", "build", "many")
    assert built["files"] == 20_000
    r = staged(env, "many", "1")
    assert r["transferred_files"] == 20_000
    assert sum(1 for _ in Path(r["path"]).rglob("*.bin")) == 20_000
    assert env.cli_json("verify", "many", "--full")["repaired"] == []


@pytest.mark.slow
def test_single_2gib_file(env: Env):
    src = env.source("huge")
    src.mkdir(parents=True)
    block = os.urandom(2**20)
    with open(src / "blob.bin", "wb") as fh:
        fh.writelines(block[:-8] + i.to_bytes(8, "little") for i in range(2048))
    env.add("huge")
    env.cli("manifest", "build", "huge")
    r = staged(env, "huge", "1")
    assert r["transferred_bytes"] == 2 * 2**30
    assert env.cli_json("verify", "huge", "--full")["repaired"] == []
    (src / "blob.bin").unlink()


def test_evict_removes_only_copies_without_leases(env: Env):
    src = env.add("ds", {"a": b"1" * 1000})
    env.cli("manifest", "build", "ds")
    old = staged(env, "ds", "1")
    (src / "a").write_bytes(b"2" * 1000)
    env.cli("manifest", "build", "ds")
    new = staged(env, "ds", "2")
    env.cli("release", "ds", "--job-id", "1")
    result = {r["version"]: r for r in env.cli_json("evict", "ds")}
    assert result[Path(old["path"]).name]["action"] == "evicted"
    assert result[Path(new["path"]).name]["action"] == "kept"
    assert "leased by job 2" in result[Path(new["path"]).name]["reason"]
    assert not Path(old["path"]).exists() and Path(new["path"]).exists()
    assert env.cli_json("verify", "ds")["ok"] is True  # the kept copy is still ready
    env.cli("release", "ds", "--job-id", "2")
    assert [r["action"] for r in env.cli_json("evict", "ds")] == ["evicted"]
    res = env.cli("verify", "ds", "--json", check=False)
    assert res.returncode == 1 and json.loads(res.stdout)["reason"] == "no ready copy on this node"
    trash = env.tier_root() / "trash"
    for _ in range(100):
        if not any(trash.iterdir()):
            break
        time.sleep(0.05)
    assert not any(trash.iterdir())  # deleted by the detached purge
    assert staged(env, "ds", "3")["action"] == "staged"


def test_a_copy_is_trusted_after_a_restart_only_once_flushed(env: Env):
    src = env.add("ds", {f"f{i}": os.urandom(2000) for i in range(5)})
    env.cli("manifest", "build", "ds")
    first = staged(env, "ds", "1")
    mark_path = next((env.tier_root() / "ready" / "ds").iterdir())
    for _ in range(200):  # the detached flush marks the copy durable
        if json.loads(mark_path.read_text()).get("durable"):
            break
        time.sleep(0.05)
    mark = json.loads(mark_path.read_text())
    assert mark["durable"] is True and mark["boot"]
    # as if the node restarted: a durable copy stays ready
    mark["boot"] = "another-boot"
    mark_path.write_text(json.dumps(mark))
    assert env.cli_json("verify", "ds")["ok"] is True
    # a copy that was not yet flushed when the node went down is verified again before use
    mark["durable"] = False
    mark_path.write_text(json.dumps(mark))
    res = env.cli("verify", "ds", "--json", check=False)
    assert res.returncode == 1 and "still being written to disk" in json.loads(res.stdout)["reason"]
    victim = Path(first["path"]) / "f2"
    victim.write_bytes(b"")  # what a crash can leave behind
    again = staged(env, "ds", "2")
    assert again["action"] == "staged" and again["path"] == first["path"]
    assert again["transferred_files"] == 1  # only the damaged file was fetched again
    assert (Path(again["path"]) / "f2").read_bytes() == (src / "f2").read_bytes()


def test_the_steps_of_a_stage_each_on_its_own(env: Env):
    """authorize, reuse, dataset_lock and make_ready, called one by one as stage() calls them."""
    from dsstage.config.catalog import User
    from dsstage.errors import AccessDenied
    from dsstage.node import staging
    from dsstage.node.lease import Lease, LeaseBook
    from dsstage.node.store import StageResult, open_tier

    env.add("coco", {"a.jpg": b"a" * 1000, "sub/b.jpg": b"b" * 2000})
    env.add("secret", {"x": b"x"}, groups=["nobody-has-this-group"])
    env.cli("manifest", "build", "coco")
    env.cli("manifest", "build", "secret")
    store = env.store()
    root = User.lookup(0)
    plain = User(name="someone", uid=4242, groups=frozenset({"users"}))
    with pytest.raises(AccessDenied):
        staging.authorize(store, "secret", staging.StageRequest(user=plain, job_id="7"))
    ds, digest = staging.authorize(store, "coco", staging.StageRequest(user=root, job_id="7"))
    layout = store.layout(ds.tier)
    lease = Lease(dataset="coco", digest=digest, job_id="7", user="root", node=store.node, taken=time.time())
    with open_tier(layout) as tier:
        book = LeaseBook(tier)
        assert staging.reuse(store, tier, ds, digest, book, lease) is False  # nothing ready: no lease left
        assert not (env.tier_root() / "leases" / "coco" / "7.json").exists()
        job = staging.StageRequest(user=root, job_id="7")
        result = StageResult(dataset="coco", digest=digest, path=layout.version_dir("coco", digest), tier=ds.tier,
                             node=store.node, action="cached", job_id="7")
        with staging.dataset_lock(store, layout, "coco", job):
            staging.make_ready(store, tier, ds, digest, job, result)
        assert result.action == "staged" and result.transferred_bytes == 3000
        assert staging.reuse(store, tier, ds, digest, book, lease) is True  # ready now: leased without the lock
        assert (env.tier_root() / "leases" / "coco" / "7.json").exists()


def test_a_dataset_that_becomes_restricted_is_closed_on_the_node_at_the_next_report(env: Env):
    """Issue 51: ``groups:`` added by the admin reached only the copies staged afterwards;
    a node's copies (and a sharded dataset's views) cached before stayed open to everyone.
    The next report refresh applies it, and lifting it opens them again."""
    import grp
    env.add("coco", {"a": b"a" * 10})
    env.cli("manifest", "build", "coco")
    staged(env, "coco", "1")
    top = env.tier_root() / "datasets" / "coco"
    assert stat.S_IMODE(top.stat().st_mode) == 0o755
    group = grp.getgrnam("daemon")  # in every Debian system: not root's group
    env.datasets["coco"]["groups"] = [group.gr_name]
    env.write()
    assert "a change of groups reaches the copies" in env.cli("check-config").stdout
    env.cli("report")
    assert stat.S_IMODE(top.stat().st_mode) == 0o750 and top.stat().st_gid == group.gr_gid
    del env.datasets["coco"]["groups"]
    env.write()
    env.cli("report")
    assert stat.S_IMODE(top.stat().st_mode) == 0o755 and top.stat().st_gid == 0
