"""What a data owner can put in a source: shapes of data that must stage, or be refused by
`manifest build` with the path named, never end a stage in an internal error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from dsstage.fs import safe
from helpers import Env
from latencyfs import LatencyFS, require

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")


def deep_tree(root: Path, levels: int) -> str:
    """A chain of ``levels`` directories under ``root`` with one file at the bottom; made
    below descriptors, since the whole path is longer than the kernel takes at once."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        out = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(out, b"at the bottom\n")
        os.close(out)
    finally:
        os.close(fd)
    return "/".join(["d"] * levels + ["leaf"])


def remove_deep(path: Path) -> None:
    """pytest's own clean-up (shutil.rmtree) recurses out of Python's stack on these trees."""
    safe.remove_tree_at(os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY), path.name)


def test_a_deep_directory_chain_stages_verifies_and_is_evicted(env: Env):
    """1,200 levels (a path of 2,405 bytes): what `manifest build` accepts is staged, verified
    and evicted (shutil.rmtree, which the store used, recursed out of Python's stack)."""
    src = env.add("deep")
    rel = deep_tree(src, 1200)
    env.cli("manifest", "build", "deep")
    res = env.cli("stage", "deep", "--job-id", "3", check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert env.cli_json("verify", "deep", "--full")["ok"] is True
    copy = res.stdout.split(": ", 1)[1].split("  (")[0]
    fd = os.open(copy, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in rel.split("/")[:-1]:
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = sub
        leaf = os.open("leaf", os.O_RDONLY, dir_fd=fd)
        assert os.read(leaf, 100) == b"at the bottom\n"
        os.close(leaf)
    finally:
        os.close(fd)
    env.cli("release", "deep", "--job-id", "3")
    res = env.cli("evict", "deep", check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not Path(copy).exists()
    remove_deep(src)


def test_a_path_longer_than_the_store_can_hold_is_refused_by_manifest_build(env: Env):
    """Deeper than a path the tools can name (PATH_MAX): the build says so, naming the path,
    and writes no manifest; no stage ever starts on it."""
    src = env.add("deeper")
    deep_tree(src, 2100)  # 4,205 bytes
    res = env.cli("manifest", "build", "deeper", check=False)
    assert res.returncode == 65, res.stderr
    assert "d/d/d" in res.stderr and "longer than" in res.stderr
    assert "internal error" not in res.stderr
    assert not [p for p in env.state.rglob("*") if "deeper" in p.name]
    assert env.cli("stage", "deeper", "--job-id", "4", check=False).returncode != 0
    remove_deep(src)


TRUNCATE_WHILE_HASHED = textwrap.dedent("""
    import os, sys
    import blake3
    from dsstage.errors import ManifestError
    from dsstage.transfer import build, hashing

    path = os.path.join(sys.argv[1], "big")
    real = blake3.blake3

    class Cutting:
        # the data owner truncates the file just as its hashing starts
        AUTO = real.AUTO

        def __init__(self, *a, **kw):
            self.h = real(*a, **kw)
        def update(self, data):
            if os.stat(path).st_size:
                os.truncate(path, 0)
            self.h.update(data)
        def hexdigest(self):
            return self.h.hexdigest()

    hashing.blake3.blake3 = Cutting
    try:
        build.build("ds", sys.argv[1])
    except ManifestError as exc:
        print(exc)
        sys.exit(65)
    sys.exit(0)
""")


def test_a_file_truncated_while_the_build_hashes_it_is_a_changed_source(tmp_path: Path):
    """The hasher read the owner's file through a memory mapping: a truncation killed the build
    with SIGBUS, naming nothing. Plain reads see the file end, and the build says it changed."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(32 << 20))
    res = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_HASHED, str(src)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 65, (res.returncode, res.stderr[-2000:])
    assert "big" in res.stdout and "changed while the manifest" in res.stdout


def test_a_source_that_cannot_be_memory_mapped_builds_and_stages(env: Env, tmp_path: Path):
    """A FUSE source mounted with direct_io (latencyfs ``uncached``) refuses mmap (ENODEV) for
    every file: the build reads it, as the stage does."""
    require()
    backing = tmp_path / "backing"
    backing.mkdir()
    files = {"big": os.urandom(9 << 20), "small": b"s" * 1000}
    for name, data in files.items():
        (backing / name).write_bytes(data)
    with LatencyFS(backing, tmp_path / "mnt", delay_us=0, extra_options="uncached") as fs:
        env.add("fused", None, source=fs.mountpoint)
        res = env.cli("manifest", "build", "fused", check=False)
        assert res.returncode == 0, res.stderr
        res = env.cli("stage", "fused", "--job-id", "5", check=False)
        assert res.returncode == 0, res.stderr
    copy = Path(res.stdout.split(": ", 1)[1].split("  (")[0])
    assert {n: (copy / n).read_bytes() for n in files} == files
