"""What the nodes of one job decide once, for all of them, in ``<state_dir>/jobs``.

A job on many nodes runs one Prolog per node, each on its own. Two decisions must be the
job's, not each node's:

* **the version of each dataset** (``pin``): every node reads ``CURRENT`` on its own, so a
  ``manifest build`` landing while a 64-node job starts would give its ranks different data.
  The first node to get there records the versions it chose (``<job id>.json``); every
  other node takes them from there.
* **who tells Slurm** (``claim_hold``): a failing 500-node job must not ask slurmctld 1,500
  times. The first node to claim ``<job id>.hold`` holds the job; the others keep their tasks
  from starting (the TaskProlog's hold mark) and say who holds it.
* **which node holds which shards** of a sharded dataset (``plan_for``, ``<job id>.shards.json``):
  the first node decides (dsstage.shards.assign: quotas, what each node's published report
  shows ready now, rendezvous hashing); it claims the making first (``<job id>.shards.claim``)
  and the others wait for its record, so that a job's M nodes read the M reports once, not
  M times each; a one-node job holds every shard and writes nothing.

Both are made with ``fs.shared.create_once`` (link(2): exactly one node wins, NFS included),
written by root or, where NFS squashes root, by ``report.user``, and trusted only if nobody
else could have written them. The Epilog removes them, so a requeued job chooses afresh.
A one-node job needs neither and writes nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

from dsstage.errors import DsstageError, StateError
from dsstage.fs import formats, jsontext, shared

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger(__name__)

DIR = "jobs"
FORMAT = formats.CURRENT["job-record"]


def directory(state_dir: str) -> str:
    return os.path.join(state_dir, DIR)


def _job_ok(job_id: str) -> bool:
    return bool(job_id) and len(job_id) <= 64 and all(c.isdigit() or c in "_+" for c in job_id)


def _as_writer(user: str | None) -> AbstractContextManager[None]:
    """Act as ``report.user`` where set (root_squash), else as root."""
    if not user:  # without importing the identity switch (ctypes, dataclasses: 20 ms of a warm Prolog)
        return nullcontext()
    from dsstage.fs import identity
    return identity.writing_as(user)


_writers = shared.writers


def pin(state_dir: str, job_id: str, nodes: str, node: str, chosen: Mapping[str, str],
        user: str | None = None) -> dict[str, str]:
    """The versions (dataset -> digest) every node of job ``job_id`` stages: ``chosen`` (this
    node's reading of ``CURRENT``) if this node is the first to record them, else the first
    node's. A record for other nodes (a job id Slurm reused) is not taken. Raises StateError
    or UnsafeStore when the state directory fails or cannot be trusted."""
    if not _job_ok(job_id):
        raise StateError(f"{job_id!r} is not a job id")
    where = directory(state_dir)
    data = jsontext.dumps({"format": FORMAT, "job": job_id, "nodes": nodes, "by": node, "time": time.time(),
                           "versions": dict(chosen)}, sort_keys=True).encode() + b"\n"
    writers = _writers(user)
    try:
        with _as_writer(user):  # reading too: where NFS squashes root, only the writer can
            won = shared.create_once(where, f"{job_id}.json", data, writers)
            raw = data if won else shared.read(where, f"{job_id}.json", writers)
    except OSError as exc:
        raise StateError(f"the shared state directory {state_dir} failed recording job {job_id}'s versions "
                         f"({exc.strerror or exc})") from None
    record = _parse(raw)
    if record is None or record.get("job") != job_id:
        raise StateError(f"{os.path.join(where, job_id + '.json')} is not a dsstage job record for job {job_id}")
    why = formats.problem("job-record", record, os.path.join(where, job_id + ".json"))
    if why:
        raise StateError(why)
    if record.get("nodes") != nodes:
        log.warning("job %s: %s names other nodes (%s): a job id used again; this node keeps its own versions",
                    job_id, os.path.join(where, f"{job_id}.json"), record.get("nodes"))
        return dict(chosen)
    versions = record.get("versions")
    if not isinstance(versions, dict):
        raise StateError(f"{os.path.join(where, job_id + '.json')} is damaged: no versions")
    out = dict(chosen)
    out.update({str(k): str(v) for k, v in versions.items() if k in chosen})
    if not won and out != dict(chosen):
        log.info("job %s: the versions node %s chose for the job's nodes: %s", job_id, record.get("by"),
                 ", ".join(f"{k} {v[:16]}" for k, v in sorted(out.items())))
    return out


def claim_hold(state_dir: str, job_id: str, nodes: str, node: str, user: str | None = None) -> tuple[bool, str]:
    """(True, node) if this node is the first of its job to hold it, and so the one that
    asks Slurm; (False, the node that is) otherwise. A claim left for other nodes (a job id
    Slurm used again after an Epilog could not remove it) is not taken: this node holds.
    Raises OSError where the state directory fails: the caller then asks Slurm itself (a job
    held twice beats a job not held)."""
    if not _job_ok(job_id):
        raise StateError(f"{job_id!r} is not a job id")
    where = directory(state_dir)
    writers = _writers(user)
    with _as_writer(user):
        won = shared.create_once(where, f"{job_id}.hold",
                                 jsontext.dumps({"job": job_id, "nodes": nodes, "by": node}).encode(), writers)
        record = {} if won else _parse(shared.read(where, f"{job_id}.hold", writers)) or {}
    if won or record.get("by") == node or record.get("nodes") != nodes:
        return True, node
    return False, str(record.get("by") or "another node")


Plan = dict[str, list[str]]  # node -> shard ids

#: seconds a node waits for the plan of the node that claimed the making of it, before it
#: makes one itself (create_once keeps whichever comes first)
PLAN_WAIT = 20.0
#: seconds between two looks for it
PLAN_POLL = 0.1


def _wait_for(where: str, name: str, writers: Sequence[int], until: float) -> bytes | None:
    while True:
        raw = shared.read(where, name, writers)
        if raw is not None or time.monotonic() >= until:
            return raw
        time.sleep(PLAN_POLL)


def plan(state_dir: str, name: str, shard_ids: Sequence[str], nodes: Sequence[str]) -> dict[str, list[str]]:
    """node -> shard ids of ``name`` for a job on ``nodes``: dsstage.shards.assign over what
    each node's published report shows ready now. The plan a job's first node records
    (``plan_for``), and the part a prefetch stages on a pending job's planned node
    (dsstage.node.standalone): the same function, so that what a prefetch staged is what the
    job's plan gives that node."""
    return plans(state_dir, name, shard_ids, [nodes])[0]


def plans(state_dir: str, name: str, shard_ids: Sequence[str],
          jobs: Sequence[Sequence[str]]) -> list[dict[str, list[str]]]:
    """``plan`` for several jobs (each given by its nodes), each node's report read once."""
    from dsstage.node import report
    from dsstage.shards.assign import assign
    everyone = sorted({n for nodes in jobs for n in nodes})
    held = report.ready_in_reports(state_dir, everyone, name, shard_ids)
    return [assign(shard_ids, nodes, {n: held[n] for n in nodes if n in held}) for nodes in jobs]


def plan_for(state_dir: str, job_id: str, nodes: Sequence[str], node: str, shards: Mapping[str, Sequence[str]],
             user: str | None = None) -> dict[str, Plan]:
    """dataset -> node -> shard ids, for the sharded datasets of job ``job_id`` (``shards``:
    dataset -> the ids of its agreed version's shards, in shard order), the same on every
    node of the job."""
    if len(nodes) <= 1:
        return {name: {node: list(ids)} for name, ids in shards.items()}
    where = directory(state_dir)
    writers = _writers(user)
    record_name = f"{job_id}.shards.json"
    try:
        with _as_writer(user):
            raw = shared.read(where, record_name, writers)
            if raw is None and not shared.create_once(where, f"{job_id}.shards.claim", node.encode(), writers):
                # another node of the job is making the plan: wait for its record rather than
                # read every node's report here too (M nodes starting at once: M x M reads)
                raw = _wait_for(where, record_name, writers, time.monotonic() + PLAN_WAIT)
            if raw is None:
                made = {name: plan(state_dir, name, ids, nodes) for name, ids in shards.items()}
                data = jsontext.dumps({"format": FORMAT, "job": job_id, "nodes": sorted(nodes), "by": node,
                                       "time": time.time(), "shards": made}, sort_keys=True).encode() + b"\n"
                if shared.create_once(where, record_name, data, writers):
                    return made
                raw = shared.read(where, record_name, writers)
    except OSError as exc:
        raise StateError(f"the shared state directory {state_dir} failed recording job {job_id}'s shards "
                         f"({exc.strerror or exc})") from None
    record = _parse(raw)
    plans = record.get("shards") if record and record.get("job") == job_id and \
        record.get("nodes") == sorted(nodes) else None
    if not isinstance(plans, dict) or any(not _fits(plans.get(name), ids, nodes) for name, ids in shards.items()):
        raise StateError(f"{os.path.join(where, record_name)} is not this job's shard plan (a job id used again, "
                         "or damaged): requeue the job")
    return {name: {n: [str(s) for s in plans[name][n]] for n in nodes} for name in shards}


def _fits(plan: object, ids: Sequence[str], nodes: Sequence[str]) -> bool:
    """Whether a recorded plan gives every shard of ``ids`` to the job's ``nodes``."""
    if not isinstance(plan, dict) or set(plan) != set(nodes):
        return False
    given = {s for v in plan.values() if isinstance(v, list) for s in v}
    return given == set(ids)


def forget(state_dir: str, job_id: str, user: str | None = None) -> None:
    """Remove the job's records (the Epilog, on every node: whoever comes first)."""
    if not _job_ok(job_id):
        return
    where = directory(state_dir)
    try:
        writers = _writers(user)
        with _as_writer(user):
            for suffix in (".json", ".hold", ".shards.json", ".shards.claim"):
                shared.remove(where, job_id + suffix, writers)
    except (OSError, DsstageError) as exc:  # a record left behind is only clutter: the Epilog goes on
        log.warning("job %s: cannot remove its records in %s: %s", job_id, where, exc)


def recorded(state_dir: str, job_id: str, nodes: Sequence[str], user: str | None = None
             ) -> tuple[dict[str, str], dict[str, Plan] | None]:
    """What job ``job_id`` on ``nodes`` recorded, for a reader that acts on nothing
    (``dsstage status --job``): its datasets' versions and its shard plans (None where it
    recorded none). Read and checked as the job's nodes read them: a record others could
    have written, of another format, or of another job that had the same id (other nodes)
    counts as none."""
    where = directory(state_dir)
    if not _job_ok(job_id):
        return {}, None
    writers = _writers(user)

    def one(name: str) -> dict[str, Any]:
        try:
            with _as_writer(user):
                record = _parse(shared.read(where, name, writers))
        except (OSError, DsstageError):
            return {}
        if not record or record.get("job") != job_id or formats.problem("job-record", record, name):
            return {}
        return record
    pins = one(f"{job_id}.json")
    found = pins.get("versions") if pins.get("nodes") is None or _same_nodes(pins.get("nodes"), nodes) else None
    versions: dict[str, Any] = found if isinstance(found, dict) else {}
    record = one(f"{job_id}.shards.json")
    plans = record.get("shards") if record.get("nodes") == sorted(nodes) else None
    return ({str(k): str(v) for k, v in versions.items()},
            {str(name): {str(n): [str(x) for x in ids] for n, ids in plan.items() if isinstance(ids, list)}
             for name, plan in plans.items() if isinstance(plan, dict)} if isinstance(plans, dict) else None)


def _same_nodes(hostlist: object, nodes: Sequence[str]) -> bool:
    """Whether a record's node list (a hostlist) is the job's ``nodes``."""
    if not isinstance(hostlist, str):
        return False
    from dsstage.hostlist import expand_nodes
    try:
        return sorted(expand_nodes(hostlist)) == sorted(nodes)
    except ValueError:
        return False


def _parse(raw: bytes | None) -> dict | None:
    if raw is None or len(raw) > shared.MAX:
        return None
    try:
        record = jsontext.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
