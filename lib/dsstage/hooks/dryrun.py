"""What a job's Prolog or Epilog would decide on a node, without doing it (``dsstage prolog
--dry-run``, ``dsstage epilog --dry-run``): for an admin trying a node before enabling the
hooks there, or asking why a job was held.

The dry run reads what the hook reads (the configuration, the job's request as Slurm
recorded it, the manifests, the node's store, the demand snapshot) and takes no lease, no
lock, copies nothing, writes no report and changes nothing in Slurm. Its verdicts come from
the same rules the hooks use (``job.on_failure``, ``job.job_action``, the retention planner),
so what it prints is what the hook would do if nothing changed in between: another stage may
finish, a copy may be evicted, the queue may move.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsstage.config import catalog as cat
from dsstage.config.model import Config, Dataset
from dsstage.errors import DsstageError, NoSpace, SourceError, StoreError
from dsstage.fs import layout as fs_layout
from dsstage.fs import safe
from dsstage.fs.safe import RootDir
from dsstage.hooks.decisions import Verdict, job_action, on_failure, task_lines
from dsstage.node import eviction, staging
from dsstage.node.lock import read_owner
from dsstage.node.store import Store, open_tier
from dsstage.ready import lease as ready_lease
from dsstage.slurm.records import Job
from dsstage.units import human


@dataclass
class Step:
    """One dataset of the job on this node: the verdict and how the Prolog would get there."""

    verdict: Verdict
    notes: list[str] = field(default_factory=list)


def prolog(conf: Config, store: Store, job: Job) -> list[Step]:
    """What the Prolog of ``job`` would do on ``store.node``, dataset by dataset."""
    names = list(job.datasets)
    try:
        user = cat.User.lookup(job.user)
    except DsstageError as exc:
        return [Step(Verdict(",".join(names), "hold", None, str(exc)))]
    return [one(conf, store, name, user, job) for name in names]


def one(conf: Config, store: Store, name: str, user: cat.User, job: Job) -> Step:
    ds = conf.datasets.get(name)
    step = Step(Verdict(name, "local", None, ""))
    try:
        ds = store.dataset(name)
        cat.authorize(ds, user)
        digest = store.current(name)
        step.notes.append(f"version {fs_layout.version_id(digest)} (the current one; a job on several nodes "
                          "stages the version its first node reads)")
        layout = store.layout(ds.tier)
        path = layout.version_dir(name, digest)
        problem = None if layout.root_filesystem else safe.root_filesystem_problem(layout.root)
        if problem:
            raise StoreError(f"tier {ds.tier}: {problem}")
        if not os.path.isdir(layout.root):
            step.notes.append(f"tier {ds.tier}: {layout.root} holds nothing yet")
            return _stage(conf, store, ds, digest, path, step, None)
        with open_tier(layout, create=False) as tier:
            state = store.ready_state(tier, name, digest)
            why_not = ready_lease.reusable(tier, name, digest, ds.verify)  # the stage's own rule
            if why_not is None:
                step.verdict = Verdict(name, "local", path, "cached")
                step.notes.append(f"reuse: a ready copy at {path} ({state.reason}); the Prolog takes a lease "
                                  "and copies nothing")
                return step
            step.notes.append(f"no ready copy here: {state.reason}" if not state.ready else
                              f"{why_not}: the Prolog takes the lock and does so")
            return _stage(conf, store, ds, digest, path, step, tier)
    except DsstageError as exc:
        step.verdict = on_failure(name, ds, exc)
        step.notes.append(f"{type(exc).__name__}: {exc}")
        return step


def _stage(conf: Config, store: Store, ds: Dataset, digest: str, path: str, step: Step,
           tier: RootDir | None) -> Step:
    """The stage the Prolog would make, and whether it fits: the stage's own plan
    (dsstage.node.staging.plan_fill, dsstage.node.eviction.room_for), said and not carried out."""
    from dsstage.node import breaker
    from dsstage.transfer.transport import describe
    name = ds.name
    record, gate = breaker.look(conf, ds)
    if record is not None and gate.kind == "open":  # as staging.closed: the dataset's on_failure at once
        raise SourceError(f"{name!r} is not staged: the breaker of {breaker.key_of(conf, ds)} is open: {gate.reason}")
    if record is not None and gate.kind == "probe":
        step.notes.append(f"the breaker of {breaker.key_of(conf, ds)} is due a probe ({gate.reason}): the Prolog "
                          "probes the source first, and takes the dataset's on_failure at once if it does not answer")
    plan = staging.plan_fill(store, tier, ds, digest)
    if plan.lent:
        step.notes.append(f"older versions here lend {human(plan.lent)} by hard links")
    if ds.source.kind == "local":
        problem = source_problem(ds.source.path)
        if problem:
            raise SourceError(f"the source of {name!r}: {problem}")
    step.notes.append(f"stage: {plan.manifest.files} files, {human(plan.needed)} to fetch from {ds.source.raw} "
                      f"with {describe(ds.source)}, verified against the BLAKE3 manifest, within prolog_budget "
                      f"({conf.prolog_budget:g}s)")
    if ds.start == "at-once":
        step.notes.append(f"start: at-once: if the stage takes more than start_budget ({conf.start_budget:g}s), "
                          "the job starts on a live view and the stage goes on in the background")
    if conf.peers.enabled:
        step.notes.append("peers: on a job of several nodes each fetches its share from the source and the rest "
                          "from the others")
    if plan.room is not None:  # (a tier that exists)
        owner = read_owner(store.layout(ds.tier).lock(name))
        if owner:
            step.notes.append(f"the dataset's lock is held ({owner.get('action') or 'stage'} on {owner.get('host')} "
                              f"pid {owner.get('pid')} job {owner.get('job_id') or '-'}): the Prolog would wait "
                              "for it within its budget")
        tier_conf = conf.tiers[ds.tier]
        room = plan.room
        if not room.fits:
            exc = NoSpace(eviction.no_room(store, tier_conf, name, plan.needed, room))
            step.verdict = on_failure(name, ds, exc)
            step.notes.append(f"NoSpace: {exc}")
            return step
        for d in room.evictions():
            step.notes.append(f"make room: evict {d.copy.dataset} {d.copy.version} ({human(d.copy.bytes)}): "
                              f"{d.reason}")
        if room.plan is None:
            step.notes.append(f"space: tier {ds.tier} holds {human(room.use.total)} of {human(room.space.capacity)}; "
                              f"{human(plan.needed)} more fits without evicting")
    step.verdict = Verdict(name, "local", path, "staged")
    return step


#: seconds the dry run waits for the source's directory to answer (a hung mount)
SOURCE_WAIT = 5.0


def source_problem(path: str, wait: float = SOURCE_WAIT) -> str | None:
    """Why a mounted source cannot be read (missing, not a directory, no answer within
    ``wait``: a hung shared filesystem), or None. The look runs in a thread this process
    does not wait for, so a hung mount cannot hold the dry run."""
    import threading
    answer: list[str | None] = []

    def look() -> None:
        try:
            os.scandir(path).close()  # a missing, unreadable or non-directory source raises
            answer.append(None)
        except OSError as exc:
            answer.append(f"{path}: {exc.strerror or exc}")
    t = threading.Thread(target=look, daemon=True)
    t.start()
    t.join(wait)
    if not answer:
        return f"{path} did not answer within {wait:g}s (a hung shared filesystem?)"
    return answer[0]


def render_prolog(job: Job, node: str, steps: Sequence[Step]) -> str:
    """The dry run as an admin reads it: per dataset, then the job's outcome."""
    out = [f"job {job.job_id} ({job.user}, {job.state.lower()}) on {node}: the Prolog would"]
    for s in steps:
        v = s.verdict
        what = {"local": f"give {v.path}", "fallback": f"fall back to {v.path}",
                "hold": "hold the job", "drain": "drain the node"}[v.action]
        out.append(f"  {v.dataset}: {what} ({v.reason})")
        out += [f"    - {n}" for n in s.notes]
    action = job_action([s.verdict for s in steps])
    outcome = {"run": "the job runs", "hold": "the job is held (scontrol hold, with the reason above); "
               "its node stays in service", "drain": "the node drains (scontrol update State=DRAIN)"}[action]
    out.append(f"  then: {outcome}")
    lines = [x for x in task_lines([s.verdict for s in steps]) if not x.startswith("#")]
    if lines:
        out.append("  the TaskProlog would print:")
        out += [f"    {x}" for x in lines]
    out.append("  (dry run: no lease, no lock, no copy, no report, nothing changed in Slurm)")
    return "\n".join(out)


def as_dict(job: Job, node: str, steps: Sequence[Step]) -> dict[str, object]:
    return {"job": job.job_id, "node": node, "action": job_action([s.verdict for s in steps]),
            "datasets": [{"dataset": s.verdict.dataset, "action": s.verdict.action, "path": s.verdict.path,
                          "reason": s.verdict.reason, "notes": s.notes} for s in steps]}


def epilog(store: Store, job_id: str) -> tuple[list[str], list[eviction.Eviction]]:
    """What the Epilog of ``job_id`` would do here: the datasets whose leases it would give
    back, and the retention plan with them given back."""
    from dsstage.node.lease import LeaseBook
    leased = set()
    for tier_conf in store.config.tiers.values():
        layout = store.layout(tier_conf)
        if os.path.isdir(layout.root):
            with open_tier(layout, create=False) as tier:
                leased |= {lease.dataset for lease in LeaseBook(tier).of_job(job_id)}
    dem, _snap = store.demand()
    return sorted(leased), eviction.retain(store, dem, dry_run=True, released=job_id)
