"""Data-aware placement: a Slurm node feature per dataset ready on a node.

The demand poller (on the controller) keeps, on every node whose report is current, the
feature ``<placement.prefix><dataset>`` (``ds_imagenet22t``) for each dataset whose current
version is ready there, and none for the others; job_submit.lua gives each job a soft
``--prefer`` for its datasets' features (see sbatch_ext/dsstage_submit.lua), so that the
scheduler starts it where its data is when such a node is free, and anywhere otherwise.

``changes`` (pure) compares what the reports say with the features Slurm has (one
``sinfo`` per round) and gives one ``scontrol update`` per group of nodes that end with
the same feature lists: one Slurm call per change, none when nothing changed, and the
features come back by themselves after ``scontrol reconfigure`` (which resets them to
slurm.conf's) at the next round. dsstage changes only features with its prefix: every
other feature, available or active, is written back as Slurm had it (slurm.conf's,
configuration management's, a NodeFeaturesPlugins' whose active features differ from the
available ones), and a node whose own features are all that would change is not touched.
A node whose report is stale or missing is left alone: what it holds is not known (a down
node is not scheduled anyway). While dsstage is disabled (``dsstage disable``) no node keeps a
dataset feature, and during a pilot only the nodes within ``rollout`` do (``in_scope``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dsstage.cluster import reports as cluster_reports
from dsstage.hostlist import fold_nodes, natural_key
from dsstage.slurm.records import Node, down_nodes

log = logging.getLogger(__name__)


def feature(prefix: str, dataset: str) -> str:
    return prefix + dataset


def held(reports: Iterable[Mapping[str, Any]], prefix: str, now: float, max_age: float,
         down: Mapping[str, str]) -> dict[str, set[str]]:
    """node -> the dataset features its current report shows ready (current version);
    nodes whose report is stale are left out."""
    from dsstage.cluster.reports import stale_reason
    out: dict[str, set[str]] = {}
    for rep in reports:
        node = str(rep.get("node") or "")
        if not node or stale_reason(rep, now, max_age, down):
            continue
        out[node] = {feature(prefix, str(c.get("dataset"))) for c in rep.get("copies") or []
                     if c.get("state") == "ready" and c.get("current") and c.get("dataset")}
    return out


def changes(current: Mapping[str, tuple[Sequence[str], Sequence[str]]], wanted: Mapping[str, set[str]],
            prefix: str) -> list[tuple[list[str], list[str], list[str]]]:
    """The updates to make: (nodes, their whole new available list, their whole new active
    list), one per distinct pair. ``current``: node -> (available, active) in Slurm now;
    only nodes in both are changed, and only in the features with ``prefix``."""
    by_lists: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}
    for node in sorted(set(current) & set(wanted), key=natural_key):
        available, active = (list(x) for x in current[node])
        ours = sorted(wanted[node])
        new_available = [f for f in available if not f.startswith(prefix)] + ours
        new_active = [f for f in active if not f.startswith(prefix)] + ours
        if set(new_available) != set(available) or set(new_active) != set(active):
            by_lists.setdefault((tuple(new_available), tuple(new_active)), []).append(node)
    return [(nodes, list(avail), list(act)) for (avail, act), nodes in by_lists.items()]


def in_scope(wanted: Mapping[str, set[str]], nodes: Mapping[str, Node], switch: Mapping[str, Any] | None,
             partitions: Sequence[str] | None, rollout_nodes: Sequence[str] | None) -> dict[str, set[str]]:
    """``wanted`` as the switches allow: while dsstage is disabled (``switch`` on), no node keeps
    a dataset feature; during a pilot, nodes outside ``rollout.nodes`` or every one of
    ``rollout.partitions`` keep none (whatever their reports say: a copy left from before).
    Those nodes' features are known (none), so they are removed even without a report."""
    from dsstage.node.rollout import node_in_scope
    out = dict(wanted)
    for name, node in nodes.items():
        if switch is not None or not node_in_scope(partitions, rollout_nodes, name, node.partitions):
            out[name] = set()
    return out


def observe(conf: Any, slurm: Any, now: float) -> tuple[dict[str, Node], dict[str, set[str]]]:
    """Slurm's nodes (one ``sinfo``) and the features their current reports want (``held``),
    within the rollout and the cluster-wide switch (``in_scope``). Raises CommandError if Slurm
    cannot be asked."""
    from dsstage.hostlist import expand_nodes
    from dsstage.node.rollout import read_switch
    nodes = slurm.nodes()
    wanted = held(cluster_reports.read_all(conf.state_dir), conf.placement.prefix, now, conf.report.max_age,
                  down_nodes(nodes))
    scope = conf.rollout
    return nodes, in_scope(wanted, nodes, read_switch(conf.state_dir), scope.partitions,
                           expand_nodes(scope.nodes) if scope.nodes is not None else None)


Change = tuple[list[str], list[str], list[str]]


def sync(conf: Any, slurm: Any, *, now: float | None = None,
         observed: tuple[dict[str, Node], dict[str, set[str]]] | None = None) -> list[Change]:
    """One round: read the reports and Slurm's features (or take ``observed``, see
    ``observe``), make the changes; what was changed. Raises CommandError if Slurm cannot be
    asked."""
    now = time.time() if now is None else now
    nodes, wanted = observed or observe(conf, slurm, now)
    todo = changes({n.name: (n.features, n.active_features) for n in nodes.values()}, wanted, conf.placement.prefix)
    for names, available, active in todo:
        slurm.set_features(fold_nodes(names), available, active)
        log.info("node features of %s: available %s, active %s", fold_nodes(names), ",".join(available) or "(none)",
                 ",".join(active) or "(none)")
    return todo
