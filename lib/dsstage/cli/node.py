"""The verbs that act on this node's store (as root): ``stage``, ``release``, ``evict``,
``reclaim``, ``verify``, ``warm``, ``report``, and the daemons and records beside it
(``peers serve``, ``bb record``/``bb forget``/``bb nudge``). Each refreshes the node report after a change.
Each imports the machinery of its own work when it runs: a ``release`` or a quick ``verify``
does not pay for the staging machinery's imports, nor a ``stage`` for Slurm's client.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import asdict
from typing import Any

from dsstage.cli.common import (
    ProgressLines,
    emit,
    how,
    load_config,
    need_root,
    need_write,
    run_on_nodes,
    user_of,
)
from dsstage.config import catalog as cat
from dsstage.config import load
from dsstage.errors import DsstageError
from dsstage.fs import runfiles
from dsstage.node import inventory
from dsstage.node.store import Store
from dsstage.units import human

log = logging.getLogger("dsstage")


def cmd_stage(args: argparse.Namespace) -> int:
    need_root("stage", "copies into this node's store and takes a lease there")
    conf = load_config(args)
    user = user_of(args)
    datasets = cat.resolve(conf, args.name, user)
    from dsstage.node import standalone
    from dsstage.node.local import default_holder
    pid = 0
    job_id = args.job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        job_id, pid = default_holder()
    store = Store(conf, args.node)
    nodes = args.group if args.group is not None else os.environ.get("SLURM_JOB_NODELIST", "")
    from dsstage.node.staging import StageRequest
    job = StageRequest(user=user, job_id=job_id, pid=pid, full=args.full, nodes=nodes)
    results = [standalone.stage(store, ds.name, job) for ds in datasets]
    inventory.refresh(store)
    from dsstage.hooks.configcache import write_config_cache
    write_config_cache(store.run_dir, conf)  # the next stage of a ready copy takes the fast path (dsstage.cli.fast)

    def text() -> None:
        for r in results:
            print(f"{r.dataset}: {r.path}  ({how(r)}, {r.seconds:.2f}s, lease {r.job_id})")
    dicts = [r.to_dict() for r in results]
    emit(args, dicts if len(dicts) > 1 else dicts[0], text)
    return 0


def cmd_peers_serve(args: argparse.Namespace) -> int:
    from dsstage.node.local import node_name
    from dsstage.transfer import peerd
    need_root("peers serve", "serves this node's store to the other nodes")
    conf = load_config(args)
    if not conf.peers.enabled:
        raise load.ConfigError(f"{conf.origin}: peers.enabled is off: set it to true on every node to share stages")
    logging.getLogger().setLevel(logging.INFO)
    node = args.node or node_name()
    addresses: dict[str, str] = {}
    if not conf.peers.allow or node not in conf.peers.hosts:
        # whom to allow and where to bind: the nodes' addresses, asked of Slurm once at start
        from dsstage.cluster import fleet
        from dsstage.errors import CommandError
        from dsstage.slurm.client import CliSlurm
        try:
            addresses = fleet.node_addresses(CliSlurm(conf.slurm_bin, timeout=fleet.SINFO_TIMEOUT).nodes())
        except CommandError as exc:
            log.warning("cannot ask Slurm for the nodes' addresses (%s): only peers.allow and peers.hosts count", exc)
    peerd.serve(conf, node, runfiles.default_run_dir(), addresses)
    return 1  # not reached: serve becomes rsync


def cmd_release(args: argparse.Namespace) -> int:
    need_root("release", "removes a lease from this node's store")
    conf = load_config(args)
    store = Store(conf, args.node)
    released = store.release(args.name, args.job_id)
    inventory.refresh(store)
    emit(args, {"dataset": args.name, "job_id": args.job_id, "released": released},
          lambda: print(f"{args.name}: lease of job {args.job_id} "
                        + ("released" if released else "was not held")))
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    conf = load_config(args)
    if args.nodes:
        if not args.name:
            raise DsstageError("evict --nodes needs a dataset name: on the nodes, dsstage evict NAME")
        if args.force and not args.reason:
            raise DsstageError("--force on many nodes needs --reason TEXT: it is logged on every node, "
                               "because it takes data from jobs that wait for it")
        if args.dry_run:
            raise DsstageError("--dry-run is for one node: run dsstage evict --dry-run there")
        extra = ["--force", "--reason", args.reason] if args.force else []
        return run_on_nodes(args, conf, "evict", ["evict", args.name, *extra])
    need_root("evict", "reads this node's store and removes copies from it")
    from dsstage.node import eviction
    if args.force and args.reason:
        log.warning("evicting %s by force: %s", args.name or "by the plan", args.reason)
    store = Store(conf, args.node)
    dem, snap = store.demand()
    if dem.stale:
        log.warning("%s: the queue's demand is unknown; copies are judged without it",
                    snap.problem or f"the demand snapshot is {dem.age:.0f}s old")
    if args.name:
        result = eviction.evict(store, args.name, force=args.force, dry_run=args.dry_run, dem=dem)
    else:
        result = eviction.retain(store, dem, dry_run=args.dry_run, wait=conf.lock_timeout)
    if not args.dry_run:
        inventory.refresh(store)
    emit(args, [asdict(e) for e in result],
          lambda: print("\n".join(f"{e.tier} {e.dataset} {e.version} ({human(e.bytes)}): {e.action}: {e.reason}"
                                  for e in result) or f"{args.name or 'nothing'}: no copy on this node"))
    return 0


def cmd_hook_dry_run(args: argparse.Namespace) -> int:
    """``dsstage prolog|epilog --dry-run --job ID``: what that hook would do here."""
    from dsstage.hooks import dryrun
    need_root(args.hook, "reads this node's store as the hook does")
    conf = load_config(args)
    store = Store(conf, args.node)
    if args.hook == "epilog":
        leased, plan = dryrun.epilog(store, args.job)
        data = {"job": args.job, "node": store.node, "released": leased, "retention": [asdict(e) for e in plan]}

        def epilog_text() -> None:
            print(f"job {args.job} on {store.node}: the Epilog would release "
                  f"{', '.join(leased) or 'nothing (the job holds no lease here)'}, then apply retention:")
            for e in plan:
                print(f"  {e.tier} {e.dataset} {e.version} ({human(e.bytes)}): {e.action}: {e.reason}")
            if not plan:
                print("  no copy on this node")
            print("  (dry run: no lease released, nothing evicted)")
        emit(args, data, epilog_text)
        return 0
    from dsstage.slurm import client as slurm_client
    job = next((j for j in slurm_client.client(conf.slurm_bin).queue() if j.job_id == args.job), None)
    if job is None:
        raise DsstageError(f"job {args.job} is not in Slurm's queue (pending or running): a finished job has no "
                           "Prolog to try")
    if not job.datasets:
        emit(args, {"job": job.job_id, "node": store.node, "action": "run", "datasets": []},
             lambda: print(f"job {job.job_id} asked for no dataset: its Prolog returns at once and the job runs"))
        return 0
    steps = dryrun.prolog(conf, store, job)
    emit(args, dryrun.as_dict(job, store.node, steps), lambda: print(dryrun.render_prolog(job, store.node, steps)))
    return 0


def cmd_reclaim(args: argparse.Namespace) -> int:
    need_root("reclaim", "removes leases from this node's store")
    conf = load_config(args)
    store = Store(conf, args.node)
    dem, snap = store.demand()
    if not dem.stale:
        gone = store.reclaim_stale(snap)
    else:
        log.info("no fresh demand snapshot: asking Slurm about each lease's job")
        from dsstage.slurm import client as slurm_client
        gone = store.reclaim(slurm_client.client(conf.slurm_bin).job_alive)
    inventory.refresh(store)
    emit(args, [asdict(x) for x in gone],
          lambda: print("\n".join(f"{x.dataset}: lease of job {x.job_id} reclaimed (job gone)" for x in gone)
                        or "no stale lease on this node"))
    return 0


def cmd_bb_record(args: argparse.Namespace) -> int:
    from dsstage.hooks import bbrequest
    conf = load_config(args)
    need_write("bb record", bbrequest.directory(conf.state_dir))
    names = cat.parse_request(args.datasets)  # the Prolog checks catalog and access with the job's uid
    path = bbrequest.write(conf.state_dir, args.job_id, names)
    print(f"job {args.job_id}: {','.join(names)} recorded in {path}")
    return 0


def cmd_bb_forget(args: argparse.Namespace) -> int:
    from dsstage.hooks import bbrequest
    conf = load_config(args)
    need_write("bb forget", bbrequest.directory(conf.state_dir))
    gone = bbrequest.remove(conf.state_dir, args.job_id)
    print(f"job {args.job_id}: {'request forgotten' if gone else 'no request recorded'}")
    return 0


def cmd_bb_nudge(args: argparse.Namespace) -> int:
    from dsstage.cluster import poller
    from dsstage.hooks import bbrequest
    conf = load_config(args)
    need_write("bb nudge", bbrequest.directory(conf.state_dir))
    poller.nudge(conf.state_dir, args.job_id)
    print(f"job {args.job_id}: the acting demand poller takes its next round now")
    return 0


def cmd_bb_status(args: argparse.Namespace) -> int:
    from dsstage.cluster import bbstat
    conf = load_config(args)
    bbstat.refresh(conf, args.key)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    conf = load_config(args)
    if args.nodes:
        return run_on_nodes(args, conf, "verify", ["verify", args.name, *(["--full"] if args.full else [])])
    need_root("verify", "reads this node's store (and --full repairs it)")
    from dsstage.node import verifying
    store = Store(conf, args.node)
    try:
        result = verifying.verify(store, args.name, full=args.full)
    except DsstageError as exc:
        if args.full and exc.blame != "node":  # a copy flagged bad: status must show it failed
            inventory.refresh(store)
        raise
    if args.full:
        inventory.refresh(store)
    emit(args, result.to_dict(),
          lambda: print(f"{result.dataset}: {'OK' if result.ok else 'NOT READY'} ({result.mode}): {result.reason}"))
    return 0 if result.ok else 1


def cmd_report(args: argparse.Namespace) -> int:
    conf = load_config(args)
    store = Store(conf, args.node)
    rep = inventory.refresh(store)
    if not rep:
        raise DsstageError(f"cannot write the report of {store.node} (see the warning above)")
    copies = rep.get("copies")
    emit(args, rep, lambda: print(f"{store.node}: report of {len(copies) if isinstance(copies, list) else 0} "
                                   "copies written"))
    return 0


def warm_argv(conf: Any, name: str, nodes: str) -> list[str]:
    """What ``dsstage warm NAME --nodes HOSTLIST`` runs on each node: of a sharded dataset,
    the part a job on those nodes would give it (a dataset larger than a node fits on them
    together, not on each)."""
    ds = conf.datasets.get(name)
    return ["warm", name, *(["--with", nodes] if ds is not None and ds.shards else [])]


def cmd_warm(args: argparse.Namespace) -> int:
    conf = load_config(args)
    if args.nodes:
        return run_on_nodes(args, conf, "warm", warm_argv(conf, args.name, args.nodes))
    need_root("warm", "copies into this node's store")
    cat.lookup(conf, args.name)
    from dsstage.node import standalone
    progress = ProgressLines() if args.progress_json else None
    store = Store(conf, args.node)
    result = standalone.warm(store, args.name, user=cat.User.lookup(), progress=progress, nodes=args.group or "")
    inventory.refresh(store)
    emit(args, result.to_dict(), lambda: print(f"{result.dataset}: {result.path}  ({how(result)}, "
                                                f"{result.seconds:.2f}s, no lease)"))
    return 0
