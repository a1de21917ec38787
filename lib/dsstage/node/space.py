"""Space in a tier: what its copies use, and reservations for stages in progress.

A tier's space is checked and reserved under one tier-wide lock (``locks/.tier.lock``),
so two datasets staging at once cannot both take the last free bytes. What counts:

* every ready copy, from its mark: its bytes, less the bytes it hard-links from an older
  version of the same dataset that is still on the node (an inode shared by two versions
  is counted once; after the older version is evicted the newer one counts it);
* every reservation in ``reserved/``: a stage in progress (or a staging area an
  interrupted stage left, until the dataset's next stage resumes or removes it), and an
  evicted copy in the trash until the background deletion is done.

A stage's reservation lives as long as its process or its staging area: one whose process is
gone (or whose pid now belongs to a later process) and that left no staging area holds no
bytes, counts for nothing, and the next reservation on the tier removes it.

The accounting errs on the side of counting too much, never too little.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dsstage.errors import NoSpace
from dsstage.fs import safe
from dsstage.fs.layout import Layout
from dsstage.fs.safe import RootDir
from dsstage.units import human

TIER_LOCK = ".tier"


@dataclass(frozen=True)
class Usage:
    copies: int  # bytes of ready copies, shared inodes counted once
    reserved: int  # bytes reserved by stages in progress, left staging areas, the trash

    @property
    def total(self) -> int:
        return self.copies + self.reserved


def stage_record(staging: str) -> str:
    return f"stage-{staging}.json"


def trash_record(entry: str) -> str:
    return f"trash-{entry}.json"


def as_bytes(value: object) -> int:
    """A byte count from a record (0 if missing or damaged)."""
    try:
        return max(0, int(str(value)))
    except ValueError:
        return 0


def as_float(value: object) -> float:
    """A time from a record (0 if missing or damaged)."""
    try:
        return float(str(value))
    except ValueError:
        return 0.0


def copies_usage(tier: RootDir) -> int:
    total = 0
    for name in tier.names("ready"):
        fd = tier.has_dir("ready", name)
        marks = {m[:-5]: safe.read_json_at(fd, m) for m in tier.names("ready", name) if m.endswith(".json")}
        for mark in marks.values():
            linked = mark.get("linked")
            shared = [as_bytes(b) for v, b in linked.items() if v in marks] if isinstance(linked, dict) else []
            total += as_bytes(mark.get("bytes")) - sum(shared)
    return total


def usage(tier: RootDir, *, besides: str = "") -> Usage:
    """What the tier holds and has promised, leaving out reservation ``besides`` and those
    of stages that are gone and left nothing (see ``orphaned``)."""
    fd = tier.dir("reserved")
    reserved = 0
    for r in tier.names("reserved"):
        record = safe.read_json_at(fd, r)
        if r != besides and not orphaned(tier, r, record):
            reserved += as_bytes(record.get("bytes"))
    return Usage(copies_usage(tier), reserved)


def orphaned(tier: RootDir, name: str, record: dict[str, object]) -> bool:
    """Whether reservation ``name`` belongs to a stage that is gone and left no staging area
    (killed before it made one, or it failed and took its area away): nothing holds its bytes."""
    if not (name.startswith("stage-") and name.endswith(".json")):
        return False  # the trash: the background deletion removes its own
    if not process_gone(record.get("pid"), as_float(record.get("since"))):
        return False
    staging = tier.has_dir("staging")
    if staging is None:
        return True
    try:
        os.stat(name[len("stage-"):-len(".json")], dir_fd=staging, follow_symlinks=False)
    except FileNotFoundError:
        return True
    return False


def reclaim(tier: RootDir) -> list[str]:
    """Remove the reservations ``orphaned`` says hold nothing; their names (under the tier lock)."""
    fd = tier.dir("reserved")
    gone = [r for r in tier.names("reserved") if orphaned(tier, r, safe.read_json_at(fd, r))]
    for r in gone:
        forget(tier, r)
    return gone


def process_gone(pid: object, since: float) -> bool:
    """Whether the process that wrote a record at ``since`` is gone: no process has ``pid``, or
    the one that has it started after the record was written (the pid was reused). A record
    that does not say (damaged, written by another host's process) is never gone."""
    try:
        number = int(str(pid))
    except ValueError:
        return False
    if number <= 0:
        return False
    try:
        os.kill(number, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    started = process_start(number)
    return started is not None and since > 0 and started > since + 1


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()
        with open("/proc/stat", "rb") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith(b"btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def capacity_of(tier_capacity: int | float, root_fd: int) -> tuple[int, int]:
    """(capacity in bytes, free bytes of the filesystem)."""
    fs = os.fstatvfs(root_fd)
    cap = tier_capacity if isinstance(tier_capacity, int) else int(fs.f_blocks * fs.f_frsize * tier_capacity)
    return cap, fs.f_bavail * fs.f_frsize


def tier_lock(tier: RootDir, timeout: float = 600) -> object:
    from dsstage.node.lock import DatasetLock
    tier.dir("locks")
    return DatasetLock(Layout(tier.root).lock(TIER_LOCK), timeout=timeout, what=f"the space of tier {tier.root}")


@contextmanager
def reservation(tier: RootDir, tier_name: str, tier_capacity: int | float, record: str, needed: int,
                what: str, node: str) -> Iterator[None]:
    """Reserve ``needed`` bytes (NoSpace if the tier cannot hold them) for the block; the
    record stays if the block fails (its staging area still holds data: the next stage of the
    dataset resumes or removes it, and ``orphaned`` lets it go once the area is gone), and goes
    when the block succeeds (the ready mark now counts the bytes)."""
    with tier_lock(tier):  # type: ignore[attr-defined]
        reclaim(tier)
        use = usage(tier, besides=record)
        cap, free = capacity_of(tier_capacity, tier.fd)
        if use.total + needed > cap:
            raise NoSpace(f"tier {tier_name!r} on {node} holds {human(use.copies)} in copies and "
                          f"{human(use.reserved)} reserved of its {human(cap)} capacity; {what} needs {human(needed)} "
                          "more: release unused datasets (`dsstage evict`) or raise the tier's capacity")
        if needed + use.reserved > free:
            raise NoSpace(f"tier {tier_name!r} on {node}: the filesystem of {tier.root} has {human(free)} free "
                          f"({human(use.reserved)} of it promised), {what} needs {human(needed)}: "
                          "free space or lower the tier's capacity")
        hold(tier, record, needed, what)
    yield
    forget(tier, record)


def hold(tier: RootDir, record: str, nbytes: int, what: str) -> None:
    """Count ``nbytes`` as used until ``forget(record)`` (a stage, an evicted copy in the trash)."""
    safe.write_json_at(tier.dir("reserved"), record, {"bytes": nbytes, "pid": os.getpid(), "since": time.time(),
                                                        "what": what}, fsync=False)


def forget(tier: RootDir, record: str) -> None:
    safe.unlink_at(tier.has_dir("reserved"), record)
