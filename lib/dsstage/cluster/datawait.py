"""The demand poller's bounded wait for data: gather what ``dsstage.policy.datawait.decide``
needs from Slurm and the nodes' reports, and carry out its actions (``scontrol update`` of
the job's ExcNodeList and AdminComment). See the policy module for the rule.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from dsstage.config.model import Config
from dsstage.errors import CommandError
from dsstage.hostlist import expand_nodes, fold_nodes
from dsstage.policy import datawait
from dsstage.slurm.client import SlurmClient
from dsstage.slurm.hold import OWN_PART
from dsstage.slurm.records import Job, Node, Placing

log = logging.getLogger(__name__)

_PENDING = "PENDING"


def sync(conf: Config, slurm: SlurmClient, jobs: list[Job], nodes: Mapping[str, Node],
         wanted: Mapping[str, set[str]], now: float) -> list[datawait.Action]:
    """One round: decide for every pending job with a dataset and apply; the actions taken.

    ``wanted``: node -> the dataset features its current report shows ready (features.held).
    With the wait off and no job marked, Slurm is not asked anything more."""
    bound = conf.placement.wait_for_data
    if not bound and not any(datawait.marker(j.admin_comment) for j in jobs):
        return []
    placing = slurm.placing()
    pending, by_id = candidates(jobs, placing)
    if not pending:
        return []
    actions = datawait.decide(pending, node_states(jobs, placing, nodes), holders(wanted, conf.placement.prefix),
                              now, bound, fold=lambda names: fold_nodes(list(names)), expand=expand_nodes)
    for act in actions:
        if act.kind == "keep":
            continue
        job = by_id[act.job_id]
        exclude = act.exclude if act.kind == "wait" else ("" if act.restore else placing[act.job_id].exc_nodes)
        comment = datawait.with_marker(job.admin_comment, act.marker, OWN_PART)
        try:
            slurm.set_exclusion(act.job_id, exclude, comment)
        except CommandError as exc:  # it started or ended meanwhile
            log.warning("job %s: %s: not done: %s", act.job_id, act.kind, exc)
            continue
        if act.kind == "wait":
            log.info("job %s waits for its data: %s (excluded %s)", act.job_id, act.reason, act.exclude)
        else:
            log.info("job %s no longer waits for its data: %s%s", act.job_id, act.reason,
                     "" if act.restore else " (its excluded nodes left as they are)")
    return actions


def candidates(jobs: list[Job], placing: Mapping[str, Placing]) -> tuple[list[datawait.PendingJob], dict[str, Job]]:
    """The pending jobs with a dataset, as the policy sees them; and the jobs by id."""
    out, by_id = [], {}
    for j in jobs:
        p = placing.get(j.job_id)
        if j.state != _PENDING or not j.datasets or p is None or p.array_pending or p.state != _PENDING:
            continue
        by_id[j.job_id] = j
        out.append(datawait.PendingJob(
            job_id=j.job_id, datasets=j.datasets, nodes=max(p.nodes, 1),
            partitions=tuple(x for x in j.partition.split(",") if x), held=j.priority == 0,
            expected_start=j.start_time, req_nodes=p.req_nodes, exc_nodes=p.exc_nodes, constraint=p.constraint,
            admin_comment=j.admin_comment))
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
