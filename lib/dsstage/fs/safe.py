"""How root touches a store safely: ``RootDir`` (a store root opened from ``/`` and the
directories below it), descriptor-relative reads and writes, fresh temporary names. The
store's shape is dsstage.fs.layout; opening paths below a descriptor, dsstage.fs.beneath.

Threat model (docs/admin-guide.md): users on a compute node are not trusted. They can
create files in any world-writable directory before dsstage does, race it, and run code
while a Prolog runs. So nothing root creates, changes or reads in a store is reached by
a path a user could have steered:

* A store root (a tier's path, the run directory) is opened from ``/`` one component at a
  time with ``O_NOFOLLOW | O_DIRECTORY``. Every component must be owned by root (or by
  the user dsstage runs as, when that is not root: see ``trusted``); an
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
import os
import stat
import time
from types import TracebackType

from dsstage.errors import StoreError, UnsafeStore
from dsstage.fs import jsontext, untrusted
from dsstage.fs.acl import set_on as set_acl

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any, Self

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: the largest JSON record (mark, lease, cache) dsstage reads; anything larger is damaged
#: the directories of a tier and their modes (see store.py for what each holds)
TIER_DIRS = {"datasets": 0o755, "ready": 0o755, "staging": 0o700, "locks": 0o755, "leases": 0o755,
             "trash": 0o700, "reserved": 0o700}
JSON_MAX = 4 * 2**20
_seq = itertools.count()


def temp_name() -> str:
    """A fresh, short temporary name (it fits any directory, whatever the final names are)."""
    return f".dsstage-{os.getpid()}-{next(_seq)}-{time.monotonic_ns() % 10**9}.tmp"


def is_temp(name: str) -> bool:
    return name.startswith(".dsstage-") and name.endswith(".tmp")


def trusted(uid: int) -> bool:
    """Whether dsstage trusts what ``uid`` owns: root's, and the caller's own. As root (the
    hooks, the services) that is root alone; an ordinary user running dsstage on a store of
    their own (the unit tests on ``tmp_path``) trusts only root and themselves, so nobody
    else can steer what they do, and they can steer nobody but themselves."""
    return uid == 0 or uid == os.geteuid()


def owner(gid: int = 0) -> tuple[int, int]:
    """The owner and group dsstage gives what it seals (published copies, their directories):
    root and ``gid`` (0: no group restriction), or, for an ordinary user on a store of their
    own, that user and ``gid`` or their own group (they cannot give files away)."""
    if os.geteuid() == 0:
        return 0, gid
    return os.geteuid(), gid or os.getegid()


def sealed_dir_mode() -> int:
    """The mode of a sealed (published, read-only) directory: 0555 as root, who writes into
    it anyway when it must (rename, purge); 0755 for an ordinary user on a store of their
    own, who could not otherwise move or purge their copies, and whom nobody else can steer."""
    return 0o555 if os.geteuid() == 0 else 0o755


def sealed(st: os.stat_result) -> bool:
    """Whether ``st`` is sealed: trusted (see ``trusted``) and writable by nobody else (by
    nobody at all where root owns it)."""
    return trusted(st.st_uid) and not st.st_mode & (0o222 if st.st_uid == 0 else 0o022)


def dir_problem(st: os.stat_result, *, store: bool) -> str | None:
    """Why a directory may not be trusted, or None. ``store``: dsstage's own directories
    (nobody else may write); else an ancestor (others may write only if it is sticky)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not trusted(st.st_uid):
        return f"is owned by uid {st.st_uid}, not root" + ("" if os.geteuid() == 0 else f" nor uid {os.geteuid()}")
    if st.st_mode & 0o022 and (store or not st.st_mode & stat.S_ISVTX):
        return f"is writable by {'group or others' if store else 'others and not sticky'} " \
               f"(mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _refuse(path: str, problem: str) -> UnsafeStore:
    return UnsafeStore(f"{path} {problem}: dsstage will not use it, a user could steer it; "
                       f"make every directory of the path root-owned and not writable by others "
                       f"(or remove {path} and let dsstage create it)")


def root_filesystem_problem(path: str, lstat: Callable[[str], os.stat_result] = os.lstat) -> str | None:
    """Why ``path`` (a tier's directory) must not be used: it, or where it would be created
    (its nearest ancestor that exists), is on the filesystem of ``/``, the sign of a disk
    that is not mounted; None where it is on a filesystem of its own. Nothing is created."""
    root_dev = lstat("/").st_dev
    here = os.path.normpath(path)
    while True:
        try:
            st = lstat(here)
            break
        except FileNotFoundError:
            if here == "/":
                return None
            here = os.path.dirname(here)
        except OSError as exc:
            return f"{here} cannot be examined ({exc.strerror}): is the disk mounted?"
    if st.st_dev != root_dev:
        return None
    where = path if here == os.path.normpath(path) else f"{path} (missing; {here} exists)"
    return (f"{where} is on the root filesystem: is the disk mounted? Nothing is written there; mount the "
            "tier's disk (and make the directory on it), or say root_filesystem: true in the tier if it "
            "is meant to be on /")


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


