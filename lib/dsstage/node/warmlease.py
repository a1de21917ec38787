"""Leasing a ready copy without the dataset's lock: the warm Prolog (dsstage.hooks.warm)
and the fast ``dsstage stage`` (dsstage.cli.fast).

The lease is written first and the copy checked again after it: either this sees the
copy's ready mark gone (an eviction was under way) and gives the lease back, or the evictor
sees the lease (see "Leases and eviction" in dsstage.node.store). Standard library and
``dsstage.fs`` only: both callers must stay cheap.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from dsstage.fs import layout, safe
from dsstage.fs.layout import Layout
from dsstage.fs.safe import RootDir

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from dsstage.shards.indexfile import Shard


class Pick:
    """A dataset found ready: its version, tier, and for a sharded one this node's part of it
    (``shards``) and what the job's environment gets for it (``exports``)."""

    __slots__ = ("name", "digest", "tier", "path", "shards", "exports")

    def __init__(self, name: str, digest: str, tier: RootDir, path: str, shards: tuple[Shard, ...] = (),
                 exports: tuple[tuple[str, str], ...] = ()) -> None:
        self.name, self.digest, self.tier, self.path = name, digest, tier, path
        self.shards, self.exports = shards, exports


def requested_names(request: str) -> list[str] | None:
    """The dataset names of a request (``a,b``), or None if it is malformed."""
    names: list[str] = []
    for part in request.split(","):
        name = part.strip()
        if not layout.name_ok(name):
            return None
        if name not in names:
            names.append(name)
    return names


def ready_whole(name: str, digest: str, tier: RootDir) -> Pick | None:
    """Version ``digest`` of whole dataset ``name`` if it is ready in ``tier``."""
    if layout.not_ready(tier, name, digest) is not None:
        return None
    return Pick(name, digest, tier, Layout(tier.root).version_dir(name, digest))


def lease(picked: Sequence[Pick], job_id: str, user: str, node: str, pid: int = 0) -> bool:
    """Lease every pick to ``job_id`` (``pid``: the process holding it, for a stage run by
    hand); False, with the leases given back, if an eviction took one first."""
    host = os.uname().nodename
    try:
        for p in picked:
            safe.write_json_at(p.tier.dir("leases", p.name), f"{job_id}.json",
                               layout.lease_record(p.name, p.digest, job_id, user, node, taken=time.time(), host=host,
                                                   pid=pid, shards=[s.digest for s in p.shards]),
                               fsync=False)
        if all(still_ready(p) for p in picked):
            return True
    except BaseException:
        give_back(picked, job_id)
        raise
    give_back(picked, job_id)
    return False


def give_back(picked: Sequence[Pick], job_id: str) -> None:
    for p in picked:
        safe.unlink_at(p.tier.has_dir("leases", p.name), f"{job_id}.json")


def still_ready(p: Pick) -> bool:
    """Whether a pick is still ready now that the job's lease holds it (an eviction that came
    first took it, and a view goes with any of its shards)."""
    if not p.shards:
        return layout.not_ready(p.tier, p.name, p.digest) is None
    from dsstage.node import views
    return all(layout.not_ready(p.tier, p.name, s.digest) is None for s in p.shards) and \
        views.find(p.tier, p.name, [s.id for s in p.shards]) is not None
