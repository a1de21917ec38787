"""The node filesystem protocol: the store's layout, and how root touches it safely.

Threat model (docs/admin-guide.md): users on a compute node are not trusted. They can
create files in any world-writable directory before dsstage does, race it, and run code
while a Prolog runs. So nothing root creates, changes or reads in a store is reached by
a path a user could have steered:

* A store root (a tier's path, the run directory) is opened from ``/`` one component at a
  time with ``O_NOFOLLOW | O_DIRECTORY``. Every component must be owned by root; an
  ancestor may be writable by others only if it is sticky (``/tmp``, ``/dev/shm``: then
  nobody but root can rename the root-owned child); the store root and every directory
  dsstage uses below it must not be writable by group or others. Otherwise the store is
  refused with one line naming the path and the fix (``UnsafeStore``).
* Below the root, every create, chmod, chown, rename, unlink and ACL write is done
  relative to directory descriptors opened the same way, or on a descriptor of the object
  itself (``fchmod``, ``fchown``, ``fsetxattr``).
* Temporary names are fresh, short (they fit whatever the final name is) and created with
  ``O_EXCL``; files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked to be regular.

Locks: the per-dataset lock is an flock(2) on ``locks/<name>.lock`` through filelock.
filelock 3.12 opens its path with ``O_CREAT | O_TRUNC`` and follows symbolic links (newer
releases add O_NOFOLLOW); either is safe here because ``locks/`` and every directory
above it have been verified root-owned and not writable by anyone else, so only root can
create an entry there.

This module imports only the standard library (and dsstage.errors, which imports nothing):
the warm Prolog uses it too.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from .errors import StoreError, UnsafeStore

VERSION_LEN = 16
NAME_MAX = 64
_FIRST = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_NAME = _FIRST | frozenset("._-")
_JOB = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-")
REQUEST_VARS = ("SPANK__SLURM_SPANK_OPTION_dsstage_dataset", "SPANK_DSSTAGE_DATASETS")
CONFIG_CACHE = "config-cache.json"
HOLD_MARK = "# dsstage: hold"
#: defaults shared by the hook scripts and the Python side
RUN_DIR = "/run/dsstage"
CONFIG_PATH = "/etc/dsstage/dsstage.yaml"

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: the largest JSON record (mark, lease, cache) dsstage reads; anything larger is damaged
JSON_MAX = 4 * 2**20

#: the directories of a tier and their modes (see store.py for what each holds)
TIER_DIRS = {"datasets": 0o755, "ready": 0o755, "staging": 0o700, "locks": 0o755, "leases": 0o755,
             "trash": 0o700, "reserved": 0o700}


# -- names --------------------------------------------------------------------------------

def name_ok(name: str) -> bool:
    """A dataset or tier name: ``[a-z0-9][a-z0-9._-]*``, at most 64 characters."""
    return 0 < len(name) <= NAME_MAX and name[0] in _FIRST and all(c in _NAME for c in name)


def job_id_ok(job_id: str) -> bool:
    return 0 < len(job_id) <= 64 and all(c in _JOB for c in job_id) and job_id not in (".", "..")


def env_var(name: str) -> str:
    """``DSSTAGE_PATH_<NAME>``: upper case, every other character as ``_``."""
    return "DSSTAGE_PATH_" + "".join(c if c.isalnum() and c.isascii() else "_" for c in name.upper())


def version_id(digest: str) -> str:
    return digest[:VERSION_LEN]


_seq = itertools.count()


def temp_name() -> str:
    """A fresh, short temporary name (it fits any directory, whatever the final names are)."""
    return f".dsstage-{os.getpid()}-{next(_seq)}-{time.monotonic_ns() % 10**9}.tmp"


def is_temp(name: str) -> bool:
    return name.startswith(".dsstage-") and name.endswith(".tmp")


# -- safe directories ---------------------------------------------------------------------

def dir_problem(st: os.stat_result, *, store: bool) -> str | None:
    """Why a directory may not be trusted, or None. ``store``: dsstage's own directories
    (nobody else may write); else an ancestor (others may write only if it is sticky)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != 0:
        return f"is owned by uid {st.st_uid}, not root"
    if st.st_mode & 0o022 and (store or not st.st_mode & stat.S_ISVTX):
        return f"is writable by {'group or others' if store else 'others and not sticky'} " \
               f"(mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _refuse(path: str, problem: str) -> UnsafeStore:
    return UnsafeStore(f"{path} {problem}: dsstage will not use it as root, a user could steer it; "
                       f"make every directory of the path root-owned and not writable by others "
                       f"(or remove {path} and let dsstage create it)")


