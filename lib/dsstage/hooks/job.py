"""What the Slurm Prolog and Epilog do, and the one place their errors become exit codes.

A non-zero Prolog or Epilog exit drains the node, so the mapping is deliberate:
only a broken local store (``blame == "node"``) drains. A user's mistake, a forged
``--dataset`` value, a broken configuration, an unreachable or failing source, a failing
shared state directory, a full tier, a store path a user could steer, or a stage that
does not fit the Prolog's time budget never does: the job falls back to the source or is
requeued and held with a readable reason. Every failure ends in one of these decisions,
never in a job that runs without its data and without a word.

The Prolog leaves the job's TaskProlog output in ``<run dir>/<node>/jobs/<job id>.task``;
``prolog/dsstage-taskprolog`` prints it for every task without starting Python.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dsstage.config import catalog as cat
from dsstage.config import load
from dsstage.config.model import Config, Dataset
from dsstage.errors import DsstageError, LockTimeout, OutOfTime, UnsafeStore, VerifyError, local_error
from dsstage.fs import runfiles
from dsstage.hooks import bbrequest, bounded, joblog
from dsstage.hooks.bounded import stage_deadline
from dsstage.hooks.configcache import write_config_cache
from dsstage.hooks.decisions import (  # noqa: F401 (the hooks' decisions, used from here too)
    Verdict,
    job_action,
    off_verdicts,
    on_failure,
    task_lines,
    why_held,
)
from dsstage.hostlist import expand_nodes
from dsstage.node import breaker, eviction, inventory, jobrecord, rollout
from dsstage.node.store import Store

if TYPE_CHECKING:
    from dsstage.slurm.client import SlurmClient

log = logging.getLogger(__name__)

#: what a job asked for when its request is a burst-buffer record that could not be read
BB_REQUEST = "#BB_LUA dataset="


@dataclass(frozen=True)
class JobContext:
    job_id: str
    uid: int
    gid: int
    user: str
    node: str
    request: str | None
    nodes: str = ""  # the job's nodes, a Slurm hostlist

    @property
    def multi_node(self) -> bool:
        """Whether the job runs on more than one node (its decisions are then the job's)."""
        if not self.nodes or ("," not in self.nodes and "[" not in self.nodes):
            return False  # one node: no hostlist to expand (ClusterShell is not even imported)
        try:
            return len(expand_nodes(self.nodes)) > 1
        except ValueError:
            return False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobContext:
        request = next((env[v] for v in runfiles.REQUEST_VARS if env.get(v)), None)
        return cls(job_id=env.get("SLURM_JOB_ID", ""), uid=int(env.get("SLURM_JOB_UID", "-1") or -1),
                   gid=int(env.get("SLURM_JOB_GID", "-1") or -1), user=env.get("SLURM_JOB_USER", ""),
                   node=env.get("SLURMD_NODENAME", ""), request=request,
                   nodes=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))


# -- the Prolog -------------------------------------------------------------------------

