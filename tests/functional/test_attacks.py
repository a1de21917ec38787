"""Attacks on the root Prolog by people it does not trust, played by a real unprivileged user.

The threat model (docs/admin-guide.md): users on a compute node can create files in any
world-writable directory before dsstage does, race it, and run code while it runs; data
owners control what their source holds, and nothing else. Each test plays one attack as
the system user ``dsstage-attacker`` (through setpriv, with the system python for loops),
in a root-owned sticky playground under /tmp (what /tmp and /dev/shm are), then checks
what root did NOT do (modes, owners, ctimes and contents of what the attacker pointed at
are unchanged) and that dsstage refused with one line naming the path.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest
from dsstage.config import manifest as config_manifest
from dsstage.fs import safe
from dsstage.transfer import build as transfer_build
from helpers import Env, write_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attacks on root: run as root")

ATTACKER = "dsstage-attacker"
READER = "dsstage-reader"
SECRET = b"root-only: payroll 2026, never for users\n"
#: what the attacker's processes get: nothing from the test's (virtual) environment
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}


# -- the attacker ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int

    def argv(self, *cmd: str) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--", *cmd]

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(self.argv(*cmd), cwd="/", env=CLEAN_ENV, text=True, capture_output=True, timeout=60)
        if check and res.returncode != 0:
            raise AssertionError(f"{self.name}: {cmd} -> {res.returncode}: {res.stderr}")
        return res

    def sh(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("/bin/sh", "-c", script, check=check)

    def popen(self, *cmd: str) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(*cmd), cwd="/", env=CLEAN_ENV, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def system_user(name: str) -> Account:
    """The system user ``name``, created once if missing (never deleted: other runs share it)."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        res = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                             capture_output=True, text=True)
        try:
            pw = pwd.getpwnam(name)  # another worker may have created it meanwhile
        except KeyError:
            pytest.fail(f"useradd {name} failed: {res.stderr.strip()}")
    return Account(name, pw.pw_uid, pw.pw_gid)


@pytest.fixture(scope="session")
def attacker() -> Account:
    return system_user(ATTACKER)


@pytest.fixture(scope="session")
def reader() -> Account:
    return system_user(READER)


