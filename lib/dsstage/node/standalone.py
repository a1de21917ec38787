"""A stage that no job's Prolog asks for: ``dsstage stage``, ``dsstage warm`` and a prefetch
for a pending job. A dataset is staged whole; of a sharded dataset, this node stages the
part that a job on the given nodes would get (dsstage.node.jobrecord.plan, from what the nodes
hold now), and its view, so that the job's own plan finds it there when it starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from dsstage.config import catalog as cat
from dsstage.errors import StateError
from dsstage.hostlist import expand_nodes
from dsstage.node import jobrecord, sharded, staging
from dsstage.node.local import default_holder
from dsstage.node.staging import StageRequest
from dsstage.node.store import StageResult, Store
from dsstage.shards import assign


def stage(store: Store, name: str, job: StageRequest, *,
          progress: Callable[[str, int, int], None] | None = None) -> StageResult:
    """``name`` ready on this node and leased to ``job.job_id``: the current version, or of a
    sharded dataset this node's part for a job on ``job.nodes`` (a Slurm hostlist; this node
    alone when empty: every shard). Raises as a stage does."""
    ds = store.dataset(name)
    if not ds.shards:
        return staging.stage(store, name, job, progress=progress)
    version, planned, plan, mine = part_for(store, name, job.nodes)
    part = sharded.stage_part(store, name, version, mine, replace(job, nodes=job.nodes if len(planned) > 1 else ""),
                              progress=progress, replicas=assign.replicas(plan, mine))
    return StageResult(dataset=name, digest=version, path=part.view.path, tier=ds.tier, node=store.node,
                       action=part.action, job_id=job.job_id, transferred_files=part.transferred_files,
                       transferred_bytes=part.transferred_bytes, seconds=part.seconds)


def part_for(store: Store, name: str, nodes: str) -> tuple[str, list[str], dict[str, list[str]], list[str]]:
    """Sharded dataset ``name`` for a job on ``nodes`` (a hostlist; this node alone if empty):
    the current version, the job's nodes, the plan its first node would make now, and this
    node's shard ids in it."""
    version = store.current(name)
    index = sharded.shards_of(store, name, version)
    planned = expand_nodes(nodes) if nodes else [store.node]
    planned = planned if store.node in planned else [store.node]
    plan = jobrecord.plan(store.config.state_dir, name, [s.id for s in index.shards], planned)
    mine = plan.get(store.node)
    if not mine:  # assign gives every node of a job at least one shard
        raise StateError(f"no shard of {name!r} for node {store.node} among {', '.join(planned)}")
    return version, planned, plan, mine


def part_ready(store: Store, name: str, nodes: str) -> bool:
    """Whether ``name`` is a sharded dataset and this node's part of it for a job on
    ``nodes`` is ready here, its view included (a prefetch then has nothing to do); False
    for any other dataset, and where that cannot be read (a stage meets the error)."""
    from dsstage.errors import DsstageError
    from dsstage.fs.layout import version_id
    from dsstage.node.store import open_tier
    from dsstage.shards import views
    ds = store.config.datasets.get(name)
    if ds is None or not ds.shards:
        return False
    try:
        version, _planned, _plan, mine = part_for(store, name, nodes)
        digests = {version_id(d): d for d in store.shard_digests(name, version)}
        with open_tier(store.layout(ds.tier), create=False) as tier:
            return all(store.ready_state(tier, name, digests[s]).ready for s in mine) and \
                views.find(tier, name, mine) is not None
    except (DsstageError, OSError):
        return False


def warm(store: Store, name: str, *, user: cat.User, progress: Callable[[str, int, int], None] | None = None,
         deadline: float | None = None, nodes: str = "") -> StageResult:
    """Make ``name`` ready on this node without keeping a lease (``dsstage warm``, ahead
    of a reservation or a campaign): the copy then stays as retention decides, its last
    use being now. ``nodes``: of a sharded dataset, this node's part for a job on them."""
    holder, pid = default_holder()
    result = stage(store, name, StageRequest(user=user, job_id=holder, pid=pid, deadline=deadline, nodes=nodes),
                   progress=progress)
    store.release(name, holder)
    result.job_id = ""
    return result
