"""Leases: which job uses which dataset version on a node.

A lease is a small JSON file ``<tier>/leases/<dataset>/<job id>.json``. A copy that has a
lease is never evicted. A lease whose holder is gone (the job ended without its Epilog,
the process that took it died) can be reclaimed, and so can a damaged lease file.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property

from dsstage.errors import StoreError
from dsstage.fs import safe
from dsstage.fs.layout import job_id_ok, version_id
from dsstage.fs.safe import RootDir
from dsstage.ready import lease as ready_lease


@dataclass(frozen=True)
class Lease:
    dataset: str
    digest: str
    job_id: str
    user: str
    node: str
    taken: float
    host: str = ""
    pid: int = 0  # for leases not tied to a Slurm job: the process that holds it
    #: a sharded dataset's lease: the shard copies it holds (``digest`` is then the version
    #: they are shards of, which has no copy of its own); () for a whole version
    shards: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.shards, tuple):  # read from JSON as a list
            object.__setattr__(self, "shards", tuple(self.shards) if isinstance(self.shards, list) else ())

    @property
    def is_job(self) -> bool:
        return self.pid == 0

    @cached_property
    def holds(self) -> frozenset[str]:
        """The version ids of the copies it holds (a sharded lease: its shards'), worked out
        once: a report or a plan asks for every copy on the node."""
        return frozenset(version_id(s) for s in self.shards) if self.shards else frozenset({version_id(self.digest)})

    def covers(self, version: str) -> bool:
        """Whether it holds the copy ``version`` (a version id: 16 hex digits)."""
        return version in self.holds


#: what a lease file's keys may name (others, such as "format", are not Lease fields)
LEASE_FIELDS = frozenset(f.name for f in fields(Lease))


def record(lease: Lease) -> dict[str, object]:
    """The lease file's record (dsstage.ready.lease.record: the one writer's)."""
    holder = ready_lease.Holder(check_job_id(lease.job_id), lease.user, lease.node, lease.pid, host=lease.host,
                                taken=lease.taken)
    return ready_lease.record(lease.dataset, lease.digest, holder, lease.shards)


def check_job_id(job_id: str) -> str:
    if not job_id_ok(job_id or ""):
        raise StoreError(f"job id {job_id!r} is not valid: use the Slurm job id (digits, optionally _ or +)")
    return job_id


class LeaseBook:
    """The leases of one tier on one node (``tier``: the tier's RootDir)."""

    def __init__(self, tier: RootDir) -> None:
        self.tier = tier

    def take(self, lease: Lease) -> None:
        ready_lease.write(self.tier, record(lease))

    def release(self, dataset: str, job_id: str) -> bool:
        return ready_lease.remove(self.tier, dataset, check_job_id(job_id))

    def _read(self, dataset: str) -> tuple[list[Lease], list[str]]:
        """The leases of ``dataset``, and the names of damaged lease files."""
        fd = self.tier.has_dir("leases", dataset)
        good: list[Lease] = []
        damaged: list[str] = []
        for n in self.tier.names("leases", dataset):
            record = safe.read_json_at(fd, n) if n.endswith(".json") else {}
            try:
                # keys a newer writer added are read as absent (dsstage.fs.formats), not as damage
                lease = Lease(**{k: v for k, v in record.items() if k in LEASE_FIELDS})
                if lease.dataset != dataset or n != f"{lease.job_id}.json":
                    raise TypeError
                good.append(lease)
            except TypeError:
                damaged.append(n)
        return good, damaged

    def of_dataset(self, dataset: str) -> list[Lease]:
        # a damaged lease file is ignored here; `reclaim` removes it
        return self._read(dataset)[0]

    def datasets(self) -> list[str]:
        return self.tier.names("leases")

    def of_job(self, job_id: str) -> list[Lease]:
        return [lease for ds in self.datasets() for lease in self.of_dataset(ds) if lease.job_id == job_id]

    def reclaim(self, dataset: str, alive: Callable[[Lease], bool]) -> tuple[list[Lease], list[str]]:
        """Remove the leases whose holder is gone (``alive`` says no), and damaged lease
        files; return both."""
        good, damaged = self._read(dataset)
        gone = [lease for lease in good if not alive(lease)]
        fd = self.tier.has_dir("leases", dataset)
        for lease in gone:
            self.release(lease.dataset, lease.job_id)
        for n in damaged:
            safe.remove_at(fd, n)
        return gone, damaged


def holder_alive(lease: Lease, job_alive: Callable[[str], bool]) -> bool:
    """Whether the job or process that took ``lease`` still exists.

    For a job, ``job_alive`` decides (the Slurm client). A process lease from another
    host cannot be checked here, so it counts as alive.
    """
    if lease.is_job:
        return job_alive(lease.job_id)
    if lease.host and lease.host != socket.gethostname():
        return True
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
