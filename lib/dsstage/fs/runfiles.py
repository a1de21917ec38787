"""What root keeps in the run directory for the hooks: the TaskProlog's file of ``export`` lines
per job, the configuration cache the warm Prolog reads instead of the YAML, the parsed
configuration every other command of root's reads instead of parsing the YAML again; the paths
and variables the hook scripts share.

Imports only the standard library and dsstage.fs: the warm Prolog uses it.
"""

from __future__ import annotations

import os
import time

from dsstage.errors import StoreError, UnsafeStore
from dsstage.fs import acl, jsontext
from dsstage.fs.layout import env_var, job_id_ok
from dsstage.fs.safe import RootDir, _read_json_fd, open_regular, read_json_at, unlink_at, write_at, write_json_at

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from typing import Any

REQUEST_VARS = ("SPANK__SLURM_SPANK_OPTION_dsstage_dataset", "SPANK_DSSTAGE_DATASETS")
CONFIG_CACHE = "config-cache.json"
CONFIG_PARSED = "config-parsed.json"
#: a configuration file changed less than this long ago may change again within the same
#: timestamp tick, unseen by its stat: it is parsed, not kept parsed
SETTLED = 2.0
HOLD_MARK = "# dsstage: hold"
#: defaults shared by the hook scripts and the Python side
RUN_DIR = "/run/dsstage"
CONFIG_PATH = "/etc/dsstage/dsstage.yaml"


def export_lines(paths: Sequence[tuple[str, str]]) -> list[str]:
    """``export`` lines for (dataset, path) pairs: one variable each, and the first as
    DSSTAGE_DATASET_DIR. A path with a control character is never written (it would add
    a line to the TaskProlog's output)."""
    for _name, path in paths:
        if any(ord(c) < 32 or ord(c) == 127 for c in path):
            raise StoreError(f"refusing to export a path with a control character: {path!r}")
    lines = [f"export {env_var(name)}={path}" for name, path in paths]
    if paths:
        lines.append(f"export DSSTAGE_DATASET_DIR={paths[0][1]}")
    return lines


def more_exports(name: str, values: Sequence[tuple[str, str]], *, first: bool) -> list[str]:
    """``export DSSTAGE_<KEY>_<NAME>=value`` for each (KEY, value), and ``DSSTAGE_<KEY>`` too for
    the job's first dataset; a value with a control character is never written."""
    suffix = env_var(name)[len("DSSTAGE_PATH_"):]
    lines = []
    for key, value in values:
        if any(ord(c) < 32 or ord(c) == 127 for c in value) or not key.replace("_", "").isalnum():
            raise StoreError(f"refusing to export {key}={value!r}")
        lines.append(f"export DSSTAGE_{key}_{suffix}={value}")
        if first:
            lines.append(f"export DSSTAGE_{key}={value}")
    return lines


def job_file(run_dir: str, node: str, job_id: str, name: str) -> str:
    """A file the Prolog leaves for the job beside its task file (a sharded dataset's map)."""
    return os.path.join(run_dir, node or "node", "jobs", f"{job_id}.{name}")


def write_job_file(run_dir: str, node: str, job_id: str, name: str, data: str, reader: tuple[int, int]) -> str:
    """Readable by the job's tasks, by nobody else; its path. Removed with the task file."""
    parts, _task = _task_parts(node, job_id)
    if not name or "/" in name or name == "task":
        raise StoreError(f"bad job file name {name!r}")
    with RootDir(run_dir) as run:
        _write_for(run.dir(*parts), f"{job_id}.{name}", data, reader)
    return job_file(run_dir, node, job_id, name)


def _write_for(dir_fd: int, name: str, data: str, reader: tuple[int, int]) -> None:
    """Write a file for the job's tasks: root's, mode 0440 with an ACL that lets the job's user
    (``reader``: its uid and gid) read it and nobody else, not even the users of its group
    (``users`` at many sites). A user who owned it could rewrite it, or fill the run directory
    through it, so it stays root's. Where the run directory's filesystem has no POSIX ACLs
    (not /run's tmpfs on Debian), it falls back to root:<the job's group> 0440."""
    uid, gid = reader
    if uid < 0:  # no user known: root alone reads it (the TaskProlog then finds nothing)
        write_at(dir_fd, name, data, mode=0o400, fsync=False, owner=(0, 0))
        return
    try:
        write_at(dir_fd, name, data, mode=0o440, fsync=False, owner=(0, 0), acl=acl.blob(4, users=[uid], grant=4))
    except OSError as exc:
        if exc.errno not in acl.UNSUPPORTED:
            raise
        write_at(dir_fd, name, data, mode=0o440, fsync=False, owner=(0, gid if gid >= 0 else 0))


def task_file(run_dir: str, node: str, job_id: str) -> str:
    return os.path.join(run_dir, node or "node", "jobs", f"{job_id}.task")


