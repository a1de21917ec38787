"""``dsstage stage`` and ``dsstage verify`` of a ready copy, without loading the configuration.

A stage of a cached dataset is a lease and a line of output, its quick verification a look
at the ready mark; loading the YAML configuration and the store's modules costs several
times that. ``dsstage.cli.main`` calls ``answer`` first. It answers only the plain forms
``[--config FILE] [--node NODE] stage NAMES [--job-id ID] [--json]`` and ``[--config FILE]
[--node NODE] verify NAME [--json]``, run by root, for datasets the configuration cache
lists as whole and quick-verified (the cache the Prolog and the full ``dsstage stage`` leave
in the run directory, valid only for the configuration file's exact state:
dsstage.fs.runfiles), whose current version is ready here. A stage leases them as the warm
Prolog does (dsstage.node.warmlease) and notes the leases in the node report. Anything else
(another form or option, a cache miss, a copy that is not ready, a lost race with an
eviction, any error) returns None: the full command runs, and decides and explains.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from dsstage.cli.output import write_json
from dsstage.fs import layout, runfiles
from dsstage.fs.safe import RootDir
from dsstage.node import report
from dsstage.node.local import default_holder, node_name
from dsstage.node.warmlease import Pick, lease, ready_whole, requested_names

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from typing import Any

GLOBAL = ("--config", "--node")
#: each verb's options with a value, and its flags
VERBS = {"stage": (("--job-id",), ("--json",)), "verify": ((), ("--json",))}


def parse(argv: Sequence[str]) -> dict[str, Any] | None:
    """The options of the plain form of a verb the fast path answers (``verb`` among them),
    or None for any other command line."""
    opts: dict[str, Any] = {"verb": None, "config": None, "node": None, "job_id": None, "json": False,
                            "names": None}
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        valued, flags = VERBS[opts["verb"]] if opts["verb"] else (GLOBAL, ())
        if key in valued:
            if not eq:
                if not args:
                    return None
                value = args.pop(0)
            opts[key[2:].replace("-", "_")] = value
        elif arg in flags:
            opts[arg[2:]] = True
        elif opts["verb"] is None and arg in VERBS:
            opts["verb"] = arg
        elif opts["verb"] and opts["names"] is None and not arg.startswith("-"):
            opts["names"] = arg
        else:
            return None
    return opts if opts["verb"] and opts["names"] else None


def answer(argv: Sequence[str]) -> int | None:
    """The exit code of a stage or quick verify of ready copies, its result printed; None for
    the full command to run."""
    started = time.monotonic()
    opts = parse(argv)
    if opts is None or os.geteuid() != 0:
        return None
    try:
        results = _stage(opts, started) if opts["verb"] == "stage" else _verify(opts)
    except Exception:  # noqa: BLE001 - anything unexpected: the full command meets it and explains
        return None
    if results is None:
        return None
    if opts["json"]:
        write_json(results if len(results) > 1 else results[0])
    elif opts["verb"] == "verify":
        print(f"{results[0]['dataset']}: OK (quick): {results[0]['reason']}")
    else:
        for r in results:
            print(f"{r['dataset']}: {r['path']}  (already here, {r['seconds']:.2f}s, lease {r['job_id']})")
    return 0


def _cache(opts: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The run directory, and the configuration cache if it matches the configuration file."""
    run_dir = runfiles.default_run_dir()
    config = opts["config"] or os.environ.get("DSSTAGE_CONFIG") or runfiles.CONFIG_PATH
    return run_dir, runfiles.load_cache(run_dir, config)


def _ready(catalog: dict[str, Any], state_dir: str, name: str, node: str, tiers: dict[str, RootDir]) -> Pick | None:
    """The current version of whole, quick-verified dataset ``name`` if it is ready here."""
    ds = catalog.get(name)
    if not ds or ds.get("verify") != "quick" or ds.get("shards") or not ds.get("tier"):
        return None
    digest = layout.read_current(state_dir, name)
    if digest is None:
        return None
    root = ds["root"].replace("{node}", node)
    if root not in tiers:
        tiers[root] = RootDir(root, create=False)
    return ready_whole(name, digest, tiers[root])


def _verify(opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    name = opts["names"]
    _run_dir, cache = _cache(opts)
    if cache is None or not layout.name_ok(name):
        return None
    tiers: dict[str, RootDir] = {}
    try:
        pick = _ready(cache["datasets"], cache["state_dir"], name, opts["node"] or node_name(), tiers)
    finally:
        for tier in tiers.values():
            tier.close()
    if pick is None:
        return None
    return [{"dataset": name, "digest": pick.digest, "path": pick.path, "mode": "quick", "ok": True,
             "reason": layout.READY, "checked_files": 0, "repaired": [], "removed_extras": 0}]


def _stage(opts: dict[str, Any], started: float) -> list[dict[str, Any]] | None:
    names = requested_names(opts["names"])
    run_dir, cache = _cache(opts)
    if not names or cache is None:
        return None
    node = opts["node"] or node_name()
    job_id, pid = opts["job_id"] or os.environ.get("SLURM_JOB_ID"), 0
    if not job_id:
        job_id, pid = default_holder()
    if not layout.job_id_ok(job_id) or not layout.name_ok(node):
        return None
    import pwd
    user = pwd.getpwuid(os.geteuid()).pw_name
    state_dir, catalog = cache["state_dir"], cache["datasets"]
    tiers: dict[str, RootDir] = {}
    try:
        picked = [_ready(catalog, state_dir, name, node, tiers) for name in names]
        ready = [p for p in picked if p is not None]
        if len(ready) < len(names) or not lease(ready, job_id, user, node, pid):
            return None
    finally:
        for tier in tiers.values():
            tier.close()
    try:
        report.note_leases(run_dir, node, job_id, user, [(p.name, layout.version_id(p.digest)) for p in ready],
                           (state_dir, cache.get("report_user")))
    except Exception:  # noqa: BLE001 - the report is informative; the next rebuild has the lease
        pass
    seconds = time.monotonic() - started
    return [{"dataset": p.name, "digest": p.digest, "path": p.path, "tier": catalog[p.name]["tier"], "node": node,
             "action": "cached", "job_id": job_id, "transferred_files": 0, "transferred_bytes": 0,
             "linked_files": 0, "peer_files": 0, "peer_bytes": 0, "seconds": seconds} for p in ready]
