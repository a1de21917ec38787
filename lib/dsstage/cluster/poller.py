"""The demand poller (``dsstage demand-poller``): on the controller or a login node, ask Slurm
once a round for the active jobs, write the demand snapshot (dsstage.policy.demand), update
the node features of ready datasets and prune manifests no node holds.

Where several pollers run (a controller pair, a login node), one acts at a time
(dsstage.cluster.leader); the others stand by and take over when it stops. What the poller
writes in ``state_dir`` it writes as ``report.user`` where that is set (NFS ``root_squash``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from dsstage import privatedata
from dsstage.cluster import leader, reports
from dsstage.config.model import Config
from dsstage.errors import DsstageError, StateError
from dsstage.fs.safe import write_atomic
from dsstage.policy.demand import Snapshot, build, copies_from, read, write
from dsstage.slurm.client import SlurmClient
from dsstage.slurm.records import Job

log = logging.getLogger(__name__)


def poll_once(conf: Config, slurm: SlurmClient, clock: Callable[[], float] = time.time) -> Snapshot:
    """One round: ask Slurm, write the snapshot, update the node features of ready
    datasets (placement.features, see features.py), let pending jobs wait for the nodes
    that hold their data (placement.wait_for_data, see datawait.py), prune old manifests."""
    from dsstage.cluster import manifests_gc
    jobs = slurm.queue()
    previous = read(conf.state_dir)
    now = clock()
    copies = None
    if conf.peers.enabled:
        try:  # the reports are other hosts' writes: one that cannot be read costs the copies, never the round
            copies = copies_from(reports.read_all(conf.state_dir), now, conf.report.max_age)
        except Exception as exc:  # noqa: BLE001 - the snapshot must be written whatever a report holds
            log.warning("which nodes hold which versions not written this round: %s", exc)
    snap = build(jobs, now, backend=type(slurm).__name__, host=socket.gethostname(),
                 previous=previous if previous.time else None, copies=copies)
    with as_writer(conf):
        write(conf.state_dir, snap, private=privatedata.hides_jobs())
    export_metrics(conf, snap.time, jobs, acting=True)
    from dsstage.cluster import datawait
    if conf.placement.features or datawait.marked(jobs):
        from dsstage.cluster import features
        now = clock()
        observed = None
        try:
            observed = features.observe(conf, slurm, now)
            if conf.placement.features:
                features.sync(conf, slurm, now=now, observed=observed)
        except (DsstageError, OSError) as exc:  # placement is an optimisation: the snapshot is written
            log.warning("node features not updated: %s", exc)
        if observed is not None:  # the waits are lifted even when the features cannot be updated
            try:
                datawait.sync(conf, slurm, jobs, *observed, now)
            except (DsstageError, OSError) as exc:
                log.warning("no job's wait for its data decided this round: %s", exc)
    removed = manifests_gc.prune(conf, clock())
    for name, version in removed:
        log.info("removed manifest %s %s: superseded, and no node holds it", name, version[:16])
    return snap


def export_metrics(conf: Config, snapshot_time: float, jobs: list[Job], *, acting: bool) -> None:
    """The controller's metrics (cluster.controller_metrics), where metrics.controller_textfile
    is set; a failure is logged, never the round's."""
    path = conf.metrics.controller_textfile
    if not path:
        return
    from dsstage.cluster import controller_metrics
    from dsstage.node import breaker
    from dsstage.slurm.conf import slurm_conf_path
    try:
        fams = controller_metrics.families(
            snapshot_time=snapshot_time, jobs=jobs, acting=acting,
            ready=controller_metrics.ready_counts(reports.read_all(conf.state_dir)),
            breakers={k: float(r.get("since") or 0) for k, r in breaker.all_open(conf.state_dir).items()},
            catalog_time=controller_metrics.catalog_time(
                ["/var/lib/dsstage/dsstage_catalog.lua",
                 os.path.join(os.path.dirname(slurm_conf_path()), "dsstage_catalog.lua")]))
        controller_metrics.write(path, fams)
    except (OSError, ValueError) as exc:
        log.warning("controller metrics not written to %s: %s", path, exc)


