"""Leasing a ready copy: "find ready, lease, check again, give back".

A lease is ``<tier>/leases/<dataset>/<job id>.json`` (dsstage.node.lease reads them back); a
copy with a lease is never evicted. A ready copy is leased without the dataset's lock: the
lease is written first and the copy checked again after it, so either this sees the copy's
ready mark gone (an eviction was under way) and gives the lease back, or the evictor sees the
lease (see "Leases and eviction" in dsstage.node.store). Every path that leases a copy it did
not stage itself goes through ``hold``: the warm Prolog and the fast ``dsstage stage``
(``lease``), the full stage's reuse of a ready copy (dsstage.node.staging.reuse); the dry run
asks ``reusable`` what the full stage would decide.
"""

from __future__ import annotations

import os
import time

from dsstage.fs import formats, layout, safe
from dsstage.fs.layout import Layout
from dsstage.fs.safe import RootDir

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any, Protocol

    class Shard(Protocol):  # dsstage.shards.indexfile.Shard, as far as a lease and a job's exports read it
        @property
        def digest(self) -> str: ...
        @property
        def id(self) -> str: ...
        @property
        def index(self) -> int: ...


class Holder:
    """Who takes a lease: the job (or ``pid``, the process, for a stage run by hand), its user,
    the node; the host and the time are the lease's own."""

    __slots__ = ("job_id", "user", "node", "pid", "host", "taken")

    def __init__(self, job_id: str, user: str, node: str, pid: int = 0, *, host: str = "",
                 taken: float | None = None) -> None:
        self.job_id, self.user, self.node, self.pid = job_id, user, node, pid
        self.host = host or os.uname().nodename
        self.taken = time.time() if taken is None else taken


def record(dataset: str, digest: str, holder: Holder, shards: Sequence[str] = ()) -> dict[str, Any]:
    """What a lease file holds, in its format (dsstage.fs.formats): the one writer's record.
    ``shards``: a sharded dataset's lease holds these shard copies (``digest`` is then the
    version they are shards of)."""
    return {"format": formats.CURRENT["lease"], "dataset": dataset, "digest": digest, "job_id": holder.job_id,
            "user": holder.user, "node": holder.node, "taken": holder.taken, "host": holder.host,
            "pid": holder.pid, "shards": list(shards)}


def write(tier: RootDir, rec: Mapping[str, Any]) -> None:
    safe.write_json_at(tier.dir("leases", rec["dataset"]), f"{rec['job_id']}.json", rec, fsync=False)


def remove(tier: RootDir, dataset: str, job_id: str) -> bool:
    return safe.unlink_at(tier.has_dir("leases", dataset), f"{job_id}.json")


class Take:
    """One lease to take: the record for ``tier``, and what to put back if the check after it
    fails (``previous``: the record the file held before, e.g. the shards a job held already;
    None: remove the file)."""

    __slots__ = ("tier", "record", "previous")

    def __init__(self, tier: RootDir, rec: Mapping[str, Any], previous: Mapping[str, Any] | None = None) -> None:
        self.tier, self.record, self.previous = tier, rec, previous


def hold(takes: Sequence[Take], still_ready: Callable[[], bool]) -> bool:
    """Write every lease, then ask ``still_ready``: True if the copies are still ready with
    the leases in place; False, with every lease given back, if an eviction came first. Any
    error gives them back too, and is raised."""
    try:
        for t in takes:
            write(t.tier, t.record)
        if still_ready():
            return True
    except BaseException:
        give_back(takes)
        raise
    give_back(takes)
    return False


def release(picked: Sequence[Pick], job_id: str) -> None:
    """Give back the leases ``lease`` took for ``job_id`` on ``picked``."""
    for p in picked:
        remove(p.tier, p.name, job_id)


def give_back(takes: Sequence[Take]) -> None:
    for t in takes:
        if t.previous is not None:
            write(t.tier, t.previous)
        else:
            remove(t.tier, t.record["dataset"], t.record["job_id"])


def reusable(tier: RootDir, name: str, digest: str, verify: str) -> str | None:
    """None if the copy of ``digest`` may be leased as it is (ready, and the dataset is
    quick-verified); else why not: the full stage then takes the lock and verifies or fills."""
    if verify != "quick":
        return "verify: full, so every file of the copy is checked again"
    return layout.not_ready(tier, name, digest)


class Pick:
    """A dataset found ready: its version, tier, and for a sharded one this node's part of it
    (``shards``), what the job's environment gets for it (``exports``) and whether the view
    of those shards is still there (``view``: dsstage.shards.views, which this layer does not
    import)."""

    __slots__ = ("name", "digest", "tier", "path", "shards", "exports", "view")

    def __init__(self, name: str, digest: str, tier: RootDir, path: str, shards: tuple[Shard, ...] = ()) -> None:
        self.name, self.digest, self.tier, self.path, self.shards = name, digest, tier, path, shards
        self.exports: tuple[tuple[str, str], ...] = ()
        self.view: Callable[[], bool] | None = None


def ready_whole(name: str, digest: str, tier: RootDir) -> Pick | None:
    """Version ``digest`` of whole dataset ``name`` if it is ready in ``tier``."""
    if layout.not_ready(tier, name, digest) is not None:
        return None
    return Pick(name, digest, tier, Layout(tier.root).version_dir(name, digest))


def lease(picked: Sequence[Pick], holder: Holder) -> bool:
    """Lease every pick to ``holder``; False, with the leases given back, if an eviction took
    one first."""
    takes = [Take(p.tier, record(p.name, p.digest, holder, [s.digest for s in p.shards])) for p in picked]
    return hold(takes, lambda: all(still_ready(p) for p in picked))


def still_ready(p: Pick) -> bool:
    """Whether a pick is still ready now that the job's lease holds it (an eviction that came
    first took it, and a view goes with any of its shards)."""
    if not p.shards:
        return layout.not_ready(p.tier, p.name, p.digest) is None
    return all(layout.not_ready(p.tier, p.name, s.digest) is None for s in p.shards) and \
        (p.view is None or p.view())
