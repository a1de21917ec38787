"""What root reads that others write (issue 51, and its review): fs.untrusted's bounded,
non-blocking reads, and the fields of manifests and shard indexes that no digest covers."""

from __future__ import annotations

import json
import os

import blake3
import pytest
from dsstage.config import manifest as m
from dsstage.config.source import parse_source
from dsstage.errors import ManifestError
from dsstage.fs import untrusted
from dsstage.shards import indexfile


def test_a_fifo_a_link_a_directory_and_a_huge_file_are_refused_never_read(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to("/dev/zero")
    (tmp_path / "dir").mkdir()
    with open(tmp_path / "huge", "wb") as fh:
        fh.truncate(2**40)
    for name, what in (("fifo", "a FIFO"), ("link", "symbolic link"), ("dir", "a directory"), ("huge", "more than")):
        with pytest.raises(untrusted.Refused, match=what):
            untrusted.read_bytes(str(tmp_path / name), 2**20)
        assert untrusted.read_json(str(tmp_path / name)) == {}
    assert untrusted.read_bytes(str(tmp_path / "absent"), 10) is None
    (tmp_path / "ok").write_bytes(b"x" * 10)
    assert untrusted.read_bytes(str(tmp_path / "ok"), 10) == b"x" * 10
    with pytest.raises(untrusted.Refused):
        untrusted.read_bytes(str(tmp_path / "ok"), 9)


def manifest_file(tmp_path, lines: list[tuple[str, str, str]], mtimes: list[str], created: object = 1.0) -> str:
    body = "".join(f"{h}\t{s}\t{p}\n" for h, s, p in lines).encode()
    header = {"digest": blake3.blake3(body).hexdigest(), "name": "ds", "created": created}
    path = str(tmp_path / "x.manifest")
    with open(path, "wb") as fh:
        fh.write((m.MAGIC + json.dumps(header) + "\n").encode() + body + m.MTIMES.encode()
                 + "".join(t + "\n" for t in mtimes).encode())
    return path


@pytest.mark.parametrize("lines,mtimes,created,what", [
    ([("0" * 64, "1", "a")], ["1"], "abc", "created 'abc'"),
    ([("0" * 64, "1", "a")], ["1"], [1], "not a time"),
    ([("0" * 64, "1", "a")], [str(10**29)], 1.0, "mtime is out of range"),
    ([("z" * 64, "1", "a")], ["1"], 1.0, ":2: malformed hash"),
    ([("0" * 64, "1", "a"), ("A" * 64, "1", "b")], ["1", "2"], 1.0, ":3: malformed hash"),
])
def test_what_the_digest_does_not_cover_is_checked_as_data(tmp_path, lines, mtimes, created, what):
    with pytest.raises(ManifestError, match=what):
        m.read(manifest_file(tmp_path, lines, mtimes, created))


def test_a_file_named_mtimes_does_not_split_the_manifest(tmp_path):
    path = manifest_file(tmp_path, [("0" * 64, "1", "#mtimes"), ("1" * 64, "2", "b")], ["5", "6"])
    assert [(e.path, e.mtime_ns) for e in m.read(path).entries] == [("#mtimes", 5), ("b", 6)]


@pytest.mark.parametrize("bad", [1e999, float("inf"), -1, 1.5, True, "3", 2**64])
def test_a_shard_index_says_whole_numbers_or_is_refused(tmp_path, bad):
    """``Infinity`` in a shard index raised OverflowError from int(), which no caller caught:
    another dataset's stage, the report, the GC and the catalog failed with it."""
    version = "a" * 64
    shard = {"index": 0, "start": 0, "stop": 1, "files": 1, "bytes": bad, "digest": "b" * 64}
    record = {"format": 1, "dataset": "ds", "version": version, "count": 1, "shards": [shard]}
    (tmp_path / indexfile.index_name(version, 1)).write_text(json.dumps(record))
    with pytest.raises(ManifestError):
        indexfile.read(str(tmp_path), "ds", version, 1)


def test_a_daemon_source_with_dot_components_is_refused():
    for raw in ("rsync://h/mod/a/./b", "rsync://h/mod/../etc", "rsync://h/mod/."):
        with pytest.raises(ValueError, match="'.' or '..'"):
            parse_source(raw)
    assert parse_source("rsync://h/mod/a.b/c").kind == "daemon"
