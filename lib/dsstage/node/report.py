"""Node reports: what each node holds and is doing, for `dsstage status` on a login node.

A report (FORMAT 2) is one JSON document per node::

    {"format": 2, "node": "n1", "dsstage": "0.2.0", "time": <epoch>, "demand": {"age": s, "stale": bool},
     "tiers": [{"tier", "path", "capacity", "used", "reserved", "free", "high", "low"}],
     "copies": [{"tier", "dataset", "version", "state", "current", "bytes", "files",
                 "leases": [{"job_id", "user", "since"}], "last_used",
                 "decision": {"action": "keep"|"evict", "reason"} | null,
                 "progress": {"phase", "unit", "done", "total", "rate", "eta", "since"} | null,
                 "job_id"}]}

``dsstage`` is the version that wrote the report (absent before 0.2.0: a key added without a
new format, which older readers skip), so that ``dsstage status`` can say which nodes an
upgrade has not reached yet. ``state`` is one of ready, staging, verifying, evicting, failed (a copy flagged bad),
incomplete (a version directory without its ready mark) and interrupted (a staging area
left by a killed stage). ``decision`` is the retention planner's current verdict on the
copy, with its reason, as the next Epilog would apply it.

Where. The node keeps its report in ``<run_dir>/reports/<node>.json`` (node-local, root's)
and publishes a copy to ``<state_dir>/nodes/<node>.json`` for login nodes. A shared
``state_dir`` is often NFS exported with ``root_squash``, where root on a node writes as
nobody: with ``report.user`` set, the published copy is written with that user's
file-system identity (setfsuid, the same switch that reads sources as ``source_user``),
so ``<state_dir>/nodes`` can belong to that user and nothing else in ``state_dir`` need
be writable from the nodes. Without a shared ``state_dir``, ``dsstage status --live``
asks each node over SSH for a report built there and then.

When. The full Prolog and the Epilog rebuild the report from the store; a stage writes
its progress at most every ``report.interval`` seconds; the warm Prolog adds its leases.
``dsstage report`` (run by dsstage-report.timer) rebuilds it, so that an idle node's
report stays recent and a report older than ``report.max_age`` means the node is not
reporting (status then shows it as stale, never as fact).

Concurrency. Several Prologs and Epilogs may run on a node at once: every change, a
rebuild or a small update, is made holding an flock on ``<run_dir>/reports/<node>.lock``,
reading the node-local report and writing it back, so no writer loses another's change (a
rebuild reads the store after taking the lock, so it sees every change committed before).

This module imports only the standard library at load time: the warm Prolog uses it.
"""

from __future__ import annotations

import os
import time

from dsstage.errors import UnsafeStore
from dsstage.fs import formats, jsontext, safe, untrusted
from dsstage.fs.safe import RootDir

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any

FORMAT = formats.CURRENT["node-report"]
REPORTS = "reports"  # below the run directory
NODES = "nodes"  # below the state directory
#: the prefetch's last actions kept in a report (see note_prefetch)
PREFETCH_KEPT = 20
STATES = ("ready", "staging", "verifying", "evicting", "failed", "incomplete", "interrupted")


def published_path(state_dir: str, node: str) -> str:
    return os.path.join(state_dir, NODES, f"{node}.json")


def ready_in_reports(state_dir: str, nodes: Sequence[str], name: str, versions: Sequence[str]) -> dict[str, set[str]]:
    """node -> the versions (ids; a sharded dataset's shards) of ``versions`` that its published
    report shows ready (a report that cannot be read counts as holding nothing)."""
    wanted = set(versions)
    out: dict[str, set[str]] = {}
    for node in nodes:
        report = untrusted.read_json(published_path(state_dir, node))  # another node wrote it
        if not report:
            continue
        rows = report.get("copies") or []
        if not isinstance(rows, list):
            continue
        out[node] = {r["version"] for r in rows if isinstance(r, dict) and r.get("dataset") == name
                     and r.get("state") == "ready" and isinstance(r.get("version"), str) and r["version"] in wanted}
    return out