def background_of(path: Path) -> list[int]:
    """The detached dsstage processes (flush, purge) still working on a tier below ``path``."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            cmd = Path("/proc", d, "cmdline").read_bytes() if d.isdigit() else b""
        except OSError:
            continue
        if b"dsstage.node.background" in cmd and os.fsencode(path) in cmd:
            pids.append(int(d))
    return pids


def remove_tree(path: Path) -> None:
    """Remove ``path`` once the detached flushes of its tier are done (a flush takes the
    dataset lock by path: started after the removal, it would create the lock again)."""
    deadline = time.monotonic() + 30
    while background_of(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    for _ in range(50):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def playground() -> Iterator[Path]:
    """A root-owned sticky world-writable directory, like /tmp or /dev/shm (tmp_path's
    parents are private to root, so the attacker could not even reach a directory there)."""
    pg = Path(tempfile.mkdtemp(prefix="dsstage-attack-", dir="/tmp"))
    os.chmod(pg, 0o1777)
    yield pg
    remove_tree(pg)


@pytest.fixture
def env(tmp_path: Path, playground: Path) -> Env:
    """The usual installation (config and state private to root), with the tier in the
    playground: ``<playground>/dsstage/{node}``, as ``/dev/shm/dsstage/{node}`` would be."""
    e = Env(tmp_path)
    e.nvme = playground / "dsstage"
    return e


@pytest.fixture
def vault(tmp_path: Path) -> Path:
    """A root-only directory (0700) holding a root-only file (0600)."""
    v = tmp_path / "root-only"
    v.mkdir()
    os.chmod(v, 0o700)
    (v / "secret").write_bytes(SECRET)
    os.chmod(v / "secret", 0o600)
    return v


def snapshot(root: Path) -> dict[str, tuple[int, ...]]:
    """Type, mode, owner, inode, size, mtime and ctime of ``root`` and everything below it
    (links not followed): any create, write, chmod or chown root did there changes it."""
    out: dict[str, tuple[int, ...]] = {}

    def add(p: str) -> None:
        st = os.lstat(p)
        out[p] = (st.st_mode, st.st_uid, st.st_gid, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if not os.path.lexists(root):
        return out
    add(str(root))
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            add(os.path.join(dirpath, n))
    return out


def files_under(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root`` (links not followed) and its content."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for n in files:
            p = os.path.join(dirpath, n)
            if stat.S_ISREG(os.lstat(p).st_mode):
                out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def b3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def build_quietly(env: Env, name: str) -> str:
    """What `dsstage manifest build` does, in process (cheaper for parametrized tests)."""
    report = transfer_build.build(name, env.datasets[name]["source"], source=env.datasets[name]["source"])
    config_manifest.Catalog(str(env.state)).publish(report.manifest)
    return report.manifest.digest


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.stderr.startswith("dsstage: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    return res.stderr


def refusal(path: Path, problem: str) -> str:
    return f"dsstage: error: {path} {problem}: dsstage will not use it, a user could steer it"


def nothing_published(env: Env, name: str) -> None:
    """No copy, ready mark or lease of ``name`` (a link the attacker planted there is not root's)."""
    for sub in ("datasets", "ready", "leases"):
        d = env.tier_root() / sub / name
        if d.exists() and not d.is_symlink():
            assert not os.listdir(d), (d, os.listdir(d))


# -- 1. a tier root the attacker planted --------------------------------------------------------

@pytest.mark.parametrize("plant", ["directory", "symlink", "file"])
def test_planted_tier_root_is_refused_and_nothing_of_the_attackers_is_touched(
        env: Env, attacker: Account, playground: Path, vault: Path, plant: str):
    env.add("coco", {"a.jpg": b"a" * 100})
    build_quietly(env, "coco")
    planted = playground / "dsstage"
    q = shlex.quote(str(planted))
    if plant == "directory":  # a whole tree, world-writable, ready for root to use
        attacker.sh(f"mkdir -m 777 {q} {q}/n1 {q}/n1/datasets {q}/n1/locks {q}/n1/staging")
    elif plant == "symlink":  # at a root-only directory root would chmod 0755 and fill
        attacker.run("/bin/ln", "-s", str(vault), str(planted))
    else:  # a plain file: only denies service
        attacker.sh(f": > {q}")
    before = snapshot(planted), snapshot(vault)

    res = env.cli("stage", "coco", "--job-id", "1", check=False)

    assert res.returncode == 74
    problem = {"directory": f"is owned by uid {attacker.uid}, not root",
               "symlink": "is a symbolic link or not a directory",
               "file": "is a symbolic link or not a directory"}[plant]
    assert one_error_line(res).startswith(refusal(planted, problem))
    assert f"or remove {planted} and let dsstage create it" in res.stderr
    # root created nothing there, chmodded or chowned nothing, wrote nothing
    assert (snapshot(planted), snapshot(vault)) == before
    assert stat.S_IMODE(vault.stat().st_mode) == 0o700 and os.listdir(vault) == ["secret"]

    # the fix the message gives works: remove it, and root makes its own
    (shutil.rmtree if plant == "directory" else os.unlink)(planted)
    staged = env.cli_json("stage", "coco", "--job-id", "2")
    assert staged["action"] == "staged"
    st = os.lstat(planted)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o755
    assert snapshot(vault) == before[1]


# -- 2. links planted inside a tier ---------------------------------------------------------------

TIER_ENTRIES = ["datasets", "ready", "staging", "locks", "leases", "trash", "reserved",
                "datasets/coco", "ready/coco", "leases/coco"]


def make_tier(env: Env) -> Path:
    """A tier made by root the way dsstage makes it: root-owned, 0755."""
    tier = env.tier_root()
    for d in (env.nvme, tier):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o755)
    return tier


def plant(attacker: Account, link: Path, target: Path) -> None:
    attacker.run("/bin/ln", "-s", str(target), str(link))
    assert link.is_symlink() and os.lstat(link).st_uid == attacker.uid


@pytest.mark.parametrize("entry, holder_state", [(e, "world-writable") for e in TIER_ENTRIES]
                         + [(e, "attacker-owned") for e in ("datasets", "locks", "datasets/coco")])
