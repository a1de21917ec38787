import os
from pathlib import Path

import pytest
from dsstage.config import manifest as config_manifest
from dsstage.config.manifest import Entry
from dsstage.errors import ManifestError
from dsstage.transfer import build as transfer_build

H = "a" * 64


def build(root, **kw):
    return transfer_build.build("ds", str(root), **kw)


def test_build_records_files_and_skips_links_and_empty_dirs(tmp_path, tree):
    src = tree(tmp_path / "src", {"a.txt": b"hello", "sub/b.bin": b"\0" * 10, "empty": b""})
    (src / "emptydir").mkdir()
    os.symlink("/etc/passwd", src / "link")
    os.mkfifo(src / "fifo")
    r = build(src)
    m = r.manifest
    assert [e.path for e in m.entries] == ["a.txt", "empty", "sub/b.bin"]
    assert m.total_bytes == 15 and r.hashed == 3 and r.reused == 0
    assert r.skipped == {"symlink": ["link"], "special": ["fifo"]}
    import blake3
    assert m.entries[0].hash == blake3.blake3(b"hello").hexdigest()


def test_incremental_rebuild_rehashes_only_changed(tmp_path, tree):
    src = tree(tmp_path / "src", {f"f{i}": bytes([i]) * 100 for i in range(20)})
    first = build(src).manifest
    again = build(src, previous=first)
    assert again.hashed == 0 and again.reused == 20 and again.unchanged
    (src / "f3").write_bytes(b"changed")
    (src / "new").write_bytes(b"new")
    third = build(src, previous=first)
    assert third.hashed == 2 and third.reused == 19 and not third.unchanged
    assert third.manifest.digest != first.digest


def test_touch_keeps_the_version(tmp_path, tree):
    src = tree(tmp_path / "src", {"a": b"x"})
    first = build(src).manifest
    os.utime(src / "a", (1, 1))
    second = build(src, previous=first)
    assert second.hashed == 1 and second.manifest.digest == first.digest


def test_write_read_roundtrip_with_awkward_names(tmp_path, tree):
    names = {"with space": b"1", "tab\there": b"2", "new\nline": b"3", "back\\slash": b"4",
             "-leading-dash": b"5", "ünïcødé/日本語.txt": b"6", "cr\rx": b""}
    src = tree(tmp_path / "src", names)
    (src / os.fsdecode(b"latin1-\xe9")).write_bytes(b"7")
    m = build(src).manifest
    path = str(tmp_path / "m.manifest")
    config_manifest.write(m, path)
    back = config_manifest.read(path)
    assert back.entries == m.entries and back.digest == m.digest
    assert len(back.entries) == 8


def test_catalog_publish_and_current(tmp_path, tree):
    cat = config_manifest.Catalog(str(tmp_path / "state"))
    assert cat.current("ds") is None
    with pytest.raises(ManifestError, match="has no manifest yet: an admin must run `dsstage manifest build ds`"):
        cat.require_current("ds")
    m = build(tree(tmp_path / "src", {"a": b"x"})).manifest
    cat.publish(m)
    assert cat.current("ds") == m.digest
    assert cat.load("ds").entries == m.entries


def test_a_remembering_catalog_reads_current_once(tmp_path, tree):
    """One Prolog's catalog (remember=True) reads each CURRENT once: a version another writer
    publishes meanwhile is the next catalog's, as is a CURRENT that appears after "none";
    what it publishes itself it sees at once. A plain catalog reads CURRENT every time."""
    state = str(tmp_path / "state")
    one_job, plain = (config_manifest.Catalog(state, remember=True), config_manifest.Catalog(state))
    assert one_job.current("ds") is None
    first = build(tree(tmp_path / "a", {"a": b"x"})).manifest
    plain.publish(first)
    assert one_job.current("ds") is None and plain.current("ds") == first.digest
    again = config_manifest.Catalog(state, remember=True)
    assert again.current("ds") == first.digest
    second = build(tree(tmp_path / "b", {"a": b"y"})).manifest
    plain.publish(second)
    assert again.current("ds") == first.digest and plain.current("ds") == second.digest
    third = build(tree(tmp_path / "c", {"a": b"z"})).manifest
    again.publish(third)
    assert again.current("ds") == third.digest == plain.current("ds")


def _manifest_file(tmp_path: Path, entries, digest=None):
    m = config_manifest.Manifest("ds", digest or config_manifest.compute_digest(entries), list(entries), 0, 0.0)
    path = str(tmp_path / "x.manifest")
    config_manifest.write(m, path)
    return path


@pytest.mark.parametrize("bad,needle", [
    ("/etc/passwd", "absolute path"), ("../../etc/passwd", "component '..'"), ("a/../../b", "component '..'"),
    ("a//b", "component ''"), ("./a", "component '.'"),
])
def test_traversal_in_manifest_is_rejected(tmp_path, bad, needle):
    path = _manifest_file(tmp_path, [Entry(bad, 1, 0, H)])
    with pytest.raises(ManifestError, match=needle):
        config_manifest.read(path)


def test_duplicates_and_file_dir_conflicts_rejected(tmp_path):
    with pytest.raises(ManifestError, match="duplicate entry 'a'"):
        config_manifest.read(_manifest_file(tmp_path, [Entry("a", 1, 0, H), Entry("a", 1, 0, H)]))
    with pytest.raises(ManifestError, match="'a' is listed as a file but also holds 'a/b'"):
        config_manifest.read(_manifest_file(tmp_path, [Entry("a", 1, 0, H), Entry("a/b", 1, 0, H)]))


def test_a_manifest_that_lies_is_rejected(tmp_path, tree):
    m = build(tree(tmp_path / "src", {"a": b"x", "b": b"y"})).manifest
    path = tmp_path / "m.manifest"
    config_manifest.write(m, str(path))
    text = path.read_text()
    path.write_text(text.replace(m.entries[0].hash, "0" * 64))
    with pytest.raises(ManifestError, match="do not match the digest in its header"):
        config_manifest.read(str(path))
    path.write_text("garbage\n")
    with pytest.raises(ManifestError, match="not a dsstage manifest"):
        config_manifest.read(str(path))
    import json

    import blake3
    body = "not\ta\tline\n"
    path.write_text(config_manifest.MAGIC + json.dumps({"digest": blake3.blake3(body.encode()).hexdigest()}) + "\n"
                    + body + config_manifest.MTIMES + "1\n")
    with pytest.raises(ManifestError, match=":2: malformed line"):
        config_manifest.read(str(path))
    path.write_text(text.replace(config_manifest.MTIMES, ""))
    with pytest.raises(ManifestError, match="no #mtimes section"):
        config_manifest.read(str(path))


def test_missing_source_is_clear(tmp_path):
    with pytest.raises(ManifestError, match="is not a readable directory"):
        build(tmp_path / "nope")
