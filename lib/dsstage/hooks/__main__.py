"""``python -I -c CODE prolog|epilog``: what the Prolog and Epilog scripts run (``python -m
dsstage.hooks`` does the same, at the cost of runpy's imports: about 6 ms, 2026-11-29).

The hook's work runs in a child bounded by the budget (dsstage.hooks.bounded): the Prolog
first tries the warm path (``dsstage.hooks.warm``: standard library only); only a job it does
not answer loads the full Prolog (``dsstage.hooks.job``), which decides and explains. When the
work does not answer in time (a hung shared filesystem or source) or dies, the hook keeps what
it had decided, or decides without it (dsstage.hooks.abandoned). Nothing here exits non-zero
but the work's own verdict that this node's store is broken.
"""

from __future__ import annotations

import os
import sys
import time

from dsstage.fs import runfiles
from dsstage.hooks import bounded, warm
from dsstage.node import metrics
from dsstage.ready import warmconf

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

#: what the hook scripts run with ``python -I -c`` (prolog/dsstage-prolog, epilog/dsstage-epilog)
CODE = "import sys; from dsstage.hooks.__main__ import main; sys.exit(main(sys.argv[1:]))"
#: the budget when the configuration cannot be read (config.model's default; the full
#: Prolog then holds the job at once, saying why)
DEFAULT_BUDGET = 300.0


def budget(run_dir: str, config_path: str) -> tuple[float, Any, Any]:
    """The hooks' budget (``prolog_budget``), the warm path's configuration cache (written by
    the full Prolog) where it knew the budget, else the configuration if it could be loaded.
    Only local files are read: the cache in the run directory, the configuration in /etc."""
    cache = warmconf.read(run_dir, config_path)
    if cache is not None:
        return cache.prolog_budget, cache, None
    from dsstage.config import load
    from dsstage.errors import DsstageError
    try:
        conf = load.load(config_path, run_dir=run_dir)
    except DsstageError:
        return DEFAULT_BUDGET, None, None  # the work meets the same error and holds the job
    return conf.prolog_budget, None, conf


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv not in (["prolog"], ["epilog"]):
        from dsstage.hooks import job
        return job.main(argv)  # says how to call it
    started = time.monotonic()
    try:
        return hook(argv[0], started)
    except Exception as exc:  # a bug here must not drain the node, nor pass in silence: hold the job
        from dsstage.hooks import job
        job.log_to_job(os.environ)
        job.log.exception("dsstage %s failed unexpectedly for job %s", argv[0], os.environ.get("SLURM_JOB_ID"))
        if argv[0] == "prolog":
            return job.on_bug(os.environ, os.environ.get("DSSTAGE_RUN_DIR", runfiles.RUN_DIR), exc)
        return 0


def hook(which: str, started: float) -> int:
    env = os.environ
    run_dir = env.get("DSSTAGE_RUN_DIR", runfiles.RUN_DIR)
    seconds, cache, conf = budget(run_dir, env.get("DSSTAGE_CONFIG") or runfiles.CONFIG_PATH)

    def work() -> int:
        if which == "prolog" and cache is not None:  # no cache: the warm path could not answer
            rc = warm.main([which], cache)
            if rc is not None:
                return rc
        from dsstage.hooks import job
        return job.main([which], started=started, config=conf)

    outcome = bounded.run(work, started + bounded.wait_limit(seconds) - time.monotonic())
    if outcome.code == 0 or outcome.code == 1:  # 1: the work found this node's store broken, and drains it
        rc = outcome.code
    else:
        from dsstage.hooks import abandoned
        rc = abandoned.finish(which, outcome, seconds, started, env, run_dir, conf)
    took(run_dir, env.get("SLURMD_NODENAME", ""), which, time.monotonic() - started, outcome.code is None)
    return rc


def took(run_dir: str, node: str, hook: str, seconds: float, abandoned: bool) -> None:
    """The hook's duration in its histogram (dsstage_hook_seconds), and whether it left its work
    behind (counted from 0, so that an alert on its increase sees the first one)."""
    try:
        metrics.count(run_dir, node, [("hooks_abandoned", {"hook": hook}, int(abandoned))],
                      [("hook_seconds", {"hook": hook}, seconds)])
    except ValueError:
        pass  # not a node name: nothing is counted (the work said so in its log)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
