"""The verifying copier for mounted sources, on real files."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import pytest
from dsstage.transfer import build as transfer_build
from dsstage.transfer import copier
from dsstage.transfer.ratelimit import Rate
from helpers import Env, native_copier, python_copier, write_tree
from helpers import copy_verified as copy


@pytest.fixture(params=["native", "whole", "streamed"])
def chunk(request, monkeypatch):
    """The native copier (dsstage.transfer.native), or the Python one with each file read
    whole or streamed."""
    if request.param == "native":
        native_copier()
    else:
        python_copier(monkeypatch)
    if request.param == "streamed":
        monkeypatch.setattr(copier, "CHUNK", 1000)  # every file above 1000 bytes is streamed
    return request.param


def test_copies_verified_files_read_only_with_mtime(tmp_path, chunk):
    src = write_tree(tmp_path / "src", {"a": os.urandom(5000), "d/b": b"x" * 10, "e": b""})
    m = transfer_build.build("ds", str(src)).manifest
    dest = tmp_path / "dest"
    dest.mkdir()
    stats, bad = copy(src, dest, m.entries)
    assert bad == [] and stats.files == 3 and stats.bytes == 5010
    for e in m.entries:
        st = os.lstat(dest / e.path)
        assert (dest / e.path).read_bytes() == (src / e.path).read_bytes()
        assert stat.S_IMODE(st.st_mode) == 0o444 and st.st_mtime_ns == e.mtime_ns
    assert copy(src, dest, m.entries)[0].files == 0  # present files are kept


def test_mismatches_write_nothing(tmp_path, chunk):
    src = write_tree(tmp_path / "src", {"same-size": b"1" * 4000, "grew": b"2" * 3000, "gone": b"3"})
    m = transfer_build.build("ds", str(src)).manifest
    (src / "same-size").write_bytes(b"X" * 4000)
    (src / "grew").write_bytes(b"2" * 3001)
    (src / "gone").unlink()
    dest = tmp_path / "dest"
    dest.mkdir()
    stats, bad = copy(src, dest, m.entries)
    found = {b.path: b.found for b in bad}
    assert found["gone"] == "missing" and found["grew"] == "size 3001" and len(found["same-size"]) == 64
    assert stats.files == 0 and sorted(os.listdir(dest)) == []


def test_rate_limit_slows_the_copy(tmp_path):
    src = write_tree(tmp_path / "src", {f"f{i}": os.urandom(100_000) for i in range(10)})
    m = transfer_build.build("ds", str(src)).manifest
    (tmp_path / "dest").mkdir()
    t = time.monotonic()
    copy(src, tmp_path / "dest", m.entries, rate=Rate(2_000_000))
    assert time.monotonic() - t >= 0.4  # 1 MB at 2 MB/s


@pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")
def test_rsync_source_that_changed_is_refused(env: Env, tmp_path):
    from servers import RsyncDaemon
    module = tmp_path / "export"
    write_tree(module / "ds", {"a": b"1" * 100, "b": b"2" * 100})
    daemon = RsyncDaemon(tmp_path, module)
    try:
        env.add("ds", None, source=daemon.url("ds"))
        env.cli("manifest", "build", "ds", "--from", str(module / "ds"))
        (module / "ds" / "b").write_bytes(b"X" * 100)
        res = env.cli("stage", "ds", "--job-id", "1", check=False)
        assert res.returncode == 65 and "'b' differs in content from the manifest" in res.stderr
        assert not (env.tier_root() / "ready" / "ds").exists()
    finally:
        daemon.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")
def test_names_of_rsyncs_own_partial_dir_in_a_dataset_stage_over_rsync(env: Env, tmp_path):
    """A dataset may hold any name, the one rsync's --partial-dir used to have included:
    its files are staged and verified, and nothing of rsync's is left beside the copy."""
    from servers import RsyncDaemon
    module = tmp_path / "export"
    files = {".dsstage-partial/a": b"a" * 10, "d/.dsstage-partial/b": b"b" * 20, ".rsync-partial/c": b"c"}
    write_tree(module / "ds", files)
    daemon = RsyncDaemon(tmp_path, module)
    try:
        env.add("ds", None, source=daemon.url("ds"))
        env.cli("manifest", "build", "ds", "--from", str(module / "ds"))
        res = env.cli("stage", "ds", "--job-id", "1", check=False)
        assert res.returncode == 0, res.stderr
        path = res.stdout.split(": ", 1)[1].split("  (")[0]
        for rel, data in files.items():
            assert (Path(path) / rel).read_bytes() == data
        assert os.listdir(env.tier_root() / "staging") == []
    finally:
        daemon.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")