def version_states(report: Mapping[str, Any], name: str, version: str) -> set[str]:
    """The states a published ``report`` (another node's, read as data) shows for ``version``
    of ``name``: what the peers across jobs ask of it (ready: a holder; staging: a claimer at work)."""
    rows = report.get("copies")
    if not isinstance(rows, list):
        return set()
    return {str(r.get("state")) for r in rows
            if isinstance(r, dict) and r.get("dataset") == name and r.get("version") == version}


#: seconds a report's file time may lie ahead of the state directory's clock as measured
CLOCK_SLACK = 5.0


def holders(state_dir: str, name: str, version: str, now: float, max_age: float,
            among: Sequence[str] | None = None, *, server_now: float | None = None) -> list[str]:
    """The nodes whose current published report (younger than ``max_age``) shows ``version``
    (a version id; a shard's id) of ``name`` ready: the peers any node may fetch it from,
    whichever job they staged it for. One bounded read per report, of every node's or only of
    those ``among`` (the ones the demand snapshot says hold it: dsstage.policy.demand's
    ``copies``); a report that cannot be read, or names another node than its file, holds nothing.

    How old a report is: with ``server_now`` (the state directory's clock now,
    dsstage.fs.shared.server_clock), its file's modification time against it, both by the
    file server's clock, so that a writer's or this node's clock being off does not make a
    live holder look stale or a dead one live; else the time the report says (its writer's
    clock) against ``now`` (this node's)."""
    if among is None:
        try:
            files = sorted(f for f in os.listdir(os.path.join(state_dir, NODES))
                           if f.endswith(".json") and not f.startswith("."))
        except OSError:
            return []
        nodes = [f[:-len(".json")] for f in files]
    else:
        nodes = [n for n in among if n and "/" not in n and not n.startswith(".")]
    out = []
    for node in nodes:
        rep, mtime = untrusted.read_json_dated(published_path(state_dir, node))  # another node wrote it
        when, at = (mtime, server_now) if server_now is not None and mtime is not None else (rep.get("time"), now)
        # by the server's clock, a report written while this reads (or within the probe's
        # round trip) may look a moment younger than now: not from the future for that
        slack = CLOCK_SLACK if server_now is not None else 0.0
        if rep.get("node") != node or not isinstance(when, (int, float)) or not -slack <= at - when <= max_age:
            continue
        if "ready" in version_states(rep, name, version):
            out.append(node)
    return out


class _locked:  # noqa: N801 - used as a function: ``with _locked(run_dir, node) as reports``
    """Hold this node's report lock; give the descriptor of the reports directory. (A class,
    not contextlib's contextmanager: the warm Prolog writes the report, and contextlib with
    functools costs it 2 ms to import.)"""

    def __init__(self, run_dir: str, node: str) -> None:
        if not node or "/" in node or node.startswith(".") or "\0" in node:
            raise ValueError(f"node name {node!r}")
        self.run_dir, self.node = run_dir, node

    def __enter__(self) -> int:
        self._run = RootDir(self.run_dir)
        try:
            reports = self._run.dir(REPORTS)
            self._flock = safe.Flock(reports, f"{self.node}.lock")
            self._flock.__enter__()
        except BaseException:
            self._run.close()
            raise
        return reports

    def __exit__(self, *exc: object) -> None:
        try:
            self._flock.__exit__(None, None, None)
        finally:
            self._run.close()


def update(run_dir: str, node: str, change: Callable[[dict[str, Any]], bool],
           publish_to: tuple[str, str | None] | None = None) -> dict[str, Any] | None:
    """Apply ``change`` to this node's report under its lock, write it if ``change`` says
    so, and publish it to ``publish_to`` = (state_dir, report user). None if there is no
    report yet (the next rebuild writes one)."""
    with _locked(run_dir, node) as reports:
        report = safe.read_json_at(reports, f"{node}.json")
        if not report or not change(report):
            return None
        report["time"] = time.time()
        text = jsontext.dumps(report, sort_keys=True)  # once, for both copies
        safe.write_at(reports, f"{node}.json", text, fsync=False)
    if publish_to:
        publish(publish_to[0], node, report, publish_to[1], text)
    return report


