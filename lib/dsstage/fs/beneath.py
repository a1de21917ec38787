"""Opening paths beneath a directory without following links: openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS), with a component-by-component fallback, and ``Tree``, the staging area's
directories opened that way.

Imports only the standard library and dsstage.fs.safe.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from dsstage.fs.safe import O_DIR

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from typing import Any

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


class Tree:
    """The directories below one directory descriptor, each opened without following a
    symbolic link at any component (and created, private to root, when ``create``). For
    staging areas, published copies and sources.

    A directory's descriptor is reached with ``opened(rel)`` ("" the root) or, for a file,
    ``parent(rel)`` (its directory's descriptor and its name), and stays open while the block
    runs. At most ``max_open`` descriptors are kept between uses (least recently used first
    to go; one in use is never closed), so a tree of any shape, one directory per sample or
    thousands of levels deep, costs a bounded number of descriptors: running out of them is
    never the dataset's doing. Safe to use from several threads."""

    #: descriptors kept open between uses
    MAX_OPEN = 64

    def __init__(self, root_fd: int, *, create: bool = False, mode: int = 0o755, max_open: int = MAX_OPEN) -> None:
        self.root_fd = root_fd
        self.create = create
        self.mode = mode
        self.max_open = max_open
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._users: dict[str, int] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._users.clear()

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @contextmanager
    def opened(self, rel: str) -> Iterator[int]:
        """The descriptor of directory ``rel`` (created if missing and ``create``), open while
        the block runs. Raises FileNotFoundError, or OSError (ELOOP: a link) like os.open."""
        fd = self._acquire(rel)
        try:
            yield fd
        finally:
            self._release(rel)

    @contextmanager
    def parent(self, rel: str) -> Iterator[tuple[int, str]]:
        """(descriptor of the directory of file ``rel``, its last component), open while the
        block runs."""
        head, _, name = rel.rpartition("/")
        with self.opened(head) as fd:
            yield fd, name

    def open_count(self) -> int:
        """Descriptors this tree holds now (the root's not counted)."""
        with self._lock:
            return len(self._fds)

    def _acquire(self, rel: str) -> int:
        if not rel:
            return self.root_fd
        with self._lock:
            fd = self._fds.get(rel)
            try:
                if fd is None:
                    fd = self._open(rel)
                else:
                    self._fds.move_to_end(rel)
                self._users[rel] = self._users.get(rel, 0) + 1
            finally:  # the ancestors a failed open left open count too
                self._trim()
            return fd

    def _release(self, rel: str) -> None:
        if not rel:
            return
        with self._lock:
            n = self._users.get(rel, 0) - 1
            if n > 0:
                self._users[rel] = n
            else:
                self._users.pop(rel, None)
            self._trim()

    def _open(self, rel: str) -> int:
        """Open ``rel`` from its nearest ancestor still open (holding the lock): one component
        at a time, iteratively, so that any depth a manifest accepts can be opened."""
        parts = rel.split("/")
        i = len(parts) - 1
        while i > 0 and "/".join(parts[:i]) not in self._fds:
            i -= 1
        parent = self._fds["/".join(parts[:i])] if i > 0 else self.root_fd
        for j in range(i, len(parts)):
            name = parts[j]
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
            self._fds["/".join(parts[:j + 1])] = fd
            parent = fd
        return parent

    def _trim(self) -> None:
        """Close the least recently used descriptors not in use, down to ``max_open``."""
        excess = len(self._fds) - self.max_open
        if excess <= 0:
            return
        for key in [k for k in self._fds if k not in self._users][:excess]:
            os.close(self._fds.pop(key))

    def exists(self, rel: str) -> bool:
        """Whether anything is at ``rel`` (a link is never followed): one lookup, for a few
        paths of a large tree, where ``paths`` would list all of it."""
        try:
            with self.parent(rel) as (fd, name):
                os.stat(name, dir_fd=fd, follow_symlinks=False)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def paths(self) -> set[str]:
        """The relative path of everything below the root, directories included."""
        return {rel for _fd, found in self.listing() for _name, rel, _kind in found}

    def listing(self, descend: Callable[[str], bool] = lambda _rel: True
                ) -> Iterator[tuple[int, list[tuple[str, str, int]]]]:
        """Like ``walk``, from the directories' listings alone: each entry's kind is
        stat.S_IFDIR, stat.S_IFREG or 0 (anything else), from its directory entry's type, so
        a tree of a million files costs readdir, not a stat of each file."""
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            with self.opened(rel_dir) as fd:
                found = []
                with os.scandir(fd) as entries:
                    for entry in entries:
                        rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                        if entry.is_dir(follow_symlinks=False):
                            found.append((entry.name, rel, stat.S_IFDIR))
                            if descend(rel):
                                stack.append(rel)
                        else:
                            found.append((entry.name, rel, stat.S_IFREG if entry.is_file(follow_symlinks=False) else 0))
                yield fd, found

    def walk(self, descend: Callable[[str], bool] = lambda _rel: True
             ) -> Iterator[tuple[int, list[tuple[str, str, os.stat_result]]]]:
        """For every directory (from the root, into those ``descend(rel)`` accepts): its
        descriptor (open until the next step) and its entries as (name, relative path, lstat)."""
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            with self.opened(rel_dir) as fd:
                found = []
                for name in os.listdir(fd):
                    rel = f"{rel_dir}/{name}" if rel_dir else name
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    found.append((name, rel, st))
                    if stat.S_ISDIR(st.st_mode) and descend(rel):
                        stack.append(rel)
                yield fd, found