def test_link_planted_in_a_tier_directory_the_attacker_can_write_is_refused(
        env: Env, attacker: Account, vault: Path, entry: str, holder_state: str):
    env.add("coco", {"a.jpg": b"a" * 100})
    build_quietly(env, "coco")
    tier = make_tier(env)
    holder = tier / os.path.dirname(entry)
    holder.mkdir(exist_ok=True)
    if holder_state == "world-writable":  # root's, but like /tmp: anyone may add an entry
        os.chmod(holder, 0o1777)
        problem = "is writable by group or others (mode 1777)"
    else:  # handed to a user
        os.chown(holder, attacker.uid, attacker.gid)
        os.chmod(holder, 0o755)
        problem = f"is owned by uid {attacker.uid}, not root"
    plant(attacker, tier / entry, vault)
    before = snapshot(holder), snapshot(vault)

    res = env.cli("stage", "coco", "--job-id", "1", check=False)

    assert res.returncode == 74
    assert one_error_line(res).startswith(refusal(holder, problem))
    assert (snapshot(holder), snapshot(vault)) == before
    assert stat.S_IMODE(vault.stat().st_mode) == 0o700 and vault.stat().st_uid == 0
    assert files_under(vault) == {"secret": SECRET}
    nothing_published(env, "coco")


@pytest.mark.parametrize("entry", [e for e in TIER_ENTRIES if e not in ("trash", "reserved")]
                         + ["staging/coco.{vid}"])
def test_directory_link_left_in_a_repaired_tier_is_never_followed(
        env: Env, attacker: Account, vault: Path, entry: str):
    """The attacker planted while a directory was writable; the admin then made it root's
    0755 again but left the entries: the link is refused, never followed."""
    env.add("coco", {"a.jpg": b"a" * 100})
    entry = entry.format(vid=build_quietly(env, "coco")[:16])
    tier = make_tier(env)
    holder = tier / os.path.dirname(entry)
    holder.mkdir(exist_ok=True)
    os.chmod(holder, 0o1777)
    plant(attacker, tier / entry, vault)
    os.chmod(holder, 0o755)
    before = snapshot(vault)

    res = env.cli("stage", "coco", "--job-id", "1", check=False)

    assert res.returncode == 74
    assert one_error_line(res).startswith(refusal(tier / entry, "is a symbolic link or not a directory"))
    assert snapshot(vault) == before
    assert (tier / entry).is_symlink()


@pytest.mark.parametrize("entry, refused", [
    ("locks/coco.lock", True),  # dsstage.ready.lock opens it O_NOFOLLOW: refused
    ("locks/coco.lock.owner", False),  # replaced by a rename, then removed
    ("ready/coco/{vid}.json", False),  # read O_NOFOLLOW (not ready), then replaced by the new mark
    ("leases/coco/1.json", False),  # replaced by the lease
    ("reserved/stage-coco.{vid}.json", False),  # replaced by the reservation, then removed
])
def test_file_link_left_in_a_repaired_tier_is_replaced_or_refused_never_followed(
        env: Env, attacker: Account, vault: Path, entry: str, refused: bool):
    src = env.add("coco", {"a.jpg": b"a" * 100})
    entry = entry.format(vid=build_quietly(env, "coco")[:16])
    tier = make_tier(env)
    holder = tier / os.path.dirname(entry)
    holder.mkdir(parents=True, exist_ok=True)
    os.chmod(holder, 0o1777)
    plant(attacker, tier / entry, vault / "secret")
    os.chmod(holder, 0o755)
    before = snapshot(vault)

    res = env.cli("stage", "coco", "--job-id", "1", "--json", check=False)

    assert snapshot(vault) == before
    assert (vault / "secret").read_bytes() == SECRET
    if refused:
        assert res.returncode == 74
        assert one_error_line(res).startswith(f"dsstage: error: cannot lock {tier / entry}: ")
        assert "symbolic links" in res.stderr
        nothing_published(env, "coco")
    else:
        assert res.returncode == 0, res.stderr
        assert not (tier / entry).is_symlink()
        assert files_under(Path(json.loads(res.stdout)["path"])) == {"a.jpg": (src / "a.jpg").read_bytes()}


# -- 3. predictable names beside the store -------------------------------------------------------

