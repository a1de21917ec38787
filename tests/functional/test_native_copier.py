"""The native copier (native/dsstage-copy, dsstage.transfer.native) on real files: the
bytes, mode and mtime of files of every size around its buffer, nothing published that
does not match, and failures mid-copy from a real failing source (latencyfs answering
EIO) and a real full filesystem (a small tmpfs), each blamed on the right party and
leaving only whole, verified files, from which the next copy resumes."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from dsstage.config.manifest import Entry
from dsstage.errors import NoSpace, OutOfTime, SourceError
from dsstage.transfer import build as transfer_build
from dsstage.transfer import native
from dsstage.transfer.parallel import Limiter
from helpers import copy_verified as copy
from helpers import native_copier, write_tree
from latencyfs import LatencyFS

BUF = 1 << 20  # the helper reads a file smaller than this whole, and streams a larger one


def source_and_dest(tmp_path: Path, files: dict[str, bytes]):
    """A source of ``files`` under tmp_path, its manifest, and an empty destination."""
    src = write_tree(tmp_path / "src", files)
    dest = tmp_path / "dest"
    dest.mkdir()
    return src, transfer_build.build("ds", str(src)).manifest, dest


def published(dest: Path) -> dict[str, bytes]:
    """Every file under ``dest`` by its path; fails on anything else left there (a temporary
    copy, a link)."""
    out = {}
    for root, _dirs, files in os.walk(dest):
        for name in files:
            p = Path(root) / name
            assert stat.S_ISREG(os.lstat(p).st_mode) and not name.startswith(".dsstage-"), p
            out[str(p.relative_to(dest))] = p.read_bytes()
    return out


def assert_whole_and_verified(dest: Path, entries: list[Entry]) -> None:
    import blake3
    by_path = {e.path: e for e in entries}
    for rel, data in published(dest).items():
        e = by_path[rel]
        st = os.lstat(dest / rel)
        assert len(data) == e.size and blake3.blake3(data).hexdigest() == e.hash, rel
        assert stat.S_IMODE(st.st_mode) == 0o444 and st.st_mtime_ns == e.mtime_ns, rel


SIZES = [0, 1, 4095, BUF - 1, BUF, BUF + 1, 3 * BUF + 17]


def test_files_of_every_size_around_the_buffer_are_copied_whole_with_mode_and_mtime(tmp_path):
    native_copier()
    files = {f"d{i % 3}/s{size}": os.urandom(size) for i, size in enumerate(SIZES)}
    src = write_tree(tmp_path / "src", files)
    os.utime(src / "d0/s0", ns=(0, -1_500_000_001))  # before 1970, to the nanosecond
    m = transfer_build.build("ds", str(src)).manifest
    dest = tmp_path / "dest"
    dest.mkdir()
    stats, bad = copy(src, dest, m.entries)
    assert bad == [] and stats.files == len(SIZES) and stats.bytes == sum(SIZES)
    assert published(dest) == files
    assert_whole_and_verified(dest, m.entries)
    assert copy(src, dest, m.entries)[0].files == 0


def test_a_file_that_changed_grew_or_shrank_publishes_nothing_whatever_its_size(tmp_path):
    native_copier()
    sizes = {"small": 5000, "big": 2 * BUF + 5}
    src = write_tree(tmp_path / "src", {f"{kind}-{name}": os.urandom(n) for name, n in sizes.items()
                                        for kind in ("changed", "grew", "shrank", "same")})
    m = transfer_build.build("ds", str(src)).manifest
    for name, n in sizes.items():
        (src / f"changed-{name}").write_bytes(os.urandom(n))
        (src / f"grew-{name}").write_bytes(os.urandom(n + 1))
        (src / f"shrank-{name}").write_bytes(os.urandom(n - 1))
    dest = tmp_path / "dest"
    dest.mkdir()
    stats, bad = copy(src, dest, m.entries)
    found = {b.path: b.found for b in bad}
    for name, n in sizes.items():
        assert len(found[f"changed-{name}"]) == 64
        assert found[f"grew-{name}"] == f"size {n + 1}" and found[f"shrank-{name}"] == f"size {n - 1}"
    assert sorted(published(dest)) == ["same-big", "same-small"] and stats.files == 2


@pytest.fixture
def slow_source(tmp_path):
    backing = write_tree(tmp_path / "backing", {f"d{i // 50}/f{i:03d}": os.urandom(3000 + i) for i in range(300)})
    m = transfer_build.build("ds", str(backing)).manifest
    with LatencyFS(backing, tmp_path / "mnt", delay_us=2000) as fs:
        yield fs, tmp_path / "mnt", m.entries


def test_a_source_that_fails_mid_copy_is_the_sources_fault_and_the_next_copy_resumes(tmp_path, slow_source):
    native_copier()
    fs, src, entries = slow_source
    dest = tmp_path / "dest"
    dest.mkdir()
    seen = []

    def progress(delta: int, total: int) -> None:
        seen.append(delta)
        if sum(seen) > total // 3:
            fs.fail_reads()
    with pytest.raises(SourceError, match="Input/output error") as err:
        copy(src, dest, entries, progress=progress)
    assert err.value.blame == "source"
    first = published(dest)
    assert 0 < len(first) < len(entries), len(first)
    assert_whole_and_verified(dest, entries)
    fs.fail_reads(False)
    stats, bad = copy(src, dest, entries)
    assert bad == [] and stats.files == len(entries) - len(first)
    assert_whole_and_verified(dest, entries)
    assert len(published(dest)) == len(entries)


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tier"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_filesystem_that_fills_mid_copy_is_no_space_and_keeps_only_whole_files(tmp_path, small_tmpfs):
    native_copier()
    src = write_tree(tmp_path / "src", {f"d/f{i:03d}": os.urandom(8192) for i in range(100)})
    m = transfer_build.build("ds", str(src)).manifest
    with pytest.raises(NoSpace, match="filesystem is full") as err:
        copy(src, small_tmpfs, m.entries)
    assert err.value.blame == "site"
    kept = published(small_tmpfs)
    assert 0 < len(kept) < 100
    assert_whole_and_verified(small_tmpfs, m.entries)


def helper_script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "helper"
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("body", [
    "exit 7",  # fails at once
    # killed mid-copy: the real helper, stopped hard after its first files
    '"$REAL" "$@" <&0 & pid=$!; sleep 0.3; kill -9 $pid; wait $pid; exit 9',
])
def test_a_helper_that_stops_before_its_end_leaves_the_rest_to_the_python_copier(tmp_path, slow_source,
                                                                                monkeypatch, body):
    monkeypatch.setenv("REAL", native_copier().path)
    monkeypatch.setenv("DSSTAGE_NATIVE_COPY", helper_script(tmp_path, body))
    native.forget()
    _fs, src, entries = slow_source
    dest = tmp_path / "dest"
    dest.mkdir()
    stats, bad = copy(src, dest, entries)
    assert bad == [] and len(published(dest)) == len(entries)
    assert_whole_and_verified(dest, entries)
    assert native.helper() is None  # not tried again in this process


def test_a_helper_anyone_else_may_write_or_replace_is_not_run(tmp_path, monkeypatch):
    program = helper_script(tmp_path, "exit 0")
    os.chmod(program, 0o777)
    monkeypatch.setenv("DSSTAGE_NATIVE_COPY", program)
    native.forget()
    assert native.helper() is None
    assert "writable by others" in native.open_trusted(program)[1]
    os.chmod(program, 0o755)
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)  # anyone may replace what is in it
    os.rename(program, open_dir / "helper")
    assert "writable by others and not sticky" in native.open_trusted(str(open_dir / "helper"))[1]
    src, m, dest = source_and_dest(tmp_path, {"a": b"x" * 10})
    assert copy(src, dest, m.entries)[0].files == 1  # copied in Python


def test_a_copy_that_runs_out_of_time_keeps_what_it_copied_and_the_next_resumes(tmp_path):
    """The stage's deadline passes mid-copy: no more files are handed out, those in flight
    finish, OutOfTime is raised, and the next copy copies only what is missing."""
    native_copier()
    backing = write_tree(tmp_path / "backing", {f"f{i:03d}": os.urandom(2000) for i in range(200)})
    m = transfer_build.build("ds", str(backing)).manifest
    dest = tmp_path / "dest"
    dest.mkdir()
    with LatencyFS(backing, tmp_path / "mnt", delay_us=20_000) as _fs:
        with pytest.raises(OutOfTime, match="next stage resumes"):
            copy(tmp_path / "mnt", dest, m.entries, deadline=time.monotonic() + 0.5, max_parallel=4)
        kept = published(dest)
        assert 0 < len(kept) < 200
        assert_whole_and_verified(dest, m.entries)
        stats, bad = copy(tmp_path / "mnt", dest, m.entries, max_parallel=64)
    assert bad == [] and stats.files == 200 - len(kept) and len(published(dest)) == 200


def test_a_copy_already_under_its_name_is_replaced_in_one_step(tmp_path):
    """A file that appeared under its name between the listing and the copy (an older
    copy) is replaced whole, as rename replaces: never an error, never a mix."""
    program = native_copier()
    src = write_tree(tmp_path / "src", {"d/a": b"new" * 1000, "b": b"fresh"})
    m = transfer_build.build("ds", str(src)).manifest
    dest = write_tree(tmp_path / "dest", {"d/a": b"old"})
    src_fd, dest_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY), os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        done = native.copy(program, native.Reading(src_fd, str(src)), dest_fd, m.entries, Limiter(2, 4), lambda: False)
    finally:
        os.close(src_fd)
        os.close(dest_fd)
    assert done.complete and done.failures == [] and (done.files, done.bytes) == (2, 3005)
    assert published(dest) == {"d/a": b"new" * 1000, "b": b"fresh"}
    assert_whole_and_verified(dest, m.entries)


def test_without_unnamed_copies_each_file_is_written_under_a_temporary_name_and_renamed(tmp_path, monkeypatch):
    """Where linkat of an unnamed file is refused (before Linux 6.10 without
    CAP_DAC_READ_SEARCH; here the refusal is injected by strace), the helper writes each
    copy under a fresh temporary name and renames it: the same files, nothing left behind."""
    monkeypatch.setenv("REAL", native_copier().path)
    calls = tmp_path / "calls"
    monkeypatch.setenv("DSSTAGE_NATIVE_COPY", helper_script(
        tmp_path, f'exec strace -f -qq -e trace=linkat,renameat,renameat2 -e inject=linkat:error=EPERM -o {calls} '
                  '"$REAL" "$@"'))
    native.forget()
    files = {f"d{i % 2}/f{i}": os.urandom(i * 700) for i in range(20)}
    src, m, dest = source_and_dest(tmp_path, files)
    stats, bad = copy(src, dest, m.entries)
    assert bad == [] and stats.files == 20 and published(dest) == files
    assert_whole_and_verified(dest, m.entries)
    lines = calls.read_text().splitlines()
    links = [line for line in lines if "linkat(" in line]
    assert len(links) == 1 and "EPERM" in links[0], lines  # the probe, refused: no copy is linked
    assert len([line for line in lines if "renameat" in line]) >= 20, lines


def test_names_with_leading_trailing_and_repeated_spaces_are_copied_under_their_own_names(tmp_path):
    native_copier()
    files = {" lead": b"1", "trail ": b"22", "two  spaces": b"333", "d/ x": b"4444", "lead": b"55555"}
    src, m, dest = source_and_dest(tmp_path, files)
    stats, bad = copy(src, dest, m.entries)
    assert bad == [] and stats.files == 5 and published(dest) == files


def test_the_helper_that_runs_is_the_file_that_was_checked(tmp_path, monkeypatch):
    """Replacing the helper's file after it was found and checked runs nothing new: what
    runs is the descriptor of the checked file."""
    real = native_copier().path
    helper = tmp_path / "bin" / "dsstage-copy"
    helper.parent.mkdir()
    shutil.copy(real, helper)
    monkeypatch.setenv("DSSTAGE_NATIVE_COPY", str(helper))
    native.forget()
    assert native.helper() is not None
    marker = tmp_path / "ran"
    helper.unlink()
    helper.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    helper.chmod(0o755)
    src, m, dest = source_and_dest(tmp_path, {"a": b"x" * 10})
    assert copy(src, dest, m.entries)[0].files == 1
    assert not marker.exists() and native.helper() is not None  # the checked helper ran, to its end


def test_a_failure_while_reading_the_helpers_reports_stops_it_and_never_hangs(tmp_path):
    """An exception on this side while the helper still writes reports (30,000 files that
    are missing: one line each) ends the helper; the exception is raised, nothing hangs."""
    program = native_copier()
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    entries = [Entry(f"gone{i}", 1, 0, "0" * 64) for i in range(30_000)]
    outcome: list[BaseException] = []

    def late() -> bool:
        raise RuntimeError("the caller failed")

    def run() -> None:
        src_fd, dest_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY), os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            native.copy(program, native.Reading(src_fd, str(src)), dest_fd, entries, Limiter(8, 8), late)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            outcome.append(exc)
        finally:
            os.close(src_fd)
            os.close(dest_fd)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "native.copy hung after the exception"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)


def test_a_helper_whose_input_ends_before_its_plan_says_so_in_its_exit(tmp_path):
    """Issue 51: when its input ended early the helper printed its totals and exited 0, as if
    every file had been handled. It now exits INPUT_ENDED, with the totals of what it did;
    the copier's own stop at its deadline (the one early close it makes) is told apart."""
    native_copier()
    program = native.helper()
    assert program is not None
    backing = write_tree(tmp_path / "backing", {f"f{i:03d}": os.urandom(100) for i in range(50)})
    m = transfer_build.build("ds", str(backing)).manifest
    dest = tmp_path / "dest"
    dest.mkdir()
    with LatencyFS(backing, tmp_path / "mnt", delay_us=20_000) as fs:
        src_fd = os.open(fs.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
        dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            res = subprocess.run([program.argv0, str(src_fd), str(dest_fd), "1", "1"], pass_fds=(src_fd, dest_fd,
                                 program.fd), input=native._records(m.entries), capture_output=True, timeout=60)
        finally:
            os.close(src_fd)
            os.close(dest_fd)
    assert res.returncode == native.INPUT_ENDED, res
    done = int(res.stdout.decode().splitlines()[-1].split()[1])
    assert res.stdout.decode().splitlines()[-1].startswith("= ") and done < 50
    assert len(published(dest)) == done
