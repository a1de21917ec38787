"""The ``dsstage`` command line: thin verbs over the library.

Errors end as one line on stderr and a non-zero exit code; this module is the one place
where exceptions become exit codes for the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from . import __version__
from . import catalog as cat
from . import config as cfg
from . import manifest as mf
from .errors import DsstageError
from .fsutil import write_atomic
from .lease import default_holder
from .store import StageResult, Store
from .units import human

log = logging.getLogger("dsstage")

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "handler", None) is cmd_simulate:
        args.args = rest  # simulate has a parser of its own
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING,
                        format="dsstage: %(levelname)s: %(message)s")
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except DsstageError as exc:
        print(f"dsstage: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("dsstage: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line, the traceback on request
        if args.debug:
            raise
        print(f"dsstage: internal error: {type(exc).__name__}: {exc} (run with --debug for a traceback)",
              file=sys.stderr)
        return 70


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsstage", description="Stage datasets onto compute nodes' local storage.")
    p.add_argument("--version", action="version", version=f"dsstage {__version__}")
    p.add_argument("--config", help="configuration file (default: $DSSTAGE_CONFIG or /etc/dsstage/dsstage.yaml)")
    p.add_argument("--node", help="node name for {node} in tier paths (default: $SLURMD_NODENAME or host name)")
    p.add_argument("-v", "--verbose", action="store_true", help="say what is being done")
    p.add_argument("--debug", action="store_true", help="debug logging and tracebacks")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    c = sub.add_parser("check-config", help="validate the configuration and print a summary")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_check_config)

    c = sub.add_parser("ls", help="list the dataset catalog")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_ls)

    m = sub.add_parser("manifest", help="build or show BLAKE3 manifests")
    msub = m.add_subparsers(title="manifest commands", metavar="ACTION")
    c = msub.add_parser("build", help="hash the source and record the dataset's current version")
    c.add_argument("name", help="dataset name")
    c.add_argument("--from", dest="from_path", metavar="PATH",
                   help="read the data here instead of the source (for an ssh or rsync:// source, "
                        "a mounted view of it)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_manifest_build)
    m.set_defaults(handler=lambda _a: _usage(m))

    c = sub.add_parser("stage", help="stage datasets on this node and lease them")
    c.add_argument("name", help="dataset name, or several separated by commas")
    c.add_argument("--job-id", help="the job holding the lease (default: $SLURM_JOB_ID, else the calling shell)")
    c.add_argument("--user", help="stage on behalf of this user (root only; default: you)")
    c.add_argument("--full", action="store_true", help="re-hash a cached copy and repair it")
    c.add_argument("--with", dest="group", metavar="HOSTLIST",
                   help="stage together with these nodes, this one among them (peers.enabled): this node's "
                        "share from the source, the rest from them (default: $SLURM_JOB_NODELIST)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_stage)

    pp = sub.add_parser("peers", help="the rsync daemon through which the nodes of a job share a stage")
    psub = pp.add_subparsers(dest="peers_command", metavar="COMMAND")
    c = psub.add_parser("serve", help="serve this node's tiers to its peers, in the foreground "
                        "(dsstage-peers.service runs it)")
    c.set_defaults(handler=cmd_peers_serve)
    pp.set_defaults(handler=lambda _a: _usage(pp))

    c = sub.add_parser("release", help="release a job's lease on a dataset")
    c.add_argument("name", help="dataset name")
    c.add_argument("--job-id", required=True, help="the job whose lease to release")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_release)

    c = sub.add_parser("status", help="what is cached on which node, what is staging, what the queue wants",
                       description="Reads the nodes' reports in the state directory (or, with --live, asks the "
                                   "nodes over SSH) and the queue's demand. A report older than report.max_age, or "
                                   "of a node Slurm says is down, is shown as stale.")
    c.add_argument("--dataset", help="only these datasets (comma-separated)")
    c.add_argument("--node", "--nodes", dest="nodes", metavar="HOSTLIST", help="only these nodes, e.g. n[1-8,10]")
    c.add_argument("--user", help="only this user's jobs and leases")
    c.add_argument("--job", help="explain why this job's data is or is not ready, and show only what it uses")
    c.add_argument("--live", action="store_true", help="ask the nodes over SSH (fleet settings) instead of reading "
                                                       "their published reports")
    c.add_argument("--all", action="store_true", help="every row (the text view shows at most 20 per section)")
    c.add_argument("--no-queue", action="store_true", help="do not ask Slurm for the queue or the nodes' states")
    c.add_argument("--json", action="store_true", help="machine-readable output (see docs/admin-guide.md)")
    c.set_defaults(handler=cmd_status)

    c = sub.add_parser("report", help="rebuild and publish this node's report (dsstage-report.timer runs it)")
    c.add_argument("--json", action="store_true", help="print the report")
    c.set_defaults(handler=cmd_report)

    c = sub.add_parser("warm", help="stage a dataset without a job, here or on nodes over SSH",
                       description="Make the current version of NAME ready (verified) without keeping a lease: "
                                   "ahead of a reservation or a campaign. Retention keeps it as for any copy.")
    c.add_argument("name", help="dataset name")
    c.add_argument("--nodes", metavar="HOSTLIST", help="on these nodes, over SSH (fleet settings)")
    c.add_argument("--progress-json", action="store_true", help=argparse.SUPPRESS)  # for --nodes
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_warm)

    c = sub.add_parser("export-catalog", help="write the catalog that job_submit.lua checks (Lua)")
    c.add_argument("-o", "--output", help="file to write (atomically); default: standard output")
    c.set_defaults(handler=cmd_export_catalog)

    c = sub.add_parser("evict", help="evict a dataset's unused copies from this node, or apply the retention plan",
                       description="With NAME: evict this node's copies of NAME that no job holds a lease on "
                                   "(a copy the queue wants stays unless --force). Without NAME: apply the retention "
                                   "plan to every tier, as the Epilog does. --dry-run shows the plan and its reasons.")
    c.add_argument("name", nargs="?", help="dataset name (default: every copy, by the retention plan)")
    c.add_argument("--force", action="store_true", help="evict NAME even if pending or running jobs want it")
    c.add_argument("--reason", help="why (logged; required with --force --nodes)")
    c.add_argument("--nodes", metavar="HOSTLIST", help="on these nodes, over SSH (fleet settings)")
    c.add_argument("--dry-run", action="store_true", help="show what would be evicted and why; change nothing")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_evict)

    c = sub.add_parser("reclaim", help="remove this node's leases whose job is gone",
                       description="Uses the demand snapshot when it is fresh (no Slurm call); otherwise asks Slurm "
                                   "about each lease's job.")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_reclaim)

    c = sub.add_parser("demand-poller", help="write the queue's dataset demand into the state directory",
                       description="Run on the controller or a login node: every retention.poll_interval seconds, "
                                   "one squeue query, an atomic <state_dir>/demand.json, and old manifests pruned. "
                                   "Prologs and Epilogs read the snapshot and never ask Slurm for demand.")
    c.add_argument("--once", action="store_true", help="one round, then exit (for cron); exit 1 if it failed")
    c.add_argument("--interval", type=float, help="seconds between rounds (default: retention.poll_interval)")
    c.set_defaults(handler=cmd_demand_poller)

    c = sub.add_parser("prefetch", help="stage, on this node, what pending jobs planned here will need",
                       description="Run on each compute node (dsstage-prefetch.service): every prefetch.interval "
                                   "seconds, read the demand snapshot and stage, at low priority and within "
                                   "prefetch.bwlimit, the datasets of pending jobs that the backfill plan put on this "
                                   "node and that are expected to start within prefetch.horizon. A Prolog that needs "
                                   "the dataset takes the stage over; nothing a lease or a sooner job needs is "
                                   "evicted for it.")
    c.add_argument("--once", action="store_true", help="one round, then exit; exit 1 if a prefetch failed")
    c.add_argument("--dry-run", action="store_true", help="say what would be prefetched, and what not and why")
    c.add_argument("--json", action="store_true", help="machine-readable output (with --dry-run)")
    c.set_defaults(handler=cmd_prefetch)

    bbp = sub.add_parser("bb", help="record or forget a #BB_LUA dataset= job's request (burst_buffer.lua runs it)",
                       description="Slurm's burst_buffer/lua runs these from sbatch_ext/burst_buffer.lua on the "
                                   "controller: pre_run records the job's datasets in <state_dir>/bb/<job id> for "
                                   "its Prolog (which cannot learn a #BB_LUA request otherwise), teardown forgets "
                                   "them.")
    bsub = bbp.add_subparsers(dest="bb_command", metavar="record|forget")
    b = bsub.add_parser("record", help="record the datasets a job asked for")
    b.add_argument("job_id", help="the job id")
    b.add_argument("datasets", help="NAME[,NAME...]: the job's #BB_LUA dataset= value")
    b.set_defaults(handler=cmd_bb_record)
    b = bsub.add_parser("forget", help="remove a job's record")
    b.add_argument("job_id", help="the job id")
    b.set_defaults(handler=cmd_bb_forget)
    bbp.set_defaults(handler=lambda _a: _usage(bbp))

    c = sub.add_parser("simulate", help="replay a job trace through retention policies and compare them",
                       add_help=False)  # its options are simulate.build_parser()'s: see dsstage simulate --help
    c.set_defaults(handler=cmd_simulate)

    c = sub.add_parser("verify", help="check the local copy against the manifest")
    c.add_argument("name", help="dataset name")
    c.add_argument("--full", action="store_true", help="re-hash every file and repair what is wrong")
    c.add_argument("--nodes", metavar="HOSTLIST", help="on these nodes, over SSH (fleet settings)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=cmd_verify)
    return p


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _config(args: argparse.Namespace) -> cfg.Config:
    return cfg.load(args.config)


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], None]) -> None:
    if getattr(args, "json", False):
        # indented for a person at a terminal; compact for a script, which Python's C encoder
        # writes several times faster (status --json of 1,000 nodes is megabytes)
        pretty = sys.stdout.isatty()
        sys.stdout.write(json.dumps(data, sort_keys=True, indent=2 if pretty else None,
                                    separators=None if pretty else (",", ":")) + "\n")
    else:
        text()


def cmd_check_config(args: argparse.Namespace) -> int:
    conf = _config(args)
    slurm, problems = cfg.check_host(conf)
    errors = [p for p in problems if p.level == "error"]
    data = {"config": conf.origin, "ok": not errors, "state_dir": conf.state_dir, "on_failure": conf.on_failure,
            "slurm_bin": conf.slurm_bin, "prolog_budget": conf.prolog_budget, "source_user": conf.source_user,
            "slurm": slurm, "peers": {"enabled": conf.peers.enabled, "port": conf.peers.port},
            "tiers": {t.name: {"path": t.path, "capacity": t.capacity, "high_watermark": t.high_watermark,
                               "low_watermark": t.low_watermark} for t in conf.tiers.values()},
            "datasets": sorted(conf.datasets),
            "problems": [{"level": p.level, "key": p.key, "message": p.message} for p in problems]}

    def text() -> None:
        print(f"{conf.origin}: {'OK' if not errors else f'{len(errors)} error(s)'}")
        print(f"  state_dir      {conf.state_dir}")
        print(f"  slurm_bin      {conf.slurm_bin}")
        timeout = slurm["prolog_epilog_timeout"]
        limit = "not read" if not slurm["read"] else "none, slurmd waits" if timeout is None else f"{timeout:g}s"
        print(f"  prolog_budget  {conf.prolog_budget:g}s (PrologEpilogTimeout: {limit}, "
              f"margin {cfg.PROLOG_MARGIN:g}s)")
        print(f"  source_user    {conf.source_user or 'root (default)'}")
        for t in conf.tiers.values():
            cap = f"{t.capacity:.0%} of the filesystem" if isinstance(t.capacity, float) else human(t.capacity)
            marks = f"{t.low_watermark:.0%}-{t.high_watermark:.0%}"
            print(f"  tier {t.name:<8} {t.path}  capacity {cap}  watermarks {marks}")
        peers = (f"on, port {conf.peers.port}, secret {conf.peers.secret_file}" if conf.peers.enabled
                 else "off (every node reads from the source alone)")
        print(f"  peers          {peers}")
        print(f"  {len(conf.datasets)} dataset(s): {', '.join(sorted(conf.datasets)) or '-'}")
        for p in problems:
            if p.level == "note":
                print(f"  note: {p.key}: {p.message}")
    _emit(args, data, text)
    for p in errors:
        print(f"dsstage: error: {conf.origin}: {p.key}: {p.message}", file=sys.stderr)
    return cfg.ConfigError.exit_code if errors else 0


def cmd_ls(args: argparse.Namespace) -> int:
    conf = _config(args)
    manifests = mf.Catalog(conf.state_dir)
    rows = []
    for ds in sorted(conf.datasets.values(), key=lambda d: d.name):
        row: dict[str, Any] = {"name": ds.name, "source": ds.source.raw, "tier": ds.tier,
                               "groups": list(ds.groups) if ds.groups else None, "verify": ds.verify,
                               "on_failure": ds.on_failure, "version": None, "files": None, "bytes": None}
        try:
            digest = manifests.current(ds.name)
            if digest:
                header = mf.read_header(manifests.path(ds.name, digest))
                row.update(version=digest[:16], files=header.get("files"), bytes=header.get("bytes"))
        except DsstageError as exc:
            row["problem"] = str(exc)
        rows.append(row)

    def text() -> None:
        from rich.table import Table

        from .ui import console
        table = Table(title="dsstage catalog", title_justify="left")
        for col in ("dataset", "version", "files", "size", "tier", "groups", "source"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["name"], r["version"] or "[yellow]no manifest[/]",
                          str(r["files"] if r["files"] is not None else "-"),
                          human(int(r["bytes"])) if r["bytes"] is not None else "-", r["tier"],
                          ",".join(r["groups"]) if r["groups"] else "everyone", r["source"])
        console().print(table)
    _emit(args, rows, text)
    return 0


def cmd_manifest_build(args: argparse.Namespace) -> int:
    conf = _config(args)
    ds = cat.lookup(conf, args.name)
    manifests = mf.Catalog(conf.state_dir)
    if args.from_path:
        root = args.from_path
    elif ds.source.kind == "local":
        root = ds.source.path
    else:
        raise DsstageError(f"dataset {ds.name!r} comes from {ds.source.raw}; build its manifest where the data is "
                           f"mounted: dsstage manifest build {ds.name} --from /mounted/path")
    previous = None
    if manifests.current(ds.name):
        try:
            previous = manifests.load(ds.name)
        except DsstageError as exc:
            log.warning("previous manifest unusable, hashing everything: %s", exc)
    from .ui import progress_bar
    with progress_bar(f"hashing {ds.name}", enabled=not args.json) as advance:
        report = mf.build(ds.name, root, source=ds.source.raw, previous=previous, reader=_reader(conf),
                          threads=conf.transfer.hash_threads, progress=advance,
                          max_parallel=conf.transfer.max_parallel)
    path = manifests.publish(report.manifest)
    m = report.manifest
    data = {"dataset": ds.name, "digest": m.digest, "version": m.digest[:16], "files": m.files,
            "bytes": m.total_bytes, "hashed": report.hashed, "reused": report.reused,
            "unchanged": report.unchanged, "path": path,
            "skipped": {k: len(v) for k, v in report.skipped.items()}}

    def text() -> None:
        print(f"{ds.name}: version {m.digest[:16]}{' (unchanged)' if report.unchanged else ''}, "
              f"{m.files} files, {human(m.total_bytes)}; hashed {report.hashed}, reused {report.reused}")
        for kind, paths in sorted(report.skipped.items()):
            print(f"  skipped {len(paths)} {kind}(s), e.g. {paths[0]!r}: a manifest holds regular files only")
        print(f"  {path}")
    _emit(args, data, text)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    conf = _config(args)
    user = _user(args)
    datasets = cat.resolve(conf, args.name, user)
    pid = 0
    job_id = args.job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        job_id, pid = default_holder()
    store = Store(conf, args.node)
    nodes = args.group if args.group is not None else os.environ.get("SLURM_JOB_NODELIST", "")
    results = [store.stage(ds.name, user=user, job_id=job_id, pid=pid, full=args.full, nodes=nodes)
               for ds in datasets]
    store.report()

    def text() -> None:
        for r in results:
            print(f"{r.dataset}: {r.path}  ({_how(r)}, {r.seconds:.2f}s, lease {r.job_id})")
    dicts = [r.to_dict() for r in results]
    _emit(args, dicts if len(dicts) > 1 else dicts[0], text)
    return 0


def _how(r: StageResult) -> str:
    if r.action == "staged":
        reused = f", {r.linked_files} reused from an older version" if r.linked_files else ""
        peers = f", {r.peer_files} files, {human(r.peer_bytes)} from peers" if r.peer_files else ""
        return f"staged {r.transferred_files} files, {human(r.transferred_bytes)}{peers}{reused}"
    return {"cached": "already here", "repaired": "repaired"}.get(r.action, r.action)


def cmd_peers_serve(args: argparse.Namespace) -> int:
    from . import peers
    from .store import node_name
    conf = _config(args)
    if not conf.peers.enabled:
        raise cfg.ConfigError(f"{conf.origin}: peers.enabled is off: set it to true on every node to share stages")
    logging.getLogger().setLevel(logging.INFO)
    from . import nodefs
    peers.serve(conf, args.node or node_name(), os.environ.get("DSSTAGE_RUN_DIR") or nodefs.RUN_DIR)
    return 1  # not reached: serve becomes rsync


def cmd_release(args: argparse.Namespace) -> int:
    conf = _config(args)
    store = Store(conf, args.node)
    released = store.release(args.name, args.job_id)
    store.report()
    _emit(args, {"dataset": args.name, "job_id": args.job_id, "released": released},
          lambda: print(f"{args.name}: lease of job {args.job_id} "
                        + ("released" if released else "was not held")))
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    conf = _config(args)
    if args.nodes:
        if not args.name:
            raise DsstageError("evict --nodes needs a dataset name: on the nodes, dsstage evict NAME")
        if args.force and not args.reason:
            raise DsstageError("--force on many nodes needs --reason TEXT: it is logged on every node, "
                               "because it takes data from jobs that wait for it")
        if args.dry_run:
            raise DsstageError("--dry-run is for one node: run dsstage evict --dry-run there")
        extra = ["--force", "--reason", args.reason] if args.force else []
        return _fleet(args, conf, "evict", ["evict", args.name, *extra])
    if args.force and args.reason:
        log.warning("evicting %s by force: %s", args.name or "by the plan", args.reason)
    store = Store(conf, args.node)
    dem, snap = store.demand()
    if dem.stale:
        log.warning("%s: the queue's demand is unknown; copies are judged without it",
                    snap.problem or f"the demand snapshot is {dem.age:.0f}s old")
    if args.name:
        result = store.evict(args.name, force=args.force, dry_run=args.dry_run, dem=dem)
    else:
        result = store.retain(dem, dry_run=args.dry_run, wait=conf.lock_timeout)
    if not args.dry_run:
        store.report()
    _emit(args, [asdict(e) for e in result],
          lambda: print("\n".join(f"{e.tier} {e.dataset} {e.version} ({human(e.bytes)}): {e.action}: {e.reason}"
                                  for e in result) or f"{args.name or 'nothing'}: no copy on this node"))
    return 0


def cmd_reclaim(args: argparse.Namespace) -> int:
    conf = _config(args)
    store = Store(conf, args.node)
    dem, snap = store.demand()
    if not dem.stale:
        gone = store.reclaim_stale(snap)
    else:
        from . import slurm
        log.info("no fresh demand snapshot: asking Slurm about each lease's job")
        gone = store.reclaim(slurm.client(conf.slurm_bin).job_alive)
    store.report()
    _emit(args, [asdict(x) for x in gone],
          lambda: print("\n".join(f"{x.dataset}: lease of job {x.job_id} reclaimed (job gone)" for x in gone)
                        or "no stale lease on this node"))
    return 0


def cmd_demand_poller(args: argparse.Namespace) -> int:
    from . import demand, slurm
    conf = _config(args)
    if not args.debug:
        logging.getLogger().setLevel(logging.INFO)
    return demand.run(conf, slurm.client(conf.slurm_bin), once=args.once, interval=args.interval)


def cmd_prefetch(args: argparse.Namespace) -> int:
    from . import prefetch
    conf = _config(args)
    if not args.debug:
        logging.getLogger().setLevel(logging.INFO)
    pre = prefetch.Prefetcher(conf, args.node or "", config_path=args.config)
    if not args.dry_run:
        return pre.run(once=args.once)
    cands, skips, dem = pre.candidates()
    data = {"node": pre.node, "stale": dem.stale, "prefetch": [c.to_dict() for c in cands],
            "skipped": [asdict(s) for s in skips]}

    def text() -> None:
        if dem.stale:
            print(f"{pre.node}: the demand snapshot is stale or missing: nothing would be prefetched")
        for c in cands:
            print(f"{pre.node}: would prefetch {c.dataset}: {c.reason}")
        for s in skips:
            print(f"{pre.node}: not {s.dataset} (job {s.job_id}): {s.reason}")
        if not (cands or skips or dem.stale):
            print(f"{pre.node}: no pending job is planned here")
    _emit(args, data, text)
    return 0


def cmd_bb_record(args: argparse.Namespace) -> int:
    from . import bbrequest
    conf = _config(args)
    names = cat.parse_request(args.datasets)  # the Prolog checks catalog and access with the job's uid
    path = bbrequest.write(conf.state_dir, args.job_id, names)
    print(f"job {args.job_id}: {','.join(names)} recorded in {path}")
    return 0


def cmd_bb_forget(args: argparse.Namespace) -> int:
    from . import bbrequest
    conf = _config(args)
    gone = bbrequest.remove(conf.state_dir, args.job_id)
    print(f"job {args.job_id}: {'request forgotten' if gone else 'no request recorded'}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim import cli as simulate
    return simulate.main(args.args)


def cmd_verify(args: argparse.Namespace) -> int:
    conf = _config(args)
    if args.nodes:
        return _fleet(args, conf, "verify", ["verify", args.name, *(["--full"] if args.full else [])])
    store = Store(conf, args.node)
    try:
        result = store.verify(args.name, full=args.full)
    except DsstageError as exc:
        if args.full and exc.blame != "node":  # a copy flagged bad: status must show it failed
            store.report()
        raise
    if args.full:
        store.report()
    _emit(args, result.to_dict(),
          lambda: print(f"{result.dataset}: {'OK' if result.ok else 'NOT READY'} ({result.mode}): {result.reason}"))
    return 0 if result.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    conf = _config(args)
    from . import slurm, status
    from .ui import console
    filt = status.Filter.parse(dataset=args.dataset, nodes=args.nodes, user=args.user, job=args.job)
    client = None if args.no_queue else slurm.client(conf.slurm_bin)
    reports, unreachable = None, None
    if args.live:
        reports, unreachable = _live_reports(args, conf, args.nodes, client)
    whole = status.collect(conf, client, reports=reports, unreachable=unreachable)
    st = status.select(whole, filt) if filt else whole
    explain = status.explain_job(whole, args.job) if args.job else ""

    def text() -> None:
        out = console()
        plain = not out.is_terminal
        secs = status.sections(st, show_queue=not args.no_queue, plain=plain, all_rows=args.all)
        if plain:
            sys.stdout.write(status.render_plain(st, secs))
        else:
            status.render_rich(st, secs, out)
        if args.job and plain:
            import textwrap
            print("\n" + textwrap.fill(explain, status.WIDTH))
        elif args.job:
            out.print(explain)
    if args.json:
        data = status.to_json(st)
        if args.job:
            data["explain"] = explain
        _emit(args, data, text)
    else:
        text()
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    conf = _config(args)
    store = Store(conf, args.node)
    rep = store.report()
    if not rep:
        raise DsstageError(f"cannot write the report of {store.node} (see the warning above)")
    copies = rep.get("copies")
    _emit(args, rep, lambda: print(f"{store.node}: report of {len(copies) if isinstance(copies, list) else 0} "
                                   "copies written"))
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    conf = _config(args)
    if args.nodes:
        return _fleet(args, conf, "warm", ["warm", args.name])
    cat.lookup(conf, args.name)
    progress = ProgressLines() if args.progress_json else None
    store = Store(conf, args.node)
    result = store.warm(args.name, user=cat.User.lookup(), progress=progress)
    store.report()
    _emit(args, result.to_dict(), lambda: print(f"{result.dataset}: {result.path}  ({_how(result)}, "
                                                f"{result.seconds:.2f}s, no lease)"))
    return 0


class ProgressLines:
    """A stage's progress as JSON lines on stderr, for the progress bars of a fleet
    operation: ``{"progress": {"phase", "done", "total"}}``, at most twice a second."""

    def __init__(self, every: float = 0.5) -> None:
        import threading
        import time
        self.clock = time.monotonic
        self.every, self.last, self.phase, self.done = every, 0.0, "", 0
        self.mutex = threading.Lock()

    def __call__(self, phase: str, delta: int, total: int) -> None:
        with self.mutex:
            if phase != self.phase:
                self.phase, self.done = phase, 0
            self.done += delta
            now = self.clock()
            if now - self.last < self.every and self.done < total:
                return
            self.last = now
            sys.stderr.write(json.dumps({"progress": {"phase": phase, "done": self.done, "total": total}}) + "\n")
            sys.stderr.flush()


def _fleet(args: argparse.Namespace, conf: cfg.Config, what: str, argv: list[str]) -> int:
    """Run ``dsstage <argv> --json`` on ``--nodes`` over SSH, with a bar per node and a summary."""
    fleet = _fleet_module(args)
    targets = fleet.addresses(fleet.expand(args.nodes), conf.slurm_bin)
    remote = [*argv, "--json", *(["--progress-json"] if what == "warm" else [])]
    with fleet.progress_view(list(targets), what, not args.json) as (on_progress, on_done):
        answers = fleet.run(conf.fleet, targets, lambda _node: remote, on_progress=on_progress, on_done=on_done)
    data = {node: {"ok": a.ok, "address": a.address, "exit_code": a.exit_code, "error": a.error or None,
                   "result": a.result, "seconds": a.seconds} for node, a in sorted(answers.items())}
    _emit(args, data, lambda: fleet.print_summary(answers, _describe(what)))
    return fleet.exit_code(answers)


def _describe(what: str) -> Callable[[Any], str]:
    """A node's JSON answer to a fleet operation, in a few words for its summary line."""
    def warm(r: Any) -> str:
        return f"{r.get('action')}, {r.get('seconds', 0):.1f}s" if isinstance(r, dict) else ""

    def evict(r: Any) -> str:
        rows = r if isinstance(r, list) else []
        if not rows:
            return "no copy here"
        return "; ".join(f"{e.get('action')} {e.get('version')} ({e.get('reason')})" for e in rows)

    def verify(r: Any) -> str:
        return (f"{'OK' if r.get('ok') else 'NOT READY'}: {r.get('reason')}") if isinstance(r, dict) else ""
    return {"warm": warm, "evict": evict, "verify": verify}[what]