def test_links_planted_beside_the_store_are_ignored_and_temporary_names_are_fresh(
        env: Env, attacker: Account, playground: Path, vault: Path, monkeypatch: pytest.MonkeyPatch):
    env.add("coco", {"a.jpg": b"a" * 100})
    build_quietly(env, "coco")
    # names the stagers before descriptors used beside their targets (<path>.tmp, <path>.<pid>.tmp,
    # .<name>.dsstage-tmp), and one shaped like today's
    planted = [playground / n for n in ("dsstage.tmp", f"dsstage.{os.getpid() + 1}.tmp", ".dsstage-1-0-0.tmp",
                                        ".dsstage.dsstage-tmp", "coco.lock")]
    for p in planted:
        plant(attacker, p, vault / "secret")
    before = snapshot(vault), {p: os.lstat(p) for p in planted}

    assert env.cli_json("stage", "coco", "--job-id", "1")["action"] == "staged"
    assert snapshot(vault) == before[0] and {p: os.lstat(p) for p in planted} == before[1]
    st = os.lstat(env.tier_root())
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o755

    names = [safe.temp_name() for _ in range(1000)]
    assert len(set(names)) == 1000 and all(safe.is_temp(n) and len(n) < 64 for n in names)
    # even the very name write_at picks, planted beforehand, is not followed: O_EXCL|O_NOFOLLOW
    monkeypatch.setattr(safe, "temp_name", lambda: planted[2].name)
    fd = os.open(playground, safe.O_DIR)
    try:
        with pytest.raises(FileExistsError):
            safe.write_at(fd, "target", b"root's bytes")
    finally:
        os.close(fd)
    assert snapshot(vault) == before[0] and planted[2].is_symlink()


# -- 4. a data owner swaps parts of the source --------------------------------------------------

def owned_source(root: Path, owner: Account, files: dict[str, bytes]) -> Path:
    """A source tree that belongs to ``owner`` (world-readable, like a project directory)."""
    write_tree(root, files)
    for dirpath, dirs, names in os.walk(root):
        for n in [".", *dirs, *names]:
            p = os.path.join(dirpath, n)
            os.chown(p, owner.uid, owner.gid)
            os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)
    os.chown(root.parent, owner.uid, owner.gid)
    return root


def root_only_copy(root: Path, files: dict[str, bytes]) -> Path:
    """The same tree, root-only: directories 0700, files 0600."""
    write_tree(root, files)
    for dirpath, dirs, names in os.walk(root):
        for n in [".", *dirs, *names]:
            p = os.path.join(dirpath, n)
            os.chmod(p, 0o700 if os.path.isdir(p) else 0o600)
    os.chmod(root.parent, 0o700)
    return root


SOURCE = {"top.bin": b"top of the dataset\n", "sub/data.bin": b"the data owner's own bytes\n"}


@pytest.mark.parametrize("swapped", ["sub", "source root"])
def test_source_swapped_for_a_link_after_the_manifest_build_is_not_published(
        env: Env, attacker: Account, playground: Path, tmp_path: Path, swapped: str):
    """Between the admin's manifest build and the stage, the data owner swaps a directory
    of the source for a link to a root-only copy holding the very same bytes (so the
    hashes would match if root followed it)."""
    src = owned_source(playground / "owner" / "ds", attacker, SOURCE)
    locked = root_only_copy(tmp_path / "vault" / "ds", SOURCE)
    env.add("ds", source=str(src))
    env.cli("manifest", "build", "ds")
    link, target = (src / "sub", locked / "sub") if swapped == "sub" else (src, locked)
    q = shlex.quote(str(link))
    attacker.sh(f"mv {q} {q}.real && ln -s {shlex.quote(str(target))} {q}")
    before = snapshot(locked.parent)

    res = env.cli("stage", "ds", "--job-id", "1", check=False)

    line = one_error_line(res)
    if swapped == "sub":
        assert res.returncode == 65
        assert "'sub/data.bin' is not a regular file (a symbolic link in its path)" in line
        assert "nothing was published" in line
    else:
        assert res.returncode == 69
        assert f"source {src} is not reachable from this node" in line and "holds no symbolic link" in line
    nothing_published(env, "ds")
    assert "data.bin" not in {os.path.basename(p) for p in files_under(env.tier_root())}
    assert snapshot(locked.parent) == before

    attacker.sh(f"rm {q} && mv {q}.real {q}")  # swapped back: the stage works, so it was the link
    assert env.cli_json("stage", "ds", "--job-id", "2")["action"] == "staged"


RACER = r"""
import ctypes, os, sys, time
os.chdir(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
os.symlink(sys.argv[2], "alt")
print("ready", flush=True)
end, n = time.monotonic() + float(sys.argv[3]), 0
while time.monotonic() < end:
    # renameat2(RENAME_EXCHANGE): "sub" is the real directory, then the link, atomically
    if libc.renameat2(-100, b"sub", -100, b"alt", 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")
    n += 1
print(n, flush=True)
"""


