"""Sealing a staging area (dsstage.node.publish.seal) in the one walk that also removes what
its manifest does not list: whatever stands where it does not belong (a directory at a
file's path, a link, a FIFO, a read-only tree) is removed without following anything, and
what stays is root-owned and read-only. stager.fill ends with it: what it leaves is ready
to publish."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from dsstage.config.model import Source
from dsstage.fs import identity
from dsstage.node import publish, stager
from dsstage.transfer import build as transfer_build
from dsstage.transfer.transport import Area, for_source
from helpers import native_copier, python_copier, write_tree


def modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = os.lstat(p).st_mode
    return out


def test_the_seal_removes_what_is_not_listed_without_following_links_and_seals_the_rest(tmp_path):
    root = write_tree(tmp_path / "area", {"a/x": b"x", "a/b/y": b"y", "z": b"z"})
    outside = write_tree(tmp_path / "outside", {"keep": b"k"})
    os.chmod(root / "a" / "x", 0o640)
    (root / "a" / "b" / "y").unlink()
    (root / "a" / "b" / "y").mkdir()  # a directory where a file belongs
    (root / "a" / "b" / "y" / "inner").write_bytes(b"i")
    os.symlink(outside, root / "a" / "link")  # a link to a directory outside
    os.symlink(outside / "keep", root / "z2")
    os.mkfifo(root / "a" / "pipe")
    ro = write_tree(root / "extra", {"deep/f": b"f"})
    for p in (ro / "deep" / "f", ro / "deep", ro):
        os.chmod(p, 0o444 if p.is_file() else 0o555)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        removed = publish.seal(fd, gid=0, wanted={"a/x", "a/b/y", "z"})
    finally:
        os.close(fd)
    assert removed == 5  # a/b/y (the directory), a/link, z2, a/pipe, extra
    assert sorted(modes(root)) == ["a", "a/b", "a/x", "z"]
    assert (outside / "keep").read_bytes() == b"k"  # nothing behind a link was touched
    for rel, mode in modes(root).items():
        assert stat.S_IMODE(mode) == (0o555 if stat.S_ISDIR(mode) else 0o444), rel
        assert os.lstat(root / rel).st_uid == 0
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o555


def _fill(area: Path, src: Path, manifest):
    fd = os.open(area, os.O_RDONLY | os.O_DIRECTORY)
    try:
        where = Area(fd, str(area))
        return stager.fill(where, manifest, for_source(Source(str(src), "local", str(src)), where))
    finally:
        os.close(fd)


def test_fill_leaves_the_area_exactly_the_manifest_and_sealed(tmp_path):
    src = write_tree(tmp_path / "src", {f"d{i % 2}/f{i}": os.urandom(50 + i) for i in range(10)})
    manifest = transfer_build.build("ds", str(src)).manifest
    area = tmp_path / "area"
    write_tree(area, {"stray/x": b"x", "d0/extra": b"e"})
    report = _fill(area, src, manifest)
    assert report.removed_extras == 2 and report.transferred.files == 10
    got = modes(area)
    assert sorted(r for r, m in got.items() if stat.S_ISREG(m)) == sorted(e.path for e in manifest.entries)
    assert all(stat.S_IMODE(m) == (0o555 if stat.S_ISDIR(m) else 0o444) for m in got.values())


def _sealed(area: Path) -> dict[str, tuple[int, int, int]]:
    """What is not root's, group 0 and read-only in ``area``: {path: (uid, gid, mode)}."""
    out = {}
    for rel, mode in modes(area).items():
        st = os.lstat(area / rel)
        if (st.st_uid, st.st_gid, stat.S_IMODE(mode)) != (0, 0, 0o555 if stat.S_ISDIR(mode) else 0o444):
            out[rel] = (st.st_uid, st.st_gid, stat.S_IMODE(mode))
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native copier", "python copier"])
def test_what_the_copier_made_is_sealed_whatever_the_umask(tmp_path, monkeypatch, native):
    # the seal skips the files the copier made only where they are made sealed: under a
    # umask that takes bits of 0444 they are not, and the seal must still fix every one
    if native:
        native_copier()
    else:
        python_copier(monkeypatch)
    files = {f"d{i % 3}/f{i}": os.urandom(10 + i) for i in range(12)}
    src = write_tree(tmp_path / "src", files | {"big": b"x" * 70000})
    manifest = transfer_build.build("ds", str(src)).manifest
    for umask in (0o077, 0o022):
        area = tmp_path / f"area{umask:o}"
        area.mkdir()
        old = os.umask(umask)
        try:
            assert identity.creates_as_root(0o444) is (umask == 0o022)
            report = _fill(area, src, manifest)
        finally:
            os.umask(old)
        assert report.transferred.files == 13
        assert report.transferred.sealed == ({e.path for e in manifest.entries} if umask == 0o022 else set())
        assert _sealed(area) == {}, umask
        assert sorted(r for r, m in modes(area).items() if stat.S_ISREG(m)) == sorted(e.path for e in manifest.entries)


def test_files_the_copier_did_not_make_are_checked_and_sealed(tmp_path):
    # a resumed file (left by an earlier stage, perhaps by rsync with the source's owner and
    # modes) is verified and kept, not made: the seal looks at it and fixes it
    src = write_tree(tmp_path / "src", {"a/x": b"x" * 100, "a/y": b"y" * 200, "z": b"z"})
    manifest = transfer_build.build("ds", str(src)).manifest
    area = write_tree(tmp_path / "area", {"a/x": b"x" * 100})
    os.chown(area / "a" / "x", 65534, 65534)
    os.chmod(area / "a" / "x", 0o664)
    os.chmod(area / "a", 0o777)
    report = _fill(area, src, manifest)
    assert report.transferred.files == 2 and "a/x" not in report.transferred.sealed
    assert _sealed(area) == {}


def test_the_seal_takes_no_file_as_made_sealed_in_a_directory_that_hands_on_its_group(tmp_path):
    root = write_tree(tmp_path / "area", {"g/x": b"x", "h/y": b"y"})
    for d in ("g", "h"):
        os.chmod(root / d, 0o755)
    os.chown(root / "g", 0, 1)
    os.chmod(root / "g", 0o2755)  # set-group-ID: its files take group 1
    os.chown(root / "g" / "x", 0, 1)
    os.chmod(root / "g" / "x", 0o444)
    os.chmod(root / "h" / "y", 0o444)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        publish.seal(fd, gid=0, wanted={"g/x", "h/y"}, made={"g/x", "h/y"})
    finally:
        os.close(fd)
    assert _sealed(root) == {}