def stage_all(ctx: JobContext, conf: Config, store: Store, deadline: float | None = None) -> list[Verdict]:
    """Stage every requested dataset on this node; one Verdict per dataset. ``deadline``
    (time.monotonic()) is when staging must stop so that the Prolog can still decide."""
    try:
        names = cat.parse_request(ctx.request or "")
        user = cat.User.lookup(ctx.uid if ctx.uid >= 0 else ctx.user)
    except DsstageError as exc:
        return [Verdict(ctx.request or "", "hold", None, str(exc))]
    # the staging machinery (the copier, rsync, the peers) is imported by the Prolog that stages
    # with it, not by the Epilog and the Prolog that holds a job
    from dsstage.hooks import shardjob
    from dsstage.node import staging
    versions = pinned_versions(ctx, conf, store, names)
    sharded_names = [n for n in names if (d := conf.datasets.get(n)) is not None and d.shards]
    outcomes = []
    part_of = shardjob.Job(ctx.job_id, ctx.node, ctx.nodes if ctx.multi_node else "", ctx.uid, ctx.gid)
    # an at-once dataset's stage gets start_budget from the Prolog's start, then the job starts on a live view
    at_once_deadline = time.monotonic() + conf.start_budget
    for name in names:
        ds = conf.datasets.get(name)
        at_once = ds is not None and ds.start == "at-once"
        if ds is not None:  # if this stage stops answering, the hook trips its source's breaker
            bounded.tell(f"staging {breaker.key_of(conf, ds)}")
        try:
            if ds is not None and ds.shards:
                cat.authorize(ds, user)
                outcomes.append(shardjob.stage(part_of, store, name, versions, user, deadline, sharded_names))
                bounded.tell("staged")
                continue
            stop, live_digest = deadline, None
            if at_once:
                stop = at_once_deadline if deadline is None else min(deadline, at_once_deadline)
                live_digest = versions.get(name) or current_version(store, name)  # read once, for the view
                if ds is not None and ds.verify != "full" and live_digest and live_pending(store, ds, live_digest):
                    # a view of the version is here, not whole: the job gets it at once, with a worker
                    raise OutOfTime("a live view of it is being finished on this node")
            result = staging.stage(store, name, staging.StageRequest(user=user, job_id=ctx.job_id, deadline=stop,
                                                                     nodes=ctx.nodes, digest=versions.get(name)))
        except DsstageError as exc:
            bounded.tell("staged")
            if at_once and ds is not None and live_digest and isinstance(exc, (OutOfTime, LockTimeout)):
                viewed = live_view(ctx, store, ds, live_digest, user, exc)
                if viewed is not None:
                    outcomes.append(viewed)
                    continue
            log.warning("job %s: %s: %s", ctx.job_id, name, exc)
            verdict = on_failure(name, ds, exc)
            if ds is not None and ds.shards:  # its part at the source, or the job held: never a rank without one
                verdict = shardjob.fallback(part_of, store, verdict, versions, sharded_names)
            outcomes.append(verdict)
            store.count(failure_events(name, outcomes[-1], exc) if ds else [])
            continue
        bounded.tell("staged")
        moved = ""
        if result.action == "staged":
            moved = (f" ({result.transferred_files} files, {result.transferred_bytes} bytes from the source; "
                     f"{result.peer_files} files, {result.peer_bytes} bytes from peers)")
        log.info("job %s: %s %s at %s in %.2fs%s", ctx.job_id, name, result.action, result.path, result.seconds,
                 moved)
        outcomes.append(Verdict(name, "local", result.path, result.action))
        label = {"dataset": name}
        store.count([("misses", label, 1), ("staged_bytes", label, result.transferred_bytes),
                     ("staged_seconds", label, result.seconds)] if result.action == "staged" else [("hits", label, 1)])
    return outcomes


def live_view(ctx: JobContext, store: Store, ds: Dataset, digest: str, user: cat.User,
              exc: DsstageError) -> Verdict | None:
    """An at-once dataset whose stage did not fit ``start_budget``: the job's live view
    (dsstage.hooks.live) of version ``digest``, or None where it cannot be made (then as for
    any failed stage)."""
    from dsstage.hooks import live
    try:
        return live.start(store, ds, digest, ctx.job_id, user,
                          f"its stage did not finish within start_budget ({store.config.start_budget:g}s): {exc}")
    except DsstageError as err:
        log.warning("job %s: %s: no live view (%s)", ctx.job_id, ds.name, err)
        return None


def live_pending(store: Store, ds: Dataset, digest: str) -> bool:
    from dsstage.node import live
    return live.pending(store, ds, digest)


def current_version(store: Store, name: str) -> str | None:
    """The dataset's current version, or None where it cannot be read (its stage meets the
    error and says so)."""
    try:
        return store.current(name)
    except DsstageError:
        return None


