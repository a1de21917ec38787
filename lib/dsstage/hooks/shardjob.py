"""The Prolog's work for a sharded dataset: this node's part of the job's plan, staged, and
what the job is told about it.

The job's plan (which node holds which shards) is decided once for the job
(dsstage.node.jobrecord.plan_for); this node stages its shards and their view
(dsstage.node.sharded). The job gets, beside ``DSSTAGE_PATH_<NAME>`` (the view: exactly this
node's files), ``DSSTAGE_FILES_<NAME>`` (the list of them), ``DSSTAGE_SHARDS_<NAME>`` (this
node's shard numbers), ``DSSTAGE_SHARD_COUNT_<NAME>``, ``DSSTAGE_NODE_FILES_<NAME>`` and
``DSSTAGE_MIN_FILES_<NAME>`` (this node's file count and the least of any node of the job:
data-parallel ranks need the same number of steps), and ``DSSTAGE_SHARD_MAP_<NAME>``: a
file, readable by the job only, with the whole job's map. The unsuffixed forms name the
job's first dataset, as ``DSSTAGE_DATASET_DIR`` does.

A job's nodes end alike: where a node falls back to a mounted source (its stage failed, or
dsstage does not act there: the rollout, ``dsstage disable``), it gets the same variables
for its part of the same plan, its files listed at the source (``fallback``); where its
part cannot be told, the job is held rather than run with ranks that read different data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from dsstage.config import catalog as cat
from dsstage.config.model import Dataset
from dsstage.errors import DsstageError, StateError
from dsstage.fs import layout, pathtext, runfiles
from dsstage.hooks.decisions import Verdict
from dsstage.hostlist import expand_nodes
from dsstage.node import jobrecord, sharded
from dsstage.node.store import Store
from dsstage.shards import assign, told
from dsstage.shards import index as shard_index

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What of the job this needs: its id, this node, all its nodes (a Slurm hostlist), its user
    and group (who may read what the Prolog leaves for it)."""

    job_id: str
    node: str
    nodes: str
    uid: int
    gid: int


def job_plans(ctx: Job, store: Store, names: Sequence[str], versions: Mapping[str, str]
              ) -> tuple[dict[str, shard_index.Index], dict[str, jobrecord.Plan]]:
    """The shards of each of the job's sharded datasets ``names`` (of the versions its nodes
    agreed on, else the current ones) and the job's plan for all of them, recorded in one
    record (dsstage.node.jobrecord.plan_for) whichever of them a node stages first. A
    dataset whose shards cannot be read is left out: its own stage meets the error."""
    indexes = {}
    for other in names:
        try:
            indexes[other] = sharded.shards_of(store, other, versions.get(other) or store.current(other))
        except DsstageError:
            continue
    nodes = expand_nodes(ctx.nodes) if ctx.nodes else [ctx.node]
    nodes = nodes if ctx.node in nodes else [ctx.node]
    conf = store.config
    plans = jobrecord.plan_for(conf.state_dir, ctx.job_id, nodes, ctx.node,
                               {n: [s.id for s in ix.shards] for n, ix in indexes.items()}, conf.report.user)
    return indexes, plans


def stage(ctx: Job, store: Store, name: str, versions: Mapping[str, str], user: cat.User,
          deadline: float | None, sharded_names: Sequence[str] = ()) -> Verdict:
    """This node's part of sharded dataset ``name`` (of the version the job's nodes agreed
    on, else the current one) staged and leased to the job; its Verdict with the job's
    exports. ``sharded_names``: all the job's sharded datasets, planned together. Raises as
    a stage does."""
    indexes, plans = job_plans(ctx, store, list(dict.fromkeys([name, *sharded_names])), versions)
    if name not in indexes:
        sharded.shards_of(store, name, versions.get(name) or store.current(name))  # raises what went wrong
    index, plan = indexes[name], plans[name]
    version = index.version
    mine = plan.get(ctx.node)
    if not mine:
        raise StateError(f"job {ctx.job_id}'s shard plan gives node {ctx.node} no shard of {name!r}: requeue the job")
    from dsstage.node.staging import StageRequest
    part = sharded.stage_part(store, name, version, mine,
                              StageRequest(user=user, job_id=ctx.job_id, deadline=deadline, nodes=ctx.nodes),
                              replicas=assign.replicas(plan, mine))
    map_path = told.write_map(store.run_dir, ctx.node, ctx.job_id, (ctx.uid, ctx.gid), name, version, index.shards,
                              plan)
    log.info("job %s: %s shards %s of %d %s on %s (view %s, %d files; %d files from the source)", ctx.job_id, name,
             ",".join(str(s.index) for s in part.shards), index.count, part.action, ctx.node, part.view.path,
             part.view.files, part.transferred_files)
    exports = told.exports(part.shards, index.count, index.shards, plan, part.view.files_list, part.view.files,
                           map_path)
    label = {"dataset": name}
    store.count([("misses", label, 1), ("staged_bytes", label, part.transferred_bytes),
                 ("staged_seconds", label, part.seconds)] if part.action == "staged" else [("hits", label, 1)])
    return Verdict(name, "local", part.view.path, part.action, exports)


