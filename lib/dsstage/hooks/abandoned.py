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
from collections.abc import Mapping

from dsstage.config import catalog as cat
from dsstage.config import load
from dsstage.config.model import Config
from dsstage.errors import DsstageError, OutOfTime
from dsstage.hooks import bbrequest
from dsstage.hooks.decisions import Verdict, on_failure
from dsstage.hooks.job import BB_REQUEST, JobContext, _slurm, decide, log_to_job

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
            out.append(on_failure(name, ds, error))
    if bb:
        out.append(Verdict(BB_REQUEST, "hold", None, f"the job's #BB_LUA request could not be read: {error}"))
    return out


def decide_without(which: str, code: int | None, budget: float, env: Mapping[str, str], run_dir: str,
                   config: Config | None = None) -> int:
    """The hook's exit code when its work (``code``: its exit, None if it did not answer) failed it."""
    log_to_job(env)
    ctx = JobContext.from_env(env)
    why = what_happened(which, code, budget)
    log.error("job %s: %s", ctx.job_id, why)
    if which != "prolog":
        log.error("job %s: the job's leases stay; they are reclaimed once the job is gone", ctx.job_id)
        return 0
    # a #BB_LUA record is in state_dir, which may be what hangs: not even looked for. Without
    # --dataset the hook script only runs Python for a job that has one (or when it could not tell)
    bb = not ctx.request and bool(env.get(bbrequest.ENV))
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
    error: DsstageError = OutOfTime(why) if code is None else DsstageError(why)
    outcomes = verdicts(ctx.request, bb, conf, user, error)
    return decide(ctx, outcomes, run_dir=run_dir, slurm=_slurm(conf.slurm_bin))
