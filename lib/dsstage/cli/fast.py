"""``dsstage stage`` of datasets already ready on this node, without loading the configuration.

A stage of a cached dataset is a lease and a line of output; loading the YAML configuration
and the store's modules costs several times that. ``dsstage.cli.main`` calls ``stage``
first. It answers only the plain form ``[--config FILE] [--node NODE] stage NAMES
[--job-id ID] [--json]``, run by root, for datasets the configuration cache lists as whole
and quick-verified (the cache the Prolog and the full ``dsstage stage`` leave in the run
directory, valid only for the configuration file's exact state: dsstage.fs.runfiles), whose
current version is ready here. It leases them as the warm Prolog does (dsstage.node.warmlease)
and notes the leases in the node report. Anything else (another form or option, a cache
miss, a copy that is not ready, a lost race with an eviction, any error) returns None: the
full command runs, and decides and explains.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from dsstage.fs import layout, runfiles
from dsstage.fs.safe import RootDir
from dsstage.node import report
from dsstage.node.local import default_holder, node_name
from dsstage.node.warmlease import lease, ready_whole, requested_names

GLOBAL = ("--config", "--node")


def parse(argv: Sequence[str]) -> dict[str, Any] | None:
    """The options of the plain form of ``stage``, or None for any other command line."""
    opts: dict[str, Any] = {"config": None, "node": None, "job_id": None, "json": False, "names": None}
    verb = False
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        if (key in GLOBAL and not verb) or (key == "--job-id" and verb):
            if not eq:
                if not args:
                    return None
                value = args.pop(0)
            opts[key[2:].replace("-", "_")] = value
        elif arg == "--json" and verb:
            opts["json"] = True
        elif arg == "stage" and not verb:
            verb = True
        elif verb and opts["names"] is None and not arg.startswith("-"):
            opts["names"] = arg
        else:
            return None
    return opts if verb and opts["names"] else None


def stage(argv: Sequence[str]) -> int | None:
    """0 if every dataset asked for was ready and is now leased (the result printed); None
    for the full command to run."""
    started = time.monotonic()
    opts = parse(argv)
    if opts is None or os.geteuid() != 0:
        return None
    try:
        return _stage(opts, started)
    except Exception:  # noqa: BLE001 - anything unexpected: the full command meets it and explains
        return None


def _stage(opts: dict[str, Any], started: float) -> int | None:
    env = os.environ
    names = requested_names(opts["names"])
    run_dir = env.get("DSSTAGE_RUN_DIR") or runfiles.RUN_DIR
    cache = runfiles.load_cache(run_dir, opts["config"] or env.get("DSSTAGE_CONFIG") or runfiles.CONFIG_PATH)
    if not names or cache is None:
        return None
    node = opts["node"] or node_name()
    job_id, pid = opts["job_id"] or env.get("SLURM_JOB_ID"), 0
    if not job_id:
        job_id, pid = default_holder()
    if not layout.job_id_ok(job_id) or not layout.name_ok(node):
        return None
    import pwd
    user = pwd.getpwuid(os.geteuid()).pw_name
    state_dir, catalog = cache["state_dir"], cache["datasets"]
    tiers: dict[str, RootDir] = {}
    try:
        picked = []
        for name in names:
            ds = catalog.get(name)
            if not ds or ds.get("verify") != "quick" or ds.get("shards") or not ds.get("tier"):
                return None
            digest = layout.read_current(state_dir, name)
            root = ds["root"].replace("{node}", node)
            if digest is None:
                return None
            if root not in tiers:
                tiers[root] = RootDir(root, create=False)
            pick = ready_whole(name, digest, tiers[root])
            if pick is None:
                return None
            picked.append(pick)
        if not lease(picked, job_id, user, node, pid):
            return None
    finally:
        for tier in tiers.values():
            tier.close()
    try:
        report.note_leases(run_dir, node, job_id, user, [(p.name, layout.version_id(p.digest)) for p in picked],
                           (state_dir, cache.get("report_user")))
    except Exception:  # noqa: BLE001 - the report is informative; the next rebuild has the lease
        pass
    seconds = time.monotonic() - started
    results = [{"dataset": p.name, "digest": p.digest, "path": p.path, "tier": catalog[p.name]["tier"], "node": node,
                "action": "cached", "job_id": job_id, "transferred_files": 0, "transferred_bytes": 0,
                "linked_files": 0, "peer_files": 0, "peer_bytes": 0, "seconds": seconds} for p in picked]
    if opts["json"]:  # as dsstage.cli.common.emit writes it
        pretty = sys.stdout.isatty()
        data = results if len(results) > 1 else results[0]
        sys.stdout.write(json.dumps(data, sort_keys=True, indent=2 if pretty else None,
                                    separators=None if pretty else (",", ":")) + "\n")
    else:
        for r in results:
            print(f"{r['dataset']}: {r['path']}  (already here, {seconds:.2f}s, lease {job_id})")
    return 0
