"""``python -I -m dsstage.hooks prolog|epilog``: what the Prolog and Epilog scripts run.

The hook's work runs in a child bounded by the budget (dsstage.hooks.bounded): the Prolog
first tries the warm path (``dsstage.hooks.warm``: standard library only); only a job it does
not answer loads the full Prolog (``dsstage.hooks.job``), which decides and explains. When the
work does not answer in time (a hung shared filesystem or source) or dies, the hook decides
without it (dsstage.hooks.abandoned).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from dsstage.fs import runfiles
from dsstage.hooks import bounded, warm
from dsstage.node import metrics

#: the budget when the configuration cannot be read (config.model's default; the full
#: Prolog then holds the job at once, saying why)
DEFAULT_BUDGET = 300.0


def budget(run_dir: str, config_path: str) -> tuple[float, Any]:
    """The hooks' budget (``prolog_budget``) and the configuration if it had to be loaded for
    it (None when the warm path's cache, written by the full Prolog, knew it). Only local
    files are read: the cache in the run directory, the configuration in /etc."""
    cache = runfiles.load_cache(run_dir, config_path)
    if cache is not None and isinstance(cache.get("prolog_budget"), (int, float)):
        return float(cache["prolog_budget"]), None
    from dsstage.config import load
    from dsstage.errors import DsstageError
    try:
        conf = load.load(config_path)
    except DsstageError:
        return DEFAULT_BUDGET, None  # the work meets the same error and holds the job
    return conf.prolog_budget, conf


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv not in (["prolog"], ["epilog"]):
        from dsstage.hooks import job
        return job.main(argv)  # says how to call it
    started = time.monotonic()
    env = os.environ
    run_dir = env.get("DSSTAGE_RUN_DIR", runfiles.RUN_DIR)
    seconds, conf = budget(run_dir, env.get("DSSTAGE_CONFIG") or runfiles.CONFIG_PATH)

    def work() -> int:
        if argv == ["prolog"] and conf is None:
            rc = warm.main(argv)
            if rc is not None:
                return rc
        from dsstage.hooks import job
        return job.main(argv, started=started, config=conf)

    code = bounded.run(work, started + bounded.wait_limit(seconds) - time.monotonic())
    if code == 0 or code == 1:  # 1: the work found this node's store broken, and drains it
        rc = code
    else:
        from dsstage.hooks import abandoned
        rc = abandoned.decide_without(argv[0], code, seconds, env, run_dir, conf)
    took(run_dir, env.get("SLURMD_NODENAME", ""), argv[0], time.monotonic() - started, code is None)
    return rc


def took(run_dir: str, node: str, hook: str, seconds: float, abandoned: bool) -> None:
    """The hook's duration in its histogram (dsstage_hook_seconds), and whether it left its work behind."""
    try:
        metrics.count(run_dir, node, [("hooks_abandoned", {"hook": hook}, 1)] * abandoned,
                      [("hook_seconds", {"hook": hook}, seconds)])
    except ValueError:
        pass  # not a node name: nothing is counted (the work said so in its log)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
