"""The warm path of the Prolog, and the small pieces it shares with the rest of dsstage.

A Prolog for datasets that are already cached on the node must cost little: this module
imports only ``os`` and ``json`` (Python's import of logging, dataclasses, yaml and the
staging code costs more than the whole warm path). ``python -m dsstage.warm prolog``
handles a job whose datasets are all ready, quick-verified and allowed for the user,
using the configuration cache the full Prolog leaves in the run directory; anything else
(a cache miss, a copy that is not ready, a restricted dataset the user may not use, any
error) falls through to the full Prolog in ``dsstage.hooks``, which decides and explains.

The store layout, ready check, name rules, lease record and TaskProlog lines live here
and are used by the store and the full Prolog too, so the two paths cannot drift apart.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VERSION_LEN = 16
NAME_MAX = 64
_FIRST = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_NAME = _FIRST | frozenset("._-")
_JOB = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-")
REQUEST_VARS = ("SPANK__SLURM_SPANK_OPTION_dsstage_dataset", "SPANK_DSSTAGE_DATASETS")
CONFIG_CACHE = "config-cache.json"
HOLD_MARK = "# dsstage: hold"


# -- names --------------------------------------------------------------------------------

def name_ok(name: str) -> bool:
    """A dataset or tier name: ``[a-z0-9][a-z0-9._-]*``, at most 64 characters."""
    return 0 < len(name) <= NAME_MAX and name[0] in _FIRST and all(c in _NAME for c in name)


def job_id_ok(job_id: str) -> bool:
    return 0 < len(job_id) <= 64 and all(c in _JOB for c in job_id)


def env_var(name: str) -> str:
    """``DSSTAGE_PATH_<NAME>``: upper case, every other character as ``_``."""
    return "DSSTAGE_PATH_" + "".join(c if c.isalnum() and c.isascii() else "_" for c in name.upper())


def version_id(digest: str) -> str:
    return digest[:VERSION_LEN]


# -- the store's layout ---------------------------------------------------------------------

class Layout:
    """Paths of one tier on one node (see store.py for what each holds)."""

    __slots__ = ("root",)

    def __init__(self, root: str) -> None:
        self.root = root

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.root == self.root

    def __repr__(self) -> str:
        return f"Layout({self.root!r})"

    def dataset_dir(self, name: str) -> str:
        return os.path.join(self.root, "datasets", name)

    def version_dir(self, name: str, digest: str) -> str:
        return os.path.join(self.root, "datasets", name, version_id(digest))

    def mark(self, name: str, digest: str) -> str:
        return os.path.join(self.root, "ready", name, version_id(digest) + ".json")

    def staging(self, name: str, digest: str) -> str:
        return os.path.join(self.root, "staging", f"{name}.{version_id(digest)}")

    def lock(self, name: str) -> str:
        return os.path.join(self.root, "locks", name + ".lock")

    def lease(self, name: str, job_id: str) -> str:
        return os.path.join(self.root, "leases", name, job_id + ".json")


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``, or {} if it is missing, unreadable or not an object."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_atomic(path: str, data: str | bytes, *, fsync: bool = True) -> None:
    """Write so that readers see the old file or the new one, never a part."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_json(path: str, data: Mapping[str, Any], *, fsync: bool = True) -> None:
    write_atomic(path, json.dumps(data, sort_keys=True), fsync=fsync)


def read_current(state_dir: str, name: str) -> str | None:
    """The digest in ``<state_dir>/manifests/<name>/CURRENT``; None if there is none.
    Raises ValueError if the file is damaged."""
    try:
        with open(os.path.join(state_dir, "manifests", name, "CURRENT")) as fh:
            digest = fh.read().strip()
    except FileNotFoundError:
        return None
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(digest)
    return digest


def boot_id() -> str:
    """This boot of the node (changes at every restart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def not_ready(layout: Layout, name: str, digest: str) -> str | None:
    """None if the copy of ``digest`` is ready, else why not. Its cost does not depend on the
    dataset's size: the mark names this digest and the inode of the copy, the copy is
    root-owned and read-only, and it is on disk (flushed, or written since the last boot)."""
    mark = read_json(layout.mark(name, digest))
    if not mark:
        return "no ready copy on this node"
    if mark.get("digest") != digest:
        return "the ready mark names another version"
    if not mark.get("durable") and mark.get("boot") != boot_id():
        return "the copy was still being written to disk when this node restarted"
    try:
        st = os.lstat(layout.version_dir(name, digest))
    except OSError:
        return "the ready mark exists but the copy is gone"
    if [st.st_ino, st.st_dev] != [mark.get("ino"), mark.get("dev")]:
        return "the copy was replaced after it was marked ready"
    if (st.st_mode & 0o170000) != 0o040000 or st.st_uid != 0 or st.st_mode & 0o222:
        return "the copy is no longer root-owned and read-only"
    return None


def lease_record(dataset: str, digest: str, job_id: str, user: str, node: str, *, taken: float,
                 host: str = "", pid: int = 0) -> dict[str, Any]:
    """What a lease file holds (lease.Lease reads it back)."""
    return {"dataset": dataset, "digest": digest, "job_id": job_id, "user": user, "node": node,
            "taken": taken, "host": host, "pid": pid}


def group_names(user: str, gid: int) -> set[str]:
    """Every group name of ``user`` (primary ``gid`` included)."""
    import grp
    names = set()
    for g in os.getgrouplist(user, gid):
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            continue
    return names


# -- the TaskProlog's file ---------------------------------------------------------------------

def export_lines(paths: Sequence[tuple[str, str]]) -> list[str]:
    """``export`` lines for (dataset, path) pairs: one variable each, and the first as
    DSSTAGE_DATASET_DIR."""
    lines = [f"export {env_var(name)}={path}" for name, path in paths]
    if paths:
        lines.append(f"export DSSTAGE_DATASET_DIR={paths[0][1]}")
    return lines


def task_file(run_dir: str, node: str, job_id: str) -> str:
    return os.path.join(run_dir, node or "node", "jobs", f"{job_id}.task")


def write_task_file(path: str, lines: Iterable[str], gid: int) -> None:
    """Readable by the job's tasks (they run as the user), by nobody else."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.chown(tmp, 0, gid if gid >= 0 else 0)
    os.chmod(tmp, 0o440)
    os.replace(tmp, path)