def test_racing_swaps_during_manifest_build_never_record_a_file_outside_the_source(
        env: Env, attacker: Account, playground: Path, tmp_path: Path):
    # the same names and sizes in the vault: only the hashes tell what root read
    files = {"top.bin": b"top\n", **{f"sub/f{i:03d}.bin": f"public {i:03d}\n".encode() for i in range(60)}}
    secret = {f"f{i:03d}.bin": f"secret {i:03d}\n".encode() for i in range(60)}
    secret["only-in-the-vault.bin"] = SECRET
    src = owned_source(playground / "owner" / "ds", attacker, files)
    locked = root_only_copy(tmp_path / "vault" / "sub", secret)
    env.add("ds", source=str(src))
    real = {b3(data) for data in files.values()}
    leaked = {b3(data) for data in secret.values()}
    before = snapshot(locked)

    racer = attacker.popen("/usr/bin/python3", "-c", RACER, str(src), str(locked), "2")
    try:
        assert racer.stdout is not None and racer.stdout.readline().strip() == "ready", racer.communicate()[1]
        outcomes = []
        while racer.poll() is None or len(outcomes) < 3:
            res = env.cli("manifest", "build", "ds", "--json", check=False)
            if res.returncode == 0:
                m = config_manifest.read(json.loads(res.stdout)["path"])
                assert {e.hash for e in m.entries} <= real, "a manifest recorded a file root read elsewhere"
                assert not {e.hash for e in m.entries} & leaked
                assert not any("only-in-the-vault" in e.path for e in m.entries)
                outcomes.append("built")
            else:  # listed as a directory, a link by the time it was read: refused, never followed
                assert res.returncode == 65, res.stderr
                assert "cannot read" in one_error_line(res) or "changed while" in res.stderr
                outcomes.append("refused")
        out, err = racer.communicate(timeout=30)
    finally:
        if racer.poll() is None:
            racer.kill()
            racer.wait()
    assert racer.returncode == 0, err
    assert int(out.split()[-1]) > 1000, "the racer hardly ran"
    assert snapshot(locked) == before and files_under(locked) == secret


def test_data_owner_cannot_redirect_the_source_by_swapping_an_ancestor_for_a_link(
        env: Env, attacker: Account, playground: Path, tmp_path: Path):
    src = owned_source(playground / "owner" / "ds", attacker, SOURCE)  # <playground>/owner is the owner's
    root_only_copy(tmp_path / "vault" / "ds", {"payroll.csv": SECRET})
    env.add("ds", source=str(src))
    env.cli("manifest", "build", "ds")
    assert env.cli_json("stage", "ds", "--job-id", "1")["action"] == "staged"
    owner = shlex.quote(str(src.parent))
    attacker.sh(f"mv {owner} {owner}.old && ln -s {shlex.quote(str(tmp_path / 'vault'))} {owner}")

    # the admin refreshes the manifest (a cron job, a request from the data owner); a job stages
    built = env.cli("manifest", "build", "ds", "--json", check=False)
    staged = env.cli("stage", "ds", "--job-id", "2", "--json", check=False)

    leaked = [p for p, data in files_under(env.tier_root()).items() if data == SECRET]
    stolen = [attacker.run("/bin/cat", str(env.tier_root() / p), check=False).stdout for p in leaked]
    assert not leaked, (f"root published a root-only file at {leaked}, which the attacker read: {stolen!r} "
                        f"(build: {built.returncode} {built.stdout[:200]!r}; stage: {staged.returncode})")


# -- 5. source_user: the source's own permissions are the boundary --------------------------------

def private_source(playground: Path) -> Path:
    """A world-readable project directory (root's) holding someone's 0600 file."""
    src = write_tree(playground / "proj" / "ds", {"public.bin": b"for everyone\n", "private.bin": SECRET})
    for p in (src.parent, src):
        os.chmod(p, 0o755)
    os.chmod(src / "public.bin", 0o644)
    os.chmod(src / "private.bin", 0o600)
    return src


def test_source_user_keeps_a_file_it_cannot_read_out_of_the_copy(env: Env, reader: Account, playground: Path):
    src = private_source(playground)
    env.add("ds", source=str(src))
    env.cli("manifest", "build", "ds")  # built as root: the manifest lists private.bin
    env.extra = {"source_user": READER}
    env.write()

    res = env.cli("stage", "ds", "--job-id", "1", check=False)

    assert res.returncode == 65
    line = one_error_line(res)
    assert "'private.bin' is not readable by the source's reader (permission denied)" in line
    assert "nothing was published" in line
    nothing_published(env, "ds")
    assert SECRET not in files_under(env.tier_root()).values()

    # the contrast: read as root (no source_user), the same file is published 0444
    env.extra = {}
    env.write()
    path = Path(env.cli_json("stage", "ds", "--job-id", "2")["path"])
    assert (path / "private.bin").read_bytes() == SECRET
    assert stat.S_IMODE((path / "private.bin").stat().st_mode) == 0o444