def open_root(path: str, *, create: bool = True, mode: int = 0o755) -> int:
    """A descriptor of directory ``path``, reached from ``/`` without following symbolic
    links, with every component checked (see the module doc); missing components are
    created (root, ``mode``) when ``create``. Raises UnsafeStore, or FileNotFoundError."""
    if not path.startswith("/"):
        raise UnsafeStore(f"{path!r} is not an absolute path")
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", O_DIR)
    here = ""
    try:
        for i, part in enumerate(parts):
            here += "/" + part
            last = i == len(parts) - 1
            try:
                nfd = os.open(part, O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = _open_dir(fd, part, here)
            except OSError as exc:
                raise _open_error(here, exc) from None
            os.close(fd)
            fd = nfd
            problem = dir_problem(os.fstat(fd), store=last)
            if problem:
                raise _refuse(here, problem)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_dir(parent: int, name: str, shown: str) -> int:
    try:
        return os.open(name, O_DIR, dir_fd=parent)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _open_error(shown, exc) from None


def _open_error(shown: str, exc: OSError) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return _refuse(shown, "is a symbolic link or not a directory")
    return exc


_D = TypeVar("_D", bound="_OpenDirs")


class _OpenDirs:
    """Directory descriptors opened once each and closed together (``close()`` or ``with``)."""

    _fds: dict[Any, int]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self: _D) -> _D:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class RootDir(_OpenDirs):
    """A root-owned directory tree (a tier of the store, or the run directory) whose
    directories are opened once each, without following symbolic links, and checked.

    ``dir(*parts)`` is the descriptor of a directory below the root (created with the
    layout's mode when missing and ``create``); close with ``close()`` or ``with``."""

    def __init__(self, root: str, *, create: bool = True) -> None:
        self.root = root
        self.create = create
        self._fds: dict[tuple[str, ...], int] = {(): open_root(root, create=create)}

    @property
    def fd(self) -> int:
        return self._fds[()]

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def dir(self, *parts: str, create: bool | None = None, mode: int | None = None) -> int:
        """Raises FileNotFoundError if missing and not creating, UnsafeStore if not trusted."""
        key = tuple(parts)
        fd = self._fds.get(key)
        if fd is not None:
            return fd
        parent = self.dir(*key[:-1], create=create)
        name = key[-1]
        if name in ("", ".", "..") or "/" in name:
            raise StoreError(f"bad directory name {name!r} under {self.root}")
        try:
            fd = os.open(name, O_DIR, dir_fd=parent)
        except FileNotFoundError:
            if not (self.create if create is None else create):
                raise
            want = mode if mode is not None else TIER_DIRS.get(name, 0o755) if len(key) == 1 else 0o755
            try:
                os.mkdir(name, want, dir_fd=parent)
            except FileExistsError:
                pass
            fd = _open_dir(parent, name, self.path(*key))
        except OSError as exc:
            raise _open_error(self.path(*key), exc) from None
        problem = dir_problem(os.fstat(fd), store=True)
        if problem:
            os.close(fd)
            raise _refuse(self.path(*key), problem)
        self._fds[key] = fd
        return fd

    def has_dir(self, *parts: str) -> int | None:
        """The descriptor of an existing directory, or None if it is missing."""
        try:
            return self.dir(*parts, create=False)
        except FileNotFoundError:
            return None

    def forget(self, *parts: str) -> None:
        """Close the descriptors of ``parts`` and below (after it was renamed or removed)."""
        key = tuple(parts)
        for k in [k for k in self._fds if k[:len(key)] == key and k]:
            os.close(self._fds.pop(k))

    def names(self, *parts: str) -> list[str]:
        """The entries of a directory (no temporary files), [] if it is missing."""
        fd = self.has_dir(*parts)
        if fd is None:
            return []
        return sorted(n for n in os.listdir(fd) if not is_temp(n))



