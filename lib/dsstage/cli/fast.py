"""``dsstage stage`` and ``dsstage verify`` of a ready copy, without loading the configuration.

A stage of a cached dataset is a lease and a line of output, its quick verification a look
at the ready mark; loading the YAML configuration and the store's modules costs several
times that. ``dsstage.cli.main`` calls ``answer`` first. It answers only the plain forms
``[--config FILE] [--node NODE] stage NAMES [--job-id ID] [--json]`` and ``[--config FILE]
[--node NODE] verify NAME [--full] [--json]``, run by root, for datasets the configuration
cache lists as whole (and, but for ``verify --full``, quick-verified) (the cache the Prolog
and the full ``dsstage stage`` leave in the run directory, valid only for the configuration
file's exact state: dsstage.ready.warmconf), whose current version is ready here. A stage
leases them as the warm Prolog does (dsstage.ready.lease) and notes the leases in the
node report. ``verify --full`` hashes the copy under the dataset's lock, as the full
command does (dsstage.node.treecheck), and answers only when every file matches and
nothing else is there: what the full command would then do is print the same line. Anything
else (another form or option, a cache miss, a copy that is not ready, a lock another holds,
a lost race with an eviction, a wrong or extra file, any error) returns None: the full
command runs, and decides, repairs and explains.
"""

from __future__ import annotations

import os
import time

from dsstage.cli.output import write_json
from dsstage.fs import layout, runfiles
from dsstage.fs.safe import RootDir
from dsstage.node import report
from dsstage.node.local import default_holder, node_name
from dsstage.ready import lock, warmconf
from dsstage.ready.lease import Holder, Pick, lease, ready_whole
from dsstage.ready.request import requested_names

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from dsstage.ready.warmconf import WarmConfig

GLOBAL = ("--config", "--node")
#: each verb's options with a value, and its flags
VERBS = {"stage": (("--job-id",), ("--json",)), "verify": ((), ("--json", "--full"))}


def parse(argv: Sequence[str]) -> dict[str, Any] | None:
    """The options of the plain form of a verb the fast path answers (``verb`` among them),
    or None for any other command line."""
    opts: dict[str, Any] = {"verb": None, "config": None, "node": None, "job_id": None, "json": False,
                            "full": False, "names": None}
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        # the global options are taken after the verb too, as the full command line takes them
        valued, flags = (VERBS[opts["verb"]][0] + GLOBAL, VERBS[opts["verb"]][1]) if opts["verb"] else (GLOBAL, ())
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
        results = _stage(opts, started) if opts["verb"] == "stage" else _verify_full(opts) if opts["full"] \
            else _verify(opts)
    except Exception:  # noqa: BLE001 - anything unexpected: the full command meets it and explains
        return None
    if results is None:
        return None
    if opts["json"]:
        write_json(results if len(results) > 1 else results[0])
    elif opts["verb"] == "verify":
        print(f"{results[0]['dataset']}: OK ({results[0]['mode']}): {results[0]['reason']}")
    else:
        for r in results:
            print(f"{r['dataset']}: {r['path']}  (already here, {r['seconds']:.2f}s, lease {r['job_id']})")
    return 0


def _cache(opts: dict[str, Any]) -> tuple[str, WarmConfig | None]:
    """The run directory, and the warm configuration if it matches the configuration file."""
    run_dir = runfiles.default_run_dir()
    config = opts["config"] or os.environ.get("DSSTAGE_CONFIG") or runfiles.CONFIG_PATH
    return run_dir, warmconf.read(run_dir, config)


def _ready(conf: WarmConfig, name: str, node: str, tiers: dict[str, RootDir], quick_only: bool = True) -> Pick | None:
    """The current version of whole dataset ``name`` if it is ready here (and only if the
    dataset is quick-verified, with ``quick_only``)."""
    ds = conf.dataset(name)
    if ds is None or (quick_only and ds.verify != "quick") or ds.shards or not ds.tier:
        return None
    digest = layout.read_current(conf.state_dir, name)
    if digest is None:
        return None
    root = ds.root_on(node)
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
        pick = _ready(cache, name, opts["node"] or node_name(), tiers)
    finally:
        for tier in tiers.values():
            tier.close()
    if pick is None:
        return None
    return [{"dataset": name, "digest": pick.digest, "path": pick.path, "mode": "quick", "ok": True,
             "reason": layout.READY, "checked_files": 0, "repaired": [], "removed_extras": 0}]


