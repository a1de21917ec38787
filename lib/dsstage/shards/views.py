"""What a job sees of a sharded dataset on a node: exactly the files of the shards the job
gave this node, at their dataset-relative paths, read-only, and a list of them.

    <tier>/views/<name>/<view id>/...     hard links to the files of the node's shard copies
    <tier>/views/<name>/<view id>.json    {"shards": [shard ids, in shard order], "files", "bytes"}
    <tier>/views/<name>/<view id>.files   the view's files: one absolute path per line, in shard order
                                          (a name's backslash, newline, tab or carriage return is
                                          escaped as the manifest escapes it: dsstage.fs.pathtext)

A view id names a set of shards (the BLAKE3 of their ids), so the jobs that get the same
shards on a node share one view, made once: the warm path only finds it. A view is made in a
temporary directory and renamed into place, so it is whole or absent; made by root from the
node's own copies (nothing a user can reach is followed), and its top directory carries the
dataset's access (groups) as the copies' does. Hard links cost no space, but they keep an
evicted copy's blocks: a view goes into the trash with any of its shards (``drop_containing``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import blake3

from dsstage.fs import pathtext, safe
from dsstage.fs.beneath import Tree
from dsstage.fs.layout import version_id
from dsstage.fs.safe import RootDir

TOP = "views"
#: trash entries of views start with this (the report does not show them as evicted copies)
TRASH_PREFIX = "view."


TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from typing import Protocol

    class _Entry(Protocol):
        @property
        def path(self) -> str: ...

    class ShardFiles(Protocol):
        """What a view needs of a shard's manifest (dsstage.config.manifest.Manifest): this module
        is read by the warm Prolog, which does not load manifests."""

        @property
        def digest(self) -> str: ...

        @property
        def total_bytes(self) -> int: ...

        @property
        def entries(self) -> Sequence[_Entry]: ...


class View:
    """A view made of shards: ``path``, the directory the job reads; ``files_list``, the file
    listing its files. (A plain class: the warm Prolog imports this module.)"""

    __slots__ = ("id", "path", "files_list", "files", "bytes")

    def __init__(self, id: str, path: str, files_list: str, files: int, bytes: int) -> None:
        self.id, self.path, self.files_list, self.files, self.bytes = id, path, files_list, files, bytes

    def _key(self) -> tuple[str, str, str, int, int]:
        return self.id, self.path, self.files_list, self.files, self.bytes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, View) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "View(id={!r}, path={!r}, files_list={!r}, files={!r}, bytes={!r})".format(*self._key())


#: what a view's id covers besides its shards: the format of its files list, so that a view made
#: by a dsstage whose list did not escape names is never found (and retires as unused)
LIST_FORMAT = "files-list 2: escaped"


def view_id(shard_ids: Sequence[str]) -> str:
    return blake3.blake3("\n".join([*sorted(shard_ids), LIST_FORMAT]).encode()).hexdigest()[:16]


def find(tier: RootDir, name: str, shard_ids: Sequence[str]) -> View | None:
    """The view of these shards if it was made (cheap: two lookups), else None."""
    vid = view_id(shard_ids)
    fd = tier.has_dir(TOP, name)
    if fd is None:
        return None
    record = safe.read_json_at(fd, f"{vid}.json")
    if sorted(record.get("shards") or ()) != sorted(shard_ids):
        return None
    try:
        os.stat(vid, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return View(vid, tier.path(TOP, name, vid), tier.path(TOP, name, f"{vid}.files"), int(record.get("files") or 0),
                int(record.get("bytes") or 0))


def make(tier: RootDir, name: str, shards: Sequence[ShardFiles]) -> View:
    """The view of ``shards`` (their manifests, in shard order; each ready in
    ``datasets/<name>/<shard id>``), made now unless it exists. The caller holds the
    dataset's lock and leases the shards, so none goes while its files are linked."""
    ids = [version_id(m.digest) for m in shards]
    found = find(tier, name, ids)
    if found:
        return found
    vid = view_id(ids)
    top = tier.dir(TOP, name, mode=0o700)
    path = tier.path(TOP, name, vid)
    lines: list[str] = []

    def fill(fd: int) -> None:
        with Tree(fd, create=True, mode=0o755) as dest:
            for m in shards:
                with Tree(tier.dir("datasets", name, version_id(m.digest), create=False)) as src:
                    for e in m.entries:
                        with src.parent(e.path) as (sfd, sname), dest.parent(e.path) as (dfd, dname):
                            os.link(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                        # one line a file, whatever its name holds (pathtext: as the manifest writes it)
                        lines.append(pathtext.escape(os.path.join(path, e.path)))
        safe.write_at(top, f"{vid}.files", "".join(line + "\n" for line in lines).encode("utf-8", "surrogateescape"),
                      fsync=False)
        safe.write_json_at(top, f"{vid}.json", {"shards": ids, "files": len(lines),
                                                "bytes": sum(m.total_bytes for m in shards), "made": time.time()},
                           fsync=False)
        safe.remove_at(top, vid)  # a half view left by a crash between the rename and its record

    # made where nobody else can enter, opened up only as it is renamed into place; who may
    # enter is decided by the top directory, restricted first
    safe.make_dir_whole(top, vid, fill)
    files, nbytes = len(lines), sum(m.total_bytes for m in shards)
    return View(vid, path, tier.path(TOP, name, f"{vid}.files"), files, nbytes)


def drop_containing(tier: RootDir, name: str, shard_id: str) -> list[str]:
    """Move every view of ``name`` that holds shard ``shard_id`` into the tier's trash (the
    background purge deletes it); the view ids."""
    fd = tier.has_dir(TOP, name)
    if fd is None:
        return []
    dropped = []
    for entry in tier.names(TOP, name):
        if not entry.endswith(".json"):
            continue
        vid = entry[:-len(".json")]
        if shard_id not in (safe.read_json_at(fd, entry).get("shards") or ()):
            continue
        drop(tier, name, vid)
        dropped.append(vid)
    return dropped


#: views kept per dataset beside those jobs use: the newest, so that a job on the same nodes
#: as a recent one finds its view made (a view costs directory entries, not data)
KEPT = 4


def unused(tier: RootDir, name: str, leased: set[str]) -> list[str]:
    """The views of ``name`` to drop: neither used by a job (``leased``: view ids) nor among
    the ``KEPT`` newest of the others."""
    fd = tier.has_dir(TOP, name)
    if fd is None:
        return []
    made = []
    for entry in tier.names(TOP, name):
        if entry.endswith(".json") and entry[:-len(".json")] not in leased:
            made.append((float(safe.read_json_at(fd, entry).get("made") or 0), entry[:-len(".json")]))
    return [vid for _t, vid in sorted(made, reverse=True)[KEPT:]]


def retire(tier: RootDir, name: str, vid: str, in_use: Callable[[], set[str]]) -> bool:
    """Drop view ``vid`` unless a job uses it, race-free against a Prolog that leases its
    shards and then finds it without the dataset's lock (the warm path): its record goes
    first, so ``find`` fails from then on; then ``in_use()`` (the view ids the leases hold,
    read now) decides, and a view a lease took meanwhile gets its record back. True if dropped."""
    fd = tier.dir(TOP, name)
    record = safe.read_json_at(fd, f"{vid}.json")
    safe.unlink_at(fd, f"{vid}.json")
    if vid in in_use():
        if record:
            safe.write_json_at(fd, f"{vid}.json", record, fsync=False)
        return False
    drop(tier, name, vid)
    return True


def drop(tier: RootDir, name: str, vid: str) -> None:
    """Move view ``vid`` of ``name`` into the tier's trash (its record first: never found half)."""
    fd = tier.dir(TOP, name)
    safe.unlink_at(fd, f"{vid}.json")
    safe.unlink_at(fd, f"{vid}.files")
    try:
        os.rename(vid, f"{TRASH_PREFIX}{name}.{vid}.{time.time_ns()}", src_dir_fd=fd, dst_dir_fd=tier.dir("trash"))
    except FileNotFoundError:
        pass


def relink(tier: RootDir, name: str, shard_id: str, paths: Sequence[str]) -> int:
    """Point every view of ``name`` that holds shard ``shard_id`` at the shard copy's files
    ``paths`` again (after a repair replaced them): each link is made beside the old one and
    renamed over it, so a job reading the view sees the old file or the repaired one, whole.
    The number of links replaced."""
    fd = tier.has_dir(TOP, name)
    if fd is None or not paths:
        return 0
    done = 0
    for entry in tier.names(TOP, name):
        if not entry.endswith(".json") or shard_id not in (safe.read_json_at(fd, entry).get("shards") or ()):
            continue
        vid = entry[:-len(".json")]
        with Tree(tier.dir("datasets", name, shard_id, create=False)) as src, \
                Tree(tier.dir(TOP, name, vid, create=False)) as dest:
            for rel in paths:
                with src.parent(rel) as (sfd, sname), dest.parent(rel) as (dfd, dname):
                    tmp = safe.temp_name()
                    os.link(sname, tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                    os.replace(tmp, dname, src_dir_fd=dfd, dst_dir_fd=dfd)
                    done += 1
    return done


def listing(view: View) -> list[str]:
    """The view's files, their names as they are (the list escapes them: pathtext)."""
    with open(view.files_list, encoding="utf-8", errors="surrogateescape") as fh:
        return [pathtext.unescape(line) for line in fh.read().split("\n")[:-1]]

