"""What every verb shares: loading the configuration, printing data as text or ``--json``, the
caller as a catalog user, progress lines, and running a verb on nodes over SSH.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from dsstage.cli.output import write_json
from dsstage.config import catalog as cat
from dsstage.config import load, model
from dsstage.errors import DsstageError, NotPermitted
from dsstage.fs import runfiles
from dsstage.node.store import StageResult
from dsstage.units import human

log = logging.getLogger("dsstage")



def load_config(args: argparse.Namespace) -> model.Config:
    """The configuration, parsed once per state of the file (dsstage.config.load)."""
    return load.load(args.config, run_dir=runfiles.default_run_dir())


def need_root(verb: str, what: str) -> None:
    """Before a verb that changes or reads this node's root-owned store: say so to anyone
    else, rather than let the store's first EACCES read as a failing disk."""
    if os.geteuid() != 0:
        raise NotPermitted(f"`dsstage {verb}` {what}, which only root may do: run it as root on the node "
                           "(jobs get their data through the Prolog: sbatch --dataset=NAME)")


def need_write(verb: str, path: str) -> None:
    """Before a verb that writes ``path`` (or creates it): refuse at once, naming it, when
    the caller may not write there, rather than after the work (a manifest build hashes the
    whole source first)."""
    if os.geteuid() == 0:
        return
    here = os.path.abspath(path)
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    target = here if os.path.isdir(here) or here != os.path.abspath(path) else os.path.dirname(here)
    if not os.access(target, os.W_OK):
        raise NotPermitted(f"`dsstage {verb}` writes {path}, and you may not write to {target}: run it as root, "
                           "or as the user who owns it")


def emit(args: argparse.Namespace, data: Any, text: Callable[[], None]) -> None:
    if getattr(args, "json", False):
        write_json(data)
    else:
        text()


def how(r: StageResult) -> str:
    if r.action == "staged":
        reused = f", {r.linked_files} reused from an older version" if r.linked_files else ""
        peers = f", {r.peer_files} files, {human(r.peer_bytes)} from peers" if r.peer_files else ""
        return f"staged {r.transferred_files} files, {human(r.transferred_bytes)}{peers}{reused}"
    return {"cached": "already here", "repaired": "repaired"}.get(r.action, r.action)


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


def run_on_nodes(args: argparse.Namespace, conf: model.Config, what: str, argv: list[str]) -> int:
    """Run ``dsstage <argv> --json`` on ``--nodes`` over SSH, with a bar per node and a summary."""
    from dsstage.cluster import fleet_view
    fleet = fleet_module(args)
    targets = fleet.addresses(fleet.parse_nodes_arg(args.nodes), conf.slurm_bin)
    remote = [*argv, "--json", *(["--progress-json"] if what == "warm" else [])]
    with fleet_view.progress_view(list(targets), what, not args.json) as (on_progress, on_done):
        from dsstage.cluster import ssh as cluster_ssh  # paramiko: 0.1-0.2 s to import, for fleet commands only
        answers = cluster_ssh.run(conf.fleet, targets, lambda _node: remote, on_progress=on_progress, on_done=on_done)
    data = {node: {"ok": a.ok, "address": a.address, "exit_code": a.exit_code, "error": a.error or None,
                   "result": a.result, "seconds": a.seconds} for node, a in sorted(answers.items())}
    emit(args, data, lambda: fleet_view.print_summary(answers, describe(what)))
    return fleet.exit_code(answers)


def describe(what: str) -> Callable[[Any], str]:
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


def fleet_module(args: argparse.Namespace) -> Any:
    """dsstage.cluster.fleet, with paramiko's tracebacks for failed connections kept out of the way
    (each node's failure is one line of the summary; --debug shows them)."""
    from dsstage.cluster import fleet  # with the SSH client: imported by the commands that reach nodes
    if not args.debug:
        from dsstage.cluster.ssh import SSH_LOGGER
        logging.getLogger(SSH_LOGGER).setLevel(logging.CRITICAL)
    return fleet


def live_reports(args: argparse.Namespace, conf: model.Config, nodes: str | None,
                  client: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``dsstage report --json`` on every node (``nodes``, else every node Slurm knows)."""
    fleet = fleet_module(args)
    if nodes:
        names = fleet.parse_nodes_arg(nodes)
    elif client is not None:
        names = sorted(client.nodes())
    else:
        raise DsstageError("--live needs the nodes: give --node HOSTLIST (or let dsstage ask Slurm: "
                           "leave out --no-queue)")
    targets = fleet.addresses(names, conf.slurm_bin)
    from dsstage.cluster import ssh as cluster_ssh  # paramiko: 0.1-0.2 s to import, for fleet commands only
    answers = cluster_ssh.run(conf.fleet, targets, lambda _node: ["report", "--json"])
    reports = [a.result for a in answers.values() if a.ok and isinstance(a.result, dict)]
    failed = {n: (a.error or "no report in its answer") for n, a in answers.items()
              if not (a.ok and isinstance(a.result, dict))}
    return reports, failed


def reader_of(conf: model.Config) -> Any:
    """Who reads sources: the configured source_user (as root), else whoever runs this."""
    if not conf.source_user:
        return None
    from dsstage.fs import identity
    return identity.lookup(conf.source_user)


def user_of(args: argparse.Namespace) -> cat.User:
    if args.user is None:
        return cat.User.lookup()
    if os.geteuid() != 0:
        raise DsstageError("--user is for root (the Prolog stages on behalf of the job's user)")
    return cat.User.lookup(args.user)