# -- files relative to a directory descriptor ------------------------------------------------

class Flock:
    """An exclusive flock(2) on ``name`` (created, root only) in directory ``dir_fd``: the
    kernel drops it if the holder dies. The directory is root's and writable by nobody
    else (RootDir checked it), so nobody else can put anything at ``name``."""

    def __init__(self, dir_fd: int, name: str) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.fd = -1

    def __enter__(self) -> Flock:
        self.fd = os.open(self.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                          0o600, dir_fd=self.dir_fd)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing the last descriptor releases the lock


def open_regular(dir_fd: int, name: str) -> int | None:
    """A read descriptor of regular file ``name``, or None if it is missing or not regular
    (a symbolic link, a FIFO: never followed, never blocks)."""
    try:
        fd = os.open(name, O_READ, dir_fd=dir_fd)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def read_json_at(dir_fd: int | None, name: str) -> dict[str, Any]:
    """A JSON object from regular file ``name``, or {} if missing, damaged or not a file."""
    if dir_fd is None:
        return {}
    fd = open_regular(dir_fd, name)
    if fd is None:
        return {}
    try:
        return _read_json_fd(fd)
    finally:
        os.close(fd)


def _read_json_fd(fd: int) -> dict[str, Any]:
    try:
        data = os.read(fd, JSON_MAX + 1)
    except OSError:
        return {}
    try:
        obj = json.loads(data) if len(data) <= JSON_MAX else None
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def write_at(dir_fd: int, name: str, data: str | bytes, *, mode: int = 0o644, fsync: bool = True,
             owner: tuple[int, int] | None = None) -> None:
    """Replace ``name`` atomically: a fresh temporary file (O_EXCL), then rename."""
    tmp = temp_name()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            write_all(fd, data.encode() if isinstance(data, str) else data)
            if owner is not None:
                os.fchown(fd, *owner)
            os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink_at(dir_fd, tmp)
        raise


def write_json_at(dir_fd: int, name: str, data: Mapping[str, Any], *, fsync: bool = True) -> None:
    write_at(dir_fd, name, json.dumps(data, sort_keys=True), fsync=fsync)


def unlink_at(dir_fd: int | None, name: str) -> bool:
    """Remove file ``name``; False if it was not there."""
    if dir_fd is None:
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


# -- path-based files (the run directory and state directory helpers below) ------------------

