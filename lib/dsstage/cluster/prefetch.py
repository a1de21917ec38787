"""Pre-staging: data on a node before the pending job planned there starts.

``dsstage prefetch`` runs on each compute node (dsstage-prefetch.service, or ``--once``
from a timer). Every ``prefetch.interval`` it reads the demand snapshot (the poller's,
see dsstage.policy.demand) and picks, with ``select`` (pure), the datasets that pending jobs need on
this node: jobs whose backfill plan (``SchedNodeList``) names this node and that are
expected to start within ``prefetch.horizon``, earliest first, one per dataset, and only
datasets not ready here already. It stages them one at a time, like ``dsstage warm``
(no lease: the planner keeps a copy a pending job wants here), and records what it did
for which job in the node report (``prefetch``) and in the copy's ready mark.

Being second to jobs. Each stage runs in a child process under ``ionice`` (class
``prefetch.io_class``) and ``nice 19``, with ``prefetch.bwlimit`` bytes/s for all its
streams, and:

- it never waits for a dataset's lock: one that a Prolog, a verify or an evict holds is
  skipped this round;
- a Prolog that needs the dataset while the prefetch holds its lock asks it to yield
  (lock.ask_to_yield writes ``<lock>.yield``); the supervisor sees that within
  ``POLL`` seconds and stops the child; the Prolog takes the lock and resumes the stage
  at full speed from what has arrived (a staging area is kept across stages);
- it evicts only what the retention planner would evict to make room, and nothing that
  ``spare`` keeps: a copy wanted by a pending job planned on this node (or not placed
  yet) that is expected to start no later than the job it prefetches for. Leased copies
  are never evicted by anyone. If room cannot be made that way, the dataset is skipped;
- when the plan changes under it (the job is no longer planned here within the horizon,
  or has started or gone), the child is stopped and its staging area removed: a changed
  plan wastes at most what arrived since the last check (``prefetch.interval``), and at
  most what ``horizon`` lets it start.

A stale or missing snapshot prefetches nothing (its plan may be long gone).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from dsstage import proc
from dsstage.config import load
from dsstage.config.model import Config
from dsstage.fs import runfiles
from dsstage.hostlist import expand_nodes, fold_nodes
from dsstage.node import eviction, inventory, report, standalone
from dsstage.policy.retention import Copy, Demand, Want

log = logging.getLogger(__name__)

#: seconds between two looks at the yield request and the child
POLL = 0.25
#: seconds a stopped child gets before it is killed
STOP_GRACE = 5.0
#: the child's exit codes
STAGED, SKIPPED, FAILED = 0, 3, 1


@dataclass(frozen=True)
class Candidate:
    """A dataset to prefetch on this node, for the earliest pending job that needs it here."""

    dataset: str
    job_id: str
    user: str
    start: float  # the job's expected start, epoch seconds
    reason: str
    nodes: str = ""  # the job's planned nodes (a hostlist) when more than this one: they fetch from each other

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "job_id": self.job_id, "user": self.user, "start": self.start,
                "reason": self.reason, **({"nodes": self.nodes} if self.nodes else {})}


@dataclass(frozen=True)
class Skip:
    dataset: str
    job_id: str
    reason: str


# -- deciding (pure) -------------------------------------------------------------------------

def select(demand: Demand, node: str, now: float, horizon: float, *, catalog: Sequence[str],
           ready: set[str], partitions: Collection[str] | None = None) -> tuple[list[Candidate], list[Skip]]:
    """What to prefetch on ``node``, earliest job first, and what was passed over, why.

    ``catalog``: the datasets this node's configuration knows; ``ready``: those whose
    current version is ready here. Only pending jobs whose plan names ``node`` and whose
    expected start is known and within ``horizon`` count, and with ``partitions`` (the
    rollout's) only jobs that may run in one of them."""
    if demand.stale:
        return [], []
    out: list[Candidate] = []
    skipped: list[Skip] = []
    known = set(catalog)
    for name in sorted(demand.wants):
        here = [w for w in demand.wants[name] if w.state == "pending" and node in w.nodes and w.start is not None
                and (partitions is None or any(p in partitions for p in w.partition.split(",")))]
        if not here:
            continue
        first = min(here, key=lambda w: (w.start, -w.priority, w.job_id))
        assert first.start is not None
        wait = first.start - now
        if wait > horizon:
            skipped.append(Skip(name, first.job_id, f"job {first.job_id} expected in {_dur(wait)}, beyond the "
                                f"horizon ({_dur(horizon)})"))
        elif name not in known:
            skipped.append(Skip(name, first.job_id, "not in this node's catalog"))
        elif name in ready:
            skipped.append(Skip(name, first.job_id, "ready here already"))
        else:
            when = f"expected in {_dur(wait)}" if wait > 0 else "due now"
            out.append(Candidate(name, first.job_id, first.user, first.start,
                                 f"pending job {first.job_id} planned on {node}, {when}",
                                 nodes=fold_nodes(first.nodes) if len(first.nodes) > 1 else ""))
    out.sort(key=lambda c: (c.start, c.job_id))
    return out, skipped


def still_wanted(demand: Demand, node: str, now: float, horizon: float, c: Candidate) -> str:
    """Why the prefetch of ``c`` is no longer wanted ("" if it is): the plan changed. A
    job that started on ``node`` keeps it (its Prolog asks the lock back)."""
    if demand.stale:
        return ""  # no news is no change: go on with what the last plan said
    for w in demand.wants.get(c.dataset, ()):
        if node in w.nodes and (w.state == "running" or (w.start is not None and w.start - now <= horizon)):
            return ""
    return f"no pending job wants {c.dataset} on {node} within the horizon any more (the plan changed)"


def spare_rule(node: str, start: float) -> Callable[[Copy, Demand], str]:
    """The prefetch's limit on making room: a copy wanted by a pending job planned on
    ``node`` (or not placed yet) expected to start no later than ``start`` is spared."""
    def spare(copy: Copy, demand: Demand) -> str:
        if demand.stale:
            return "the demand is unknown (stale snapshot)"
        sooner = [w for w in demand.wants.get(copy.dataset, ())
                  if _needs_here(w, node, start) and w.job_id not in copy.not_for]  # not_for: other shards
        if sooner:
            w = min(sooner, key=lambda w: w.start or 0.0)
            return f"which pending job {w.job_id} needs sooner"
        return ""
    return spare


def _needs_here(w: Want, node: str, start: float) -> bool:
    if w.state == "running":
        return node in w.nodes
    return (not w.nodes or node in w.nodes) and (w.start is None or w.start <= start)


def _dur(seconds: float) -> str:
    from dsstage.units import human_duration
    return human_duration(max(0.0, seconds))


# -- the service -----------------------------------------------------------------------------

@dataclass
class PrefetchResult:
    candidate: Candidate
    action: str  # staged | cached | skipped | yielded | abandoned | failed
    reason: str
    bytes: int = 0
    seconds: float = 0.0


#: seconds a job's sharded part found ready here stays ready without a new look (its Prolog stages what went)
PART_READY_TTL = 300.0


class Prefetcher:
    """The node-side loop: select, stage in a child, watch it; one dataset at a time."""

    def __init__(self, conf: Config, node: str, *, config_path: str | None = None, run_dir: str | None = None,
                 clock: Callable[[], float] = time.time, python: str = sys.executable) -> None:
        from dsstage.node.store import Store
        self.conf = conf
        self.store = Store(conf, node, clock=clock, run_dir=run_dir)
        self.node = self.store.node
        self.config_path = config_path
        self.clock = clock
        self.python = python
        self._config_key = runfiles.config_key(conf.origin)
        #: (dataset, job, nodes) -> when its sharded part was last found ready here (PART_READY_TTL)
        self._part_ready: dict[tuple[str, str, str], float] = {}

    def follow_config(self) -> None:
        """A prefetch runs for weeks: when the configuration file changes (a tier or a dataset
        added), take the new one, or its reports would describe the node as it was."""
        key = runfiles.config_key(self.conf.origin)
        if key == self._config_key:
            return
        self._config_key = key
        from dsstage.errors import DsstageError
        from dsstage.node.store import Store
        try:
            conf = load.load(self.config_path or self.conf.origin)
        except DsstageError as exc:
            log.warning("prefetch on %s keeps the configuration it has: %s", self.node, exc)
            return
        self.conf, self.store = conf, Store(conf, self.node, clock=self.clock, run_dir=self.store.run_dir)

    def demand(self) -> Demand:
        return self.store.demand()[0]

    def candidates(self) -> tuple[list[Candidate], list[Skip], Demand]:
        dem = self.demand()
        from dsstage.node import rollout
        nodes = set(expand_nodes(self.conf.rollout.nodes)) if self.conf.rollout.nodes is not None else None
        off = rollout.off_reason(rollout.read_switch(self.conf.state_dir), None, nodes, "", self.node)
        if off:
            return [], [Skip("*", "", f"{off}: nothing is prefetched")], dem
        ready = self._ready()
        cands, skips = select(dem, self.node, self.clock(), self.conf.prefetch.horizon,
                              catalog=list(self.conf.datasets), ready=ready, partitions=self.conf.rollout.partitions)
        # a sharded dataset is ready for a job when this node's part of the job's plan is
        todo = [c for c in cands if not self._part_is_ready(c)]
        skips += [Skip(c.dataset, c.job_id, "its part for the job is ready here already") for c in cands
                  if c not in todo]
        return todo, skips, dem

    def _part_is_ready(self, c: Candidate) -> bool:
        """standalone.part_ready, its yes kept for PART_READY_TTL: working out a part reads the
        published report of each of the job's nodes, and a 500-node job pending for an hour
        must not have each of its nodes read 500 reports every round."""
        key, now = (c.dataset, c.job_id, c.nodes), self.clock()
        if now - self._part_ready.get(key, -PART_READY_TTL) < PART_READY_TTL:
            return True
        if not standalone.part_ready(self.store, c.dataset, c.nodes):
            return False
        self._part_ready = {k: t for k, t in self._part_ready.items() if now - t < PART_READY_TTL}
        self._part_ready[key] = now
        return True

    def _ready(self) -> set[str]:
        from dsstage.errors import DsstageError
        from dsstage.node.store import open_tier
        out = set()
        for name, ds in self.conf.datasets.items():
            try:
                digest = self.store.current(name)
                with open_tier(self.store.layout(ds.tier), create=False) as tier:
                    if self.store.ready_state(tier, name, digest).ready:
                        out.add(name)
            except (DsstageError, OSError):
                continue
        return out

    def round(self) -> list[PrefetchResult]:
        """One round: prefetch every candidate in turn, re-reading the plan after each."""
        done: list[PrefetchResult] = []
        tried: set[str] = set()
        while True:
            cands, skips, dem = self.candidates()
            if dem.stale:
                log.info("prefetch on %s: the demand snapshot is stale or missing: nothing prefetched", self.node)
                return done
            for s in skips:
                log.debug("prefetch on %s: %s for job %s: %s", self.node, s.dataset, s.job_id, s.reason)
            todo = [c for c in cands if c.dataset not in tried]
            if not todo:
                return done
            c = todo[0]
            tried.add(c.dataset)
            out = self.prefetch(c)
            done.append(out)

    def prefetch(self, c: Candidate) -> PrefetchResult:
        """Stage ``c`` in a low-priority child; stop it if a Prolog asks the lock back or
        the plan changes. The outcome goes to the log and the node report."""
        from dsstage.node.lock import clear_yield, yield_request
        ds = self.conf.datasets[c.dataset]
        lock = self.store.layout(ds.tier).lock(c.dataset)
        clear_yield(lock)  # a request left from before this child is no one's
        log.info("prefetch on %s: staging %s for %s", self.node, c.dataset, c.reason)
        started = time.monotonic()
        child = subprocess.Popen(self.child_argv(c), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True, cwd="/", env=proc.c_locale())
        checked = time.monotonic()
        out: PrefetchResult | None = None
        while child.poll() is None:
            time.sleep(POLL)
            asked = yield_request(lock)
            if asked is not None:
                _stop(child)
                clear_yield(lock)
                out = PrefetchResult(c, "yielded", f"job {asked.get('job_id') or '?'} needs it now: its Prolog "
                                     "stages the rest at full speed")
                break
            if time.monotonic() - checked >= self.conf.prefetch.interval:
                checked = time.monotonic()
                why = still_wanted(self.demand(), self.node, self.clock(), self.conf.prefetch.horizon, c)
                if why:
                    _stop(child)
                    removed = eviction.discard_staging(self.store, c.dataset)
                    out = PrefetchResult(c, "abandoned", why + ("; its staging area was removed" if removed else ""))
                    break
        stdout, stderr = child.communicate()
        if out is None:
            out = _child_outcome(c, child.returncode, stdout, stderr)
        out.seconds = time.monotonic() - started
        level = logging.WARNING if out.action == "failed" else logging.INFO
        log.log(level, "prefetch on %s: %s %s for job %s: %s", self.node, out.action, c.dataset, c.job_id, out.reason)
        self.record(out)
        return out

    def child_argv(self, c: Candidate) -> list[str]:
        argv = [self.python, "-I", "-m", "dsstage.cluster.prefetch", "child", "--node", self.node,
                "--dataset", c.dataset, "--job", c.job_id, "--user", c.user, "--start", repr(c.start),
                *(["--nodes", c.nodes] if c.nodes else [])]
        if self.config_path:
            argv += ["--config", self.config_path]
        ionice = shutil.which("ionice", path="/usr/bin:/bin")
        if ionice:
            argv = [ionice, "-c", "3" if self.conf.prefetch.io_class == "idle" else "2", *(
                ["-n", "7"] if self.conf.prefetch.io_class != "idle" else []), "-t", *argv]
        return argv

    def record(self, out: PrefetchResult) -> None:
        c = out.candidate
        event = {"dataset": c.dataset, "job_id": c.job_id, "start": c.start, "action": out.action,
                 "reason": out.reason, "bytes": out.bytes, "seconds": round(out.seconds, 3), "time": self.clock()}
        events: list[tuple[str, dict[str, str], float]] = [("prefetches", {"dataset": c.dataset,
                                                                          "result": out.action}, 1)]
        if out.bytes:
            events.append(("prefetched_bytes", {"dataset": c.dataset}, out.bytes))
        self.store.count(events)
        inventory.refresh(self.store)  # the copy's state, then the event
        try:
            report.note_prefetch(self.store.run_dir, self.node, event, report.publish_target(self.conf))
        except OSError as exc:
            log.warning("cannot note the prefetch in the node report: %s", exc)

    def run(self, *, once: bool = False, sleep: Callable[[float], None] = time.sleep) -> int:
        """Rounds until stopped; ``once``: one round, exit code 1 if anything failed."""
        from dsstage.errors import DsstageError
        while True:
            started = time.monotonic()
            self.follow_config()
            try:
                outcomes = self.round()
            except (DsstageError, OSError) as exc:
                log.error("prefetch on %s failed: %s", self.node, exc)
                if once:
                    return 1
                outcomes = []
            if once:
                return 1 if any(o.action == "failed" for o in outcomes) else 0
            sleep(max(0.0, self.conf.prefetch.interval - (time.monotonic() - started)))


def _stop(child: subprocess.Popen[str]) -> None:
    """Stop the child's whole process group (its rsync streams too): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _child_outcome(c: Candidate, code: int | None, stdout: str, stderr: str) -> PrefetchResult:
    try:
        result = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    except ValueError:
        result = {}
    if code == STAGED and result:
        return PrefetchResult(c, str(result.get("action", "staged")), str(result.get("reason", "")),
                       int(result.get("bytes") or 0))
    if code == SKIPPED:
        return PrefetchResult(c, "skipped", str(result.get("reason") or "busy"))
    tail = " | ".join((stderr or "").strip().splitlines()[-2:])
    return PrefetchResult(c, "failed", str(result.get("reason") or f"the prefetch process exited {code}: {tail}"))


# -- the child: one stage, at low priority ---------------------------------------------------

def child(conf: Config, node: str, dataset: str, job_id: str, user: str, start: float,
          nodes: str = "") -> tuple[int, dict[str, Any]]:
    """Stage ``dataset`` on ``node`` for pending job ``job_id`` (of ``user``) without a
    lease, as a prefetch; (exit code, result for the supervisor). ``nodes``: the job's
    planned nodes, which prefetch it at the same time: with ``peers.enabled`` each reads its
    share from the source and the rest from the others, as the job's Prologs would."""
    from dsstage.config import catalog as cat
    from dsstage.errors import DsstageError, LockTimeout, NoSpace
    from dsstage.node.local import default_holder
    from dsstage.node.store import Prefetching, Store
    try:
        os.nice(19)
    except OSError:
        pass
    store = Store(conf, node)
    holder, pid = default_holder()
    how = Prefetching(job_id=job_id, start=start, bwlimit=conf.prefetch.bwlimit, spare=spare_rule(store.node, start))
    try:
        who = cat.User.lookup(user)
        from dsstage.node.staging import StageRequest
        result = standalone.stage(store, dataset, StageRequest(user=who, job_id=holder, pid=pid, prefetch=how,
                                                               nodes=nodes))
    except LockTimeout:
        return SKIPPED, {"reason": "its lock is held (a Prolog, a verify or an evict): tried again next round"}
    except NoSpace as exc:
        return SKIPPED, {"reason": str(exc)}
    except DsstageError as exc:
        return FAILED, {"reason": str(exc)}
    store.release(dataset, holder)
    return STAGED, {"action": result.action, "bytes": result.transferred_bytes,
                    "reason": f"{result.transferred_bytes} bytes in {result.seconds:.1f}s" if result.action == "staged"
                    else "ready already"}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dsstage.cluster.prefetch child ...``: the supervisor's child (not for people)."""
    import argparse

    p = argparse.ArgumentParser(prog="dsstage.cluster.prefetch")
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("child")
    c.add_argument("--node", required=True)
    c.add_argument("--dataset", required=True)
    c.add_argument("--job", required=True)
    c.add_argument("--user", required=True)
    c.add_argument("--start", type=float, required=True)
    c.add_argument("--nodes", default="")
    c.add_argument("--config")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="dsstage prefetch: %(message)s")
    try:
        conf = load.load(args.config)
    except Exception as exc:  # noqa: BLE001 - said to the supervisor, which logs it
        print(json.dumps({"reason": f"configuration: {exc}"}))
        return FAILED
    code, result = child(conf, args.node, args.dataset, args.job, args.user, args.start, args.nodes)
    print(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