def pinned_versions(ctx: JobContext, conf: Config, store: Store, names: Sequence[str]) -> dict[str, str]:
    """For a job on several nodes, the version of each dataset all of them stage: the first
    node's reading of CURRENT (dsstage.node.jobrecord); {} for a one-node job. Where the
    record cannot be made or read, each node stages its own reading (as before) and says so."""
    if not ctx.multi_node:
        return {}
    chosen = {}
    for name in names:
        try:
            chosen[name] = store.current(name)
        except DsstageError:
            continue  # its stage meets the same error and reports it
    try:
        return jobrecord.pin(conf.state_dir, ctx.job_id, ctx.nodes, ctx.node, chosen, conf.report.user)
    except DsstageError as exc:
        log.warning("job %s: the job's nodes may stage different versions: %s", ctx.job_id, exc)
        return chosen


def failure_events(name: str, outcome: Verdict, exc: DsstageError) -> list[tuple[str, dict[str, str], float]]:
    """What a failed stage adds to the metrics: the fallback or hold, and a failed verification."""
    label = {"dataset": name}
    events: list[tuple[str, dict[str, str], float]] = []
    if outcome.action in ("fallback", "hold"):
        events.append(("fallbacks" if outcome.action == "fallback" else "holds", label, 1))
    if isinstance(exc, VerifyError):
        events.append(("verify_failures", label, 1))
    return events


def prolog(env: Mapping[str, str], *, run_dir: str, slurm: SlurmClient | None = None,
           load_config: Callable[[], Config] = load.load, started: float | None = None) -> int:
    """The Prolog for one job on this node; ``slurm`` defaults to the command-line client
    in the configuration's ``slurm_bin``."""
    started = time.monotonic() if started is None else started
    ctx = JobContext.from_env(env)
    bb = bbrequest.flagged(env)  # #BB_LUA dataset=, alone or with --dataset
    if not ctx.request and not bb:
        return 0
    store = None
    try:
        conf = load_config()
    except DsstageError as exc:
        outcomes = [Verdict(ctx.request or BB_REQUEST, "hold", None, f"dsstage is misconfigured on {ctx.node}: {exc}")]
        slurm = slurm or _slurm()
        return decide(ctx, outcomes, run_dir=run_dir, slurm=slurm)
    slurm = slurm or _slurm(conf.slurm_bin)
    if conf.unknown_keys:
        log.warning("%s: %s: unknown to this dsstage, ignored (a newer version's? upgrade this node)", conf.origin,
                    ", ".join(conf.unknown_keys))
    if bb:
        try:
            recorded = bb_request(ctx, conf, env)
        except (OSError, DsstageError) as exc:
            outcomes = [Verdict(BB_REQUEST, "hold", None, f"cannot read the job's #BB_LUA request: {exc}")]
            return decide(ctx, outcomes, run_dir=run_dir, slurm=slurm)
        ctx = replace(ctx, request=",".join(r for r in (ctx.request, recorded) if r) or None)  # repeats go later
        if not ctx.request:
            return 0
    why = off_here(conf, ctx, env.get("SLURM_JOB_PARTITION", ""))
    if why:
        log.info("job %s: %s: not staged, the job reads its sources", ctx.job_id, why)
        return decide(ctx, off_parts(ctx, conf, off_verdicts(ctx.request or "", conf, why), run_dir),
                      run_dir=run_dir, slurm=slurm)
    store = Store(conf, ctx.node or None, run_dir=run_dir, one_job=True)
    budget = conf.prolog_budget
    outcomes = stage_all(ctx, conf, store, deadline=started + stage_deadline(budget))
    write_config_cache(run_dir, conf)
    return decide(ctx, outcomes, run_dir=run_dir, slurm=slurm, store=store)


