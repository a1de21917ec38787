"""What an ordinary user hears from the verbs that need root or write access: that, with the
usage-error exit code, never "check the local disk" (exit 74) nor an internal error (70).

The user is a real unprivileged account (euid != 0, no group of root's); it keeps only
CAP_DAC_READ_SEARCH, so that it can reach this checkout's virtual environment and the
test's configuration wherever the checkout is (under /root, mode 0700, in CI) while every
write it attempts is checked as that user's.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time

import pytest
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays an ordinary user: run as root")

USER = "dsstage-reader"


@pytest.fixture(scope="module")
def user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                       capture_output=True)
        return pwd.getpwnam(USER)


def as_user(env: Env, user: pwd.struct_passwd, *args: str) -> subprocess.CompletedProcess[str]:
    argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--",
            sys.executable, "-m", "dsstage", *args]
    return subprocess.run(argv, env=env.env(), cwd="/", text=True, capture_output=True, timeout=120)


@pytest.fixture
def staged(env: Env) -> Env:
    env.add("coco", {"a": b"a" * 100, "d/b": b"b" * 50})
    env.cli("manifest", "build", "coco")
    env.cli("stage", "coco", "--job-id", "1")
    # the stage's detached flush takes the dataset lock and rewrites the mark: let it finish, or a
    # test comparing the store before and after a refused verb sees the flush's files (seen under load)
    deadline = time.monotonic() + 60
    marks = env.tier_root() / "ready" / "coco"
    while not all(json.loads(m.read_text()).get("durable") for m in marks.glob("*.json")):
        assert time.monotonic() < deadline, "the stage's flush never marked the copy durable"
        time.sleep(0.1)
    return env


ROOT_VERBS = [
    ("stage", "coco", "--job-id", "9"),
    ("warm", "coco"),
    ("verify", "coco"),
    ("verify", "coco", "--full"),
    ("release", "coco", "--job-id", "1"),
    ("reclaim",),
    ("evict", "coco"),
    ("evict", "--dry-run"),
    ("peers", "serve"),
]


@pytest.mark.parametrize("verb", ROOT_VERBS, ids=lambda v: " ".join(v))
def test_a_verb_on_the_nodes_store_says_it_needs_root(staged: Env, user, verb):
    before = sorted(p.relative_to(staged.nvme) for p in staged.nvme.rglob("*"))
    res = as_user(staged, user, *verb)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "only root may do: run it as root" in res.stderr
    assert "check the local disk" not in res.stderr and "internal error" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert sorted(p.relative_to(staged.nvme) for p in staged.nvme.rglob("*")) == before


def test_verbs_that_write_shared_paths_name_the_path_they_may_not_write(staged: Env, user, tmp_path):
    out = tmp_path / "slurm"
    out.mkdir()
    for verb, path in [(("manifest", "build", "coco"), staged.state / "manifests" / "coco"),
                       (("bb", "record", "77", "coco"), staged.state / "bb"),
                       (("export-catalog", "-o", str(out / "dsstage_catalog.lua")), out)]:
        res = as_user(staged, user, *verb)
        assert res.returncode == 2, (verb, res.returncode, res.stderr)
        assert "you may not write to" in res.stderr and str(path) in res.stderr, (verb, res.stderr)
        assert "internal error" not in res.stderr
    assert not (out / "dsstage_catalog.lua").exists() and not (staged.state / "bb" / "77").exists()


def test_what_an_ordinary_user_may_do_still_works(staged: Env, user):
    """Read-only verbs are for everyone: the catalog and the cluster's status."""
    res = as_user(staged, user, "ls")
    assert res.returncode == 0 and "coco" in res.stdout, res.stderr
    res = as_user(staged, user, "status", "--no-queue")
    assert res.returncode == 0, res.stderr


#: the unit tests of the store that must pass without root (a developer's `pytest tests/unit`)
STORE_UNIT_TESTS = ("tests/unit/test_store.py", "tests/unit/test_lease.py", "tests/unit/test_formats.py")


def test_the_stores_unit_tests_pass_as_an_ordinary_user(user):
    """The store trusts root's and the caller's own directories (dsstage.fs.safe.trusted):
    its unit tests run on an ordinary user's tmp_path. The user keeps only the right to read
    this checkout (CAP_DAC_READ_SEARCH: it may lie under /root, mode 0700); every write it
    makes is checked as that user's, so a store operation that only root's override lets
    through fails here."""
    import shutil
    import tempfile
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent.parent
    base = Path(tempfile.mkdtemp(prefix="dsstage-user-"))
    try:
        os.chown(base, user.pw_uid, user.pw_gid)
        argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--",
                sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(base / "t"),
                *STORE_UNIT_TESTS]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DSSTAGE_", "PYTEST_"))}
        env.update(HOME=str(base), PYTHONPATH=str(root / "lib"))  # this checkout's, whichever the venv names
        res = subprocess.run(argv, cwd=root, env=env, text=True, capture_output=True, timeout=600)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
        assert " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-2000:]
    finally:
        shutil.rmtree(base, ignore_errors=True)
