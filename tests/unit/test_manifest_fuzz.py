"""The manifest reader under fuzzing (issue 51): a data owner writes their manifests, and can
give any body a matching digest. Whatever the lines hold (sizes that are negative, huge,
signed, with ``_`` or non-ASCII digits; paths with ``..``, ``/``, control bytes, bad escapes;
hashes of any length; missing or extra mtimes), ``read`` either returns a manifest that is
safe to act on or raises ManifestError naming the file: never another exception, never a
negative or unbounded size, never a path outside the dataset."""

from __future__ import annotations

import os

import blake3
from dsstage.config import manifest as m
from dsstage.errors import ManifestError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SIZES = st.one_of(
    st.integers(min_value=0, max_value=2**40).map(str),
    st.integers(min_value=-(2**64), max_value=2**64).map(str),
    st.sampled_from(["-0", "+5", "1_000", " 7", "7 ", "", "0x10", "١٢", "²", "9" * 30, str(m.FILE_MAX),
                     str(m.FILE_MAX + 1), "NaN"]),
)
PATHS = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=12),
    st.sampled_from(["..", "a/../b", "/etc/passwd", "a//b", "./a", "a/.", "x\\n/etc/shadow", "bad\\q", "\\", "a\x00b",
                     "dir", "dir/file", "a\\tb"]),
)
HASHES = st.one_of(st.just("0" * 64), st.text(alphabet="0123456789abcdefX", min_size=0, max_size=70))
ROWS = st.lists(st.tuples(HASHES, SIZES, PATHS), min_size=0, max_size=8)


def body_of(rows: list[tuple[str, str, str]]) -> bytes:
    return "".join(f"{h}\t{s}\t{p}\n" for h, s, p in rows).encode("utf-8", "surrogateescape")


def write(path: str, body: bytes, mtimes: list[str], header_digest: str | None = None) -> None:
    digest = header_digest or blake3.blake3(body).hexdigest()
    with open(path, "wb") as fh:
        fh.write(f'{m.MAGIC}{{"digest": "{digest}", "name": "ds", "files": 1, "bytes": 1}}\n'.encode())
        fh.write(body + m.MTIMES.encode() + "".join(t + "\n" for t in mtimes).encode())


def check_safe(got: m.Manifest) -> None:
    assert all(0 <= e.size <= m.FILE_MAX for e in got.entries)
    assert got.total_bytes == sum(e.size for e in got.entries)
    assert all(m.path_problem(e.path) is None and len(e.hash) == 64 for e in got.entries)
    assert len({e.path for e in got.entries}) == len(got.entries)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=ROWS, extra_mtimes=st.integers(min_value=-1, max_value=1),
       mtime=st.sampled_from(["0", "17", "-5", "x", "1e3"]))
def test_any_body_with_a_matching_digest_is_read_safely_or_refused(tmp_path, rows, extra_mtimes, mtime):
    path = os.path.join(tmp_path, "0" * 64 + m.SUFFIX)
    write(path, body_of(rows), [mtime] * max(0, len(rows) + extra_mtimes))
    try:
        got = m.read(path)
    except ManifestError as exc:
        assert path in str(exc) and "\n" not in str(exc)
        return
    check_safe(got)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400), cut=st.integers(min_value=0, max_value=400))
def test_any_bytes_at_all_are_refused_or_read_safely(tmp_path, data, cut):
    """Whole files of arbitrary bytes, and a valid manifest cut anywhere or with bytes spliced in."""
    path = os.path.join(tmp_path, "1" * 64 + m.SUFFIX)
    valid = os.path.join(tmp_path, "valid")
    write(valid, body_of([("0" * 64, "3", "a/b"), ("0" * 64, "0", "c")]), ["1", "2"])
    good = open(valid, "rb").read()
    for blob in (data, m.MAGIC.encode() + data, good[:cut] + data + good[cut:], good[:cut]):
        with open(path, "wb") as fh:
            fh.write(blob)
        for reader in (m.read, m.read_header):
            try:
                got = reader(path)
            except ManifestError:
                continue
            if isinstance(got, m.Manifest):
                check_safe(got)
