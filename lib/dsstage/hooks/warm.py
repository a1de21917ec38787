"""The warm path of the Prolog: a job whose datasets are all ready on the node.

A Prolog for datasets that are already cached must cost little: this module imports the
standard library, ``dsstage.fs``, the light node modules and the job records, never the
configuration's loader, yaml or the staging code (their import costs more than the whole
warm path); a job on several nodes adds ClusterShell, to read its hostlist.
The Prolog (dsstage.hooks.__main__) tries this first: it handles a job whose datasets are all ready,
quick-verified and allowed for the user (for a sharded dataset: this node's part of the
job's plan, and its view), using the configuration cache the full Prolog
leaves in the run directory; anything else (a cache miss, a copy that is not ready, a
restricted dataset the user may not use, any error) falls through to the full Prolog in
``dsstage.hooks.job``, which decides and explains. The store protocol both follow is in
``dsstage.ready`` (the ready-copy core the full stage uses too), so the paths cannot drift apart.
"""

from __future__ import annotations

import os

from dsstage.errors import DsstageError
from dsstage.fs import layout, runfiles
from dsstage.fs.groups import group_names
from dsstage.fs.safe import RootDir
from dsstage.hooks import bbrequest, bounded, joblog
from dsstage.node import metrics, report, rollout
from dsstage.ready import warmconf
from dsstage.ready.lease import Holder, Pick, lease, ready_whole, release
from dsstage.ready.request import requested_names

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from dsstage.ready.warmconf import WarmConfig, WarmDataset
    from dsstage.shards.indexfile import Shard

# a job on several nodes or a sharded dataset imports what it needs (the job records, the
# hostlist, the shard index, views) when it needs it: a one-node job on a whole dataset,
# the common case, does not pay for their import


