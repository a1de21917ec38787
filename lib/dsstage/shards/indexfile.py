"""A version's shard index read back: what every node needs to know of a sharded dataset's
version (its shards' digests, files and bytes), without its manifests.

    manifests/<name>/<version digest>.shards-<N>.json

Written by dsstage.shards.index (``dsstage manifest build``); read here, with the standard
library only, so that the warm Prolog (dsstage.hooks.warm) can read it too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from dsstage.errors import ManifestError
from dsstage.fs import formats, jsontext, untrusted

KIND = "shard-index"

#: how many hex digits of a shard's digest name it (as a version's id does)
ID_DIGITS = 16


class Shard:
    """Files ``start:stop`` of a manifest's entries. (A plain class, compared and hashed by its
    fields: the warm Prolog imports this module, and dataclasses cost it 15-20 ms to import.)"""

    __slots__ = ("index", "start", "stop", "files", "bytes", "digest")

    def __init__(self, index: int, start: int, stop: int, files: int, bytes: int, digest: str) -> None:
        self.index, self.start, self.stop = index, start, stop
        self.files, self.bytes, self.digest = files, bytes, digest

    def _key(self) -> tuple[int, int, int, int, int, str]:
        return self.index, self.start, self.stop, self.files, self.bytes, self.digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shard) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "Shard(index={!r}, start={!r}, stop={!r}, files={!r}, bytes={!r}, digest={!r})".format(*self._key())

    @property
    def id(self) -> str:
        return self.digest[:ID_DIGITS]


def index_name(digest: str, count: int) -> str:
    return f"{digest}.shards-{count}.json"


def read(directory: str, name: str, version: str, count: int) -> tuple[Shard, ...]:
    """The shards of ``version`` split into ``count``, from the index in ``directory`` (the
    dataset's manifests); ManifestError, saying what to run, if there is none or it is damaged.
    OSError where the state directory fails."""
    path = os.path.join(directory, index_name(version, count))
    try:
        data = untrusted.read_bytes(path, untrusted.JSON_MAX)  # its data owner writes it
        if data is None:
            raise ManifestError(f"dataset {name!r}: version {version[:16]} was not split into {count} shards (its "
                                f"shards: setting): an admin must run `dsstage manifest build {name}`")
        record = jsontext.loads(data)
    except ValueError as exc:
        raise ManifestError(f"{path}: unreadable ({exc}); rebuild with `dsstage manifest build {name}`") from None
    why = formats.problem(KIND, record, path) if isinstance(record, dict) else f"{path}: not a shard index"
    if why:
        raise ManifestError(why)
    try:
        shards = tuple(Shard(_count(r["index"]), _count(r["start"]), _count(r["stop"]), _count(r["files"]),
                             _count(r["bytes"]), str(r["digest"])) for r in record["shards"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ManifestError(f"{path}: damaged; rebuild with `dsstage manifest build {name}`") from None
    if record.get("version") != version or len(shards) != count or \
            [s.index for s in shards] != list(range(count)) or not _chained(shards):
        raise ManifestError(f"{path}: does not describe {count} shards of version {version[:16]}; rebuild with "
                            f"`dsstage manifest build {name}`")
    return shards


#: the largest count or size a shard index may say (its data owner writes it: a bound, not a fact)
COUNT_MAX = 2**63 - 1


def _count(value: object) -> int:
    """A whole number from 0 to COUNT_MAX as JSON writes it (no float, no bool, no Infinity:
    ``int(1e999)`` raises OverflowError, which no caller expects); ValueError otherwise."""
    if type(value) is not int or not 0 <= value <= COUNT_MAX:
        raise ValueError(value)
    return value


def _chained(shards: Sequence[Shard]) -> bool:
    return bool(shards) and shards[0].start == 0 and all(a.stop == b.start for a, b in zip(shards, shards[1:])) \
        and all(s.stop - s.start == s.files >= 1 for s in shards)