def read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``, or {} if it is missing, unreadable or not an object
    (for files in the admins' state directory; the store uses read_json_at)."""
    try:
        with open(path, "rb") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_atomic(path: str, data: str | bytes, *, fsync: bool = True) -> None:
    """Write so that readers see the old file or the new one, never a part (for the
    admins' state directory and files the command line writes)."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, mode=0o755, exist_ok=True)
    fd = os.open(parent, O_DIR)
    try:
        write_at(fd, os.path.basename(path), data, fsync=fsync)
    finally:
        os.close(fd)


def write_json(path: str, data: Mapping[str, Any], *, fsync: bool = True) -> None:
    write_atomic(path, json.dumps(data, sort_keys=True), fsync=fsync)


def read_current(state_dir: str, name: str) -> str | None:
    """The digest in ``<state_dir>/manifests/<name>/CURRENT``; None if there is none.
    Raises ValueError if the file is damaged, OSError if the state directory fails."""
    try:
        with open(os.path.join(state_dir, "manifests", name, "CURRENT")) as fh:
            digest = fh.read(200).strip()
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


# -- the tier's layout -----------------------------------------------------------------------

class Layout:
    """Paths of one tier on one node, as shown to people and jobs, and the lock files
    (the store reaches everything else through a RootDir)."""

    __slots__ = ("root",)

    def __init__(self, root: str) -> None:
        self.root = root

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def __repr__(self) -> str:
        return f"Layout({self.root!r})"

    def version_dir(self, name: str, digest: str) -> str:
        return os.path.join(self.root, "datasets", name, version_id(digest))

    def lock(self, name: str) -> str:
        return os.path.join(self.root, "locks", name + ".lock")



def staging_name(name: str, digest: str) -> str:
    return f"{name}.{version_id(digest)}"


def mark_name(digest: str) -> str:
    return version_id(digest) + ".json"


def read_mark(tier: RootDir, name: str, digest: str) -> dict[str, Any]:
    return read_json_at(tier.has_dir("ready", name), mark_name(digest))


def not_ready(tier: RootDir, name: str, digest: str) -> str | None:
    """None if the copy of ``digest`` is ready, else why not. Its cost does not depend on the
    dataset's size: the mark names this digest and the inode of the copy, the copy is
    root-owned and read-only, and it is on disk (flushed, or written since the last boot)."""
    mark = read_mark(tier, name, digest)
    if not mark:
        return "no ready copy on this node"
    if mark.get("digest") != digest:
        return "the ready mark names another version"
    if mark.get("bad"):
        return f"the copy is known to be damaged ({mark.get('bad')})"
    if not mark.get("durable") and mark.get("boot") != boot_id():
        return "the copy was still being written to disk when this node restarted"
    parent = tier.has_dir("datasets", name)
    try:
        if parent is None:
            raise FileNotFoundError
        st = os.stat(version_id(digest), dir_fd=parent, follow_symlinks=False)
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
    DSSTAGE_DATASET_DIR. A path with a control character is never written (it would add
    a line to the TaskProlog's output)."""
    for _name, path in paths:
        if any(ord(c) < 32 or ord(c) == 127 for c in path):
            raise StoreError(f"refusing to export a path with a control character: {path!r}")
    lines = [f"export {env_var(name)}={path}" for name, path in paths]
    if paths:
        lines.append(f"export DSSTAGE_DATASET_DIR={paths[0][1]}")
    return lines


def task_file(run_dir: str, node: str, job_id: str) -> str:
    return os.path.join(run_dir, node or "node", "jobs", f"{job_id}.task")


def _task_parts(node: str, job_id: str) -> tuple[tuple[str, str], str]:
    if not job_id_ok(job_id) or (node and not job_id_ok(node)):
        raise StoreError(f"job id {job_id!r} or node {node!r} is not valid")
    return (node or "node", "jobs"), f"{job_id}.task"


def write_task_file(run_dir: str, node: str, job_id: str, lines: Iterable[str], gid: int) -> None:
    """Readable by the job's tasks (they run as the user), by nobody else."""
    parts, name = _task_parts(node, job_id)
    with RootDir(run_dir) as run:
        write_at(run.dir(*parts), name, "\n".join(lines) + "\n", mode=0o440, fsync=False,
                 owner=(0, gid if gid >= 0 else 0))


def remove_task_file(run_dir: str, node: str, job_id: str) -> bool:
    """Remove the job's file; False if there was none."""
    parts, name = _task_parts(node, job_id)
    with RootDir(run_dir, create=False) as run:
        return unlink_at(run.has_dir(*parts), name)


# -- the configuration cache -----------------------------------------------------------------------

def config_key(path: str) -> list[int] | None:
    """What identifies one state of the configuration file: any edit, chmod or chown changes it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid, st.st_mode]


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


def load_cache(run_dir: str, config_path: str) -> dict[str, Any] | None:
    """The cache if it was written by root for this very state of ``config_path``."""
    try:
        with RootDir(run_dir, create=False) as run:
            fd = open_regular(run.fd, CONFIG_CACHE)
            if fd is None:
                return None
            try:
                st = os.fstat(fd)
                if st.st_uid != 0 or st.st_mode & 0o022:
                    return None
                cache = _read_json_fd(fd)
            finally:
                os.close(fd)
    except (OSError, UnsafeStore):
        return None
    key = config_key(config_path)
    if not cache or key is None or cache.get("origin") != config_path or cache.get("key") != key:
        return None
    return cache


def remove_at(dir_fd: int | None, name: str) -> bool:
    """Remove ``name`` (a file, or a directory tree, without following links); False if missing."""
    if dir_fd is None:
        return False
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        import shutil
        shutil.rmtree(name, dir_fd=dir_fd)  # fd-based: never follows a link planted inside
        return True
    return unlink_at(dir_fd, name)


# -- trees below a descriptor (staging areas, published copies, sources) -------------------------

RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (5.6+)
_openat2: Any = None


def _load_openat2() -> Any:
    global _openat2
    if _openat2 is None:
        import ctypes

        class OpenHow(ctypes.Structure):
            _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long

        def call(dir_fd: int, rel: str, flags: int, mode: int) -> int:
            how = OpenHow(flags, mode if flags & os.O_CREAT else 0, RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH)
            fd = libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), os.fsencode(rel),
                              ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), rel)
            return int(fd)
        try:
            fd = call(os.open("/", O_DIR), ".", O_DIR, 0)
            os.close(fd)
            _openat2 = call
        except OSError:  # kernel without openat2: walk the components instead
            _openat2 = False
    return _openat2


def open_beneath(dir_fd: int, rel: str, flags: int, mode: int = 0) -> int:
    """Open ``rel`` below ``dir_fd`` without following a symbolic link at any component and
    without leaving the tree (openat2 RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH, or a walk with
    O_NOFOLLOW on kernels before 5.6). ELOOP (or ENOTDIR) if a component is a link."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    call = _load_openat2()
    if call:
        return int(call(dir_fd, rel, flags, mode))
    head, _, tail = rel.rpartition("/")
    parent = dir_fd
    for part in head.split("/") if head else ():
        if part in ("", ".", ".."):
            raise OSError(errno.EINVAL, "bad path component", rel)
        nxt = os.open(part, O_DIR, dir_fd=parent)
        if parent != dir_fd:
            os.close(parent)
        parent = nxt
    try:
        return os.open(tail, flags, mode, dir_fd=parent)
    finally:
        if parent != dir_fd:
            os.close(parent)


def open_source_dir(path: str) -> int:
    """A descriptor of a source directory, reached from ``/`` without following a symbolic
    link at any component: a data owner who controls an ancestor (a directory of theirs in
    a sticky /scratch) cannot redirect root to another tree. ELOOP/ENOTDIR if a component
    is a link; configure the real path."""
    if not path.startswith("/"):
        raise OSError(errno.EINVAL, "not an absolute path", path)
    top = os.open("/", O_DIR)
    try:
        rel = path.strip("/")
        return os.dup(top) if not rel else open_beneath(top, rel, os.O_RDONLY | os.O_DIRECTORY)
    finally:
        os.close(top)


class Tree(_OpenDirs):
    """The directories below one directory descriptor, each opened once without following
    symbolic links (and created, private to root, when ``create``). For staging areas,
    published copies and sources; ``dir("a/b")`` is a descriptor, "" the root itself."""

    def __init__(self, root_fd: int, *, create: bool = False, mode: int = 0o755) -> None:
        self.root_fd = root_fd
        self.create = create
        self.mode = mode
        self._fds: dict[str, int] = {}

    def dir(self, rel: str) -> int:
        if not rel:
            return self.root_fd
        fd = self._fds.get(rel)
        if fd is not None:
            return fd
        head, _, name = rel.rpartition("/")
        parent = self.dir(head)
        try:
            fd = os.open(name, O_DIR, dir_fd=parent)
        except FileNotFoundError:
            if not self.create:
                raise
            try:
                os.mkdir(name, self.mode, dir_fd=parent)
            except FileExistsError:
                pass
            fd = os.open(name, O_DIR, dir_fd=parent)
        self._fds[rel] = fd
        return fd

    def split(self, rel: str) -> tuple[int, str]:
        """(descriptor of the parent directory, last component) of file ``rel``."""
        head, _, name = rel.rpartition("/")
        return self.dir(head), name

    def walk(self, descend: Callable[[str], bool] = lambda _rel: True
             ) -> Iterator[tuple[int, list[tuple[str, str, os.stat_result]]]]:
        """For every directory (from the root, into those ``descend(rel)`` accepts): its
        descriptor and its entries as (name, relative path, lstat)."""
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            fd = self.dir(rel_dir)
            found = []
            for name in os.listdir(fd):
                rel = f"{rel_dir}/{name}" if rel_dir else name
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                found.append((name, rel, st))
                if stat.S_ISDIR(st.st_mode) and descend(rel):
                    stack.append(rel)
            yield fd, found