def _task_parts(node: str, job_id: str) -> tuple[tuple[str, str], str]:
    if not job_id_ok(job_id) or (node and not job_id_ok(node)):
        raise StoreError(f"job id {job_id!r} or node {node!r} is not valid")
    return (node or "node", "jobs"), f"{job_id}.task"


def write_task_file(run_dir: str, node: str, job_id: str, lines: Iterable[str], reader: tuple[int, int]) -> None:
    """Readable by the job's tasks (they run as the user ``reader``: uid, gid), by nobody else."""
    parts, name = _task_parts(node, job_id)
    with RootDir(run_dir) as run:
        _write_for(run.dir(*parts), name, "\n".join(lines) + "\n", reader)


def remove_task_file(run_dir: str, node: str, job_id: str) -> bool:
    """Remove the job's file, and the other files left for it (``write_job_file``); False if
    there was no task file."""
    parts, name = _task_parts(node, job_id)
    with RootDir(run_dir, create=False) as run:
        fd = run.has_dir(*parts)
        if fd is not None:
            for other in os.listdir(fd):
                if other.startswith(f"{job_id}.") and other != name:
                    unlink_at(fd, other)
        return unlink_at(fd, name)


def default_run_dir() -> str:
    """The run directory of the command line and the store: ``$DSSTAGE_RUN_DIR``, else RUN_DIR."""
    return os.environ.get("DSSTAGE_RUN_DIR") or RUN_DIR


def stat_key(st: os.stat_result) -> list[int]:
    """What identifies one state of a file: any edit, chmod or chown changes it."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid, st.st_mode]


def config_key(path: str) -> list[int] | None:
    """The configuration file's state (stat_key), None if it cannot be reached."""
    try:
        return stat_key(os.stat(path))
    except OSError:
        return None


def cache_record(origin: str, state_dir: str, datasets: Mapping[str, Mapping[str, Any]],
                 report_user: str | None = None, bb_uid: int | None = None) -> dict[str, Any]:
    return {"origin": origin, "key": config_key(origin), "state_dir": state_dir, "datasets": dict(datasets),
            "report_user": report_user, "bb_uid": bb_uid}


def write_cache(run_dir: str, record: Mapping[str, Any]) -> bool:
    """Write the configuration cache unless it holds ``record`` already; True if written."""
    with RootDir(run_dir) as run:
        if read_json_at(run.fd, CONFIG_CACHE) == record:
            return False
        write_json_at(run.fd, CONFIG_CACHE, record, fsync=False)
    return True


def _read_roots(run_dir: str, name: str, forbidden: int) -> dict[str, Any]:
    """The JSON object in file ``name`` of the run directory if root owns it and none of the
    ``forbidden`` mode bits is set; {} otherwise."""
    try:
        with RootDir(run_dir, create=False) as run:
            fd = open_regular(run.fd, name)
            if fd is None:
                return {}
            try:
                st = os.fstat(fd)
                if st.st_uid != 0 or st.st_mode & forbidden:
                    return {}
                return _read_json_fd(fd)
            finally:
                os.close(fd)
    except (OSError, UnsafeStore):
        return {}


def parsed_config(run_dir: str, path: str, st: os.stat_result) -> Any:
    """What the configuration file at ``path`` parses to, as root kept it (keep_parsed_config)
    for the very state ``st`` of the file (the fstat of the descriptor the caller would read);
    None if the caller is not root, or nothing is kept for this state."""
    if os.geteuid() != 0:
        return None
    kept = _read_roots(run_dir, CONFIG_PARSED, 0o077)
    if kept.get("origin") != path or kept.get("key") != stat_key(st):
        return None
    return kept.get("data")


def keep_parsed_config(run_dir: str, path: str, st: os.stat_result, data: Any,
                       now: float | None = None) -> bool:
    """Keep what the configuration file at ``path``, in state ``st``, parsed to, for the next
    command (parsed_config), readable by root alone; True if kept. Only as root, where the run
    directory exists, for data that JSON gives back exactly (a YAML date or an integer key
    would come back as something else: such a file is parsed every time), and for a file
    that has settled (SETTLED): an edit within the same timestamp tick could leave the
    file's stat as it was."""
    if os.geteuid() != 0 or (time.time() if now is None else now) - st.st_ctime < SETTLED:
        return False
    try:
        text = jsontext.dumps({"origin": path, "key": stat_key(st), "data": data}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return False
    if jsontext.loads(text)["data"] != data:
        return False
    try:
        with RootDir(run_dir, create=False) as run:
            write_at(run.fd, CONFIG_PARSED, text, mode=0o600, fsync=False)
    except (OSError, UnsafeStore, StoreError):
        return False
    return True


def load_cache(run_dir: str, config_path: str) -> dict[str, Any] | None:
    """The cache if it was written by root for this very state of ``config_path``."""
    cache = _read_roots(run_dir, CONFIG_CACHE, 0o022)
    key = config_key(config_path)
    if not cache or key is None or cache.get("origin") != config_path or cache.get("key") != key:
        return None
    return cache