# -- the node report (what `dsstage status` shows) ----------------------------------------------

def node_report(state_dir: str, node: str) -> str:
    return os.path.join(state_dir, "nodes", f"{node}.json")


def note_leases(report_path: str, job_id: str, copies: Sequence[tuple[str, str]]) -> None:
    """Add ``job_id`` to the leases of (dataset, version) rows of a node report, best effort:
    the full Prolog and the Epilog rewrite the whole report from the store."""
    report = read_json(report_path)
    rows = report.get("copies")
    if not isinstance(rows, list):
        return
    wanted = set(copies)
    for row in rows:
        if isinstance(row, dict) and (row.get("dataset"), row.get("version")) in wanted:
            row["leases"] = sorted(set(row.get("leases") or []) | {job_id})
    report["time"] = time.time()
    try:
        write_json(report_path, report, fsync=False)
    except OSError:
        pass


# -- the configuration cache -----------------------------------------------------------------------

def config_key(path: str) -> list[int] | None:
    """What identifies one state of the configuration file: any edit, chmod or chown changes it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid, st.st_mode]


def cache_record(origin: str, state_dir: str, datasets: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {"origin": origin, "key": config_key(origin), "state_dir": state_dir, "datasets": dict(datasets)}


def load_cache(run_dir: str, config_path: str) -> dict[str, Any] | None:
    """The cache if it was written by root for this very state of ``config_path``."""
    path = os.path.join(run_dir, CONFIG_CACHE)
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_uid != 0 or st.st_mode & 0o022:
        return None
    cache = read_json(path)
    key = config_key(config_path)
    if not cache or key is None or cache.get("origin") != config_path or cache.get("key") != key:
        return None
    return cache


# -- the warm Prolog ---------------------------------------------------------------------------------

def prolog(env: Mapping[str, str], run_dir: str, config_path: str,
           log: Any = None) -> int | None:
    """0 if every requested dataset was ready and is now leased; None: use the full Prolog."""
    request = next((env[v] for v in REQUEST_VARS if env.get(v)), "")
    job_id, node, user = env.get("SLURM_JOB_ID", ""), env.get("SLURMD_NODENAME", ""), env.get("SLURM_JOB_USER", "")
    try:
        uid, gid = int(env.get("SLURM_JOB_UID", "")), int(env.get("SLURM_JOB_GID", ""))
    except ValueError:
        return None
    names: list[str] = []
    for part in request.split(","):
        name = part.strip()
        if not name_ok(name):
            return None
        if name not in names:
            names.append(name)
    cache = load_cache(run_dir, config_path)
    if not names or not job_id_ok(job_id) or not node or not user or cache is None:
        return None
    state_dir, catalog = cache["state_dir"], cache["datasets"]
    picked: list[tuple[str, str, Layout]] = []
    groups: set[str] | None = None
    for name in names:
        ds = catalog.get(name)
        if not ds or ds.get("verify") != "quick":
            return None
        if ds.get("groups") is not None and uid != 0:
            groups = group_names(user, gid) if groups is None else groups
            if not groups & set(ds["groups"]):
                return None
        try:
            digest = read_current(state_dir, name)
        except ValueError:
            return None
        layout = Layout(ds["root"].replace("{node}", node))
        if digest is None or not_ready(layout, name, digest) is not None:
            return None
        picked.append((name, digest, layout))
    host = os.uname().nodename
    for name, digest, layout in picked:
        write_json(layout.lease(name, job_id),
                   lease_record(name, digest, job_id, user, node, taken=time.time(), host=host), fsync=False)
    if any(not_ready(layout, name, digest) is not None for name, digest, layout in picked):
        # lost a race with an eviction (see store.py): give the leases back, take the full path
        for name, _digest, layout in picked:
            try:
                os.unlink(layout.lease(name, job_id))
            except OSError:
                pass
        return None
    paths = [(name, layout.version_dir(name, digest)) for name, digest, layout in picked]
    write_task_file(task_file(run_dir, node, job_id), export_lines(paths), gid)
    note_leases(node_report(state_dir, node), job_id, [(name, version_id(digest)) for name, digest, _ in picked])
    if log:
        for name, path in paths:
            log(f"job {job_id}: {name} cached at {path} (warm path)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ
    if argv == ["prolog"]:
        run_dir = env.get("DSSTAGE_RUN_DIR", "/run/dsstage")
        config_path = env.get("DSSTAGE_CONFIG") or "/etc/dsstage/dsstage.yaml"
        log_path = env.get("DSSTAGE_LOG")

        def log(text: str) -> None:
            line = f"dsstage-{os.getpid()}: INFO: {text}\n"
            if log_path:
                with open(log_path, "a") as fh:
                    fh.write(line)
            else:
                sys.stderr.write(line)
        try:
            rc = prolog(env, run_dir, config_path, log)
        except Exception:  # noqa: BLE001 - anything unexpected: the full Prolog decides and logs
            rc = None
        if rc is not None:
            return rc
    from . import hooks
    return hooks.main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