def off_parts(ctx: JobContext, conf: Config, outcomes: list[Verdict], run_dir: str) -> list[Verdict]:
    """Where dsstage does not act: a sharded dataset read at its source still gets this node's
    part of the job's plan (dsstage.hooks.shardjob.fallback), so that a job whose other nodes
    staged theirs (in the rollout, or before ``dsstage disable``) reads each part once."""
    sharded_names = [o.dataset for o in outcomes if (d := conf.datasets.get(o.dataset)) is not None and d.shards]
    if not any(o.path for o in outcomes if o.dataset in sharded_names):
        return outcomes
    from dsstage.hooks import shardjob
    store = Store(conf, ctx.node or None, run_dir=run_dir, one_job=True)
    part_of = shardjob.Job(ctx.job_id, ctx.node, ctx.nodes if ctx.multi_node else "", ctx.uid, ctx.gid)
    # every dataset of the job pinned, not only these: the first node to pin decides for all
    versions = pinned_versions(ctx, conf, store, [o.dataset for o in outcomes if o.dataset in conf.datasets])
    return [shardjob.fallback(part_of, store, o, versions, sharded_names, may_hold=False)
            if o.dataset in sharded_names else o for o in outcomes]


def off_here(conf: Config, ctx: JobContext, partition: str) -> str | None:
    """Why dsstage does not act for this job here (the rollout's partitions and nodes, the
    cluster-wide switch), or None."""
    nodes = None
    if conf.rollout.nodes is not None:
        try:
            nodes = set(expand_nodes(conf.rollout.nodes))
        except ValueError:
            nodes = set()
    return rollout.off_reason(rollout.read_switch(conf.state_dir), conf.rollout.partitions, nodes, partition,
                              ctx.node)


def bb_request(ctx: JobContext, conf: Config, env: Mapping[str, str]) -> str | None:
    """The datasets of a ``#BB_LUA dataset=`` job, from the record its pre_run left
    (dsstage.hooks.bbrequest), or None if there is none any more."""
    request = bbrequest.read(conf.state_dir, ctx.job_id, bbrequest.writer_uid(conf.burst_buffer.user))
    where = bbrequest.directory(conf.state_dir)
    if request is None:
        log.error("job %s: no #BB_LUA record in %s (the hook script found one in %s=%s): set %s to %s in the "
                  "defaults file", ctx.job_id, where, bbrequest.ENV, env.get(bbrequest.ENV), bbrequest.ENV, where)
    else:
        log.info("job %s: #BB_LUA request %s", ctx.job_id, request)
    return request


def decide(ctx: JobContext, outcomes: list[Verdict], *, run_dir: str, slurm: SlurmClient,
           store: Store | None = None) -> int:
    """Carry out the job's decision: the TaskProlog's file, the hold, the exit code; then the
    node's report. The hook waiting on this process is told each step done (bounded.tell), so
    that a stop in the report's write to the shared state directory loses nothing."""
    try:
        write_task_file(run_dir, ctx, task_lines(outcomes))
        action = job_action(outcomes)
        bounded.tell(f"decided {action} {why_held(outcomes) if action == 'hold' else ''}")
    except (OSError, DsstageError) as exc:
        # without its file the job would run without its variables and without a word; the
        # error's blame decides (errors.py): only the node's own broken disk drains it, a full
        # run directory or too few descriptors (the site's), an unsafe one (a user's) hold the job
        err = local_error(exc, f"writing the TaskProlog's file in {run_dir}") if isinstance(exc, OSError) else exc
        what = "the run directory is unsafe" if isinstance(err, UnsafeStore) else "the run directory cannot be written"
        log.error("job %s: cannot write the TaskProlog's file in %s (%s): %s", ctx.job_id, run_dir, what, err)
        action = "drain" if err.blame == "node" else "hold"
        outcomes = [*outcomes, Verdict(ctx.request or "", action, None, f"{what} on {ctx.node}: {err}")]
    action = job_action(outcomes)
    if action == "hold" and not holds_it(ctx, store):
        pass  # another node of the job tells Slurm; this node's hold mark stops its tasks
    elif action == "hold":  # for a drain Slurm requeues and holds the job itself
        try:
            done = slurm.hold(ctx.job_id, why_held(outcomes))
            log.info("job %s: %s", ctx.job_id, done)
        except DsstageError as exc:
            # the task file's hold mark still stops the job's tasks (see dsstage-taskprolog)
            log.error("job %s: could not hold it in Slurm: %s", ctx.job_id, exc)
    bounded.tell("held")
    if store is not None:
        inventory.refresh(store)  # after the hold: the shared state directory may be what hangs
    if action == "drain":
        why = "; ".join(o.reason for o in outcomes if o.action == "drain")
        log.error("job %s: draining %s: %s", ctx.job_id, ctx.node, why)
        try:  # the reason where the admin looks (sinfo -R); the exit drains the node regardless
            slurm.drain(ctx.node, why)
        except DsstageError as exc:
            log.error("job %s: could not give Slurm the drain reason: %s", ctx.job_id, exc)
        return 1
    return 0


