"""The native helper's input under fuzzing (issue 51): whatever records it is fed (sizes that
are negative, huge or not numbers; paths with ``..``, ``/``, control bytes, 5,000 bytes;
hashes of any length; duplicates; no final empty record), copying from a real source into a
staging area it either refuses the input (exit 1), stops on a failure it names (exit 2), or
copies; it never crashes, never writes outside the staging area, and every file it leaves
there under a final name is a source file whose BLAKE3 a record named."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import blake3
import pytest
from dsstage.transfer import native
from helpers import native_copier, write_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the helper copies as root: run as root")

SOURCE = {"a": b"alpha" * 10, "d/b": b"beta", "d/e/c": b"", "big": os.urandom(70_000)}
HASH = {p: blake3.blake3(data).hexdigest() for p, data in SOURCE.items()}

SIZES = st.one_of(st.sampled_from([str(len(d)) for d in SOURCE.values()]),
                  st.integers(min_value=-(2**64), max_value=2**65).map(str),
                  st.sampled_from(["", "-1", "+4", "0x10", "1e3", " 4", "18446744073709551615"]))
PATHS = st.one_of(st.sampled_from([*SOURCE, "..", "../x", "/etc/passwd", "d/../a", "d//b", "./a", "d", "d/e",
                                   "outside/../../x", "x" * 5000, "a\nb", "\x01", ""]),
                  st.binary(min_size=0, max_size=40).map(lambda b: b.replace(b"\0", b"").decode("latin-1")))
HASHES = st.one_of(st.sampled_from(list(HASH.values())), st.text(alphabet="0123456789abcdefZ", max_size=70))
RECORDS = st.lists(st.tuples(SIZES, st.sampled_from(["0", "1700000000000000000", "-3", "x"]), HASHES, PATHS),
                   max_size=6)


def feed(program: native.Helper, src: Path, dest: Path, records: bytes,
         keep_open: bool) -> subprocess.CompletedProcess[bytes]:
    """Run the helper with ``records`` on its input, kept open (``keep_open``: a whole list)
    until it reports its totals, as its caller does (an input that ends early stops it), then
    closed; or closed at once (a list cut short: it waits for the rest until then)."""
    src_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        proc = subprocess.Popen([program.argv0, str(src_fd), str(dest_fd), "2", "2"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(src_fd, dest_fd, program.fd))
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(records)
            proc.stdin.flush()
            if not keep_open:
                proc.stdin.close()
        except BrokenPipeError:
            pass
        out = b""
        for line in proc.stdout:
            out += line
            if line.startswith(b"= "):
                break
        try:
            proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        out += proc.stdout.read()
        err = proc.stderr.read() if proc.stderr else b""
        rc = proc.wait(timeout=60)
    finally:
        os.close(src_fd)
        os.close(dest_fd)
    return subprocess.CompletedProcess(proc.args, rc, out, err)


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    top = tmp_path_factory.mktemp("fuzz")
    return write_tree(top / "src", SOURCE), top


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=RECORDS, ended=st.booleans())
def test_any_records_are_refused_or_copied_into_the_area_alone_verified(area, records, ended):
    native_copier()
    program = native.helper()
    assert program is not None
    src, top = area
    staging = top / "staging"
    if staging.exists():
        subprocess.run(["rm", "-rf", str(staging)], check=True)
    (staging / "area").mkdir(parents=True)
    stream = b"".join(f"{s} {t} {h} ".encode() + p.encode("utf-8", "surrogateescape") + b"\0"
                      for s, t, h, p in records) + (b"\0" if ended else b"")
    res = feed(program, src, staging / "area", stream, keep_open=ended)
    assert res.returncode in (0, 1, 2), (res.returncode, res.stdout[-300:], res.stderr[-300:])
    if not ended:
        assert res.returncode == 1  # a list without its final empty record is malformed
    assert sorted(os.listdir(staging)) == ["area"]  # nothing beside the area
    named = {(p, h) for _s, _t, h, p in records}
    for root, _dirs, files in os.walk(staging / "area"):
        for name in files:
            path = Path(root) / name
            rel = str(path.relative_to(staging / "area"))
            assert not path.is_symlink()
            if name.startswith(".dsstage-"):
                continue  # a temporary name: never published
            data = path.read_bytes()
            assert rel in SOURCE and data == SOURCE[rel] and (rel, blake3.blake3(data).hexdigest()) in named, rel
