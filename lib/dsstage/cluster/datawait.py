"""The demand poller's bounded wait for data: gather what ``dsstage.policy.datawait.decide``
needs from Slurm and the nodes' reports, and carry out its actions (``scontrol update`` of
the job's ExcNodeList and AdminComment). See the policy module for the rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial

from dsstage.config.model import Config
from dsstage.errors import CommandError
from dsstage.hostlist import expand_nodes, fold_nodes
from dsstage.node import rollout
from dsstage.policy import datawait
from dsstage.slurm.client import SlurmClient
from dsstage.slurm.hold import OWN_PART
from dsstage.slurm.records import Job, Node, Placing

log = logging.getLogger(__name__)

_PENDING = "PENDING"


#: job ids above this carry a federation's cluster id: an update would go to their origin cluster
_FEDERATED = 1 << 26


def _commented(mark: datawait.Marker | None, current: str) -> str:
    """The job's AdminComment ``current`` with its wait marker made ``mark``."""
    return datawait.with_marker(current, mark, OWN_PART)


def marked(jobs: list[Job]) -> bool:
    """Whether any job carries a wait marker (which a round must be able to lift)."""
    return any(datawait.marker(j.admin_comment) for j in jobs)


def sync(conf: Config, slurm: SlurmClient, jobs: list[Job], nodes: Mapping[str, Node],
         wanted: Mapping[str, set[str]], now: float) -> list[datawait.Action]:
    """One round: decide for every pending job with a dataset and apply; the actions taken.

    ``wanted``: node -> the dataset features its current report shows ready (features.held).
    With placement.features off the wait is off (waits are only lifted). With the wait off
    and no job marked, Slurm is not asked anything more."""
    bound = conf.placement.wait_for_data if conf.placement.features else 0.0
    if not bound and not marked(jobs):
        return []
    placing = slurm.placing()
    pending, by_id = candidates(jobs, placing, off_reasons(conf, rollout.read_switch(conf.state_dir)))
    if not pending:
        return []
    actions = datawait.decide(pending, node_states(jobs, placing, nodes), holders(wanted, conf.placement.prefix),
                              now, bound, fold=lambda names: fold_nodes(list(names)), expand=expand_nodes)
    for act in actions:
        if act.kind == "keep":
            continue
        exclude = act.exclude if act.kind == "wait" else ("" if act.restore else None)
        try:
            done = slurm.set_exclusion(act.job_id, placing[act.job_id].job_ref, exclude,
                                       partial(_commented, act.marker))
        except CommandError as exc:  # it started or ended meanwhile
            log.warning("job %s: %s: not done: %s", act.job_id, act.kind, exc)
            continue
        if not done:
            log.info("job %s: %s: not done: no longer pending", act.job_id, act.kind)
        elif act.kind == "wait":
            log.info("job %s waits for its data: %s (excluded %s)", act.job_id, act.reason, act.exclude)
        else:
            log.info("job %s no longer waits for its data: %s%s", act.job_id, act.reason,
                     "" if act.restore else " (its excluded nodes left as they are)")
    return actions


def off_reasons(conf: Config, switch: Mapping[str, object] | None) -> Callable[[tuple[str, ...]], str]:
    """Why dsstage does not act for a job in these partitions ("" if it does): the switch
    (``dsstage disable``) or ``rollout.partitions``. A job outside waits for nothing."""
    if switch is not None:
        why = rollout.off_reason(switch, None, None, "", "") or ""
        return lambda partitions: why

    def off(partitions: tuple[str, ...]) -> str:
        if rollout.job_in_scope(conf.rollout.partitions, partitions):
            return ""
        return (f"its partition {','.join(partitions)} is outside the rollout (rollout.partitions: "
                f"{', '.join(conf.rollout.partitions or ())})")
    return off


def candidates(jobs: list[Job], placing: Mapping[str, Placing],
               off: Callable[[tuple[str, ...]], str] = lambda partitions: "",
               ) -> tuple[list[datawait.PendingJob], dict[str, Job]]:
    """The pending jobs with a dataset, as the policy sees them; and the jobs by id. Never
    a pending array not split yet, a heterogeneous job (an update reaches every component)
    or a federated one (it would go to the origin cluster). ``off``: why dsstage does not act
    for a job in these partitions (``off_reasons``)."""
    out, by_id = [], {}
    for j in jobs:
        p = placing.get(j.job_id)
        if (j.state != _PENDING or not j.datasets or p is None or p.state != _PENDING or p.array_pending
                or p.heterogeneous or int(j.job_id) >= _FEDERATED):
            continue
        by_id[j.job_id] = j
        partitions = tuple(x for x in j.partition.split(",") if x)
        out.append(datawait.PendingJob(
            job_id=j.job_id, datasets=j.datasets, nodes=max(p.nodes, 1),
            partitions=partitions, held=j.priority == 0,
            expected_start=j.start_time, req_nodes=p.req_nodes, exc_nodes=p.exc_nodes, constraint=p.constraint,
            reservation=p.reservation, admin_comment=j.admin_comment, off=off(partitions)))
    return out, by_id


def node_states(jobs: list[Job], placing: Mapping[str, Placing],
                nodes: Mapping[str, Node]) -> dict[str, datawait.NodeState]:
    """Each node with the latest expected end of the jobs on it (a job whose end Slurm does
    not show keeps its nodes busy for good)."""
    busy: dict[str, float] = {}
    for j in jobs:
        if j.state == _PENDING or not j.nodes:
            continue
        p = placing.get(j.job_id)
        end = p.end_time if p is not None and p.end_time is not None else float("inf")
        for n in expand_nodes(j.nodes):
            busy[n] = max(busy.get(n, 0.0), end)
    return {name: datawait.NodeState(name=name, state=n.state, partitions=n.partitions,
                                     features=frozenset(n.active_features), busy_until=busy.get(name, 0.0))
            for name, n in nodes.items()}


def holders(wanted: Mapping[str, set[str]], prefix: str) -> dict[str, set[str]]:
    """dataset -> the nodes whose current report shows it ready."""
    out: dict[str, set[str]] = {}
    for node, feats in wanted.items():
        for f in feats:
            if f.startswith(prefix):
                out.setdefault(f[len(prefix):], set()).add(node)
    return out
