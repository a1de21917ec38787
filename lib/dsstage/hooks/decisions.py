"""The decisions of the Prolog, as pure functions: what a job gets for each dataset (a
``Verdict``), what a failure means for it (``on_failure``), what the whole job gets
(``job_action``: run, hold or drain) and what its tasks are told (``task_lines``).
The Prolog (dsstage.hooks.job) and its dry run (dsstage.hooks.dryrun) both decide here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsstage.config import catalog as cat
from dsstage.config.model import Config, Dataset
from dsstage.errors import AccessDenied, DsstageError, UnknownDataset
from dsstage.fs import runfiles


@dataclass(frozen=True)
class Verdict:
    """What a job gets for one dataset, and why."""

    dataset: str
    action: str  # "local": the staged copy | "fallback": the source | "hold" | "drain"
    path: str | None
    reason: str
    #: more for the job's environment: (KEY, value) gives DSSTAGE_<KEY>_<NAME> (and DSSTAGE_<KEY>
    #: for the first dataset), e.g. a sharded dataset's ("FILES", the list of this node's files)
    exports: tuple[tuple[str, str], ...] = ()


# -- decisions (pure) -----------------------------------------------------------------

def on_failure(name: str, ds: Dataset | None, error: DsstageError) -> Verdict:
    """What to do for a dataset that could not be staged."""
    if error.blame == "node":
        return Verdict(name, "drain", None, f"the local store of this node is broken: {error}")
    if ds is None or isinstance(error, (UnknownDataset, AccessDenied)) or error.blame in ("config", "user"):
        # never fall back here: the user may not read the source, or there is none
        return Verdict(name, "hold", None, str(error))
    # "source" and "site": the source, the shared state, a full tier, an unsafe store path,
    # the time budget: never this node's fault, so never a drain
    if ds.on_failure == "fallback":
        if ds.source.kind == "local":
            return Verdict(name, "fallback", ds.source.path,
                           f"could not stage {name!r} ({error}); reading {ds.source.path} directly, which is slower")
        return Verdict(name, "hold", None, f"{error} (no fallback: the source {ds.source.raw} is not mounted here)")
    return Verdict(name, "hold", None, str(error))


def job_action(outcomes: Sequence[Verdict]) -> str:
    """"drain" if the node is broken, else "hold" if any dataset must hold the job, else "run"."""
    actions = {o.action for o in outcomes}
    if "drain" in actions:
        return "drain"
    return "hold" if "hold" in actions else "run"


def task_lines(outcomes: Sequence[Verdict]) -> list[str]:
    """TaskProlog output: the variables a task needs, and warnings for its output."""
    lines = runfiles.export_lines([(o.dataset, o.path) for o in outcomes if o.path])
    exported = [o for o in outcomes if o.path]
    for o in exported:
        lines += runfiles.more_exports(o.dataset, o.exports, first=o is exported[0])
    for o in outcomes:
        if o.action == "fallback":
            lines.append(f"print dsstage: warning: {_one_line(o.reason)}")
    if job_action(outcomes) != "run":
        lines.append(runfiles.HOLD_MARK)
        lines += [f"print dsstage: error: {_one_line(o.reason)}" for o in outcomes if o.action in ("hold", "drain")]
    return lines


def why_held(outcomes: Sequence[Verdict]) -> str:
    """The one-line reason Slurm shows for a held job (slurm.hold bounds and cleans it)."""
    bad = [o for o in outcomes if o.action == "hold"]
    return _one_line("; ".join(_one_line(o.reason) for o in bad))


def _one_line(text: str) -> str:
    return " ".join(text.split())


def off_verdicts(request: str, conf: Config, why: str) -> list[Verdict]:
    """Where dsstage does not act: every dataset read from its source, with a warning; never a
    hold (a mounted source is given as the dataset's path, another is named)."""
    try:
        names = cat.parse_request(request)
    except DsstageError:
        return [Verdict(request, "fallback", None, f"{why}; the job's request is not staged")]
    out = []
    for name in names:
        ds = conf.datasets.get(name)
        if ds is not None and ds.source.kind == "local":
            out.append(Verdict(name, "fallback", ds.source.path, f"{why}; reading {ds.source.path} directly"))
        else:
            where = f"read it from {ds.source.raw}" if ds is not None else "it is not in the catalog"
            out.append(Verdict(name, "fallback", None, f"{why}; {name} is not staged: {where}"))
    return out