def replace(run_dir: str, node: str, build: Callable[[Mapping[str, Any]], dict[str, Any]],
            publish_to: tuple[str, str | None] | None = None) -> dict[str, Any]:
    """Rebuild this node's report under its lock: ``build(previous)`` gives the new one."""
    with _locked(run_dir, node) as reports:
        report = build(safe.read_json_at(reports, f"{node}.json"))
        text = jsontext.dumps(report, sort_keys=True)  # once, for both copies
        safe.write_at(reports, f"{node}.json", text, fsync=False)
    if publish_to:
        publish(publish_to[0], node, report, publish_to[1], text)
    return report


def local(run_dir: str, node: str) -> dict[str, Any]:
    """This node's own report, as last written ({} if none)."""
    try:
        with RootDir(run_dir, create=False) as run:
            return safe.read_json_at(run.has_dir(REPORTS), f"{node}.json")
    except (OSError, UnsafeStore):
        return {}


def publish(state_dir: str, node: str, report: Mapping[str, Any], user: str | None, text: str | None = None) -> bool:
    """Copy the report to the shared state directory, as ``user`` if set (root_squash);
    False (and a warning) if it cannot be written: the node-local report stays right.
    ``text``: the report as JSON already (the node-local copy's)."""
    path = published_path(state_dir, node)
    from dsstage import privatedata
    if privatedata.hides_jobs():  # the shared copy is read by every user: no job ids or users
        report, text = privatedata.redact_report(report), None
    if text is None:
        text = jsontext.dumps(report, sort_keys=True)
    try:
        if user:  # imported only then: the warm Prolog pays for what it uses
            from dsstage.fs import identity
            with identity.acting_as(identity.lookup(user, "report.user")):
                _write_creating(path, text)
        else:
            _write_creating(path, text)
        return True
    except Exception as exc:  # noqa: BLE001 - a report is never worth failing a job
        import logging
        log = logging.getLogger("dsstage")
        hint = (f"; on NFS with root_squash, make {os.path.dirname(path)} belong to an unprivileged user and set "
                "report.user" if isinstance(exc, PermissionError) and not user else "")
        log.warning("cannot publish the node report %s: %s%s", path, exc, hint)
        return False


def _write_creating(path: str, text: str) -> None:
    try:
        safe.write_atomic(path, text, fsync=False)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        safe.write_atomic(path, text, fsync=False)


def note_leases(run_dir: str, node: str, job_id: str, user: str, copies: Sequence[tuple[str, str]],
                publish_to: tuple[str, str | None] | None = None) -> None:
    """The warm Prolog's change: ``job_id`` of ``user`` leases these (dataset, version)
    copies, which are used now and kept while the lease lasts."""
    now = time.time()
    wanted = set(copies)

    def change(report: dict[str, Any]) -> bool:
        changed = False
        for row in report.get("copies") or []:
            if isinstance(row, dict) and (row.get("dataset"), row.get("version")) in wanted:
                leases = [x for x in row.get("leases") or [] if isinstance(x, dict) and x.get("job_id") != job_id]
                row["leases"] = [*leases, {"job_id": job_id, "user": user, "since": now}]
                row["last_used"] = now
                row["decision"] = {"action": "keep", "reason": f"leased by job {job_id}"}
                changed = True
        return changed
    update(run_dir, node, change, publish_to)


def note_verified(run_dir: str, node: str, dataset: str, version: str,
                  publish_to: tuple[str, str | None] | None = None) -> None:
    """The fast ``verify --full``'s change (dsstage.cli.fast): the copy it checked under the
    dataset's lock is ready again, where a rebuild during the check wrote it "verifying".
    Nothing is written if no row says so."""
    def change(report: dict[str, Any]) -> bool:
        changed = False
        for row in report.get("copies") or []:
            if isinstance(row, dict) and (row.get("dataset"), row.get("version"), row.get("state")) == (
                    dataset, version, "verifying"):
                row["state"] = "ready"
                changed = True
        return changed
    update(run_dir, node, change, publish_to)


