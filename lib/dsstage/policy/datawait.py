"""A bounded wait for the data: which pending jobs wait for the nodes that hold their dataset.

``--prefer`` (placement.prefer) never waits: a job whose data's nodes are busy starts on
any free node and stages its dataset again there. With ``placement.wait_for_data`` set,
the demand poller makes the preference hard for a while: a job waits for the nodes that
hold its datasets when enough of them do and enough of them are expected to be free (by
their running jobs' time limits) within that time. It is the rule ``dsstage simulate
--wait-for-data`` measures (docs/simulation.md, section f), on a real queue.

Slurm has no "prefer these nodes, but wait for them up to an hour", so the poller writes
the wait as an exclusion: the job's ``ExcNodeList`` becomes every node but the holders,
and a marker in its AdminComment records when the wait began and which nodes dsstage
excluded (``dsstage-wait=SINCE:HOSTLIST``). Backfill then reserves the holders for the
job as for any job that can run only there, and the jobs behind it use the other nodes
meanwhile. Each round ``decide`` looks again, and the exclusion is lifted (``ExcNodeList``
emptied, the marker turned into ``dsstage-waited=SINCE``, never set again for that job)
as soon as any of these holds:

- the job has waited ``wait_for_data`` since the round that first made it wait;
- fewer holders than the job needs hold the data, are up, or are expected free by then;
- backfill plans it on them only after then (another job takes them first, or they cannot
  run it: memory, GRES, a reservation);
- the wait is switched off (``wait_for_data: 0``), dsstage is disabled on the whole
  cluster (``dsstage disable``), or the job's partitions are outside ``rollout.partitions``;
- the job is held, names nodes or runs in a reservation; its constraint, exclusion or
  nodes were changed by someone else (the exclusion is then theirs: it is left as it is,
  only the marker goes).

A job is made to wait only if it is pending and not held, backfill expects it to start
within ``wait_for_data`` (a job deep in the queue would spend its wait behind other jobs),
it names no nodes (``-w``), excludes none (``-x``) and runs in no reservation, and its
constraint is empty or a plain list of features all of which must hold (``gpu&nvme``):
the holders must have them. (dsstage.cluster.datawait also leaves out pending arrays not
split into tasks yet, heterogeneous and federated jobs.)
A job with any other constraint (``|``, counts, brackets) keeps its soft preference only.

``decide`` is pure: the poller gathers the jobs and nodes (dsstage.cluster.datawait),
``decide`` gives an action with its reason per job, the poller carries it out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

#: the marker of a job that waits: ``dsstage-wait=SINCE:EXCLUDED`` (epoch seconds, hostlist)
WAITING = "dsstage-wait"
#: the marker of a job that waited once (or was let go): it never waits again
WAITED = "dsstage-waited"
_MARKER_RE = re.compile(r"(?:^|\s)(dsstage-wait(?:ed)?)=(\d+)(?::(\S*))?(?=\s|\Z)")
#: a constraint the holders can be checked against: names that must all hold
_PLAIN_CONSTRAINT = re.compile(r"[A-Za-z0-9_.\-]+(?:&[A-Za-z0-9_.\-]+)*")
#: node states in which a node runs jobs (sinfo %T, before any "+flag"); a trailing "*"
#: (not responding) or any other state (down, drained, draining, fail, maint, reserved,
#: power...) takes a node out of the holders a job may wait for
_RUNNING_STATES = ("idle", "mixed", "allocated", "completing", "planned")


@dataclass(frozen=True)
class Marker:
    """What a job's AdminComment says about its wait."""

    waiting: bool  # True: dsstage-wait (it waits now); False: dsstage-waited (done)
    since: int
    excluded: str = ""  # the hostlist dsstage set as the job's ExcNodeList


def marker(admin_comment: str) -> Marker | None:
    m = _MARKER_RE.search(admin_comment or "")
    if not m:
        return None
    return Marker(m.group(1) == WAITING, int(m.group(2)), m.group(3) or "")


def marker_text(mark: Marker | None) -> str:
    if mark is None:
        return ""
    return f"{WAITING}={mark.since}:{mark.excluded}" if mark.waiting else f"{WAITED}={mark.since}"


def with_marker(admin_comment: str, mark: Marker | None, own_part: re.Pattern[str] | None = None) -> str:
    """``admin_comment`` with its wait marker replaced by ``mark`` (removed for None).

    The marker goes before dsstage's hold message, which runs to the end of the comment
    (``own_part``, see dsstage.slurm.hold); everything else is kept as it is."""
    text = _MARKER_RE.sub("", admin_comment or "")
    tail = ""
    if own_part is not None:
        m = own_part.search(text)
        if m:
            text, tail = text[:m.start()], text[m.start():]
    words = " ".join(w for w in (text.strip(), marker_text(mark)) if w)
    return f"{words}{tail}" if words else tail.strip()


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    datasets: tuple[str, ...]
    nodes: int  # the nodes it needs (the minimum it asked for)
    partitions: tuple[str, ...]
    held: bool  # priority 0: held by its user, an admin or a requeue
    expected_start: float | None  # backfill's plan; None: not planned
    req_nodes: str = ""  # -w
    exc_nodes: str = ""  # its ExcNodeList now (-x, or dsstage's)
    constraint: str = ""  # -C, as Slurm shows it
    reservation: str = ""  # --reservation
    admin_comment: str = ""
    #: why dsstage does not act for this job ("": it does): the cluster-wide switch is on,
    #: or its partitions are outside the rollout (dsstage.node.rollout)
    off: str = ""


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # sinfo %T
    partitions: tuple[str, ...]
    features: frozenset[str]  # active
    busy_until: float = 0.0  # the latest time limit of the jobs running on it (0: none)

    @property
    def runs_jobs(self) -> bool:
        return not self.state.endswith("*") and self.state.split("+")[0] in _RUNNING_STATES


