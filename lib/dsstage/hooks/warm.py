"""The warm path of the Prolog: a job whose datasets are all ready on the node.

A Prolog for datasets that are already cached must cost little: this module and
``dsstage.fs`` import only the standard library's lightest modules (Python's import of
logging, dataclasses, yaml and the staging code costs more than the whole warm path).
``python -I -m dsstage.hooks prolog`` tries this first: it handles a job whose datasets are all ready,
quick-verified and allowed for the user, using the configuration cache the full Prolog
leaves in the run directory; anything else (a cache miss, a copy that is not ready, a
restricted dataset the user may not use, any error) falls through to the full Prolog in
``dsstage.hooks.job``, which decides and explains. The store protocol both follow is in
``dsstage.fs``, so the two paths cannot drift apart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dsstage.errors import DsstageError
from dsstage.fs import layout, runfiles, safe
from dsstage.fs.groups import group_names
from dsstage.fs.layout import Layout
from dsstage.fs.safe import RootDir
from dsstage.hooks import bbrequest, bounded, joblog
from dsstage.node import metrics, report, rollout


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


def prolog(env: Mapping[str, str], run_dir: str, config_path: str,
           log: Any = None, cache: Mapping[str, Any] | None = None) -> int | None:
    """0 if every requested dataset was ready and is now leased; None: use the full Prolog.
    ``cache``: the configuration cache, if the caller read it already."""
    job_id, node, user = env.get("SLURM_JOB_ID", ""), env.get("SLURMD_NODENAME", ""), env.get("SLURM_JOB_USER", "")
    try:
        uid, gid = int(env.get("SLURM_JOB_UID", "")), int(env.get("SLURM_JOB_GID", ""))
    except ValueError:
        return None
    request = next((env[v] for v in runfiles.REQUEST_VARS if env.get(v)), "")
    cache = runfiles.load_cache(run_dir, config_path) if cache is None else cache
    if cache is not None and bbrequest.flagged(env):  # #BB_LUA dataset=, alone or with --dataset
        try:
            recorded = bbrequest.read(cache["state_dir"], job_id, cache.get("bb_uid"))
        except (OSError, DsstageError):
            return None  # the full Prolog holds the job and says why
        request = ",".join(r for r in (request, recorded) if r)
    names = requested_names(request)
    if not names or not layout.job_id_ok(job_id) or not node or not user or cache is None:
        return None
    state_dir, catalog = cache["state_dir"], cache["datasets"]
    if rollout.off_reason(rollout.read_switch(state_dir), cache.get("rollout_partitions"), cache.get("rollout_nodes"),
                          env.get("SLURM_JOB_PARTITION", ""), node):
        return None  # the full Prolog gives the job its sources and says why
    tiers: dict[str, RootDir] = {}
    try:
        return _lease_all(names, catalog, tiers, state_dir, run_dir, job_id, node, user, uid, gid, log,
                          cache.get("report_user"))
    except (OSError, DsstageError):
        return None  # the full Prolog decides, and says why
    finally:
        for tier in tiers.values():
            tier.close()


def _lease_all(names: Sequence[str], catalog: Mapping[str, Any], tiers: dict[str, RootDir], state_dir: str,
               run_dir: str, job_id: str, node: str, user: str, uid: int, gid: int, log: Any,
               report_user: str | None = None) -> int | None:
    picked: list[tuple[str, str, RootDir]] = []
    groups: set[str] | None = None
    for name in names:
        ds = catalog.get(name)
        if not ds or ds.get("verify") != "quick" or ds.get("shards"):
            return None  # a sharded dataset's part and view: the full Prolog (dsstage.hooks.shardjob)
        if ds.get("groups") is not None and uid != 0:
            groups = group_names(user, gid) if groups is None else groups
            if not groups & set(ds["groups"]):
                return None
        try:
            digest = layout.read_current(state_dir, name)
        except ValueError:
            return None
        root = ds["root"].replace("{node}", node)
        if root not in tiers:
            tiers[root] = RootDir(root, create=False)
        tier = tiers[root]
        if digest is None or layout.not_ready(tier, name, digest) is not None:
            return None
        picked.append((name, digest, tier))
    host = os.uname().nodename
    for name, digest, tier in picked:
        safe.write_json_at(tier.dir("leases", name), f"{job_id}.json",
                             layout.lease_record(name, digest, job_id, user, node, taken=time.time(), host=host),
                             fsync=False)
    if any(layout.not_ready(tier, name, digest) is not None for name, digest, tier in picked):
        # lost a race with an eviction (see dsstage.node.store): give the leases back, take the full path
        for name, _digest, tier in picked:
            safe.unlink_at(tier.has_dir("leases", name), f"{job_id}.json")
        return None
    paths = [(name, Layout(tier.root).version_dir(name, digest)) for name, digest, tier in picked]
    runfiles.write_task_file(run_dir, node, job_id, runfiles.export_lines(paths), gid)
    bounded.tell("decided run")  # what follows writes to the shared state directory, which may hang
    try:
        leased = [(name, layout.version_id(digest)) for name, digest, _ in picked]
        report.note_leases(run_dir, node, job_id, user, leased, (state_dir, report_user))
    except (OSError, DsstageError, ValueError):
        pass  # the report is informative; the next rebuild has the lease
    metrics.count(run_dir, node, [("hits", {"dataset": name}, 1) for name, _d, _t in picked])
    if log:
        for name, path in paths:
            log(f"job {job_id}: {name} cached at {path} (warm path)")
    return 0


def main(argv: Sequence[str], cache: Mapping[str, Any] | None = None) -> int | None:
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
