"""The Prolog's work for a sharded dataset: this node's part of the job's plan, staged, and
what the job is told about it.

The job's plan (which node holds which shards) is decided once for the job
(dsstage.hooks.jobrecord.plan_for); this node stages its shards and their view
(dsstage.node.sharded). The job gets, beside ``DSSTAGE_PATH_<NAME>`` (the view: exactly this
node's files), ``DSSTAGE_FILES_<NAME>`` (the list of them), ``DSSTAGE_SHARDS_<NAME>`` (this
node's shard numbers), ``DSSTAGE_SHARD_COUNT_<NAME>``, ``DSSTAGE_NODE_FILES_<NAME>`` and
``DSSTAGE_MIN_FILES_<NAME>`` (this node's file count and the least of any node of the job:
data-parallel ranks need the same number of steps), and ``DSSTAGE_SHARD_MAP_<NAME>``: a
file, readable by the job only, with the whole job's map. The unsuffixed forms name the
job's first dataset, as ``DSSTAGE_DATASET_DIR`` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dsstage.config import catalog as cat
from dsstage.errors import StateError
from dsstage.hooks import jobrecord, shardmap
from dsstage.hooks.decisions import Verdict
from dsstage.hostlist import expand_nodes
from dsstage.node import sharded, shardplan
from dsstage.node.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What of the job this needs: its id, this node, all its nodes (a Slurm hostlist), its group."""

    job_id: str
    node: str
    nodes: str
    gid: int


def stage(ctx: Job, store: Store, name: str, version: str | None, user: cat.User,
          deadline: float | None) -> Verdict:
    """This node's part of sharded dataset ``name`` (of ``version``, the one the job's nodes
    agreed on, else the current one) staged and leased to the job; its Verdict with the
    job's exports. Raises as a stage does."""
    conf = store.config
    version = version or store.current(name)
    index = sharded.shards_of(store, name, version)
    nodes = expand_nodes(ctx.nodes) if ctx.nodes else [ctx.node]
    nodes = nodes if ctx.node in nodes else [ctx.node]
    plan = jobrecord.plan_for(conf.state_dir, ctx.job_id, nodes, ctx.node, {name: [s.id for s in index.shards]},
                              conf.report.user)[name]
    mine = plan.get(ctx.node)
    if not mine:
        raise StateError(f"job {ctx.job_id}'s shard plan gives node {ctx.node} no shard of {name!r}: requeue the job")
    part = sharded.stage_part(store, name, version, mine, user=user, job_id=ctx.job_id, deadline=deadline,
                              nodes=ctx.nodes, replicas=shardplan.replicas(plan, mine))
    map_path = shardmap.write_map(store.run_dir, ctx.node, ctx.job_id, ctx.gid, name, version, index.shards, plan)
    log.info("job %s: %s shards %s of %d %s on %s (view %s, %d files; %d files from the source)", ctx.job_id, name,
             ",".join(str(s.index) for s in part.shards), index.count, part.action, ctx.node, part.view.path,
             part.view.files, part.transferred_files)
    exports = shardmap.exports(part.shards, index.count, index.shards, plan, part.view.files_list, part.view.files,
                               map_path)
    label = {"dataset": name}
    store.count([("misses", label, 1), ("staged_bytes", label, part.transferred_bytes),
                 ("staged_seconds", label, part.seconds)] if part.action == "staged" else [("hits", label, 1)])
    return Verdict(name, "local", part.view.path, part.action, exports)
