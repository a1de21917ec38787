"""How a ``#BB_LUA dataset=`` job's request reaches its Prolog.

A ``--dataset`` request reaches the Prolog in its environment (SPANK). A burst-buffer
directive cannot: on Slurm 22.05 job_submit cannot set ``spank_job_env``, and the
burst-buffer callbacks run on the controller, never on the nodes. But the Prolog waits for
``slurm_bb_pre_run``. So ``sbatch_ext/burst_buffer.lua`` runs ``dsstage bb record JOBID
NAMES`` from pre_run, which writes ``<state_dir>/bb/<job id>``; the Prolog (and the warm
path) reads it when the job has no SPANK request; ``slurm_bb_job_teardown`` runs ``dsstage
bb forget JOBID``. The hook scripts start Python for such a job only when the defaults file
names the directory (``DSSTAGE_BB_REQUESTS``) and the job's record is there: a site
without burst buffers pays nothing.

Trust: the record decides which datasets root stages for a job, so it is read only from a
directory that nobody but root or ``burst_buffer.user`` (Slurm's SlurmUser, which runs the
callbacks) can write, without following a symbolic link, and only if the file belongs to
one of them and nobody else can write it. Even a forged record could only ask for
datasets: the Prolog checks names, catalog and access with the job's uid as for
``--dataset``.

This module imports only the standard library, dsstage.errors and dsstage.fs: the warm
Prolog uses it.
"""

from __future__ import annotations

import os

from dsstage.errors import ConfigError, StateError
from dsstage.fs import jsontext, runfiles, safe, shared

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

DIR = "bb"
#: the hook scripts' variable naming the directory (from the defaults file)
ENV = "DSSTAGE_BB_REQUESTS"


def directory(state_dir: str) -> str:
    return os.path.join(state_dir, DIR)


def writer_uid(user: str | None) -> int:
    """The uid of ``burst_buffer.user`` (0 for root, the default)."""
    if not user:
        return 0
    import pwd
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise ConfigError(f"burst_buffer.user {user!r} is not a user on this host: name Slurm's SlurmUser, "
                          "who runs burst_buffer.lua") from None


def _job_ok(job_id: str) -> bool:
    return job_id.isdigit() and len(job_id) <= 20


#: what the hook script found (``yes``, ``no``, ``unknown``: the shared filesystem did not answer)
RECORD_ENV = "DSSTAGE_BB_RECORD"


def flagged(env: Mapping[str, str]) -> bool:
    """Whether the job has a burst-buffer record: what the hook script found, else (it could
    not tell, or did not run) what a look finds now."""
    where, job_id = env.get(ENV, ""), env.get("SLURM_JOB_ID", "")
    if not where or not _job_ok(job_id):
        return False
    said = env.get(RECORD_ENV, "")
    if said in ("yes", "no"):
        return said == "yes"
    return os.path.lexists(os.path.join(where, job_id))


def maybe(env: Mapping[str, str]) -> bool:
    """Whether the job may have a burst-buffer record, without looking (the look is what may
    hang): the hook script found one or could not tell; without its word, a job with no
    ``--dataset`` (the script starts Python for such a job only when it has one)."""
    said = env.get(RECORD_ENV, "")
    if said:
        return said in ("yes", "unknown") and bool(env.get(ENV))
    return bool(env.get(ENV)) and not next((env[v] for v in runfiles.REQUEST_VARS if env.get(v)), None)


def read(state_dir: str, job_id: str, writer_uid: int | None = None) -> str | None:
    """The datasets (``a,b``) job ``job_id`` asked for by burst-buffer directive, or None if
    it has no record. Raises UnsafeStore for a record or directory others could have
    written (dsstage.fs.shared), StateError for a damaged record: the site's to fix, never
    the node's."""
    if not _job_ok(job_id):
        raise StateError(f"{job_id!r} is not a job id")
    writers = (0,) if writer_uid in (None, 0) else (0, writer_uid)
    where = directory(state_dir)
    data = shared.read(where, job_id, writers)
    if data is None:
        return None
    try:
        record = jsontext.loads(data) if len(data) <= shared.MAX else None
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get("job") != job_id or not isinstance(record.get("datasets"), str):
        raise StateError(f"{os.path.join(where, job_id)} is not a dsstage burst-buffer record for job {job_id}")
    return str(record["datasets"])


def write(state_dir: str, job_id: str, names: Sequence[str]) -> str:
    """Record job ``job_id``'s datasets (atomically: a fresh temporary file, then rename)."""
    if not _job_ok(job_id):
        raise StateError(f"{job_id!r} is not a job id")
    path = os.path.join(directory(state_dir), job_id)
    safe.write_atomic(path, jsontext.dumps({"job": job_id, "datasets": ",".join(names)}) + "\n")
    return path


def remove(state_dir: str, job_id: str) -> bool:
    """Forget job ``job_id``'s record; False if there was none."""
    if not _job_ok(job_id):
        raise StateError(f"{job_id!r} is not a job id")
    try:
        os.unlink(os.path.join(directory(state_dir), job_id))
    except FileNotFoundError:
        return False
    return True