def note_prefetch(run_dir: str, node: str, event: Mapping[str, Any],
                  publish_to: tuple[str, str | None] | None = None) -> None:
    """Add one of the prefetch's actions (dataset, job_id, start, action, reason, time,
    bytes) to the report's ``prefetch`` list, the last PREFETCH_KEPT of them."""
    def change(report: dict[str, Any]) -> bool:
        kept = [p for p in report.get("prefetch") or [] if isinstance(p, dict)]
        report["prefetch"] = (kept + [dict(event)])[-PREFETCH_KEPT:]
        return True
    update(run_dir, node, change, publish_to)


def progress_row(phase: str, unit: str, done: int, total: int, since: float, now: float) -> dict[str, Any]:
    """Progress with its rate and ETA (None until something has moved)."""
    elapsed = max(now - since, 1e-3)
    rate = done / elapsed if done else 0.0
    eta = (total - done) / rate if rate > 0 and total >= done else None
    return {"phase": phase, "unit": unit, "done": done, "total": total, "rate": rate, "eta": eta, "since": since}


class ProgressNote:
    """A stage's progress into the report, at most every ``interval`` seconds.

    Called as ``note(phase, delta, total)`` from the stager (any thread): ``phase`` is
    "copying" (bytes) or "verifying" (files)."""

    def __init__(self, run_dir: str, node: str, key: tuple[str, str, str], job_id: str, *,
                 interval: float, publish_to: tuple[str, str | None] | None,
                 clock: Callable[[], float] = time.time,
                 also: Callable[[str, int, int], None] | None = None) -> None:
        """``key``: the copy staging, as (tier, dataset, version)."""
        import threading
        self.run_dir, self.node, self.publish_to = run_dir, node, publish_to
        self.key = key
        self.job_id, self.interval, self.clock = job_id, interval, clock
        self.phase, self.done, self.total = "", 0, 0
        self.noted_end = ""  # the phase whose end was written: written once
        self.since = self.last = clock()
        self._mutex = threading.Lock()
        self.also = also

    def __call__(self, phase: str, delta: int, total: int) -> None:
        if self.also:
            self.also(phase, delta, total)
        with self._mutex:
            now = self.clock()
            if phase != self.phase:  # the first phase is timed from the stage's start
                self.since = now if self.phase else self.since
                self.phase, self.done = phase, 0
            self.done += delta
            self.total = total
            # between two intervals, only a phase's end is written, and once: a stage of many
            # empty files (a byte total of 0) is at its end at every file
            end = self.done >= self.total and self.noted_end != phase
            if now - self.last < self.interval and not end:
                return
            if self.done >= self.total:
                self.noted_end = phase
            self.last = now
            row = progress_row(phase, "files" if phase == "verifying" else "bytes", self.done, total, self.since, now)
        try:
            update(self.run_dir, self.node, lambda r: self._apply(r, row), self.publish_to)
        except (OSError, UnsafeStore, ValueError):
            pass  # progress is informative; the stage goes on

    def _apply(self, report: dict[str, Any], progress: dict[str, Any]) -> bool:
        rows = report.setdefault("copies", [])
        for row in rows:
            if isinstance(row, dict) and (row.get("tier"), row.get("dataset"), row.get("version")) == self.key:
                break
        else:
            row = {"tier": self.key[0], "dataset": self.key[1], "version": self.key[2], "current": True,
                   "bytes": 0, "files": 0, "leases": [], "last_used": None, "decision": None}
            rows.append(row)
        row.update(state="verifying" if progress["phase"] == "verifying" else "staging", job_id=self.job_id,
                   progress=progress)
        return True


def publish_target(config: Any) -> tuple[str, str | None]:
    return config.state_dir, config.report.user
