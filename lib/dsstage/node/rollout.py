"""Switches for a rollout: where dsstage acts, and one place to turn it off.

* ``rollout.partitions`` and ``rollout.nodes`` in the configuration: a pilot. Jobs in other
  partitions, and on other nodes, are not staged.
* ``<state_dir>/disabled.json`` (``dsstage disable --reason TEXT``, ``dsstage enable``): off on
  every node at once, with the admin's reason, read by every Prolog from the shared state
  directory it already reads.

Where dsstage does not act, a job that asked for a dataset is never held and never fails: it
runs against the dataset's source (``DSSTAGE_PATH_<NAME>`` names a mounted source) with a
warning in its output that says why. The Epilog still gives back whatever leases the job has.

Imports only the standard library and dsstage.fs: the warm path reads the switch too.
"""

from __future__ import annotations

import os

from dsstage.fs import formats, safe

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Collection, Mapping
    from typing import Any

SWITCH = "disabled.json"


def switch_path(state_dir: str) -> str:
    return os.path.join(state_dir, SWITCH)


def read_switch(state_dir: str) -> dict[str, Any] | None:
    """The cluster-wide switch if it is on (its record: reason, by, time), else None."""
    path = switch_path(state_dir)
    if not os.path.lexists(path):
        return None
    record = safe.read_json(path)
    return record or {"reason": f"{path} exists (unreadable)"}


def off_reason(switch: Mapping[str, Any] | None, partitions: Collection[str] | None,
               nodes: Collection[str] | None, partition: str, node: str) -> str | None:
    """Why dsstage does not act for a job in ``partition`` on ``node``, or None if it does.
    ``partitions``/``nodes``: the rollout's (None: all). A job in several partitions (Slurm
    gives the one it runs in) is judged by that one."""
    if switch is not None:
        reason = str(switch.get("reason") or "no reason given")
        by = f" by {switch['by']}" if switch.get("by") else ""
        return f"dsstage is disabled on the whole cluster{by}: {reason}"
    if partitions is not None and partition not in partitions:
        return (f"dsstage is not enabled for partition {partition or '(unknown)'} (rollout.partitions: "
                f"{', '.join(partitions)})")
    if nodes is not None and node not in nodes:
        return f"dsstage is not enabled on node {node or '(unknown)'} (rollout.nodes)"
    return None


def node_in_scope(partitions: Collection[str] | None, nodes: Collection[str] | None, node: str,
                  node_partitions: Collection[str]) -> bool:
    """Whether the controller side (node features, waits for data) acts for ``node``: it is in
    ``rollout.nodes`` and in at least one of ``rollout.partitions`` (None: all). A node outside
    keeps no dataset feature: no job is steered to it for its data, none waits for it."""
    if nodes is not None and node not in nodes:
        return False
    return partitions is None or bool(set(partitions) & set(node_partitions))


def job_in_scope(partitions: Collection[str] | None, job_partitions: Collection[str]) -> bool:
    """Whether the controller side acts for a job submitted to ``job_partitions`` (several: it
    runs in one of them, so it is in the pilot if any is; none known: in)."""
    if partitions is None or not job_partitions:
        return True
    return bool(set(partitions) & set(job_partitions))


def write_switch(state_dir: str, record: Mapping[str, Any]) -> str:
    path = switch_path(state_dir)
    safe.write_json(path, formats.stamp("switch", record), fsync=True)
    return path


def clear_switch(state_dir: str) -> bool:
    """Turn the switch off; False if it was not on."""
    try:
        os.unlink(switch_path(state_dir))
    except FileNotFoundError:
        return False
    return True
