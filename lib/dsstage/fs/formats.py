"""The formats of the files one dsstage version writes and another may read.

A site upgrades a node, a login node or a controller at a time, so for a while an old
writer and a new reader (or the reverse) share a file: the demand snapshot and its summary
(the poller writes, every node reads), node reports (nodes write, ``status`` reads), job
records (a job's first node writes, its other nodes read), the poller's lease, the rollout
switch, and the store's own leases, ready marks and reservations (written by one version's
Prolog, read by the next version's Epilog after an upgrade in between).

Every such file carries ``"format": N``. A reader accepts its own format and the one before
(a file from before formats, with no ``format``, is format 0), and reads extra keys it does
not know as absent, so a newer writer's additions never make a record look damaged. A file of
a format newer than that is said to be from a newer dsstage: upgrade the reader.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

#: each file kind's current format
CURRENT = {
    "demand": 1,  # <state_dir>/demand.json
    "demand-summary": 1,  # <state_dir>/demand-summary.json
    "node-report": 2,  # <state_dir>/nodes/<node>.json and the node-local copy
    "job-record": 1,  # <state_dir>/jobs/<job>.json
    "poller-lease": 1,  # <state_dir>/poller.json
    "switch": 1,  # <state_dir>/disabled.json
    "lease": 1,  # <tier>/leases/<dataset>/<job>.json
    "shard-index": 1,  # <state_dir>/manifests/<dataset>/<version>.shards-<N>.json
    "breaker": 1,  # <state_dir>/sources/<key>.json
    "stager-claim": 1,  # <state_dir>/staging/<dataset>.<version id>
    "budget-grant": 1,  # <state_dir>/budget/<source>/@<slots>.<until>.<node>.<token>.json (0.3.0 on)
}


def found(record: Mapping[str, Any]) -> int:
    """The format a record says (0: none, from before formats; -1: not a number)."""
    value = record.get("format", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def readable(kind: str, record: Mapping[str, Any]) -> bool:
    """Whether this version reads ``record`` of ``kind``: its own format or the one before."""
    return found(record) in (CURRENT[kind], CURRENT[kind] - 1)


def problem(kind: str, record: Mapping[str, Any], where: str) -> str | None:
    """Why ``record`` (at ``where``) is not read, in words for an admin; None if it is."""
    if readable(kind, record):
        return None
    got, ours = found(record), CURRENT[kind]
    if got > ours:
        return f"{where}: format {got}, written by a newer dsstage (this one reads {ours - 1} and {ours}): upgrade it"
    return f"{where}: format {record.get('format')!r}, this dsstage reads {ours - 1} and {ours}: it was written by " \
           "a much older dsstage, or damaged; the writer's next round replaces it"


def stamp(kind: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with its kind's current format."""
    return {**record, "format": CURRENT[kind]}
