"""How a staging area is filled from one place: the ``Transport`` protocol, chosen once per
stage from the dataset's source (``for_source``), as ClusterShell chooses a Worker:

- ``LocalCopy``: a mounted source, through the verifying copier (dsstage.transfer.copier):
  a file stands at its final name only once it matched the manifest;
- ``Rsync``: an ssh or rsync-daemon source, through rsync (dsstage.transfer.rsync), then
  every file it was asked for is hashed (what an earlier stage left included);
- dsstage.transfer.peers.PeersFirst wraps either: what other nodes hold or are staging comes
  from them, the rest from the wrapped transport;
- dsstage.node.live.Switching wraps the copier's: a live view's entries switch to the files
  as they land.

dsstage.node.stager.fill drives any of them the same way. Every transport writes into an
``Area``: the staging area's descriptor (and path, for rsync), the dataset's transfer
settings, the stage's deadline and its progress. The copier and the hashing are imported
when a transport first runs, not with this module (dsstage.transfer.peers imports it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from dsstage.config.manifest import Entry, Mismatch
from dsstage.config.model import Source, Transfer
from dsstage.errors import OutOfTime, StoreError
from dsstage.fs import safe
from dsstage.fs.beneath import Tree
from dsstage.transfer.ratelimit import Rate
from dsstage.transfer.rsync import TransferStats, fetch

if TYPE_CHECKING:
    from dsstage.fs.identity import Identity

#: progress(phase, delta, total): "copying" in bytes, "verifying" in files
Progress = Callable[[str, int, int], None]


@dataclass
class Copied:
    """What a transport moved: from the source (``source``; ``bad``: the files that came
    wrong from it, not kept, for the caller to fetch again) and from peers."""

    source: TransferStats = field(default_factory=TransferStats)
    bad: list[Mismatch] = field(default_factory=list)
    from_peers: TransferStats = field(default_factory=TransferStats)
    given_up: dict[str, str] = field(default_factory=dict)  # peer -> why


class Transport(Protocol):
    """Brings entries of a manifest into its Area."""

    @property
    def verified_on_arrival(self) -> bool:
        """A file stands at its final name only once verified (a live view may link it at once:
        dsstage.node.live.Switching wraps such a transport)."""
        ...

    @property
    def checks_all(self) -> bool:
        """``copy`` hashes every entry it is given, what an earlier stage left included; else
        what an interrupted stage left at a final name is checked before (a crash may have
        lost what was not yet on disk, and what a peer sent stands there before its hash)."""
        ...

    @property
    def origin(self) -> Transport:
        """The transport that reads the source itself (a file that came wrong from the
        source is fetched from it again)."""
        ...

    def copy(self, entries: Sequence[Entry]) -> Copied:
        """Bring ``entries`` not yet in the area; raise OutOfTime at the deadline (what
        arrived is kept), SourceError when the source fails, the store's error when the
        area does."""
        ...


@dataclass(frozen=True)
class Area:
    """The staging area a transport fills (its descriptor; its path, which rsync writes by),
    how (``transfer``; ``rate``), by when (``deadline``, monotonic), and who hears of it (``progress``;
    ``whole``: the version's bytes, the total a stage with peers reports against, as several
    copies run at once)."""

    fd: int
    path: str
    transfer: Transfer = field(default_factory=Transfer)
    deadline: float | None = None
    progress: Progress | None = None
    whole: int = 0
    #: a lower limit than the transfer's (a prefetch's); None: the transfer's own
    rate: Rate | None = None

    @property
    def limit(self) -> Rate:
        """The stage's bandwidth limit: ``rate``, else ``transfer.bwlimit`` (KiB/s per stream)."""
        t = self.transfer
        return self.rate if self.rate is not None else Rate.of_rsync(t.bwlimit, t.streams)

    def copying(self) -> Callable[[int, int], None] | None:
        """``progress`` of the bytes copied (delta, total), against ``whole`` where it is set."""
        if self.progress is None:
            return None
        progress, whole = self.progress, self.whole
        return lambda delta, of: progress("copying", delta, whole or of)

    def verifying(self, total: int) -> Callable[[int], None] | None:
        progress = self.progress
        return (lambda delta: progress("verifying", delta, total)) if progress else None

    def late(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise OutOfTime("the transfer used up the time budget; what arrived is kept and the next stage resumes")

    def present(self, entries: Sequence[Entry]) -> list[Entry]:
        """The ``entries`` at their final names (a lookup of each: listing the whole area
        would cost the dataset, not the entries)."""
        with Tree(self.fd) as tree:
            return [e for e in entries if tree.exists(e.path)]

    def check(self, entries: Sequence[Entry], progress: Callable[[int], None] | None = None) -> list[Mismatch]:
        from dsstage.transfer.check import check_tree  # the hashing, when a check runs
        return check_tree(self.fd, entries, self.transfer.hash_threads, progress)

    def remove(self, bad: Sequence[Mismatch]) -> None:
        """Remove the files ``bad`` names (those already gone are no error)."""
        with Tree(self.fd) as tree:
            for m in bad:
                try:
                    with tree.parent(m.path) as (fd, name):
                        safe.remove_at(fd, name)
                except (FileNotFoundError, NotADirectoryError):
                    pass
                except OSError as exc:
                    raise StoreError(f"cannot remove {m.path!r} from the staging area: {exc.strerror}") from None


@dataclass
class LocalCopy:
    """A mounted source (``root``), read as ``reader``, through the verifying copier."""

    root: str
    area: Area
    reader: Identity | None = None
    verified_on_arrival = True
    checks_all = False

    @property
    def origin(self) -> Transport:
        return self

    def copy(self, entries: Sequence[Entry]) -> Copied:
        from dsstage.transfer import copier  # the copier and its hashing, when a copy runs
        t = self.area.transfer
        tuning = copier.Tuning(hash_threads=t.hash_threads, rate=self.area.limit, max_parallel=t.max_parallel)
        stats, bad = copier.copy_verified(self.root, self.area.fd, entries, tuning, deadline=self.area.deadline,
                                          reader=self.reader, progress=self.area.copying())
        return Copied(stats, bad)


@dataclass
class Rsync:
    """An ssh or rsync-daemon source, through parallel rsync streams; then every file asked
    for is hashed against the manifest."""

    source: Source
    area: Area
    verified_on_arrival = False
    checks_all = True

    @property
    def origin(self) -> Transport:
        return self

    def copy(self, entries: Sequence[Entry]) -> Copied:
        a = self.area
        t = replace(a.transfer, bwlimit=a.limit.rsync_kib(a.transfer.streams))
        stats = fetch(self.source, a.path, entries, t, deadline=a.deadline, progress=a.copying())
        a.late()
        return Copied(stats, a.check(entries, a.verifying(len(entries))))


def for_source(source: Source, area: Area, reader: Identity | None = None) -> Transport:
    """The transport for ``source``: a mounted one (read as ``reader``) through the
    verifying copier, any other through rsync."""
    if source.kind == "local":
        return LocalCopy(source.path, area, reader)
    return Rsync(source, area)


def describe(source: Source) -> str:
    """The transport ``for_source`` would choose, as a dry run says it (nothing is opened)."""
    return "the verifying copier" if source.kind == "local" else f"rsync ({source.kind})"
