"""Opening paths beneath a directory without following links: openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS), with a component-by-component fallback, and ``Tree``, the staging area's
directories opened that way.

Imports only the standard library and dsstage.fs.safe.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any

from dsstage.fs.safe import O_DIR, _OpenDirs

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