def holds_it(ctx: JobContext, store: Store | None) -> bool:
    """Whether this node is the one of its job that asks Slurm to hold it: always for a
    one-node job; for more, the first to claim it (dsstage.node.jobrecord), or any node
    where the claim cannot be made (a job held twice beats a job not held)."""
    if not ctx.multi_node or store is None:
        return True
    conf = store.config
    try:
        won, by = jobrecord.claim_hold(conf.state_dir, ctx.job_id, ctx.nodes, ctx.node, conf.report.user)
    except (OSError, DsstageError) as exc:
        log.warning("job %s: cannot tell the job's other nodes that this one holds it (%s): holding it here",
                    ctx.job_id, exc)
        return True
    if not won:
        log.info("job %s: held by node %s of the job; not asking Slurm again from %s", ctx.job_id, by, ctx.node)
    return won


def epilog(env: Mapping[str, str], *, run_dir: str,
           load_config: Callable[[], Config] = load.load) -> int:
    """Release the job's leases, reclaim leases of jobs that are gone, then apply the
    retention plan: evictions are renames into the trash, deleted in the background."""
    ctx = JobContext.from_env(env)
    # a #BB_LUA job has no request in its environment: its Prolog's file says it had one
    if not remove_task_file(run_dir, ctx) and not ctx.request:
        return 0
    try:
        conf = load_config()
    except DsstageError as exc:
        # leases stay; they are reclaimed once the job is known to be gone
        log.error("job %s: cannot release leases, configuration broken: %s", ctx.job_id, exc)
        return 0
    store = Store(conf, ctx.node or None, run_dir=run_dir, one_job=True)
    try:
        released = store.release_job(ctx.job_id)  # local: first, whatever the shared state directory does
        log.info("job %s: released %s", ctx.job_id, ", ".join(x.dataset for x in released) or "nothing")
        if ctx.multi_node:
            jobrecord.forget(conf.state_dir, ctx.job_id, conf.report.user)
        retain(store, ctx.job_id)
    except DsstageError as exc:
        # leases stay; they are reclaimed once the job is gone
        log.error("job %s: releasing leases or applying retention failed: %s", ctx.job_id, exc)
        return 1 if exc.blame == "node" else 0
    inventory.refresh(store)
    return 0


def retain(store: Store, job_id: str) -> None:
    """The Epilog's retention pass, with the demand snapshot; a stale one is said."""
    dem, snap = store.demand()
    if dem.stale:
        bound = store.config.retention.demand_max_age
        why = snap.problem or f"the demand snapshot is {dem.age:.0f}s old (bound {bound:g}s)"
        log.warning("job %s: %s: retention decides without the queue's demand, keeping what it cannot judge "
                    "and leaving leases alone", job_id, why)
    else:
        for lease in store.reclaim_stale(snap):
            log.info("job %s: reclaimed the lease of job %s on %s: the job is gone", job_id, lease.job_id,
                     lease.dataset)
    for e in eviction.retain(store, dem):
        if e.action != "kept":
            log.info("job %s: %s %s %s (%s)", job_id, e.action, e.dataset, e.version, e.reason)