@dataclass(frozen=True)
class Action:
    """``wait``: set ExcNodeList to ``exclude`` and the marker; ``lift``: empty ExcNodeList
    (``restore``: only if it is still what dsstage set) and mark the job done; ``keep``:
    nothing to change. ``reason`` says why, for the log."""

    job_id: str
    kind: str  # "wait", "lift", "keep"
    reason: str
    exclude: str = ""
    marker: Marker | None = None
    restore: bool = False
    holders: tuple[str, ...] = field(default=())


def decide(jobs: Iterable[PendingJob], nodes: Mapping[str, NodeState], holders: Mapping[str, set[str]], now: float,
           bound: float, fold: Callable[[Iterable[str]], str], expand: Callable[[str], list[str]]) -> list[Action]:
    """One action per job that waits, waited, or may wait now (see the module docstring).

    ``holders``: dataset -> the nodes whose current report shows it ready; ``fold`` and
    ``expand`` turn node names into a hostlist and back (dsstage.hostlist); ``bound``:
    ``placement.wait_for_data`` in seconds (0: off). Jobs with nothing to do are left out."""
    out = []
    for job in jobs:
        mark = marker(job.admin_comment)
        if mark is not None and not mark.waiting:
            continue  # it waited once: never again
        ours = mark is not None and set(expand(job.exc_nodes)) == set(expand(mark.excluded))

        def lift(reason: str, mark: Marker | None = mark, ours: bool = ours, job: PendingJob = job) -> Action:
            done = Marker(False, mark.since if mark else int(now))
            return Action(job.job_id, "lift", reason, marker=done, restore=ours)

        if mark is not None and not ours:
            out.append(lift("its excluded nodes were changed by someone else: left as they are"))
            continue
        why_not, chosen = _why_not(job, nodes, holders, now, bound, mark)
        if why_not:
            if mark is not None:
                out.append(lift(why_not))
            continue
        exclude = fold(sorted(set(nodes) - set(chosen)))
        if not exclude:
            if mark is not None:
                out.append(lift("every node holds its data"))
            continue
        since = mark.since if mark else int(now)
        new = Marker(True, since, exclude)
        kind = "keep" if mark == new else "wait"
        waited = f"waiting since {int(now) - since} s" if mark else "starts waiting"
        out.append(Action(job.job_id, kind, f"{waited} for {fold(chosen)}, which hold {','.join(job.datasets)}",
                          exclude=exclude, marker=new, holders=tuple(chosen)))
    return out


def _why_not(job: PendingJob, nodes: Mapping[str, NodeState], holders: Mapping[str, set[str]], now: float,
             bound: float, mark: Marker | None) -> tuple[str, list[str]]:
    """Why ``job`` must not wait now ("" if it may), and the nodes it may wait for."""
    if bound <= 0:
        return "placement.wait_for_data is off", []
    if job.off:
        return job.off, []
    if mark is not None and now - mark.since >= bound:
        return f"waited {int(now - mark.since)} s, placement.wait_for_data is {bound:g} s", []
    deadline = mark.since + bound if mark is not None else now + bound
    if job.held:
        return "held", []
    if job.reservation:
        return "it runs in a reservation", []
    if not job.datasets:
        return "no dataset", []
    if job.req_nodes:
        return "it names its nodes", []
    if mark is None and job.exc_nodes:
        return "it excludes nodes of its own", []
    if job.constraint and not _PLAIN_CONSTRAINT.fullmatch(job.constraint):
        return f"its constraint {job.constraint!r} is not a plain list of features", []
    if mark is None and (job.expected_start is None or job.expected_start > deadline):
        return "backfill does not expect it to start within placement.wait_for_data", []
    if mark is not None and job.expected_start is not None and job.expected_start > deadline:
        return "backfill expects it on the nodes it waits for only after placement.wait_for_data", []
    need = set(job.constraint.split("&")) if job.constraint else set()
    have = set(holders.get(job.datasets[0], ())) & set(nodes)
    for name in job.datasets[1:]:
        have &= holders.get(name, set())
    usable = sorted(n for n in have if nodes[n].runs_jobs and need <= nodes[n].features
                    and (not job.partitions or set(job.partitions) & set(nodes[n].partitions)))
    if len(usable) < job.nodes:
        return f"{len(usable)} node(s) up hold {','.join(job.datasets)}, it needs {job.nodes}", []
    soon = [n for n in usable if nodes[n].busy_until <= deadline]
    if len(soon) < job.nodes:
        return (f"{len(soon)} of the nodes holding {','.join(job.datasets)} are expected free within "
                f"{bound:g} s of its first round, it needs {job.nodes}"), []
    return "", usable