def from_source(ctx: Job, store: Store, name: str, versions: Mapping[str, str], sharded_names: Sequence[str],
                source: str) -> tuple[tuple[str, str], ...]:
    """The exports of this node's part of sharded dataset ``name`` read at its mounted
    ``source``: the variables a staged part gets, from the job's one plan, with this node's
    files listed at the source. Raises DsstageError where the plan or the shards cannot be had."""
    indexes, plans = job_plans(ctx, store, list(dict.fromkeys([name, *sharded_names])), versions)
    if name not in indexes:
        sharded.shards_of(store, name, versions.get(name) or store.current(name))  # raises what went wrong
    index, plan = indexes[name], plans[name]
    by_id = index.by_id()
    mine = sorted((by_id[s] for s in plan.get(ctx.node) or () if s in by_id), key=lambda s: s.index)
    if not mine:
        raise StateError(f"job {ctx.job_id}'s shard plan gives node {ctx.node} no shard of {name!r}")
    lines = [pathtext.escape(os.path.join(source, e.path)) + "\n"
             for s in mine for e in store.load_manifest(name, s.digest).entries]
    files_list = runfiles.write_job_file(store.run_dir, ctx.node, ctx.job_id, f"files-{name}", "".join(lines),
                                         (ctx.uid, ctx.gid))
    map_path = told.write_map(store.run_dir, ctx.node, ctx.job_id, (ctx.uid, ctx.gid), name, index.version,
                              index.shards, plan)
    return told.exports(mine, index.count, index.shards, plan, files_list, len(lines), map_path)


def fallback(ctx: Job, store: Store, verdict: Verdict, versions: Mapping[str, str], sharded_names: Sequence[str],
             *, may_hold: bool = True) -> Verdict:
    """A sharded dataset's fallback ``verdict`` (its source mounted at ``verdict.path``) with
    this node's part of the job's plan (``from_source``): every node of the job reads its own
    part, staged here or not, and every rank takes the same number of steps. Where the part
    cannot be told the job is held (``may_hold``; else, where dsstage does not act and never
    holds, the fallback stays without its part, said in the job's output)."""
    if verdict.action != "fallback" or not verdict.path:
        return verdict
    try:
        exports = from_source(ctx, store, verdict.dataset, versions, sharded_names, verdict.path)
    except (DsstageError, OSError) as exc:
        log.warning("job %s: %s: this node's part cannot be told: %s", ctx.job_id, verdict.dataset, exc)
        if may_hold:
            return Verdict(verdict.dataset, "hold", None,
                           f"{verdict.reason}; and this node's part of it cannot be told ({exc}): held, so that "
                           "no rank reads another node's part or the whole dataset")
        return replace(verdict, reason=f"{verdict.reason} (this node's part cannot be told: {exc}; "
                                       "DSSTAGE_FILES is not set)")
    listed = "DSSTAGE_FILES_" + layout.env_var(verdict.dataset)[len("DSSTAGE_PATH_"):]
    return replace(verdict, exports=exports,
                   reason=f"{verdict.reason} (this node's part of the job's plan: {listed} lists its files there)")


def failure_note(ds: Dataset) -> str:
    """What a sharded dataset's on_failure means for a multi-node job (dsstage.hooks.shardjob.fallback)."""
    if ds.on_failure == "fallback" and ds.source.kind == "local":
        return ("a node whose part fails to stage reads that part at the source (the same variables, its files "
                "listed there) and the job runs; choose hold if the source cannot take a node's part read during "
                "training")
    if ds.on_failure == "fallback":
        return (f"fallback cannot read {ds.source.raw} directly (not mounted): a job whose part fails to stage is "
                "held, as with on_failure: hold")
    return "a job any of whose nodes cannot stage its part is held until its data can be staged"
