"""What the Prolog and Epilog decide when their work did not answer (dsstage.hooks.bounded).

The work ran in a child that did not end within the budget (the shared filesystem or a
dataset's source stopped answering) or that died. The hook decides without it, from local
things only: the configuration in /etc, the passwd and group databases, the run directory
and slurmctld. Nothing here reads ``state_dir`` or a source: they are what may hang.

* Prolog: each dataset gets its ``on_failure`` (the source where it is mounted and allowed,
  else a hold), exactly as for a stage that failed; never a drain, since the node's own
  store is not what failed.
* Epilog: the job's leases stay and are reclaimed once the job is gone; exit 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from dsstage.config import catalog as cat
from dsstage.config import load
from dsstage.config.model import Config
from dsstage.errors import DsstageError, OutOfTime
from dsstage.fs import runfiles
from dsstage.hooks import bbrequest, bounded
from dsstage.hooks.decisions import Verdict, on_failure
from dsstage.hooks.job import BB_REQUEST, JobContext, _slurm, decide, log_to_job, write_task_file

log = logging.getLogger(__name__)


def what_happened(which: str, code: int | None, budget: float) -> str:
    """Why the hook decided without its work, for the log and the job."""
    if code is None:
        return (f"dsstage's {which} did not finish within prolog_budget ({budget:g}s): the shared filesystem "
                f"(state_dir) or a dataset's source stopped answering; the work was stopped and the next stage "
                f"resumes it")
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return f"dsstage's {which} ended unexpectedly ({how}); an admin should check its log"


def verdicts(request: str | None, bb: bool, conf: Config, user: cat.User | None, error: DsstageError) -> list[Verdict]:
    """Each requested dataset's verdict when its stage did not answer (pure): unknown names and
    datasets the user may not use are held, the rest get their ``on_failure``. A ``#BB_LUA``
    request, whose record is in ``state_dir``, cannot be read: the job is held."""
    out = []
    if request:
        try:
            names = cat.parse_request(request)
        except DsstageError as exc:
            names, out = [], [Verdict(request, "hold", None, str(exc))]
        for name in names:
            try:
                ds = cat.lookup(conf, name)
                if user is None:
                    raise DsstageError(f"the job's user is not known on this node: {name!r} is not given to it")
                cat.authorize(ds, user)
            except DsstageError as exc:
                out.append(Verdict(name, "hold", None, str(exc)))
                continue
            verdict = on_failure(name, ds, error)
            if ds.shards and verdict.action == "fallback":
                # this node's part of the job's plan is in the state directory, which may be what
                # hangs: a fallback without it would give this rank the whole dataset, or nothing
                verdict = Verdict(name, "hold", None, f"{verdict.reason}; this node's part of {name!r} cannot be "
                                  "told now: held, so that no rank reads another node's part or the whole dataset")
            out.append(verdict)
    if bb:
        out.append(Verdict(BB_REQUEST, "hold", None, f"the job's #BB_LUA request could not be read: {error}"))
    return out


def finish(which: str, outcome: bounded.Outcome, budget: float, started: float, env: Mapping[str, str],
           run_dir: str, config: Config | None = None) -> int:
    """The hook's exit code when its work did not end well (``outcome``): the work's decision
    where it had written one (the Slurm hold it had not asked for yet is asked here), else this
    module's, each bounded by what is left of the budget; at the very last the job's TaskProlog
    file alone (local) keeps its tasks from starting."""
    log_to_job(env)
    ctx = JobContext.from_env(env)
    why = what_happened(which, outcome.code, budget)
    log.error("job %s: %s", ctx.job_id, why)
    if which != "prolog":
        log.error("job %s: the job's leases stay; they are reclaimed once the job is gone", ctx.job_id)
        return 0
    decided = outcome.last("decided ")
    if decided is not None:  # the job's TaskProlog file is written: that decision stands
        action, _, reason = decided.partition(" ")
        log.warning("job %s: the Prolog had decided (%s) before it was stopped: its decision stands", ctx.job_id,
                    action)
        if action == "drain":
            return 1
        if action == "hold" and outcome.last("held") is None:
            bounded.run(lambda: hold_only(ctx, reason or why, config), started + budget - time.monotonic())
        return 0
    out = bounded.run(lambda: decide_without(ctx, why, outcome.code is None, env, run_dir, config),
                      started + budget - time.monotonic())
    suspect = hung_source(outcome)
    if suspect and outcome.code is None:  # after the job's decision, with what is left of the budget
        left = min(TRIP_SECONDS, started + budget - time.monotonic())
        bounded.run(lambda: trip(suspect, ctx.node, why, config), left)
    if out.code == 0 or out.code == 1:
        return out.code
    if out.last("decided ") is None:  # not even that answered (slurm_bin or NSS hang too): the local mark
        log.error("job %s: deciding without the work did not finish either: its tasks are stopped by the "
                  "TaskProlog's hold mark", ctx.job_id)
        try:
            write_task_file(run_dir, ctx, [runfiles.HOLD_MARK, f"print dsstage: error: {why}"])
        except (OSError, DsstageError) as exc:
            log.error("job %s: cannot write its TaskProlog file either: %s", ctx.job_id, exc)
    return 0


#: the most the hook spends tripping a breaker, after the job's decision
TRIP_SECONDS = 2.0


def hung_source(outcome: bounded.Outcome) -> str | None:
    """The breaker key of the source the work was staging from when it stopped answering
    (its last ``staging KEY`` with no ``staged`` after it), or None (pure)."""
    current = None
    for message in outcome.said:
        if message.startswith("staging "):
            current = message[len("staging "):].strip() or None
        elif message == "staged":
            current = None
    return current


def trip(key: str, node: str, why: str, config: Config | None) -> int:
    """Open ``key``'s breaker (dsstage.node.breaker): the cluster's next stages from that source
    decide at once. Run bounded: the state directory may be what hangs."""
    from dsstage.fs.identity import writing_as
    from dsstage.node import breaker
    try:
        conf = config or load.load()
        with writing_as(conf.report.user):
            breaker.trip(conf.state_dir, key, node, why, time.time())
    except (OSError, DsstageError) as exc:
        log.warning("cannot trip the breaker of %s: %s", key, exc)
        return 0
    log.error("the breaker of %s is open: the next stages from it, on every node, decide at once until a probe "
              "finds it answering", key)
    return 0


def hold_only(ctx: JobContext, reason: str, config: Config | None) -> int:
    """Ask Slurm to hold the job (the work decided so, and was stopped before it asked)."""
    slurm = _slurm(config.slurm_bin if config else None)
    try:
        log.info("job %s: %s", ctx.job_id, slurm.hold(ctx.job_id, reason))
    except DsstageError as exc:
        log.error("job %s: could not hold it in Slurm: %s", ctx.job_id, exc)
    return 0


def decide_without(ctx: JobContext, why: str, timed_out: bool, env: Mapping[str, str], run_dir: str,
                   config: Config | None = None) -> int:
    """The Prolog's exit code when its work failed it (``why``; ``timed_out``: it did not answer)."""
    bb = bbrequest.maybe(env)  # a #BB_LUA record is in state_dir, which may be what hangs: not looked for
    if not ctx.request and not bb:
        return 0
    try:
        conf = config or load.load()
    except DsstageError as exc:
        held = [Verdict(ctx.request or BB_REQUEST, "hold", None, f"dsstage is misconfigured on {ctx.node}: {exc}")]
        return decide(ctx, held, run_dir=run_dir, slurm=_slurm())
    try:
        user: cat.User | None = cat.User.lookup(ctx.uid if ctx.uid >= 0 else ctx.user)
    except DsstageError:
        user = None
    error: DsstageError = OutOfTime(why) if timed_out else DsstageError(why)
    outcomes = verdicts(ctx.request, bb, conf, user, error)
    return decide(ctx, outcomes, run_dir=run_dir, slurm=_slurm(conf.slurm_bin))
