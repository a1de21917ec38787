"""Who reads a version from the source right now, so that the nodes that need it at the same
moment, in any jobs, read it from that node instead (peers across jobs, first wave).

A 64-task array of one-node jobs starts on 64 cold nodes at once: no node holds the version
ready yet (dsstage.node.report.holders finds none), and each would read it from the shared
filesystem. So the first node that is about to read a version from its source *claims* it:
``<state_dir>/staging/<dataset>.<version id>`` (link(2): exactly one node wins, NFS included;
written by root or ``report.user``). Every other node that needs the version while the claim
stands fetches it from the claimer, as the files land there, through the peers (a peer that
is staging: dsstage.transfer.peers polls it, verifies every file and falls back to the
source after ``peers.wait`` without progress). The claimer gives the claim back if its stage
fails, and keeps it when it succeeds (until its report shows the copy ready, the claim is how
the others find it); a claim older than ``peers.wait`` whose node's published
report is stale or does not show the version staging or ready, or any claim older than
``lock_timeout``, is taken over.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.fs import formats, jsontext, shared, untrusted
from dsstage.node import report

log = logging.getLogger(__name__)

DIR = "staging"


def _where(state_dir: str) -> str:
    return os.path.join(state_dir, DIR)


def _name(dataset: str, version: str) -> str:
    return f"{dataset}.{version}"


def current(record: dict[str, Any] | None, rep: dict[str, Any], dataset: str, version: str, now: float,
            limits: tuple[float, float, float]) -> bool:
    """Whether a claim still stands (pure): with ``limits`` = (max_age, ttl, grace), younger
    than ``grace`` (its node's report may not show the stage yet), or younger than ``ttl``
    with its node's published report ``rep`` current (``max_age``) and showing the version
    staging or ready."""
    max_age, ttl, grace = limits
    if not record or not isinstance(record.get("time"), (int, float)) or now - record["time"] > ttl:
        return False
    if now - record["time"] <= grace:
        return True
    when = rep.get("time")
    if rep.get("node") != record.get("node") or not isinstance(when, (int, float)) or now - when > max_age:
        return False
    states = report.version_states(rep, dataset, version)
    # a stage notes its progress in the report every few seconds: a report that still says
    # "staging" but has not changed for ``grace`` is a killed stage's, whose claim goes
    return "ready" in states or ("staging" in states and now - when <= grace)


def claim(conf: Config, dataset: str, version: str, me: str, now: float | None = None) -> str | None:
    """The node that reads ``version`` of ``dataset`` from the source now: ``me`` if this node
    claimed it (it must give it back, ``release``), another node if its claim stands, None
    where no claim can be made or read (each node then reads the source, as before).

    How old a claim and its node's report are is told by the state directory's clock: the
    files' modification times against its measured clock (dsstage.fs.shared.server_clock), not
    the times the nodes wrote by their own clocks, which may disagree; where that clock cannot
    be read, this host's against the records' times. ``now``: a given time, against the
    records' own times (tests)."""
    where, name = _where(conf.state_dir), _name(dataset, version)
    clock: Callable[[], float] | None = None
    measured = now is not None
    writers = shared.writers(conf.report.user)
    # its time as this node's clock has it, for older readers: this version reads the file's
    data = jsontext.dumps(formats.stamp("stager-claim", {"node": me, "time": time.time() if now is None else now,
                                                         "dataset": dataset,
                                                         "version": version})).encode()
    from dsstage.fs.identity import writing_as
    try:
        with writing_as(conf.report.user):
            for _attempt in range(2):
                if shared.create_once(where, name, data, writers):
                    return me
                if not measured:  # (after create_once made the directory, where its probe goes)
                    clock, measured = shared.server_clock(where), True
                t = clock() if clock else (time.time() if now is None else now)
                raw = shared.read(where, name, writers)
                record = jsontext.loads(raw) if raw else None
                record = record if isinstance(record, dict) and formats.readable("stager-claim", record) else None
                node = str(record.get("node") or "") if record else ""
                if node == me:
                    return me  # a claim of this node's own (a stage resumed)
                rep = untrusted.read_json(report.published_path(conf.state_dir, node)) if node else {}
                if clock and record:  # the files' times, by the same clock as t
                    made = shared.mtime(where, name)
                    if made is None:
                        continue  # gone meanwhile (given back, or taken over): try to claim it again
                    record = {**record, "time": made}
                    rep = {**rep, "time": shared.mtime(*os.path.split(report.published_path(conf.state_dir, node)))}
                if current(record, rep, dataset, version, t,
                           (conf.report.max_age, conf.lock_timeout, conf.peers.wait)):
                    return node
                log.info("the claim of node %s on %s %s no longer stands: taken over", node or "?", dataset,
                         version)
                shared.remove(where, name, writers)
    except (OSError, ValueError, DsstageError) as exc:
        log.warning("%s %s: who reads it from the source cannot be told (%s): this node reads it", dataset,
                    version, exc)
    return None


def release(conf: Config, dataset: str, version: str, me: str) -> None:
    """Give this node's claim back (its stage ended); another node's is left alone."""
    where, name = _where(conf.state_dir), _name(dataset, version)
    writers = shared.writers(conf.report.user)
    from dsstage.fs.identity import writing_as
    try:
        with writing_as(conf.report.user):
            raw = shared.read(where, name, writers)
            record = jsontext.loads(raw) if raw else None
            if isinstance(record, dict) and record.get("node") == me:
                shared.remove(where, name, writers)
    except (OSError, ValueError, DsstageError) as exc:
        log.warning("%s %s: the claim to read it from the source is not given back (%s)", dataset, version, exc)


@contextmanager
def claimed(conf: Config, dataset: str, version: str, me: str, mine: bool) -> Iterator[None]:
    """While a stage runs: gives this node's claim back (``mine``) if the stage fails. One that
    succeeds keeps it: until its published report shows the copy ready, a node that needs the
    version still finds it here (and fetches the published copy); after that the report does."""
    try:
        yield
    except BaseException:
        if mine:
            release(conf, dataset, version, me)
        raise