# -- files ----------------------------------------------------------------------------

def write_task_file(run_dir: str, ctx: JobContext, lines: Sequence[str]) -> None:
    runfiles.write_task_file(run_dir, ctx.node, ctx.job_id, lines, (ctx.uid, ctx.gid))


def remove_task_file(run_dir: str, ctx: JobContext) -> bool:
    """Remove the job's TaskProlog file; False if there was none (or it cannot be reached)."""
    try:
        return runfiles.remove_task_file(run_dir, ctx.node, ctx.job_id)
    except (OSError, DsstageError):
        return False


def main(argv: Sequence[str] | None = None, *, started: float | None = None, config: Config | None = None) -> int:
    """The hook ``argv[0]`` (``prolog`` or ``epilog``) for the job in the environment; ``started``
    (time.monotonic()) is when the hook began, ``config`` the configuration if already loaded."""
    argv = list(sys.argv[1:] if argv is None else argv)
    log_to_job(os.environ)
    run_dir = os.environ.get("DSSTAGE_RUN_DIR", runfiles.RUN_DIR)
    which = argv[0] if argv else ""
    load_config: Callable[[], Config] = (lambda: load.load(run_dir=run_dir)) if config is None else (lambda: config)
    try:
        if which == "prolog":
            return prolog(os.environ, run_dir=run_dir, load_config=load_config, started=started)
        if which == "epilog":
            return epilog(os.environ, run_dir=run_dir, load_config=load_config)
        if which == "live":  # a live view's worker (dsstage.hooks.live), started by a Prolog
            from dsstage.hooks import live
            return live.main(argv[1:])
    except Exception as exc:  # a bug must not drain the node, nor pass in silence: hold the job
        log.exception("dsstage %s failed unexpectedly for job %s", which, os.environ.get("SLURM_JOB_ID"))
        if which == "prolog":
            return on_bug(os.environ, run_dir, exc)
        return 0
    print("usage: python -m dsstage.hooks prolog|epilog", file=sys.stderr)
    return 2


def log_to_job(env: Mapping[str, str]) -> None:
    """The hooks' logging: every line to syslog and the configured file, with the job id."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[JobLogHandler(env)], force=True)


class JobLogHandler(logging.Handler):
    """The hooks' log lines to syslog and the configured file, each with the job id
    (dsstage.hooks.joblog)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        super().__init__()
        self.env = env
        self.job_id = env.get("SLURM_JOB_ID", "")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            joblog.write(self.format(record), record.levelname, job_id=self.job_id, env=self.env)
        except Exception:  # noqa: BLE001 - logging must never fail a hook
            self.handleError(record)


def _slurm(bin_dir: str | None = None) -> SlurmClient:
    from dsstage.slurm.client import BIN_DIR, client
    return client(bin_dir or BIN_DIR)


def on_bug(env: Mapping[str, str], run_dir: str, exc: BaseException) -> int:
    """The Prolog failed unexpectedly: the job is held with the reason (never a drain)."""
    ctx = JobContext.from_env(env)
    if not ctx.request and not bbrequest.flagged(env):
        return 0
    reason = f"dsstage failed unexpectedly on {ctx.node} ({type(exc).__name__}: {exc}); an admin should check its log"
    try:
        decide(ctx, [Verdict(ctx.request or BB_REQUEST, "hold", None, reason)], run_dir=run_dir, slurm=_slurm())
    except Exception:  # noqa: BLE001 - the last resort: logged, the node stays up
        log.exception("job %s: could not hold the job either", ctx.job_id)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
