"""How root reads a file that someone else may write: a data owner's manifest directory
(``CURRENT``, manifests, shard indexes), and what nodes, pollers and jobs publish in the state
directory (node reports, job records, the demand snapshot, the poller's lease, the switch).

The threat model (docs/admin-guide.md, "Threat model") trusts a data owner with their own
dataset's bytes and manifest directory, nothing else: what they write there is data. So is
what a node publishes, read by every other node and the controller. Such a file may be a
FIFO (a plain ``open()`` blocks forever), a symbolic link (to ``/dev/zero``: ``readline()``
never ends), a directory, or a sparse file of a terabyte. Every read here:

* opens with ``O_NONBLOCK | O_NOFOLLOW`` (a FIFO or a device never blocks the open, a link
  at the last component is refused), then
* checks with ``fstat`` that it is a regular file no larger than the caller's bound, and
* reads at most that bound (plus one byte, to see a file that grew past it).

A violation raises ``Refused`` (a ValueError: the callers that treat a damaged file as a
ValueError keep doing so) with a line that names the file and what it is. It is that file's
problem, for its dataset or its node: never a hang of a cluster service, never a drain.

Ownership is not checked: under NFS ``root_squash`` what root writes belongs to ``nobody``,
and a data owner writes their own manifests; what is read is checked as data (a manifest's
digest and sizes, a record's format) by the module that reads it.

Imports only the standard library (the warm Prolog reads ``CURRENT`` through it).
"""

from __future__ import annotations

import errno
import os
import stat

from dsstage.fs import jsontext

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from typing import Any

O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: the largest JSON record (report, job record, demand snapshot, shard index) read
JSON_MAX = 64 * 2**20
#: bytes read at most to find a file's first line (a manifest's header)
LINE_MAX = 64 * 2**10


class Refused(ValueError):
    """A file that root will not read: not a regular file, or larger than its bound."""


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_file(path: str, limit: int, *, dir_fd: int | None = None) -> int | None:
    """A read descriptor of regular file ``path`` of at most ``limit`` bytes; None if it does
    not exist. Raises Refused (a link, a FIFO, a device, a directory, too large), or OSError
    where the filesystem fails."""
    opened = _open(path, limit, dir_fd)
    return None if opened is None else opened[0]


def _open(path: str, limit: int, dir_fd: int | None) -> tuple[int, os.stat_result] | None:
    """``open_file``, with what fstat found."""
    try:
        fd = os.open(path, O_READ, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{path} is a symbolic link: root does not follow it; replace it with the file") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV):  # a socket; a directory opened for writing
            raise Refused(f"{path} is not a regular file: root does not read it; replace it with the file") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EWOULDBLOCK):  # its writer's modes or lease: theirs to fix
            raise Refused(f"{path} cannot be read by root ({exc.strerror}; under NFS root_squash root reads as "
                          "nobody): make it readable by everyone") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path} is {_kind(st.st_mode)}, not a regular file: root does not read it; "
                          "replace it with the file")
        if st.st_size > limit:
            raise Refused(f"{path} is {st.st_size} bytes, more than the {limit} root reads of such a file: "
                          "it is damaged or not what its name says; replace it")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_fd(fd: int, limit: int, shown: str, size: int | None = None) -> bytes:
    """Everything in ``fd`` up to ``limit`` bytes; Refused if there is more. The first read asks
    for the size ``fstat`` gives (``size`` if known: one buffer for a file that does not change,
    so a manifest of a million files is read without a second copy), later ones for what a
    growing file adds."""
    chunks = []
    got = 0
    want = min(limit, os.fstat(fd).st_size if size is None else size) + 1
    while True:
        chunk = os.read(fd, min(limit + 1 - got, max(want - got, 8 * 2**20)))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
        if got > limit:
            raise Refused(f"{shown} grew past the {limit} bytes root reads of such a file while it was read; "
                          "replace it")
    return b"".join(chunks)


def read_bytes(path: str, limit: int, *, dir_fd: int | None = None) -> bytes | None:
    """The contents of regular file ``path`` (at most ``limit`` bytes), None if it does not
    exist; Refused or OSError as ``open_file``."""
    dated = _read_dated(path, limit, dir_fd)
    return None if dated is None else dated[0]


def _read_dated(path: str, limit: int, dir_fd: int | None) -> tuple[bytes, float] | None:
    opened = _open(path, limit, dir_fd)
    if opened is None:
        return None
    fd, st = opened
    try:
        return read_fd(fd, limit, path, st.st_size), st.st_mtime
    finally:
        os.close(fd)


def first_line(path: str, limit: int = LINE_MAX) -> bytes | None:
    """The first line of regular file ``path`` (without its newline; at most ``limit`` bytes
    read), None if the file does not exist; Refused if the line is longer, or as ``open_file``."""
    fd = open_file(path, 2**62, dir_fd=None)
    if fd is None:
        return None
    try:
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    line, sep, _rest = data.partition(b"\n")
    if not sep and len(data) > limit:
        raise Refused(f"{path}: its first line is longer than the {limit} bytes root reads of it; replace it")
    return line


def read_json(path: str, limit: int = JSON_MAX) -> dict[str, Any]:
    """A JSON object from ``path``; {} if it is missing, unreadable, damaged, not an object, not
    a regular file or larger than ``limit`` (for files others write in the state directory:
    every reader treats {} as "no record")."""
    return read_json_dated(path, limit)[0]


def read_json_dated(path: str, limit: int = JSON_MAX) -> tuple[dict[str, Any], float | None]:
    """``read_json``, with the file's modification time (by the clock of the filesystem it is
    on, its server's) as the same open found it; None with {} where there is no record."""
    try:
        dated = _read_dated(path, limit, None)
        obj = jsontext.loads(dated[0]) if dated is not None else None
    except (OSError, ValueError):
        return {}, None
    return (obj, dated[1]) if isinstance(obj, dict) and dated is not None else ({}, None)
