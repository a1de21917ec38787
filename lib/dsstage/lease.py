"""Leases: which job uses which dataset version on a node.

A lease is a small JSON file ``<tier>/leases/<dataset>/<job id>.json``. A copy that has a
lease is never evicted. A lease whose holder is gone (the job ended without its Epilog,
the process that took it died) can be reclaimed.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .errors import StoreError
from .fsutil import write_json
from .warm import job_id_ok


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

    @property
    def is_job(self) -> bool:
        return self.pid == 0


def check_job_id(job_id: str) -> str:
    if not job_id_ok(job_id or ""):
        raise StoreError(f"job id {job_id!r} is not valid: use the Slurm job id (digits, optionally _ or +)")
    return job_id


def default_holder() -> tuple[str, int]:
    """A lease id and pid for a stage run by hand: the calling shell holds it."""
    ppid = os.getppid()
    return f"pid-{socket.gethostname()}-{ppid}", ppid


class LeaseBook:
    """The leases of one tier on one node."""

    def __init__(self, tier_root: str) -> None:
        self.root = os.path.join(tier_root, "leases")

    def _path(self, dataset: str, job_id: str) -> str:
        return os.path.join(self.root, dataset, check_job_id(job_id) + ".json")

    def take(self, lease: Lease) -> None:
        write_json(self._path(lease.dataset, lease.job_id), asdict(lease), fsync=False)

    def release(self, dataset: str, job_id: str) -> bool:
        try:
            os.unlink(self._path(dataset, job_id))
            return True
        except FileNotFoundError:
            return False

    def of_dataset(self, dataset: str) -> list[Lease]:
        d = os.path.join(self.root, dataset)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if not n.endswith(".json"):
                continue
            try:
                with open(os.path.join(d, n)) as fh:
                    out.append(Lease(**json.load(fh)))
            except (OSError, ValueError, TypeError):
                continue  # a damaged lease file is ignored; `reclaim` removes it
        return out

    def datasets(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def of_job(self, job_id: str) -> list[Lease]:
        return [lease for ds in self.datasets() for lease in self.of_dataset(ds) if lease.job_id == job_id]

    def reclaim(self, dataset: str, job_alive: Callable[[str], bool]) -> list[Lease]:
        """Remove the leases whose holder is gone; return them."""
        gone = [lease for lease in self.of_dataset(dataset) if not holder_alive(lease, job_alive)]
        for lease in gone:
            self.release(lease.dataset, lease.job_id)
        return gone


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