def prolog(env: Mapping[str, str], run_dir: str, config_path: str,
           log: Any = None, cache: WarmConfig | None = None) -> int | None:
    """0 if every requested dataset was ready and is now leased; None: use the full Prolog.
    ``cache``: the configuration cache, if the caller read it already."""
    job_id, node, user = env.get("SLURM_JOB_ID", ""), env.get("SLURMD_NODENAME", ""), env.get("SLURM_JOB_USER", "")
    try:
        uid, gid = int(env.get("SLURM_JOB_UID", "")), int(env.get("SLURM_JOB_GID", ""))
    except ValueError:
        return None
    request = next((env[v] for v in runfiles.REQUEST_VARS if env.get(v)), "")
    cache = warmconf.read(run_dir, config_path) if cache is None else cache
    if cache is not None and bbrequest.flagged(env):  # #BB_LUA dataset=, alone or with --dataset
        try:
            recorded = bbrequest.read(cache.state_dir, job_id, cache.bb_uid)
        except (OSError, DsstageError):
            return None  # the full Prolog holds the job and says why
        request = ",".join(r for r in (request, recorded) if r)
    names = requested_names(request)
    if not names or not layout.job_id_ok(job_id) or not node or not user or cache is None:
        return None
    state_dir = cache.state_dir
    if rollout.off_reason(rollout.read_switch(state_dir), cache.rollout_partitions, cache.rollout_nodes,
                          env.get("SLURM_JOB_PARTITION", ""), node):
        return None  # the full Prolog gives the job its sources and says why
    tiers: dict[str, RootDir] = {}
    job = Job(job_id, node, user, uid, gid, env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    try:
        return _lease_all(names, cache, tiers, run_dir, job, log)
    except (OSError, ValueError, DsstageError):
        return None  # the full Prolog decides, and says why
    finally:
        for tier in tiers.values():
            tier.close()


class Job:
    """The job a Prolog runs for, as its environment says."""

    __slots__ = ("job_id", "node", "user", "uid", "gid", "nodes")

    def __init__(self, job_id: str, node: str, user: str, uid: int, gid: int, nodes: str) -> None:
        self.job_id, self.node, self.user, self.uid, self.gid = job_id, node, user, uid, gid
        self.nodes = nodes  # the job's nodes, a Slurm hostlist

    def node_names(self) -> list[str]:
        """The names the job's hostlist stands for (as the full Prolog reads it); this node
        alone for a one-node job."""
        if not self.nodes or ("," not in self.nodes and "[" not in self.nodes):
            return [self.node]
        from dsstage.hostlist import expand_nodes
        return expand_nodes(self.nodes)  # ValueError: the full Prolog says what is wrong


def _lease_all(names: Sequence[str], conf: WarmConfig, tiers: dict[str, RootDir], run_dir: str, job: Job,
               log: Any) -> int | None:
    state_dir, report_user = conf.state_dir, conf.report_user
    groups: set[str] | None = None
    chosen: dict[str, str] = {}
    catalog: dict[str, WarmDataset] = {}
    for name in names:
        ds = conf.dataset(name)
        if ds is None or ds.verify != "quick":
            return None
        catalog[name] = ds
        if ds.groups is not None and job.uid != 0:
            groups = group_names(job.user, job.gid) if groups is None else groups
            if not groups & ds.groups:
                return None
        digest = layout.read_current(state_dir, name)
        if digest is None:
            return None
        chosen[name] = digest
    names_of_job = job.node_names()
    if len(names_of_job) > 1:  # every node of the job uses the same versions (dsstage.node.jobrecord)
        from dsstage.node import jobrecord
        chosen = jobrecord.pin(state_dir, job.job_id, job.nodes, job.node, chosen, report_user)
        if any(not layout.digest_ok(d) for d in chosen.values()):
            return None  # the full Prolog says what is wrong with the record
    nodes = names_of_job if job.node in names_of_job else [job.node]
    parts = _parts(names, catalog, chosen, state_dir, job, nodes, report_user)
    picked: list[Pick] = []
    for name in names:
        ds, digest = catalog[name], chosen[name]
        root = ds.root_on(job.node)
        if root not in tiers:
            tiers[root] = RootDir(root, create=False)
        tier = tiers[root]
        if ds.shards:
            pick = _part(name, digest, tier, run_dir, job, parts[name]) if name in parts else None
            if pick is None:
                return None
            picked.append(pick)
        elif (whole := ready_whole(name, digest, tier)) is not None:
            picked.append(whole)
        else:
            return None
    if not lease(picked, Holder(job.job_id, job.user, job.node)):
        return None  # lost a race with an eviction (see dsstage.node.store): take the full path
    try:
        lines = runfiles.export_lines([(p.name, p.path) for p in picked])
        for p in picked:
            lines += runfiles.more_exports(p.name, p.exports, first=p is picked[0]) if p.exports else []
        runfiles.write_task_file(run_dir, job.node, job.job_id, lines, (job.uid, job.gid))
    except BaseException:
        release(picked, job.job_id)  # the full Prolog takes its own leases
        raise
    bounded.tell("decided run")  # what follows writes to the shared state directory, which may hang
    try:
        leased = [(p.name, s.id) for p in picked for s in p.shards] + \
            [(p.name, layout.version_id(p.digest)) for p in picked if not p.shards]
        report.note_leases(run_dir, job.node, job.job_id, job.user, leased, (state_dir, report_user))
    except (OSError, DsstageError, ValueError):
        pass  # the report is informative; the next rebuild has the lease
    metrics.count(run_dir, job.node, [("hits", {"dataset": p.name}, 1) for p in picked])
    if log:
        for p in picked:
            part = f" (shards {','.join(str(s.index) for s in p.shards)})" if p.shards else ""
            log(f"job {job.job_id}: {p.name} cached at {p.path}{part} (warm path)")
    return 0


class Part:
    """A sharded dataset's shards (of the version the job uses) and the job's plan for it."""

    __slots__ = ("shards", "plan")

    def __init__(self, shards: tuple[Shard, ...], plan: dict[str, list[str]]) -> None:
        self.shards, self.plan = shards, plan


def _parts(names: Sequence[str], catalog: Mapping[str, WarmDataset], versions: Mapping[str, str], state_dir: str,
           job: Job, nodes: Sequence[str], report_user: str | None) -> dict[str, Part]:
    """The shards and the job's plan of each of its sharded datasets, planned together in one
    record (dsstage.node.jobrecord.plan_for), as the full Prolog plans them."""
    sharded = [n for n in names if catalog[n].shards]
    if not sharded:
        return {}
    from dsstage.node import jobrecord
    from dsstage.shards import indexfile
    shards = {n: indexfile.read(os.path.join(state_dir, "manifests", n), n, versions[n], int(catalog[n].shards or 0))
              for n in sharded}
    ids = {n: [s.id for s in v] for n, v in shards.items()}
    plans = jobrecord.plan_for(state_dir, job.job_id, nodes, job.node, ids, report_user)
    return {n: Part(shards[n], plans[n]) for n in sharded}


def _part(name: str, version: str, tier: RootDir, run_dir: str, job: Job, part: Part) -> Pick | None:
    """This node's part of sharded dataset ``name`` if every shard the job's plan gives it is
    ready here and their view was made (dsstage.shards.views); else None. Writes the job's map."""
    from dsstage.shards import told, views
    shards, plan = part.shards, part.plan
    by_id = {s.id: s for s in shards}
    mine = sorted((by_id[s] for s in dict.fromkeys(plan.get(job.node) or ()) if s in by_id), key=lambda s: s.index)
    if not mine or any(layout.not_ready(tier, name, s.digest) is not None for s in mine):
        return None
    view = views.find(tier, name, [s.id for s in mine])
    if view is None:
        return None
    map_path = told.write_map(run_dir, job.node, job.job_id, (job.uid, job.gid), name, version, shards, plan)
    pick = Pick(name, version, tier, view.path, tuple(mine))
    pick.exports = told.exports(mine, len(shards), shards, plan, view.files_list, view.files, map_path)
    pick.view = lambda: views.find(tier, name, [s.id for s in mine]) is not None
    return pick


def main(argv: Sequence[str], cache: WarmConfig | None = None) -> int | None:
    """The warm Prolog for ``["prolog"]``: its exit code, or None for the full Prolog to decide
    (dsstage.hooks.__main__ then runs it). ``cache``: the configuration cache, if read already."""
    env = os.environ
    if list(argv) != ["prolog"]:
        return None
    run_dir = env.get("DSSTAGE_RUN_DIR", runfiles.RUN_DIR)
    config_path = env.get("DSSTAGE_CONFIG") or runfiles.CONFIG_PATH
    job_id = env.get("SLURM_JOB_ID", "")

    def log(text: str) -> None:
        joblog.write(text, job_id=job_id, env=env)
    try:
        return prolog(env, run_dir, config_path, log, cache)
    except Exception:  # noqa: BLE001 - anything unexpected: the full Prolog decides and logs
        return None
