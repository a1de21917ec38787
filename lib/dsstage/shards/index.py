"""A version's shards in the state directory, written once by ``dsstage manifest build``.

    manifests/<name>/<version digest>.shards-<N>.json   the index: each shard's index, digest,
                                                       files and bytes, for a split into N
    manifests/<name>/<shard digest>.manifest           each shard's own manifest (its files'
                                                       lines; its header names the version)

A node reads the small index to know a version's shards, and then only the manifests of
the shards it stages: a shard is staged, verified, leased and evicted like a version of its
own (its copy is ``datasets/<name>/<shard id>``). Shards are split by dsstage.shards.split,
so the files are the same wherever they are written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dsstage.config.manifest import Catalog, Manifest, write
from dsstage.errors import ManifestError
from dsstage.fs import formats
from dsstage.fs.safe import write_atomic
from dsstage.shards import indexfile
from dsstage.shards.indexfile import Shard
from dsstage.shards.split import split

KIND = indexfile.KIND
index_name = indexfile.index_name


@dataclass(frozen=True)
class Index:
    """The shards of version ``version`` of dataset ``name``."""

    name: str
    version: str
    shards: tuple[Shard, ...]

    @property
    def count(self) -> int:
        return len(self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def by_id(self) -> dict[str, Shard]:
        return {s.id: s for s in self.shards}


def publish(catalog: Catalog, manifest: Manifest, count: int) -> Index:
    """Split ``manifest`` into ``count`` shards and write their manifests and the index
    (each written whole, then renamed: a reader sees all of a file or none of it). A shard
    manifest that exists already (an unchanged shard of an earlier version) is kept."""
    shards = split(manifest.entries, count, manifest.name)
    where = catalog.dir(manifest.name)
    os.makedirs(where, mode=0o755, exist_ok=True)
    for shard in shards:
        path = catalog.path(manifest.name, shard.digest)
        if not os.path.exists(path):
            write(Manifest(name=manifest.name, digest=shard.digest, entries=manifest.entries[shard.start:shard.stop],
                           total_bytes=shard.bytes, created=manifest.created, source=manifest.source,
                           shard_of=manifest.digest), path)
    index = Index(manifest.name, manifest.digest, tuple(shards))
    record = formats.stamp(KIND, {"dataset": manifest.name, "version": manifest.digest, "count": count,
                                  "shards": [{"index": s.index, "digest": s.digest, "start": s.start, "stop": s.stop,
                                              "files": s.files, "bytes": s.bytes} for s in shards]})
    write_atomic(os.path.join(where, index_name(manifest.digest, count)),
                 (json.dumps(record, sort_keys=True) + "\n").encode())
    return index


def load(catalog: Catalog, name: str, version: str, count: int) -> Index:
    """The index of ``version`` split into ``count`` shards; ManifestError, saying what to run,
    if there is none or it is damaged."""
    try:
        return Index(name, version, indexfile.read(catalog.dir(name), name, version, count))
    except OSError as exc:
        raise ManifestError(f"{catalog.dir(name)}: unreadable ({exc}); rebuild with "
                            f"`dsstage manifest build {name}`") from None


def shard_manifest(catalog: Catalog, name: str, shard: Shard, version: str) -> Manifest:
    """The manifest of one shard of ``version``, checked whole (its digest, its paths)."""
    m = catalog.load(name, shard.digest)
    if m.files != shard.files or m.total_bytes != shard.bytes:
        raise ManifestError(f"{catalog.path(name, shard.digest)}: does not match shard {shard.index} of version "
                            f"{version[:16]}; rebuild with `dsstage manifest build {name}`")
    return m


def is_index(filename: str) -> bool:
    return ".shards-" in filename and filename.endswith(".json")


def index_count(filename: str) -> int:
    """The shard count an index file is named by (ValueError if it is not one)."""
    return int(filename.split(".shards-", 1)[1].removesuffix(".json"))


def index_version(filename: str) -> str:
    """The version digest an index file is named by."""
    return filename.split(".shards-", 1)[0]

