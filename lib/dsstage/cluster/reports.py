"""Reading every node's published report on a login node or the controller: load them,
normalize older formats, and say why one is stale.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from dsstage.fs import safe
from dsstage.node.report import NODES

#: a version string longer than this is cut (another host's write: data)
VERSION_MAX = 40


def read_all(state_dir: str) -> list[dict[str, Any]]:
    """Every published node report (format 1 reports read as best they can), by node."""
    directory = os.path.join(state_dir, NODES)
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        report = safe.read_json(os.path.join(directory, name))
        out.append(normalize(report, name[:-5]))
    return out


def normalize(report: Mapping[str, Any], node: str = "") -> dict[str, Any]:
    """A report with every field of FORMAT 2 present and of the right type (a damaged or
    older report is shown with what it has, never trusted beyond it)."""
    copies = [c for c in report.get("copies") or [] if isinstance(c, dict)] \
        if isinstance(report.get("copies"), list) else []
    for c in copies:
        leases = c.get("leases")
        leases = leases if isinstance(leases, list) else []  # another host's write: data
        c["leases"] = [x if isinstance(x, dict) else {"job_id": str(x), "user": "", "since": None} for x in leases]
        c.setdefault("state", "unknown")
        c.setdefault("decision", None)
        c.setdefault("progress", None)
    try:
        when = float(report.get("time") or 0)
    except (TypeError, ValueError):
        when = 0.0
    tiers = [t for t in report.get("tiers") or [] if isinstance(t, dict)] \
        if isinstance(report.get("tiers"), list) else []
    demand = report.get("demand") if isinstance(report.get("demand"), dict) else {}
    prefetch = [p for p in report.get("prefetch") or [] if isinstance(p, dict)] \
        if isinstance(report.get("prefetch"), list) else []
    version = report.get("dsstage")  # which dsstage wrote it (none before 0.2.0)
    return {"format": report.get("format", 1), "node": str(report.get("node") or node),
            "dsstage": version[:VERSION_MAX] if isinstance(version, str) else "", "time": when,
            "tiers": tiers, "copies": copies, "demand": demand, "prefetch": prefetch,
            **({"file_node": node} if node else {})}  # whose file it was: a report may name another node


def stale_reason(report: Mapping[str, Any], now: float, max_age: float, down: Mapping[str, str]) -> str:
    """Why a report is not to be taken as fact ("" if it is current): its node is down in
    Slurm, or it has not been written for longer than ``max_age``."""
    node = str(report.get("node"))
    if node in down:
        return f"node {down[node]}"
    age = now - float(report.get("time") or 0)
    if age > max_age:
        from dsstage.units import human_duration
        return f"report {human_duration(age)} old"
    return ""