#: what ``verify --full`` says of a copy whose every file matches (dsstage.node.verifying)
FULL_OK = "every file matches the manifest"


def _verify_full(opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``verify NAME --full`` of a ready copy that matches its manifest and holds nothing
    else, or None. The copy is checked under the dataset's lock, taken as the full command
    takes it (an flock of ``locks/NAME.lock``, its owner recorded beside it) but without
    waiting: a lock another holds is the full command's to wait for. A copy with a wrong or
    extra file is the full command's to check again and repair: it is hashed twice then,
    which is rare, and its repair reads the source anyway. The node report is not rebuilt
    (nothing changed), only set back to "ready" where a rebuild during the check wrote the
    copy "verifying"."""
    name, node = opts["names"], opts["node"] or node_name()
    run_dir, cache = _cache(opts)
    if cache is None or not layout.name_ok(name) or not layout.name_ok(node):
        return None
    tiers: dict[str, RootDir] = {}
    try:
        pick = _ready(cache, name, node, tiers, quick_only=False)
        if pick is None:
            return None
        locks = pick.tier.has_dir("locks")
        held = _try_lock(locks, name) if locks is not None else None
        if locks is None or held is None:
            return None
        try:
            if layout.not_ready(pick.tier, name, pick.digest) is not None:  # evicted before the lock
                return None
            import logging  # the check's modules bring it: their warnings read as the full command's
            logging.basicConfig(level=logging.WARNING, format="dsstage: %(levelname)s: %(message)s")
            from dsstage.config.manifest import Catalog
            from dsstage.node import treecheck
            from dsstage.transfer import check
            entries = Catalog(cache.state_dir).load(name, pick.digest).entries
            vfd = pick.tier.dir("datasets", name, layout.version_id(pick.digest))
            extra = treecheck.extras(vfd, entries)
            try:
                if next(extra, None) is not None:
                    return None
            finally:
                extra.close()
            if check.check_tree(vfd, entries, cache.hash_threads):
                return None
        finally:  # never left held for the full command to wait on
            lock.unlock(locks, f"{name}.lock", held)
    finally:
        for tier in tiers.values():
            tier.close()
    try:  # a rebuild while the lock was held shows the copy "verifying": it is ready again
        report.note_verified(run_dir, node, name, layout.version_id(pick.digest),
                             (cache.state_dir, cache.report_user))
    except Exception:  # noqa: BLE001 - the report is informative; the next rebuild has it right
        pass
    return [{"dataset": name, "digest": pick.digest, "path": pick.path, "mode": "full", "ok": True,
             "reason": FULL_OK, "checked_files": len(entries), "repaired": [], "removed_extras": 0}]


def _try_lock(locks: int, name: str) -> int | None:
    """The descriptor holding dataset ``name``'s lock (dsstage.ready.lock: the one the full
    command waits for), its owner recorded; None if another holds it or it cannot be taken."""
    try:
        fd = lock.try_lock(locks, f"{name}.lock")
    except Exception:  # noqa: BLE001 - not root's regular file, or unreadable: the full command says so
        return None
    if fd is not None:
        lock.note_owner(locks, f"{name}.lock", "", "verify")
    return fd


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
    tiers: dict[str, RootDir] = {}
    try:
        picked = [_ready(cache, name, node, tiers) for name in names]
        ready = [p for p in picked if p is not None]
        if len(ready) < len(names) or not lease(ready, Holder(job_id, user, node, pid)):
            return None
    finally:
        for tier in tiers.values():
            tier.close()
    try:
        report.note_leases(run_dir, node, job_id, user, [(p.name, layout.version_id(p.digest)) for p in ready],
                           (cache.state_dir, cache.report_user))
    except Exception:  # noqa: BLE001 - the report is informative; the next rebuild has the lease
        pass
    seconds = time.monotonic() - started
    tier_of = {n: ds.tier for n in names if (ds := cache.dataset(n)) is not None}
    return [{"dataset": p.name, "digest": p.digest, "path": p.path, "tier": tier_of[p.name], "node": node,
             "action": "cached", "job_id": job_id, "transferred_files": 0, "transferred_bytes": 0,
             "linked_files": 0, "peer_files": 0, "peer_bytes": 0, "seconds": seconds} for p in ready]