def test_manifest_build_reads_the_source_as_source_user(env: Env, reader: Account, playground: Path):
    src = private_source(playground)
    env.extra = {"source_user": READER}
    env.add("ds", source=str(src))

    res = env.cli("manifest", "build", "ds", "--json", check=False)

    if res.returncode == 0:
        listed = [e.path for e in config_manifest.read(json.loads(res.stdout)["path"]).entries]
        assert "private.bin" not in listed, "root read for the manifest a file the source user may not read"
    else:
        assert "private.bin" in one_error_line(res)


def test_a_run_directory_a_user_made_first_never_hosts_the_root_peer_daemon(env: Env, playground: Path,
                                                                          attacker: Account, tmp_path: Path):
    """DSSTAGE_RUN_DIR on a tmpfs after a reboot: a user creates it before dsstage does. Had the
    daemon put its rsyncd.conf there, the user could later rename peers-<node> and write their
    own, which rsync re-reads at every connection (it served /etc/shadow to nobody). The daemon
    refuses the directory, naming it, and never starts."""
    import sys

    from servers import free_port
    run = playground / "run"
    attacker.run("mkdir", "-m", "0755", str(run))
    secret = tmp_path / "peers.secret"
    secret.write_text("s3cret-for-tests-" + "x" * 24 + "\n")
    secret.chmod(0o600)
    port = free_port()
    env.extra["peers"] = {"enabled": True, "secret_file": str(secret), "hosts": {"n1": f"127.0.0.1:{port}"},
                          "allow": ["127.0.0.1"]}
    env.write()
    proc = subprocess.Popen([sys.executable, "-m", "dsstage", "--node", "n1", "peers", "serve"],
                            env=dict(env.env(), DSSTAGE_RUN_DIR=str(run)), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail(f"the peer daemon started in {run}, a directory {ATTACKER} owns")
    assert proc.returncode != 0
    line = one_error_line(subprocess.CompletedProcess([], proc.returncode, out, err))
    assert str(run) in line and "a user could steer it" in line
    assert os.listdir(run) == []  # nothing of root's was put there


def test_the_files_the_prolog_leaves_for_a_job_are_read_by_its_user_alone(env: Env, playground: Path,
                                                                           reader: Account, attacker: Account):
    """Issue 51: the TaskProlog's file and the shard map were ``0440 root:<job's group>``, so
    another user of the same primary group (``users`` at many sites) read them. Now the job's
    user alone reads them (root's, with an ACL), and a user of its group is refused."""
    from dsstage.hooks import job as hooks
    from dsstage.slurm.fake import FakeSlurm
    env.run = playground / "run"
    env.add("coco", {"a": b"a" * 10})
    env.add("parts", {f"p{i}": bytes([i]) * 10 for i in range(4)}, shards=2)
    env.cli("manifest", "build", "coco")
    env.cli("manifest", "build", "parts")
    # the reader's job runs with the attacker's group as its primary group: a group they share
    e = {"SLURM_JOB_ID": "77", "SLURM_JOB_UID": str(reader.uid), "SLURM_JOB_GID": str(attacker.gid),
         "SLURM_JOB_USER": reader.name, "SLURMD_NODENAME": env.node, "SLURM_JOB_NODELIST": env.node,
         "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "coco,parts"}
    assert hooks.prolog(e, run_dir=str(env.run), slurm=FakeSlurm(), load_config=env.config) == 0
    task = env.run / env.node / "jobs" / "77.task"
    lines = task.read_text().splitlines()
    shard_map = next(line.split("=", 1)[1] for line in lines if line.startswith("export DSSTAGE_SHARD_MAP_PARTS="))
    for path in (str(task), shard_map):
        st = os.stat(path)
        assert st.st_uid == 0 and not st.st_mode & 0o002, (path, oct(st.st_mode))
        job_user = Account(reader.name, reader.uid, attacker.gid)  # as the job's tasks run
        assert job_user.run("cat", path).stdout  # the job's user reads it
        res = attacker.run("cat", path, check=False)  # a user of the job's group does not
        assert res.returncode != 0 and "Permission denied" in res.stderr, (path, res)
