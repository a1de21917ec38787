"""The native helper checking a tree on this node's disk (``dsstage-copy --check``, through
dsstage.transfer.check.check_tree, which ``verify --full`` and the checks after rsync and peers
use): the same mismatches as the Python hashing path on the same tree, files of every size
around its buffer and past the size Python keeps, a real failing disk (latencyfs answering
EIO, EUCLEAN or EBADMSG) blamed on the node, and a helper that stops early leaving the check to Python."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from dsstage.config.manifest import Entry
from dsstage.errors import StoreError
from dsstage.transfer import build as transfer_build
from dsstage.transfer import hashing, native
from dsstage.transfer.check import check_tree
from helpers import native_copier, python_copier, write_tree
from latencyfs import LatencyFS

BUF = 1 << 20  # the helper reads a file in pieces of this size
SIZES = [0, 1, 4095, BUF - 1, BUF, BUF + 1, 3 * BUF + 17, hashing.LARGE + 3]
P = {size: f"d{i % 3}/s{size}" for i, size in enumerate(SIZES)}  # a file of each size, by its size


def tree(tmp_path: Path) -> tuple[Path, list[Entry]]:
    files = {P[size]: os.urandom(size) for size in SIZES}
    files.update({f"many/f{i:03d}": os.urandom(i * 7) for i in range(200)})
    root = write_tree(tmp_path / "tree", files)
    return root, transfer_build.build("ds", str(root)).manifest.entries


def check(root: Path, entries: list[Entry], progress=None) -> list[tuple[str, str, str]]:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return [(m.path, m.expected, m.found) for m in check_tree(fd, entries, 2, progress)]
    finally:
        os.close(fd)


def spoil(root: Path) -> None:
    """A file of each kind of wrong: changed in place, shorter, longer, gone, a link, a directory."""
    with open(root / P[4095], "r+b") as fh:
        fh.seek(100)
        fh.write(b"\0" if fh.read(1) != b"\0" else b"\1")
    os.truncate(root / P[BUF], 10)
    with open(root / "many/f010", "ab") as fh:
        fh.write(b"more")
    os.unlink(root / P[BUF - 1])
    os.unlink(root / "many/f020")
    os.symlink("f021", root / "many/f020")
    os.unlink(root / "many/f030")
    os.mkdir(root / "many/f030")
    with open(root / P[hashing.LARGE + 3], "r+b") as fh:  # one Python hashes
        fh.write(b"changed")


def test_the_helper_finds_what_python_finds_on_every_size_and_kind_of_wrong(tmp_path, monkeypatch):
    native_copier()
    root, entries = tree(tmp_path)
    seen: list[int] = []
    assert check(root, entries, seen.append) == [] and sum(seen) == len(entries)
    spoil(root)
    seen.clear()
    found = check(root, entries, seen.append)
    assert sum(seen) == len(entries)
    assert {p for p, _e, _f in found} == {P[4095], P[BUF], "many/f010", P[BUF - 1], "many/f020", "many/f030",
                                          P[hashing.LARGE + 3]}
    by_path = {p: f for p, _e, f in found}
    assert by_path[P[BUF]] == "size 10" and by_path["many/f010"] == f"size {10 * 7 + 4}"
    assert by_path[P[BUF - 1]] == "missing" and by_path["many/f020"] == "missing"
    assert by_path["many/f030"] == "missing" and len(by_path[P[4095]]) == 64
    python_copier(monkeypatch)
    assert check(root, entries) == found  # the same mismatches, in the manifest's order


@pytest.mark.parametrize("path", ["helper", "python"])
def test_a_disk_that_fails_under_the_check_is_the_nodes_fault(tmp_path, monkeypatch, path):
    """EIO, and the two errors ext4 and XFS give for a corrupt filesystem: EUCLEAN
    (EFSCORRUPTED) and EBADMSG (EFSBADCRC, a checksum that does not match)."""
    if path == "helper":
        native_copier()
    else:
        python_copier(monkeypatch)
    backing = write_tree(tmp_path / "backing", {f"d/f{i:03d}": os.urandom(2000 + i) for i in range(50)})
    entries = transfer_build.build("ds", str(backing)).manifest.entries
    with LatencyFS(backing, tmp_path / "mnt", delay_us=0) as fs:
        assert check(tmp_path / "mnt", entries) == []
        for error in (errno.EIO, errno.EUCLEAN, errno.EBADMSG):
            fs.fail_reads(error=error)
            # the helper's StoreError, or the OSError the caller's local_errors makes one
            with pytest.raises((StoreError, OSError)) as err:
                check(tmp_path / "mnt", entries)
            if path == "helper":
                assert isinstance(err.value, StoreError) and err.value.blame == "node", error
                assert os.strerror(error) in str(err.value)
            else:
                assert isinstance(err.value, OSError) and err.value.errno == error
        fs.fail_reads(error=errno.EACCES)  # not the disk: the files are taken for missing
        assert {found for _p, _e, found in check(tmp_path / "mnt", entries)} == {"missing"}


def test_a_helper_that_stops_early_leaves_the_check_to_python(tmp_path, monkeypatch):
    root, entries = tree(tmp_path)
    spoil(root)
    want = check(root, entries)
    helper = tmp_path / "helper"
    helper.write_text("#!/bin/bash\nexit 7\n")
    helper.chmod(0o755)
    monkeypatch.setenv("DSSTAGE_NATIVE_COPY", str(helper))
    native.forget()
    assert check(root, entries) == want
    assert native.helper() is None  # not tried again in this process


def test_a_helper_killed_part_way_leaves_the_rest_to_python_and_counts_each_file_once(tmp_path, monkeypatch):
    real = native_copier().path
    backing = write_tree(tmp_path / "backing", {f"d{i // 50}/f{i:03d}": os.urandom(3000 + i) for i in range(300)})
    entries = transfer_build.build("ds", str(backing)).manifest.entries
    helper = tmp_path / "helper"  # the real helper, stopped hard once it has reported some files
    helper.write_text(f'#!/bin/bash\n"{real}" "$@" <&0 & pid=$!; sleep 0.3; kill -9 $pid; wait $pid; exit 9\n')
    helper.chmod(0o755)
    monkeypatch.setenv("DSSTAGE_NATIVE_COPY", str(helper))
    native.forget()
    with LatencyFS(backing, tmp_path / "mnt", delay_us=2000):
        fd = os.open(tmp_path / "mnt", os.O_RDONLY | os.O_DIRECTORY)
        try:
            reported = native.check(native.helper(), fd, entries, 2).files
            native.forget()
            seen: list[int] = []
            assert check(tmp_path / "mnt", entries, seen.append) == []
        finally:
            os.close(fd)
    assert 0 < reported < len(entries)  # the helper did report some before it was killed
    assert sum(seen) == len(entries) and native.helper() is None


def test_names_with_newlines_tabs_spaces_and_bytes_of_no_encoding_are_checked_as_python_does(tmp_path, monkeypatch):
    native_copier()
    names = ["new\nline", "tab\there", " lead", "trail ", "two  spaces", os.fsdecode(b"latin\xe9"), "-dash"]
    root = write_tree(tmp_path / "tree", {f"d/{n}": os.urandom(100 + i) for i, n in enumerate(names)})
    entries = transfer_build.build("ds", str(root)).manifest.entries
    assert check(root, entries) == []
    for n in names[::2]:
        with open(os.path.join(root, "d", n), "r+b") as fh:
            fh.write(b"\0\1\2")
    found = check(root, entries)
    assert sorted(p for p, _e, _f in found) == sorted(f"d/{n}" for n in names[::2])
    python_copier(monkeypatch)
    assert check(root, entries) == found


def test_a_retired_helpers_descriptor_stays_open_for_a_thread_about_to_run_it():
    """disable() while another thread holds the Helper: its /proc/self/fd/N must still be the
    helper, never a number the process reused for a file it opened since."""
    program = native_copier()
    native.disable()
    opened = os.open("/dev/null", os.O_RDONLY)
    try:
        assert opened != program.fd
        assert os.readlink(f"/proc/self/fd/{program.fd}") == os.path.realpath(program.path)
    finally:
        os.close(opened)
