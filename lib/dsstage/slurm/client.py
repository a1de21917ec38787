"""The Slurm client: one small interface (``SlurmClient``), its command-line backend
(``CliSlurm``, every command through ``dsstage.proc`` with a fixed environment and timeout), a
pyslurm backend where pyslurm imports, and ``client()`` that picks one.

Holding a job (``SlurmClient.hold``) never touches the user's ``Comment``: dsstage writes its
message into the job's ``AdminComment``, after what is there already (see dsstage.slurm.hold).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any, Protocol

from dsstage import proc
from dsstage.errors import CommandError
from dsstage.slurm.hold import (
    ALREADY_HELD,
    CANCELLED,
    GONE,
    HELD,
    NOT_REQUEUED,
    clean_reason,
    hold_message,
    merge_admin_comment,
)
from dsstage.slurm.records import (
    _ALIVE,
    _ENDING,
    JOB_FORMAT,
    NODE_FORMAT,
    PLACING_FORMAT,
    QUEUE_FORMAT,
    Job,
    Node,
    Placing,
    RawJob,
    _job,
    parse_job_records,
    parse_nodes,
    parse_placing,
)

log = logging.getLogger(__name__)

TIMEOUT = 30.0
BIN_DIR = "/usr/bin"


class SlurmClient(Protocol):
    def queue(self) -> list[Job]: ...
    def nodes(self) -> dict[str, Node]: ...
    def job_alive(self, job_id: str) -> bool: ...
    def hold(self, job_id: str, reason: str) -> str: ...
    def drain(self, node: str, reason: str) -> None: ...
    def set_features(self, nodes: str, available: list[str], active: list[str]) -> None: ...
    def placing(self) -> dict[str, Placing]: ...
    def set_exclusion(self, job_id: str, job_ref: str, exclude: str | None, comment: Callable[[str], str]) -> bool: ...


#: what Slurm's clients read from the environment that would change what they print, what
#: they act on or which cluster they ask (seen: SQUEUE_USERS filters squeue's jobs,
#: SQUEUE_ARRAY splits arrays, SLURM_TIME_FORMAT changes dates; SCANCEL_* filter scancel,
#: SLURM_CLUSTERS picks another cluster). None of it may come from whoever runs dsstage.
_CLIENT_ENV_DROP = ("SQUEUE_", "SINFO_", "SCONTROL_", "SCANCEL_", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT")


def client_env() -> dict[str, str]:
    """The environment of Slurm's clients: ours, less _CLIENT_ENV_DROP, with times printed as
    epoch seconds (``%s``): squeue otherwise prints local time without a zone, which a
    daylight-saving change makes ambiguous, and follows ``TZ``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_DROP)}
    env["SLURM_TIME_FORMAT"] = "%s"
    return env


#: what Slurm's clients print when the controller did not answer in time (MessageTimeout under
#: load, a takeover in progress): the same request may succeed a moment later
TRANSIENT = ("Socket timed out on send/recv operation", "Unable to contact slurm controller",
             "Zero Bytes were transmitted or received", "Slurm backup controller in standby mode")


def transient(stderr: str) -> bool:
    return any(t in stderr for t in TRANSIENT)