def _fleet_module(args: argparse.Namespace) -> Any:
    """dsstage.fleet, with paramiko's tracebacks for failed connections kept out of the way
    (each node's failure is one line of the summary; --debug shows them)."""
    from . import fleet
    if not args.debug:
        logging.getLogger(fleet.SSH_LOGGER).setLevel(logging.CRITICAL)
    return fleet


def _live_reports(args: argparse.Namespace, conf: cfg.Config, nodes: str | None,
                  client: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``dsstage report --json`` on every node (``nodes``, else every node Slurm knows)."""
    fleet = _fleet_module(args)
    if nodes:
        names = fleet.expand(nodes)
    elif client is not None:
        names = sorted(client.nodes())
    else:
        raise DsstageError("--live needs the nodes: give --node HOSTLIST (or let dsstage ask Slurm: "
                           "leave out --no-queue)")
    targets = fleet.addresses(names, conf.slurm_bin)
    answers = fleet.run(conf.fleet, targets, lambda _node: ["report", "--json"])
    reports = [a.result for a in answers.values() if a.ok and isinstance(a.result, dict)]
    failed = {n: (a.error or "no report in its answer") for n, a in answers.items()
              if not (a.ok and isinstance(a.result, dict))}
    return reports, failed


def cmd_export_catalog(args: argparse.Namespace) -> int:
    from . import luacatalog
    conf = _config(args)
    # how burst_buffer.lua runs dsstage on this host: this installation, this configuration
    here = os.path.join(os.path.dirname(sys.executable), "dsstage")
    command = [here if os.access(here, os.X_OK) else "/usr/bin/dsstage", "--config", os.path.abspath(conf.origin)]
    text = luacatalog.render(conf, command=command)
    if args.output:
        write_atomic(os.path.abspath(args.output), text)
    else:
        sys.stdout.write(text)
    return 0


def _reader(conf: cfg.Config) -> Any:
    """Who reads sources: the configured source_user (as root), else whoever runs this."""
    if not conf.source_user:
        return None
    from . import identity
    return identity.lookup(conf.source_user)


def _user(args: argparse.Namespace) -> cat.User:
    if args.user is None:
        return cat.User.lookup()
    if os.geteuid() != 0:
        raise DsstageError("--user is for root (the Prolog stages on behalf of the job's user)")
    return cat.User.lookup(args.user)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