class _OpenDirs:
    """Directory descriptors opened once each and closed together (``close()`` or ``with``)."""

    _fds: dict[Any, int]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Self:
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
        obj = jsontext.loads(data) if len(data) <= JSON_MAX else None
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def write_at(dir_fd: int, name: str, data: str | bytes, *, mode: int = 0o644, fsync: bool = True,
             owner: tuple[int, int] | None = None, acl: bytes | None = None) -> None:
    """Replace ``name`` atomically: a fresh temporary file (O_EXCL), then rename; ``acl``: its
    access ACL (dsstage.fs.acl), set before it has its name (OSError if the filesystem refuses)."""
    tmp = temp_name()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            write_all(fd, data.encode() if isinstance(data, str) else data)
            if owner is not None:
                os.fchown(fd, *owner)
            os.fchmod(fd, mode)
            if acl is not None:
                set_acl(fd, acl)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink_at(dir_fd, tmp)
        raise


def write_json_at(dir_fd: int, name: str, data: Mapping[str, Any], *, fsync: bool = True) -> None:
    write_at(dir_fd, name, jsontext.dumps(data, sort_keys=True), fsync=fsync)


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


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``, or {} if it is missing, unreadable, not an object or not
    a regular file of bounded size (for files in the shared state directory, which others
    write: dsstage.fs.untrusted; the store uses read_json_at)."""
    return untrusted.read_json(path)


def write_atomic(path: str, data: str | bytes, *, fsync: bool = True, mode: int = 0o644) -> None:
    """Write so that readers see the old file or the new one, never a part (for the
    admins' state directory and files the command line writes)."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, mode=0o755, exist_ok=True)
    fd = os.open(parent, O_DIR)
    try:
        write_at(fd, os.path.basename(path), data, fsync=fsync, mode=mode)
    finally:
        os.close(fd)


def write_json(path: str, data: Mapping[str, Any], *, fsync: bool = True, mode: int = 0o644) -> None:
    write_atomic(path, jsontext.dumps(data, sort_keys=True), fsync=fsync, mode=mode)


def remove_at(dir_fd: int | None, name: str) -> bool:
    """Remove ``name`` (a file, or a directory tree, without following links); False if missing."""
    if dir_fd is None:
        return False
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        remove_tree_at(dir_fd, name)
        return True
    return unlink_at(dir_fd, name)


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove directory ``name`` below ``dir_fd`` and all it holds, never following a link.

    Iterative, at any depth (a dataset may be a chain of thousands of directories, where
    shutil.rmtree recurses out of Python's stack), and with one directory open at a time
    (a Prolog may have few descriptors): it climbs back through ``..``, checking that each
    parent is the directory it came from."""
    fd = os.open(name, O_DIR, dir_fd=dir_fd)
    # (name in its parent, (dev, ino), subdirectories still to remove; None: not listed yet)
    stack: list[tuple[str, tuple[int, int], list[str] | None]] = [(name, _ident(fd), None)]
    try:
        while True:
            here, ident, pending = stack[-1]
            if pending is None:
                pending = []
                with os.scandir(fd) as it:
                    for entry in it:
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(entry.name)
                        else:
                            unlink_at(fd, entry.name)
                stack[-1] = (here, ident, pending)
            if pending:
                child = pending.pop()
                try:
                    sub = os.open(child, O_DIR, dir_fd=fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    unlink_at(fd, child)  # swapped for a file or a link: removed as such
                    continue
                os.close(fd)
                fd = sub
                stack.append((child, _ident(fd), None))
                continue
            stack.pop()
            if not stack:
                break
            up = os.open("..", O_DIR, dir_fd=fd)
            os.close(fd)
            fd = up
            if _ident(fd) != stack[-1][1]:
                raise OSError(errno.ESTALE, f"a directory moved while {name!r} was removed")
            os.rmdir(here, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def make_dir_whole(top: int, name: str, fill: Callable[[int], None]) -> None:
    """Make directory ``name`` in ``top`` whole or not at all: ``fill(fd)`` fills a temporary
    directory made 0700 (nobody else can enter it, nor keep a descriptor of it or of anything in
    it, while it is filled), which is then opened (0755: who may enter is decided by ``top``)
    and renamed over ``name`` (an empty directory there, or nothing). A failure, the rename's
    included, removes it."""
    tmp = temp_name()
    os.mkdir(tmp, 0o700, dir_fd=top)
    tmp_fd = os.open(tmp, O_DIR, dir_fd=top)
    try:
        try:
            fill(tmp_fd)
            os.fchmod(tmp_fd, 0o755)
        finally:
            os.close(tmp_fd)
        os.rename(tmp, name, src_dir_fd=top, dst_dir_fd=top)
    except BaseException:
        remove_at(top, tmp)
        raise
