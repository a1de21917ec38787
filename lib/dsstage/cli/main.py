"""The ``dsstage`` command line: thin verbs over the library.

Errors end as one line on stderr and a non-zero exit code; this module is the one place
where exceptions become exit codes for the command line.
"""

from __future__ import annotations

import sys

from dsstage import __version__
from dsstage.errors import DsstageError, NotPermitted

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence

    Handler = Callable[[argparse.Namespace], int]


class Lazy:
    """A verb's handler, imported when it runs: building the parser imports no verb's module,
    so a command pays only for its own (``dsstage stage`` does not import the status view,
    the simulator or the Slurm configuration reader)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.__name__ = module, name

    def __call__(self, args: argparse.Namespace) -> int:
        import importlib
        handler: Handler = getattr(importlib.import_module(f"dsstage.cli.{self.module}"), self.__name__)
        return handler(args)


_cmd_check_config = Lazy("admin", "cmd_check_config")
_cmd_disable = Lazy("admin", "cmd_disable")
_cmd_enable = Lazy("admin", "cmd_enable")
_cmd_export_catalog = Lazy("admin", "cmd_export_catalog")
_cmd_ls = Lazy("admin", "cmd_ls")
_cmd_manifest_build = Lazy("admin", "cmd_manifest_build")
_cmd_manifest_check = Lazy("admin", "cmd_manifest_check")
_cmd_manifest_list = Lazy("admin", "cmd_manifest_list")
_cmd_manifest_use = Lazy("admin", "cmd_manifest_use")
_cmd_simulate = Lazy("admin", "cmd_simulate")
_cmd_state_dir_init = Lazy("admin", "cmd_state_dir_init")
_cmd_demand_poller = Lazy("cluster", "cmd_demand_poller")
_cmd_prefetch = Lazy("cluster", "cmd_prefetch")
_cmd_status = Lazy("cluster", "cmd_status")
_cmd_bb_forget = Lazy("node", "cmd_bb_forget")
_cmd_bb_record = Lazy("node", "cmd_bb_record")
_cmd_bb_status = Lazy("node", "cmd_bb_status")
_cmd_bb_nudge = Lazy("node", "cmd_bb_nudge")
_cmd_evict = Lazy("node", "cmd_evict")
_cmd_hook_dry_run = Lazy("node", "cmd_hook_dry_run")
_cmd_peers_serve = Lazy("node", "cmd_peers_serve")
_cmd_reclaim = Lazy("node", "cmd_reclaim")
_cmd_release = Lazy("node", "cmd_release")
_cmd_report = Lazy("node", "cmd_report")
_cmd_stage = Lazy("node", "cmd_stage")
_cmd_verify = Lazy("node", "cmd_verify")
_cmd_warm = Lazy("node", "cmd_warm")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "stage" in argv or "verify" in argv:  # of a ready copy: answered without the parser or the configuration
        from dsstage.cli import fast
        try:
            rc = fast.answer(argv)
        except KeyboardInterrupt:  # a long fast verify --full
            print("dsstage: interrupted", file=sys.stderr)
            return 130
        if rc is not None:
            return rc
    import logging
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "handler", None) is _cmd_simulate:
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
    except PermissionError as exc:  # a path the verb did not check first: still the caller's rights
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"dsstage: error: permission denied{where}: run it as root, or as a user who may write there",
              file=sys.stderr)
        return NotPermitted.exit_code
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
    import argparse
    p = argparse.ArgumentParser(prog="dsstage", description="Stage datasets onto compute nodes' local storage.")
    p.add_argument("--version", action="version", version=f"dsstage {__version__}")
    p.add_argument("--config", help="configuration file (default: $DSSTAGE_CONFIG or /etc/dsstage/dsstage.yaml)")
    p.add_argument("--node", help="node name for {node} in tier paths (default: $SLURMD_NODENAME or host name)")
    p.add_argument("-v", "--verbose", action="store_true", help="say what is being done")
    p.add_argument("--debug", action="store_true", help="debug logging and tracebacks")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    c = sub.add_parser("check-config", help="validate the configuration and print a summary")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_check_config)

    c = sub.add_parser("state-dir", help="the shared state directory's layout (who owns what)")
    ssub = c.add_subparsers(title="state-dir commands", metavar="ACTION")
    c = ssub.add_parser("init", help="make the directories of state_dir and give each its writer (report.user, "
                                     "burst_buffer.user); run it where chown works: on the NFS server")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_state_dir_init)

    c = sub.add_parser("ls", help="list the dataset catalog")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_ls)

    m = sub.add_parser("manifest", help="build, list, check BLAKE3 manifests; make a version current")
    msub = m.add_subparsers(title="manifest commands", metavar="ACTION")
    c = msub.add_parser("build", help="hash the source and record the dataset's current version (and, for a "
                                      "dataset with shards: N, split it into its shards)")
    c.add_argument("name", help="dataset name")
    c.add_argument("--from", dest="from_path", metavar="PATH",
                   help="read the data here instead of the source (for an ssh or rsync:// source, "
                        "a mounted view of it)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_manifest_build)
    c = msub.add_parser("list", help="a dataset's versions: when, how big, which is current, which nodes hold each")
    c.add_argument("name", help="dataset name")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_manifest_list)
    c = msub.add_parser("use", help="make an earlier version current again (a rollback)",
                        description="Set the dataset's CURRENT to VERSION, a manifest still in the state directory "
                                    "(see `dsstage manifest list`): jobs that start from now stage it; running jobs "
                                    "keep theirs. Build a new version with `dsstage manifest build`.")
    c.add_argument("name", help="dataset name")
    c.add_argument("version", help="the version: at least 8 hex digits of it")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_manifest_use)
    c = msub.add_parser("check", help="does the source still match the current manifest? exit 1 if not",
                        description="Walk the source (as source_user, never following a link) and compare its files "
                                    "with the current manifest by path, size and mtime, reading no content: what was "
                                    "added, removed or changed since `dsstage manifest build`. Exit 1 when anything "
                                    "differs: for a timer that tells the data owner "
                                    "(dsstage-manifest-check@NAME.timer).")
    c.add_argument("name", help="dataset name")
    c.add_argument("--from", dest="from_path", metavar="PATH", help="check the data here instead of the source")
    c.add_argument("--limit", type=int, default=20, metavar="N", help="paths listed per kind (default 20)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_manifest_check)
    m.set_defaults(handler=lambda _a: _usage(m))

    c = sub.add_parser("stage", help="stage datasets on this node and lease them")
    c.add_argument("name", help="dataset name, or several separated by commas")
    c.add_argument("--job-id", help="the job holding the lease (default: $SLURM_JOB_ID, else the calling shell)")
    c.add_argument("--user", help="stage on behalf of this user (root only; default: you)")
    c.add_argument("--full", action="store_true", help="re-hash a cached copy and repair it")
    c.add_argument("--with", dest="group", metavar="HOSTLIST",
                   help="stage together with these nodes, this one among them (peers.enabled): this node's "
                        "share from the source, the rest from them; of a sharded dataset, the shards a job on "
                        "these nodes would give this one (default: $SLURM_JOB_NODELIST; none: every shard)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_stage)

    pp = sub.add_parser("peers", help="the rsync daemon through which the nodes of a job share a stage")
    psub = pp.add_subparsers(dest="peers_command", metavar="COMMAND")
    c = psub.add_parser("serve", help="serve this node's tiers to its peers, in the foreground "
                        "(dsstage-peers.service runs it)")
    c.set_defaults(handler=_cmd_peers_serve)
    pp.set_defaults(handler=lambda _a: _usage(pp))

    c = sub.add_parser("release", help="release a job's lease on a dataset")
    c.add_argument("name", help="dataset name")
    c.add_argument("--job-id", required=True, help="the job whose lease to release")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_release)

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
    c.set_defaults(handler=_cmd_status)

    c = sub.add_parser("report", help="rebuild and publish this node's report (dsstage-report.timer runs it)")
    c.add_argument("--json", action="store_true", help="print the report")
    c.set_defaults(handler=_cmd_report)

    c = sub.add_parser("warm", help="stage a dataset without a job, here or on nodes over SSH",
                       description="Make the current version of NAME ready (verified) without keeping a lease: "
                                   "ahead of a reservation or a campaign. Retention keeps it as for any copy.")
    c.add_argument("name", help="dataset name")
    c.add_argument("--nodes", metavar="HOSTLIST", help="on these nodes, over SSH (fleet settings); of a sharded "
                   "dataset, each node stages the part a job on these nodes would give it")
    c.add_argument("--with", dest="group", metavar="HOSTLIST", help=argparse.SUPPRESS)  # what --nodes passes on
    c.add_argument("--progress-json", action="store_true", help=argparse.SUPPRESS)  # for --nodes
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_warm)

    c = sub.add_parser("export-catalog", help="write the catalog that job_submit.lua checks (Lua)")
    c.add_argument("-o", "--output", help="file to write (atomically); default: standard output")
    c.set_defaults(handler=_cmd_export_catalog)

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
    c.set_defaults(handler=_cmd_evict)

    for hook, does in (("prolog", "stage, reuse, fall back, hold or drain"),
                       ("epilog", "release and evict")):
        c = sub.add_parser(hook, help=f"what a job's {hook.capitalize()} would do on this node (--dry-run)",
                           description=f"Print what job ID's {hook.capitalize()} would {does} on this node (or "
                                       "--node NAME), and why, from the inputs the hook reads: the configuration, "
                                       "the job's request as Slurm recorded it, the manifests, the node's store, "
                                       "the demand snapshot. Nothing is changed: no lease, no lock, no copy, no "
                                       "report, nothing asked of Slurm but the job's record. For trying a node "
                                       "before enabling the hooks there. The hook itself runs from slurm.conf's "
                                       f"{hook.capitalize()}=.")
        c.add_argument("--dry-run", action="store_true", required=True, help="say what would be done; do nothing")
        c.add_argument("--job", required=True, metavar="ID", help="the job (pending or running)")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        c.set_defaults(handler=_cmd_hook_dry_run, hook=hook)

    c = sub.add_parser("disable", help="turn dsstage off on every node at once (jobs read their sources)",
                       description="Write <state_dir>/disabled.json, which every Prolog reads: from the next job on, "
                                   "a job that asks for a dataset is not staged but runs against its source, with a "
                                   "warning in its output that gives REASON; it is never held. Epilogs still give "
                                   "leases back; prefetch stages nothing. `dsstage enable` turns it back on. For a "
                                   "pilot, see rollout.partitions and rollout.nodes in the configuration.")
    c.add_argument("--reason", required=True, help="why (shown to the jobs' users and in the logs)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_disable)
    c = sub.add_parser("enable", help="turn dsstage back on after `dsstage disable`")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_enable)

    c = sub.add_parser("reclaim", help="remove this node's leases whose job is gone",
                       description="Uses the demand snapshot when it is fresh (no Slurm call); otherwise asks Slurm "
                                   "about each lease's job.")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_reclaim)

    c = sub.add_parser("demand-poller", help="write the queue's dataset demand into the state directory",
                       description="Run on the controller or a login node: every retention.poll_interval seconds, "
                                   "one squeue query, an atomic <state_dir>/demand.json, and old manifests pruned. "
                                   "Prologs and Epilogs read the snapshot and never ask Slurm for demand.")
    c.add_argument("--once", action="store_true", help="one round, then exit (for cron); exit 1 if it failed")
    c.add_argument("--interval", type=float, help="seconds between rounds (default: retention.poll_interval)")
    c.set_defaults(handler=_cmd_demand_poller)

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
    c.set_defaults(handler=_cmd_prefetch)

    bbp = sub.add_parser("bb", help="record or forget a #BB_LUA dataset= job's request (burst_buffer.lua runs it)",
                       description="Slurm's burst_buffer/lua runs these from sbatch_ext/burst_buffer.lua on the "
                                   "controller: pre_run records the job's datasets in <state_dir>/bb/<job id> for "
                                   "its Prolog (which cannot learn a #BB_LUA request otherwise), teardown forgets "
                                   "them.")
    bsub = bbp.add_subparsers(dest="bb_command", metavar="record|forget|nudge|status")
    b = bsub.add_parser("record", help="record the datasets a job asked for")
    b.add_argument("job_id", help="the job id")
    b.add_argument("datasets", help="NAME[,NAME...]: the job's #BB_LUA dataset= value")
    b.set_defaults(handler=_cmd_bb_record)
    b = bsub.add_parser("forget", help="remove a job's record")
    b.add_argument("job_id", help="the job id")
    b.set_defaults(handler=_cmd_bb_forget)
    b = bsub.add_parser("nudge", help="ask the acting demand poller for its next round now (data_in)",
                        description="data_in runs this for a job whose data is wanted soon: the demand poller that "
                                    "holds the lease takes its next round at once, so that the nodes' prefetch sees "
                                    "the job; no round runs here.")
    b.add_argument("job_id", help="the job id")
    b.set_defaults(handler=_cmd_bb_nudge)
    b = bsub.add_parser("status", help="compute the answer to a `scontrol show bbstat` question, in the background",
                        description="burst_buffer.lua starts this when its answer to a question is missing or old; "
                                    "it reads only dsstage's own files, never asks Slurm, and writes the answer "
                                    "into burst_buffer.status_dir, where the Lua reads it.")
    b.add_argument("key", help="the question: all, job=ID, dataset=NAME or node=HOSTLIST, optionally @UID")
    b.set_defaults(handler=_cmd_bb_status)
    bbp.set_defaults(handler=lambda _a: _usage(bbp))

    c = sub.add_parser("simulate", help="replay a job trace through retention policies and compare them",
                       add_help=False)  # its options are simulate.build_parser()'s: see dsstage simulate --help
    c.set_defaults(handler=_cmd_simulate)

    c = sub.add_parser("verify", help="check the local copy against the manifest")
    c.add_argument("name", help="dataset name")
    c.add_argument("--full", action="store_true", help="re-hash every file and repair what is wrong")
    c.add_argument("--nodes", metavar="HOSTLIST", help="on these nodes, over SSH (fleet settings)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(handler=_cmd_verify)
    _globals_after_verbs(p)
    return p


#: the options every verb takes, before or after its name (``dsstage prolog --dry-run --job 5
#: --node n1``); ``status`` has a ``--node`` of its own (a hostlist of nodes to show)
GLOBAL = (("--config", "configuration file (as before the command)"),
          ("--node", "node name for {node} in tier paths (as before the command)"))


def _globals_after_verbs(parser: argparse.ArgumentParser) -> None:
    """Give every verb the global options too, where it has none of its own of that name:
    given after the verb they win, left out they leave the global value (SUPPRESS)."""
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb in set(action.choices.values()):
                _globals_after_verbs(verb)
            return
    if parser.prog == "dsstage":
        return
    for option, text in GLOBAL:
        if option not in parser._option_string_actions:
            parser.add_argument(option, default=argparse.SUPPRESS, help=text)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
