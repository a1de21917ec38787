"""Live views: a job starts at once on a dataset that is still being staged (``start: at-once``),
and each of its files switches to the verified local copy as it lands.

    <tier>/live/<name>/<version>/...      the version's whole tree from the first moment: each
                                          file a symbolic link to the source's file, replaced by
                                          a hard link to the verified local file once it is one
    <tier>/live/<name>/<version>.json     {"files", "local", "state", "reason", "pid", "boot", ...}
    <tier>/live/<name>/<version>.worker   the flock of the process that finishes the view
    <tier>/live/<name>/<version>.lock     the flock of a Prolog that makes or checks the view
    <tier>/live/<name>/<version>.links/   root's (0700): where a switch makes its link before it
                                          is renamed over the entry (never a stray name in the view)

Made by root in a directory nobody else can enter and renamed into place (whole or absent);
the dataset's top directory ``live/<name>`` carries its access (groups) as its copies' does
(dsstage.node.access), and nothing in it is writable by anyone but root: a user can neither plant
an entry nor redirect one. A file is switched (``switch``) by hard-linking the local file beside
its entry and renaming the link over it, so a reader sees the source's file or the local one,
whole; an entry whose local file is no longer the one the stage holds (taken back, repaired,
removed as bad) points at the source again before a job is given the view (``revert``); only
a file that is sealed (root's, regular, not writable: dsstage.node.publish.seal) in
a staging area whose earlier content was checked again, or in the published copy, is linked:
nothing unverified ever is. When the version is published every entry is switched
(``complete``): the view is then the copy, file for file (the same inodes).

Who finishes a view: the Prolog that made it starts a detached worker (dsstage.hooks.live),
which stages the version under the dataset's lock with a ``Switcher`` polling the staging area;
one worker per view (its flock: ``hold_worker``). A failed stage leaves the view's links to the source (the job
keeps working) and says why in the record; the next job's Prolog resumes the stage. A view made
before the node's last boot is remade from scratch (what it linked may not have reached the disk).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dsstage.errors import DsstageError
from dsstage.fs import layout as fs_layout
from dsstage.fs import safe
from dsstage.fs.beneath import Tree
from dsstage.fs.layout import version_id
from dsstage.fs.safe import RootDir
from dsstage.node import access
from dsstage.node.lease import Lease, LeaseBook
from dsstage.node.store import Store, local_errors, open_tier

if TYPE_CHECKING:
    from dsstage.config.manifest import Entry
    from dsstage.config.model import Dataset
    from dsstage.transfer.transport import Area, Copied, Transport

log = logging.getLogger(__name__)

TOP = "live"
#: trash entries of live views start with this (the report does not show them as evicted copies)
TRASH_PREFIX = "_live."  # no dataset name starts with "_"
#: seconds between two looks at the staging area for files that landed
INTERVAL = 0.5
#: a record's states: the worker is staging | every entry is local | the stage failed (links to
#: the source stay) | its worker is gone (a reboot, a kill): the next job resumes it
FILLING, WHOLE, FAILED, STOPPED = "filling", "whole", "failed", "stopped"


def record_name(vid: str) -> str:
    return f"{vid}.json"


def read(tier: RootDir, name: str, vid: str) -> dict[str, object]:
    """The view's record ({} if there is no view), its state ``stopped`` where it says
    ``filling`` but its worker holds no flock (died, or the node rebooted)."""
    fd = tier.has_dir(TOP, name)
    if fd is None:
        return {}
    record = safe.read_json_at(fd, record_name(vid))
    if not record:
        return {}
    if record.get("state") == FILLING and not worker_alive(fd, vid):
        record["state"] = STOPPED
    return record


def worker_alive(top_fd: int, vid: str) -> bool:
    """Whether a worker holds the view's flock now."""
    try:
        fd = os.open(f"{vid}.worker", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=top_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def note(tier: RootDir, name: str, vid: str, **changes: object) -> dict[str, object]:
    """Update the view's record with ``changes`` (its writer: the Prolog that makes it, its worker)."""
    fd = tier.dir(TOP, name)
    record = {**safe.read_json_at(fd, record_name(vid)), **changes, "updated": time.time()}
    safe.write_json_at(fd, record_name(vid), record, fsync=False)
    return record


def ensure(tier: RootDir, name: str, digest: str, paths: Sequence[str], source_root: str) -> tuple[str, bool]:
    """The view of version ``digest`` of ``name`` (its files ``paths``, read from ``source_root``
    until they are local), made now unless it exists from this boot; (its path, made now). The
    caller holds the view's flock (``making``) and has given ``live/<name>`` the dataset's
    access (dsstage.node.access.apply, top=TOP)."""
    vid = version_id(digest)
    top = tier.dir(TOP, name, mode=0o700)
    record = safe.read_json_at(top, record_name(vid))
    path = tier.path(TOP, name, vid)
    if record.get("boot") == fs_layout.boot_id() and record.get("digest") == digest:
        try:
            os.stat(vid, dir_fd=top, follow_symlinks=False)
            return path, False
        except FileNotFoundError:
            pass
    drop(tier, name, vid)  # of another boot, or half made: what it linked may not be on disk
    for entry in tier.names(TOP, name):
        if safe.is_temp(entry):  # a view a killed Prolog was making
            safe.remove_at(top, entry)

    def fill(fd: int) -> None:
        with Tree(fd, create=True, mode=0o755) as dest:
            for rel in paths:
                with dest.parent(rel) as (dfd, dname):
                    os.symlink(os.path.join(source_root, rel), dname, dir_fd=dfd)

    safe.make_dir_whole(top, vid, fill)
    # the record last: a view without one is half made, and made again
    safe.write_json_at(top, record_name(vid), {
        "dataset": name, "version": vid, "digest": digest, "files": len(paths), "local": 0, "state": FILLING,
        "boot": fs_layout.boot_id(), "made": time.time(), "updated": time.time()}, fsync=False)
    return path, True


def making(tier: RootDir, name: str, vid: str) -> safe.Flock:
    """The view's flock for a Prolog that makes or checks it: two jobs that start together
    make it once."""
    return safe.Flock(tier.dir(TOP, name, mode=0o700), f"{vid}.lock")


def side(tier: RootDir, name: str, vid: str) -> int:
    """The view's side directory (root's, 0700), where links are made before they are renamed
    into the view."""
    return tier.dir(TOP, name, f"{vid}.links", mode=0o700)


def sealed(st: os.stat_result) -> bool:
    """Whether a local file may be linked into a view: a regular file of root's that nobody may
    write (what dsstage.node.publish.seal makes of a verified file)."""
    return stat.S_ISREG(st.st_mode) and safe.sealed(st)


def switch(src: Tree, view: Tree, rel: str, links: int) -> bool:
    """Point the view's entry ``rel`` at the local file ``rel`` below ``src`` if that file is
    there and sealed: a hard link made in the side directory ``links`` and renamed over the
    entry. True if the entry is the local file now (it may have been already)."""
    try:
        with src.parent(rel) as (sfd, sname):
            st = os.stat(sname, dir_fd=sfd, follow_symlinks=False)
            if not sealed(st):
                return False
            with view.parent(rel) as (dfd, dname):
                try:
                    there = os.stat(dname, dir_fd=dfd, follow_symlinks=False)
                    if (there.st_ino, there.st_dev) == (st.st_ino, st.st_dev):
                        return True
                except FileNotFoundError:
                    pass
                _swap(links, dfd, dname,
                      lambda tmp: os.link(sname, tmp, src_dir_fd=sfd, dst_dir_fd=links, follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def _swap(links: int, dfd: int, dname: str, make: Callable[[str], None]) -> None:
    """Replace entry ``dname`` of directory ``dfd`` by what ``make(tmp)`` makes at a temporary
    name in the side directory ``links``: renamed over it, or removed if that fails."""
    tmp = safe.temp_name()
    make(tmp)
    try:
        os.rename(tmp, dname, src_dir_fd=links, dst_dir_fd=dfd)
    except BaseException:
        safe.unlink_at(links, tmp)
        raise


def revert(tier: RootDir, name: str, digest: str, paths: Sequence[str], source_root: str) -> int:
    """Point back at the source each entry of the view of this version (not ready) that is a
    local file other than the one its staging area holds now (a copy taken back, a file removed
    as bad or not on disk after a crash): nothing but what the stage holds verified is read
    locally. The entries changed. One lookup per file; the caller holds the view's flock or
    its worker's."""
    vid = version_id(digest)
    top = tier.has_dir(TOP, name)
    if top is None:
        return 0
    staging = tier.has_dir("staging", fs_layout.staging_name(name, digest))
    vfd = os.open(vid, safe.O_DIR, dir_fd=top)
    links = side(tier, name, vid)
    done = 0
    try:
        with Tree(vfd) as view:
            src = Tree(staging) if staging is not None else None
            try:
                for rel in paths:
                    with view.parent(rel) as (dfd, dname):
                        there = os.stat(dname, dir_fd=dfd, follow_symlinks=False)
                        if stat.S_ISLNK(there.st_mode) or (src is not None and _same(src, rel, there)):
                            continue
                        _swap(links, dfd, dname, _symlink_to(os.path.join(source_root, rel), links))
                        done += 1
            finally:
                if src is not None:
                    src.close()
    finally:
        os.close(vfd)
    return done


def _symlink_to(target: str, links: int) -> Callable[[str], None]:
    return lambda tmp: os.symlink(target, tmp, dir_fd=links)


def _same(src: Tree, rel: str, st: os.stat_result) -> bool:
    try:
        with src.parent(rel) as (sfd, sname):
            here = os.stat(sname, dir_fd=sfd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return (here.st_ino, here.st_dev) == (st.st_ino, st.st_dev)


def complete(tier: RootDir, name: str, digest: str, paths: Sequence[str], *, whole: bool = True) -> int | None:
    """Switch the entries ``paths`` of the view of this version (every one, unless ``whole`` is
    False: files a repair replaced) to the published copy (ready in ``datasets/<name>/
    <version>``), if there is a view; the entries switched (None: no view). The caller holds
    the dataset's lock or a lease, so the copy stays while it is linked."""
    vid = version_id(digest)
    top = tier.has_dir(TOP, name)
    if top is None:
        return None
    try:
        vfd = os.open(vid, safe.O_DIR, dir_fd=top)
    except FileNotFoundError:
        return None
    done = 0
    links = side(tier, name, vid)
    try:
        with Tree(tier.dir("datasets", name, vid, create=False)) as src, Tree(vfd) as view:
            missing = [rel for rel in paths if not switch(src, view, rel, links)]
            done = len(paths) - len(missing)
    finally:
        os.close(vfd)
    if not whole:
        return done
    if missing:  # the copy is sealed whole by publish: this is not expected
        note(tier, name, vid, local=done, state=FAILED,
             reason=f"{len(missing)} file(s) of the copy could not be linked, e.g. {missing[0]!r}")
    else:
        note(tier, name, vid, local=done, state=WHOLE, reason="")
    return done


class Switcher:
    """Switches a view's entries to the files that land in a staging area, while a stage fills
    it: ``begin(staging_fd)`` once what the area held before was checked again (``Switching``
    calls it as its copy starts), then a thread looks every ``interval`` seconds for the files still
    to switch (a lookup each, not a listing of the area); ``stop`` ends it."""

    def __init__(self, tier: RootDir, name: str, digest: str, paths: Sequence[str], *,
                 interval: float = INTERVAL, on_round: Callable[[int, int], None] | None = None) -> None:
        self.tier, self.name, self.vid = tier, name, version_id(digest)
        self.todo = list(paths)
        self.total = len(paths)
        self.interval = interval
        self.on_round = on_round
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: list[int] = []

    def begin(self, staging_fd: int) -> None:
        if self._thread is not None:
            return
        top = self.tier.has_dir(TOP, self.name)
        if top is None:
            return
        try:
            view = os.open(self.vid, safe.O_DIR, dir_fd=top)
        except FileNotFoundError:
            return
        self._fds = [os.dup(staging_fd), view, side(self.tier, self.name, self.vid)]
        self._thread = threading.Thread(target=self._run, name=f"live {self.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with Tree(self._fds[0]) as src, Tree(self._fds[1]) as view:
                while self.todo:
                    self.round(src, view, self._fds[2])
                    if self._stop.wait(self.interval):
                        break
        except BaseException as exc:  # noqa: BLE001 - the stage goes on; the view completes when it ends
            log.warning("live view of %s %s: switching files stopped: %s", self.name, self.vid, exc)

    def round(self, src: Tree, view: Tree, links: int) -> int:
        """Switch what landed since the last round; the number switched now."""
        before = len(self.todo)
        self.todo = [rel for rel in self.todo if self._stop.is_set() or not switch(src, view, rel, links)]
        done = before - len(self.todo)
        if done and self.on_round:
            self.on_round(self.total - len(self.todo), self.total)
        return done

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for fd in self._fds[:2]:  # the side directory's is the tier's (RootDir keeps it)
            os.close(fd)
        self._fds = []


class Switching:
    """A transport (dsstage.transfer.transport) that switches a live view's entries while the one
    it wraps (``inner``, one that renames a file into place only once verified:
    ``verified_on_arrival``) fills the ``area``: the switcher begins as the copy does, when
    dsstage.node.stager.fill has checked again what an earlier stage left. The live view is a
    transport of its own, not a flag of the stage."""

    verified_on_arrival = True

    def __init__(self, inner: Transport, switcher: Switcher, area: Area) -> None:
        if not inner.verified_on_arrival:
            raise ValueError("a live view switches only files verified as they land")
        self.inner, self.switcher, self.area = inner, switcher, area

    @property
    def checks_all(self) -> bool:
        return self.inner.checks_all

    @property
    def origin(self) -> Transport:
        return self.inner.origin

    def copy(self, entries: Sequence[Entry]) -> Copied:
        self.switcher.begin(self.area.fd)
        return self.inner.copy(entries)


def drop(tier: RootDir, name: str, vid: str) -> bool:
    """Move the view of version ``vid`` of ``name`` into the tier's trash (its record first:
    never found half); True if there was one. The background purge deletes it."""
    top = tier.has_dir(TOP, name)
    if top is None:
        return False
    had = safe.unlink_at(top, record_name(vid))
    safe.unlink_at(top, f"{vid}.worker")
    safe.remove_at(top, f"{vid}.links")
    tier.forget(TOP, name, f"{vid}.links")
    try:
        os.rename(vid, f"{TRASH_PREFIX}{name}.{vid}.{time.time_ns()}", src_dir_fd=top, dst_dir_fd=tier.dir("trash"))
    except FileNotFoundError:
        return had
    return True


def hold_worker(tier: RootDir, name: str, vid: str, tries: int = 20) -> int | None:
    """The view's worker flock (a descriptor to close when done), or None if another worker
    holds it. Tried ``tries`` times over a second: ``worker_alive`` takes it shared for a moment
    (a report being built), which must not turn a new worker away."""
    fd = os.open(f"{vid}.worker", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=tier.dir(TOP, name))
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
        if i + 1 < tries:
            time.sleep(0.05)
    os.close(fd)
    return None


# -- a job's view, and the worker that finishes it -------------------------------------------

def open_for_job(store: Store, ds: Dataset, digest: str, job_id: str, user: str) -> tuple[str, bool]:
    """The live view of version ``digest`` of ``ds`` for job ``job_id`` (its lease taken on the
    version first, which holds the copy and its view from then on, whatever stage fills it):
    (its path, whether a worker must finish it). The Prolog's, once the dataset's stage did
    not fit ``start_budget``."""
    import socket
    manifest = store.load_manifest(ds.name, digest)
    paths = [e.path for e in manifest.entries]
    layout = store.layout(ds.tier)
    vid = version_id(digest)
    with open_tier(layout) as tier, local_errors(f"making a live view of {ds.name!r} in {layout.root}"):
        access.apply(tier, ds, origin=store.config.origin, node=store.node, top=TOP)
        LeaseBook(tier).take(Lease(dataset=ds.name, digest=digest, job_id=job_id, user=user, node=store.node,
                                   taken=store.clock(), host=socket.gethostname()))
        with making(tier, ds.name, vid):
            path, made = ensure(tier, ds.name, digest, paths, ds.source.path)
            # after the view is in place: a stage that published meanwhile either found the view
            # (and switched it) or published before this look (and it is switched here); a copy
            # to verify fully is left to the worker, which verifies it first
            if store.ready_state(tier, ds.name, digest).ready and ds.verify != "full":
                complete(tier, ds.name, digest, paths)
                return path, False
            record = read(tier, ds.name, vid)
            if record.get("state") == FILLING:
                return path, False  # its worker is at it
            if not made:
                revert(tier, ds.name, digest, paths, ds.source.path)
            note(tier, ds.name, vid, state=FILLING, reason="", made_for=job_id if made else record.get("made_for"))
    return path, True


def pending(store: Store, ds: Dataset, digest: str) -> bool:
    """Whether a live view of this version is on the node and the version not ready: a Prolog
    then gives its job the view at once, without a stage of its own (which would first hash
    again what earlier stages left, for longer than ``start_budget``). Two lookups."""
    try:
        with open_tier(store.layout(ds.tier), create=False) as tier:
            top = tier.has_dir(TOP, ds.name)
            return top is not None and bool(safe.read_json_at(top, record_name(version_id(digest)))) and \
                not fs_layout.read_mark(tier, ds.name, digest)
    except (OSError, DsstageError):
        return False  # the stage meets it and says so


def tidy(tier: RootDir, book: LeaseBook) -> list[tuple[str, str]]:
    """Drop the live views no job needs any more; (dataset, version id) of each. A view goes
    when its version has no lease, no ready copy here and no worker: a version never published
    (its stage failed and no job came back for it, or the catalog moved on), whose links may
    keep the blocks of staging areas removed since. The leases are read again under the view's
    flock: a Prolog leases the version before it takes the flock and makes or finds the view."""
    dropped = []
    for name in tier.names(TOP):
        top = tier.has_dir(TOP, name)
        if top is None:
            continue
        for entry in tier.names(TOP, name):
            vid = entry[:-len(".json")]
            if not entry.endswith(".json") or worker_alive(top, vid):
                continue
            digest = safe.read_json_at(top, entry).get("digest")
            if not fs_layout.digest_ok(digest) or fs_layout.read_mark(tier, name, str(digest)):
                continue
            with making(tier, name, vid):
                if any(x.covers(vid) for x in book.of_dataset(name)):
                    continue
                drop(tier, name, vid)
                dropped.append((name, vid))
    return dropped


def progress_of(tier: RootDir, name: str, vid: str) -> dict[str, object] | None:
    """What a node report says of a live view: {"files", "local", "state", "reason"}, or None."""
    record = read(tier, name, vid)
    if not record:
        return None
    return {k: record.get(k) for k in ("files", "local", "state", "reason")}
