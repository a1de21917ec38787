"""Work the Prolog and Epilog hand to detached processes, so that a job does not wait:
flushing a new copy to disk, and deleting evicted copies from a tier's trash.

Each runs as ``python -I -m dsstage.node.background ...`` in its own session (it outlives the
hook that started it), isolated from the current directory and the environment.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

from dsstage import proc
from dsstage.fs import layout as fs_layout
from dsstage.fs import safe
from dsstage.fs.layout import Layout
from dsstage.fs.safe import RootDir

PURGE_LOCK = ".purge"
#: the ioprio_set system call's number, by machine (no libc wrapper exists)
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}


def _detach(*args: str) -> None:
    subprocess.Popen([sys.executable, "-I", "-m", "dsstage.node.background", *args], cwd="/",
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, env=proc.c_locale())


def flush_later(layout: Layout, name: str, digest: str) -> None:
    """Flush the tier's filesystem in a detached process, then mark the copy durable.

    The job need not wait for the disk; but until the flush is done, a crash of the node
    could leave files short or empty under a valid-looking mark. A mark that is not
    durable is trusted only during the boot that wrote it (see fs_layout.not_ready)."""
    _detach("flush", layout.root, name, digest)


def purge_later(layout: Layout) -> None:
    """Delete the tier's trash in a detached process."""
    _detach("purge", layout.root)


def flush(root: str, name: str, digest: str) -> bool:
    """syncfs() the filesystem of ``root``, then set ``durable`` in the copy's ready mark
    (under the dataset lock: an eviction may have removed it meanwhile)."""
    from dsstage.node.lock import DatasetLock
    layout = Layout(root)
    with RootDir(root, create=False) as tier:
        if ctypes.CDLL(None, use_errno=True).syncfs(tier.fd) != 0:
            os.sync()
        with DatasetLock(layout.lock(name), timeout=3600, what=f"dataset {name!r}"):
            mark = fs_layout.read_mark(tier, name, digest)
            if not mark or mark.get("digest") != digest:
                return False
            mark["durable"] = True
            safe.write_json_at(tier.dir("ready", name), fs_layout.mark_name(digest), mark)
    return True


def idle_priority() -> None:
    """Run at the lowest CPU and the idle I/O priority: a deletion yields to jobs and stages."""
    os.nice(19)
    number = _IOPRIO_SET.get(os.uname().machine)
    if number is not None:  # ioprio_set(IOPRIO_WHO_PROCESS, this process, IOPRIO_CLASS_IDLE)
        ctypes.CDLL(None, use_errno=True).syscall(number, 1, 0, 3 << 13)


def purge(root: str) -> int:
    """Delete every entry of the tier's trash (without following links), and the space
    record of each; return how many."""
    from dsstage.node import space
    from dsstage.node.lock import DatasetLock
    done = 0
    with RootDir(root, create=False) as tier:
        trash = tier.dir("trash")
        # one purge at a time; each lists the trash afresh, so what a later eviction put
        # there is deleted by the purge that eviction started, if not by this one
        with DatasetLock(Layout(root).lock(PURGE_LOCK), timeout=3600, what=f"the trash of {root}"):
            for entry in tier.names("trash"):
                try:
                    safe.remove_at(trash, entry)
                except FileNotFoundError:
                    pass  # gone already
                space.forget(tier, space.trash_record(entry))
                done += 1
    return done


if __name__ == "__main__":  # pragma: no cover - run by flush_later() and purge_later()
    if sys.argv[1:2] == ["flush"]:
        flush(*sys.argv[2:5])
    elif sys.argv[1:2] == ["purge"]:
        idle_priority()
        purge(sys.argv[2])
