"""Slurm's ``PrivateData``, as dsstage honours it.

Where slurm.conf says ``PrivateData=jobs``, Slurm shows a user only their own jobs, and so
does dsstage: the demand snapshot (every queued job, its user and datasets) is readable by
its writer only, a summary of counts per dataset is what everyone may read, the node
reports published to the shared state directory carry no job ids or users, and a status
shown to a user (``dsstage status``, ``scontrol show bbstat``) lists that user's own jobs
and counts of the rest. Read from the slurm.conf Slurm's clients use on this host
(``$SLURM_CONF``, else /etc/slurm/slurm.conf, else a configless copy), once per process.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"
#: where slurmd keeps the configuration a configless controller sent it
CONFIGLESS = "/run/slurm/conf/slurm.conf"


def hides_jobs_in(text: str) -> bool:
    """Whether slurm.conf ``text`` hides other users' jobs (the last PrivateData wins). Read
    line by line, not with ``re``: the fast ``dsstage stage`` imports this module, and ``re``
    costs it several milliseconds (dsstage.fs.jsontext)."""
    found = None
    for line in text.splitlines():
        key, eq, value = line.split("#", 1)[0].partition("=")
        if not eq or key.strip().lower() != "privatedata":
            continue
        value = value.lstrip()
        value = value[1:] if value.startswith('"') else value
        end = next((i for i, ch in enumerate(value) if ch == '"' or ch.isspace()), len(value))
        found = value[:end]
    return found is not None and "jobs" in {v.strip().lower() for v in found.split(",")}


#: what each slurm.conf said, read once per process (a dict, not functools.lru_cache: the warm
#: Prolog publishes its report through here, and functools with collections costs it 5 ms)
_read: dict[str, bool] = {}


def _hides_jobs(path: str) -> bool:
    if path not in _read:
        _read[path] = False
        for p in (path, CONFIGLESS):
            try:
                with open(p, encoding="utf-8", errors="replace") as fh:
                    _read[path] = hides_jobs_in(fh.read(1 << 20))
                    break
            except OSError:
                continue
    return _read[path]


def hides_jobs(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this host's Slurm hides other users' jobs."""
    return _hides_jobs(environ.get("SLURM_CONF") or DEFAULT_SLURM_CONF)


def redact_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """A node report without job ids or users: what each copy's leases are, not whose."""
    out = dict(report)
    copies = []
    for row in report.get("copies") or []:
        if not isinstance(row, dict):
            continue
        row = dict(row)
        row["leases"] = [{"since": x.get("since")} for x in row.get("leases") or [] if isinstance(x, dict)]
        if row.get("job_id"):
            row["job_id"] = ""
        decision = row.get("decision")
        if isinstance(decision, dict) and "job" in str(decision.get("reason", "")):
            row["decision"] = {**decision, "reason": "kept for a job"}
        copies.append(row)
    out["copies"] = copies
    return out