def as_writer(conf: Config) -> AbstractContextManager[None]:
    """Write in ``state_dir`` as ``report.user`` where set (NFS squashes root), else as root."""
    from dsstage.fs.identity import writing_as
    return writing_as(conf.report.user)


def run(conf: Config, slurm: SlurmClient, *, once: bool = False, interval: float | None = None,
        clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
        me: leader.Me | None = None, lease_age: Callable[[str, leader.Me], float | None] = leader.server_age) -> int:
    """Poll until stopped, acting in the rounds this poller holds the lease (``leader``);
    ``once``: one round now, lease or not (an admin's command), exit code 1 if it failed.
    ``lease_age``: the lease's age by the state directory's clock (leader.server_age)."""
    interval = interval or conf.retention.poll_interval
    me = me or leader.Me.here()
    standing = ""
    while True:
        started = clock()
        if not once:
            try:
                with as_writer(conf):
                    decision = leader.round_(conf.state_dir, me, started, leader.ttl(interval), lease_age)
            except (DsstageError, OSError) as exc:
                decision = leader.Decision(False, f"cannot write the poller's lease in {conf.state_dir}: {exc}")
            if not decision.act:
                if decision.reason.split(" (")[0] != standing.split(" (")[0]:
                    log.info("standing by: %s", decision.reason)
                standing = decision.reason
                export_metrics(conf, read(conf.state_dir).time, [], acting=False)
                wait(conf.state_dir, max(0.0, interval - (clock() - started)), sleep)
                continue
            if standing:
                log.info("acting: %s", decision.reason)
                standing = ""
        try:
            snap = poll_once(conf, slurm, clock)
            n = sum(len(r["pending"]) + len(r["running"]) for r in snap.datasets.values())
            log.info("demand: %d job request(s) over %d dataset(s), %d running job(s)", n, len(snap.datasets),
                     len(snap.running))
        except (DsstageError, OSError) as exc:
            log.error("demand snapshot failed: %s", exc)
            if once:
                return 1
        if once:
            return 0
        wait(conf.state_dir, max(0.0, interval - (clock() - started)), sleep)


#: where ``dsstage bb nudge`` asks the acting poller for a round now: in the burst-buffer
#: records' directory (dsstage.hooks.bbrequest.DIR), which the callbacks' user may write
NUDGE = os.path.join("bb", ".poll-now")


def nudge(state_dir: str, job_id: str) -> str:
    """Ask the acting demand poller for its next round now (a job's data_in: its data is
    wanted soon), by replacing ``<state_dir>/bb/.poll-now``; the poller sees it change
    (``nudge_key``). A file, not a round of our own: only the poller that holds the lease
    acts, whoever asks."""
    if not job_id.isdigit() or len(job_id) > 20:
        raise StateError(f"{job_id!r} is not a job id")
    path = os.path.join(state_dir, NUDGE)
    write_atomic(path, job_id + "\n", fsync=False)
    return path


def nudge_key(state_dir: str) -> tuple[int, int] | None:
    """What identifies the last nudge (inode and modification time: compared for a change,
    never with a clock), None if there is none or it cannot be seen."""
    try:
        st = os.stat(os.path.join(state_dir, NUDGE), follow_symlinks=False)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def wait(state_dir: str, seconds: float, sleep: Callable[[float], None], step: float = 1.0) -> bool:
    """Sleep ``seconds`` until the next round, in steps of ``step``, ending early when a
    burst-buffer job's data_in asks for a round now (``dsstage bb nudge``: the nudge changed);
    True if it did. Each step is one stat of the state directory."""
    seen = nudge_key(state_dir)
    left = seconds
    while left > 0:
        sleep(min(step, left))
        left -= step
        now = nudge_key(state_dir)
        if now is not None and now != seen:
            log.info("a job's data_in asked for a round now")
            return True
    return False