def test_a_mismatch_over_rsync_names_the_file_and_kind_never_what_was_read(env: Env, tmp_path):
    """The data owner swaps a directory of an rsync source for a link to a file they cannot
    read: the stage is refused, and its message names the file and the kind of mismatch,
    never the hash or size of what was read (which would confirm a guess at its content)."""
    import blake3
    from servers import RsyncDaemon
    module = tmp_path / "export"
    write_tree(module / "ds", {"sub/x": b"1" * 100, "sub/y": b"2" * 50})
    secret = (b"the secret content of another user's file\n" * 3)[:100]
    write_tree(module / "private", {"x": secret, "y": b"2" * 73})
    daemon = RsyncDaemon(tmp_path, module)
    try:
        env.add("ds", None, source=daemon.url("ds"))
        env.cli("manifest", "build", "ds", "--from", str(module / "ds"))
        shutil.rmtree(module / "ds" / "sub")
        os.symlink("../private", module / "ds" / "sub")
        res = env.cli("stage", "ds", "--job-id", "1", check=False)
        assert res.returncode == 65, res.stderr
        assert "'sub/x' differs in content from the manifest" in res.stderr
        assert "'sub/y' differs in size from the manifest" in res.stderr
        leaked = [blake3.blake3(secret).hexdigest()[:8], "73"]
        assert not [w for w in leaked if w in res.stderr], res.stderr
        assert not (env.tier_root() / "ready" / "ds").exists()
    finally:
        daemon.stop()


def test_a_source_swapped_for_links_fifos_or_devices_is_never_followed_nor_blocks(tmp_path, chunk):
    """Between the manifest build and the copy, the data owner swaps a directory for a link
    to a root-only directory, a file for a FIFO, and a directory for a link to /dev: the
    copier reads none of them, never blocks, and writes nothing for them."""
    secret = tmp_path / "root-only"
    write_tree(secret, {"key": b"k" * 10, "zero": b"z" * 4000})
    os.chmod(secret, 0o700)
    src = write_tree(tmp_path / "src", {"d/key": b"k" * 10, "fifo": b"f" * 10, "dev/zero": b"z" * 4000,
                                        "ok": b"fine"})
    m = transfer_build.build("ds", str(src)).manifest
    for p in ("d/key", "dev/zero", "fifo"):
        (src / p).unlink()
    (src / "d").rmdir()
    (src / "d").symlink_to(secret)
    (src / "dev").rmdir()
    (src / "dev").symlink_to("/dev")
    os.mkfifo(src / "fifo")
    dest = tmp_path / "dest"
    dest.mkdir()
    t = time.monotonic()
    stats, bad = copy(src, dest, m.entries)
    assert time.monotonic() - t < 10
    found = {b.path: b.found for b in bad}
    assert found == {"d/key": "not a regular file (a symbolic link in its path)",
                     "dev/zero": "not a regular file (a symbolic link in its path)",
                     "fifo": "not a regular file"}
    assert stats.files == 1 and sorted(p.name for p in dest.rglob("*") if p.is_file()) == ["ok"]


def test_names_of_255_bytes_fit_the_temporary_names(tmp_path, chunk):
    long = "n" * 255
    src = write_tree(tmp_path / "src", {long: os.urandom(3000), f"d/{'é' * 127}": b"x"})
    m = transfer_build.build("ds", str(src)).manifest
    dest = tmp_path / "dest"
    dest.mkdir()
    stats, bad = copy(src, dest, m.entries)
    assert bad == [] and stats.files == 2 and (dest / long).read_bytes() == (src / long).read_bytes()


def test_a_source_read_error_is_the_sources_fault_and_a_full_tier_is_no_space(tmp_path, monkeypatch):
    import errno

    from dsstage.errors import NoSpace, SourceError
    python_copier(monkeypatch)  # the Python copier's calls fail here (the native one: test_native_copier)
    src = write_tree(tmp_path / "src", {"a": b"1" * 100})
    m = transfer_build.build("ds", str(src)).manifest
    (tmp_path / "dest").mkdir()
    real_read = os.read

    def eio(fd, n):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(copier.os, "read", eio)
    with pytest.raises(SourceError, match="Input/output error") as err:
        copy(src, tmp_path / "dest", m.entries)
    assert err.value.blame == "source"
    monkeypatch.setattr(copier.os, "read", real_read)

    def enospc(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(copier.safe, "write_all", enospc)
    with pytest.raises(NoSpace, match="full") as err2:
        copy(src, tmp_path / "dest", m.entries)
    assert err2.value.blame == "site" and os.listdir(tmp_path / "dest") == []  # no temporary file left