class CliSlurm:
    """Slurm through its command-line clients, called by absolute path in ``bin_dir``."""

    def __init__(self, bin_dir: str = BIN_DIR, timeout: float = TIMEOUT) -> None:
        if not os.path.isabs(bin_dir):
            raise ValueError(f"the Slurm bin directory must be an absolute path, not {bin_dir!r}")
        self.bin_dir = bin_dir
        self.timeout = timeout

    def _cmd(self, name: str) -> str:
        return os.path.join(self.bin_dir, name)

    def _run(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run_argv([self._cmd(name), *args], check=check)

    def _run_argv(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a client; one that failed because the controller did not answer in time (a busy
        slurmctld: TRANSIENT) is run again after 0.5, 1, 2, ... s, as Slurm's own clients
        advise, while ``timeout`` seconds in all allow it."""
        name = os.path.basename(argv[0])
        deadline = time.monotonic() + self.timeout
        pause = 0.5
        while True:
            left = deadline - time.monotonic()
            res = proc.run(argv, timeout=max(1.0, left), check=False, env=client_env())
            if res.returncode == 0 or not transient(res.stderr) or time.monotonic() + pause >= deadline:
                break
            log.info("%s: the controller did not answer (%s); again in %.1f s", name, res.stderr.strip(), pause)
            time.sleep(pause)
            pause *= 2
        if check and res.returncode != 0:
            raise CommandError(argv, res.returncode, res.stdout, res.stderr)
        return res

    def queue_argv(self) -> list[str]:
        """The one squeue command of ``queue``: every active job, in all partitions (``-a``:
        hidden ones too), of this cluster only (``--local``: not a federation's others)."""
        return [self._cmd("squeue"), "-h", "-a", "--local", "-t", ",".join(_ALIVE), "-O", QUEUE_FORMAT]

    def queue(self) -> list[Job]:
        """Every job that may still run or use its nodes' data (see parse_job_records).

        Raises CommandError if squeue cannot be run or fails (slurmctld down, timeout).
        """
        out = self._run_argv(self.queue_argv()).stdout
        return list(parse_job_records(out, QUEUE_FORMAT).values())

    def nodes(self) -> dict[str, Node]:
        """Every node, in every partition (``-a``: hidden ones too): one ``sinfo`` call.
        Raises CommandError if it fails."""
        return parse_nodes(self._run("sinfo", "-h", "-a", "-N", "-o", NODE_FORMAT).stdout)

    def set_features(self, nodes: str, available: list[str], active: list[str]) -> None:
        """Make ``available`` and ``active`` the available and active features of ``nodes``
        (a hostlist): one ``scontrol update``. Raises CommandError if Slurm refuses."""
        self._run("scontrol", "update", f"NodeName={nodes}", f"AvailableFeatures={','.join(available)}",
                  f"ActiveFeatures={','.join(active)}")

    def placing(self) -> dict[str, Placing]:
        """What the bounded wait for data reads of every active job (records.Placing): one
        ``squeue``. Raises CommandError if it fails."""
        return parse_placing(self._run("squeue", "-h", "-a", "--local", "-t", ",".join(_ALIVE),
                                       "-o", PLACING_FORMAT).stdout)

    def set_exclusion(self, job_id: str, job_ref: str, exclude: str | None, comment: Callable[[str], str]) -> bool:
        """Make ``exclude`` (a hostlist; "" for none; None: leave it) the ExcNodeList of the
        pending job ``job_ref`` (squeue %i: ``12``, ``12_3``: that one job, never its whole
        array) and ``comment(its AdminComment now)`` its AdminComment, read just before:
        one ``squeue`` and one ``scontrol update``. False if the job is gone or no longer
        pending; raises CommandError if Slurm refuses (the job started meanwhile)."""
        job = self._job(job_ref, job_id)
        if job is None or job.state != "PENDING":
            return False
        args = [f"JobId={job_ref}"] + ([f"ExcNodeList={exclude}"] if exclude is not None else [])
        self._run("scontrol", "update", *args, f"AdminComment={comment(job.admin_comment)}")
        return True

    def job_alive(self, job_id: str) -> bool:
        try:
            job = self._job(job_id)
        except CommandError:
            return True  # cannot tell: keep the lease
        return job is not None and job.state in _ALIVE

    def drain(self, node: str, reason: str) -> None:
        """Drain ``node`` with ``reason`` (``dsstage: ...``), before the hook's non-zero exit
        drains it with Slurm's own "Prolog error": the admin reads why in ``sinfo -R``.
        Raises CommandError if Slurm refuses (the exit still drains the node)."""
        self._run("scontrol", "update", f"NodeName={node}", "State=DRAIN",
                  f"Reason=dsstage: {clean_reason(reason)}")

    def hold(self, job_id: str, reason: str) -> str:
        """Keep the job from running without its data; say what was done (see hold_message).

        The message goes into the job's AdminComment first, after what is there. Then a batch
        job is requeued and held (``scontrol requeuehold Incomplete``: the nodes are free, the
        job stays; its user releases it). Slurm requeues only batch jobs, and not those
        submitted with ``--no-requeue``: such a batch job is left to its TaskProlog, which
        fails it with the reason in its output; an allocation from ``salloc`` or ``srun`` gets
        the message on its terminal (``scontrol notify``) and is cancelled, so that it does
        not keep its nodes idle. Raises CommandError if Slurm cannot be asked, or refuses;
        the TaskProlog still keeps the job's tasks from starting.
        """
        reason = clean_reason(reason)
        job = self._job(job_id)
        if job is None or job.state not in _ALIVE:
            return GONE
        message = hold_message(job, reason)
        self._record(job, message)
        if job.batch and job.requeue:
            # Incomplete: a job that another node's Prolog requeued already (COMPLETING while its
            # batch script is killed, then PENDING) is left as it is
            self._run("scontrol", "requeuehold", "Incomplete", job_id)
            return ALREADY_HELD if job.state in _ENDING else HELD
        if job.batch:
            return NOT_REQUEUED
        self._run("scontrol", "notify", job_id, message, check=False)  # best effort: the terminal
        self._run("scancel", job_id)
        return CANCELLED

    def _job(self, job_id: str, record: str | None = None) -> Job | None:
        """The job as squeue sees it (see parse_job_records); None if Slurm does not know it.
        ``job_id`` names it to squeue, ``record`` (default: the same) is its JobID there."""
        res = self._run("squeue", "-h", "-t", "all", "-j", job_id, "-O", JOB_FORMAT, check=False)
        if res.returncode != 0 and "Invalid job id" in res.stderr:
            return None
        if res.returncode != 0:
            raise CommandError(res.args, res.returncode, res.stdout, res.stderr)
        return parse_job_records(res.stdout).get(record or job_id)

    def _record(self, job: Job, message: str) -> None:
        """``message`` into the job's AdminComment, after what is there (best effort)."""
        merged = merge_admin_comment(job.admin_comment, message)
        res = self._run("scontrol", "update", f"JobId={job.job_id}", f"AdminComment={merged}", check=False)
        if res.returncode != 0:  # "Job has already finished": another node's Prolog cancelled it
            log.warning("job %s: cannot record the hold reason: %s", job.job_id, res.stderr.strip())


def client(bin_dir: str = BIN_DIR) -> SlurmClient:
    """The Slurm backend for this machine: pyslurm where it imports with the job API
    PySlurm follows, else the command-line clients in ``bin_dir``.

    No pyslurm release builds against Slurm 22.05 (Debian 12's); PyPI's old 17.x/18.x
    releases have no ``pyslurm.Jobs``: both get CliSlurm.
    """
    cli = CliSlurm(bin_dir=bin_dir)
    module = _pyslurm()
    return PySlurm(module, cli) if module is not None else cli


def _pyslurm() -> Any:
    """The pyslurm module if it imports and has the API PySlurm uses, else None."""
    try:
        import pyslurm  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError; a build against another libslurm fails as it loads
        log.debug("pyslurm: not used: %s", exc)
        return None
    if callable(getattr(getattr(pyslurm, "Jobs", None), "load", None)) and hasattr(pyslurm, "PyslurmError"):
        return pyslurm
    log.debug("pyslurm %s: no pyslurm.Jobs.load: not used", getattr(pyslurm, "__version__", "?"))
    return None


class PySlurm:
    """Slurm through pyslurm's job API, for ``queue``: one RPC (slurm_load_jobs), no client
    process, no text to parse.

    Follows pyslurm 24.11.0 (pyslurm/core/job/job.pyx; the same names since 23.2.2, whose
    ``Jobs`` became a MultiClusterMap: ``values()`` yields every cluster's jobs):
    ``Jobs.load()``; of each ``Job``: ``id``, ``user_name``, ``user_id``, ``state``,
    ``partition``, ``priority`` (0 when held; None for NO_VAL), ``start_time`` (epoch
    seconds, None for 0), ``scheduled_nodes``, ``allocated_nodes``, ``admin_comment`` (None
    when empty), ``is_batch_job``, ``is_requeueable``. Load errors are ``pyslurm.RPCError``
    (a ``pyslurm.PyslurmError``).

    ``hold`` and ``job_alive`` are CliSlurm's (``cli``): pyslurm could set AdminComment
    (``Job.modify(JobSubmitDescription(admin_comment=...))``), but ``Job.requeue(hold=True)``
    sends JOB_REQUEUE_HOLD alone, without scontrol's ``Incomplete`` (JOB_RUNNING: leave a job
    that another node's Prolog requeued already as it is); and one implementation of the
    hold rules is the one tested on a real Slurm.
    """

    def __init__(self, module: Any, cli: CliSlurm) -> None:
        self.pyslurm = module
        self.cli = cli

    @property
    def bin_dir(self) -> str:
        return self.cli.bin_dir

    def queue(self) -> list[Job]:
        """Every job that may still run or use its nodes' data, as CliSlurm.queue lists them.

        Raises CommandError if slurmctld cannot be asked.
        """
        try:
            loaded = self.pyslurm.Jobs.load()
            return [_job(RawJob(job_id=str(j.id), user=j.user_name or str(j.user_id), state=str(j.state),
                                partition=j.partition, priority=j.priority,
                                start=float(j.start_time) if j.start_time else None, sched_nodes=j.scheduled_nodes,
                                nodes=j.allocated_nodes, batch=bool(j.is_batch_job),
                                requeue=bool(j.is_requeueable), admin_comment=j.admin_comment))
                    for j in loaded.values() if j.state in _ALIVE]
        except self.pyslurm.PyslurmError as exc:
            raise CommandError(["pyslurm.Jobs.load()"], None, "", str(exc),
                               message="pyslurm cannot load the jobs from slurmctld") from exc

    def job_alive(self, job_id: str) -> bool:
        return self.cli.job_alive(job_id)

    def nodes(self) -> dict[str, Node]:
        return self.cli.nodes()

    def set_features(self, nodes: str, available: list[str], active: list[str]) -> None:
        self.cli.set_features(nodes, available, active)

    def placing(self) -> dict[str, Placing]:
        return self.cli.placing()

    def set_exclusion(self, job_id: str, job_ref: str, exclude: str | None, comment: Callable[[str], str]) -> bool:
        return self.cli.set_exclusion(job_id, job_ref, exclude, comment)

    def hold(self, job_id: str, reason: str) -> str:
        """CliSlurm.hold (see the class docstring for why)."""
        return self.cli.hold(job_id, reason)

    def drain(self, node: str, reason: str) -> None:
        self.cli.drain(node, reason)
