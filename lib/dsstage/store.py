"""The node-local store: one read-only copy per dataset version, shared by every job.

Layout of a tier on a node (``<root>`` is the tier's path with ``{node}`` filled in)::

    <root>/datasets/<name>/                  0755, or 0750 + group/ACL for a restricted dataset
    <root>/datasets/<name>/<version>/         the published copy: root-owned, files 0444, dirs 0555
    <root>/ready/<name>/<version>.json        ready mark: full digest, size, inode of the copy
    <root>/staging/<name>.<version>/          private (0700) staging area, kept across crashes
    <root>/locks/<name>.lock                  per-dataset flock; <name>.lock.owner says who holds it
    <root>/leases/<name>/<job id>.json        one lease per job using the dataset
    <root>/trash/                             evicted copies, deleted by a detached process

``<version>`` is the first 16 hex digits of the manifest's root digest. A copy is ready
only when its ready mark exists and names the same digest and inode: the staging area is
renamed into place after verification and the mark is written after the rename, so no
half-staged copy ever looks ready.

Leases and eviction. The warm path (a ready copy, quick verification) takes no lock and
imports nothing of the staging machinery, to keep a Prolog for a cached dataset cheap:
it writes the job's lease, then checks the ready mark again. Whoever removes a copy must,
holding the dataset lock, first remove the ready mark and then look for leases (putting
the mark back if there is one). Either the reader sees the mark gone (and takes the
locked path) or the remover sees the lease: a copy in use is never removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from . import catalog as cat
from .config import Config, Dataset, Tier
from .errors import ConfigError, DsstageError, NoSpace, StoreError
from .fsutil import read_json, write_json
from .lease import Lease, LeaseBook, check_job_id
from .manifest import Catalog, Manifest
from .units import human
from .warm import Layout, boot_id, not_ready, version_id

if TYPE_CHECKING:  # the staging machinery is imported only when a stage needs it
    from .stager import FillReport

log = logging.getLogger(__name__)


def node_name() -> str:
    """This node's Slurm name (``SLURMD_NODENAME`` in a Prolog), else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def ensure_layout(layout: Layout) -> None:
    """Create a tier's directories (root-owned; staging private)."""
    try:
        for sub, mode in (("", 0o755), ("datasets", 0o755), ("ready", 0o755), ("staging", 0o700),
                          ("locks", 0o755), ("leases", 0o755), ("trash", 0o700)):
            path = os.path.join(layout.root, sub) if sub else layout.root
            os.makedirs(path, mode=mode, exist_ok=True)
    except PermissionError as exc:
        raise StoreError(f"cannot create the store at {layout.root}: {exc.strerror}; "
                         "staging writes a root-owned store: run as root (the Prolog does)") from None
    except OSError as exc:
        raise StoreError(f"cannot create the store at {layout.root}: {exc.strerror}") from None


@dataclass
class StageResult:
    dataset: str
    digest: str
    path: str
    tier: str
    node: str
    action: str  # "cached" | "staged" | "repaired"
    job_id: str
    transferred_files: int = 0
    transferred_bytes: int = 0
    linked_files: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Eviction:
    dataset: str
    version: str
    action: str  # "evicted" | "kept"
    reason: str
    bytes: int = 0


@dataclass
class VerifyResult:
    dataset: str
    digest: str
    path: str
    mode: str
    ok: bool
    reason: str
    checked_files: int = 0
    repaired: list[str] = field(default_factory=list)
    removed_extras: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ReadyState:
    ready: bool
    reason: str


class Store:
    """The store of one node, over all tiers of a configuration."""

    def __init__(self, config: Config, node: str | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.node = node or node_name()
        self.manifests = Catalog(config.state_dir)
        self.clock = clock

    # -- where things are ------------------------------------------------------

    def layout(self, tier: str | Tier) -> Layout:
        t = tier if isinstance(tier, Tier) else self.config.tiers[tier]
        return Layout(t.root(self.node))

    def dataset(self, name: str) -> Dataset:
        return cat.lookup(self.config, name)

    # -- the quick check -------------------------------------------------------

    def ready_state(self, name: str, digest: str, layout: Layout) -> ReadyState:
        """Whether the copy of version ``digest`` is ready, at a cost independent of its size:
        the mark names this digest and the inode of the copy, and the copy is root-owned
        and read-only."""
        reason = not_ready(layout, name, digest)
        if reason:
            return ReadyState(False, reason)
        return ReadyState(True, "ready mark matches the current manifest")

    # -- staging ---------------------------------------------------------------

    def stage(self, name: str, *, user: cat.User, job_id: str, pid: int = 0,
              full: bool = False, on_staging: Callable[[], None] | None = None) -> StageResult:
        """Make the current version of ``name`` ready on this node and lease it to ``job_id``.

        ``on_staging`` is called (holding the lock) before a transfer starts, so that a
        node report can show the dataset as staging."""
        started = time.monotonic()
        ds = self.dataset(name)
        cat.authorize(ds, user)
        check_job_id(job_id)
        digest = self.manifests.require_current(name)
        layout = self.layout(ds.tier)
        ensure_layout(layout)
        result = StageResult(dataset=name, digest=digest, path=layout.version_dir(name, digest), tier=ds.tier,
                             node=self.node, action="cached", job_id=job_id)
        lease = Lease(dataset=name, digest=digest, job_id=job_id, user=user.name, node=self.node,
                      taken=self.clock(), host=socket.gethostname(), pid=pid)
        book = LeaseBook(layout.root)
        if not full and ds.verify == "quick" and self.ready_state(name, digest, layout).ready:
            self._apply_access(ds, layout)
            book.take(lease)
            if self.ready_state(name, digest, layout).ready:  # see "Leases and eviction" above
                result.seconds = time.monotonic() - started
                return result
            book.release(name, job_id)
        from .lock import DatasetLock
        with DatasetLock(layout.lock(name), timeout=self.config.lock_timeout, job_id=job_id,
                         what=f"dataset {name!r} on {self.node}"):
            self._apply_access(ds, layout)
            state = self.ready_state(name, digest, layout)
            if state.ready and (full or ds.verify == "full"):
                vr = self._verify_full_locked(ds, digest, layout)
                result.action = "repaired" if vr.repaired or vr.removed_extras else "cached"
            elif not state.ready:
                log.info("staging %s version %s on %s: %s", name, version_id(digest), self.node, state.reason)
                if on_staging:
                    on_staging()
                report = self._stage_locked(ds, digest, layout)
                result.action = "staged"
                result.transferred_files = report.transferred.files
                result.transferred_bytes = report.transferred.bytes
                result.linked_files = report.linked_files
            book.take(lease)
        result.seconds = time.monotonic() - started
        return result

    def _stage_locked(self, ds: Dataset, digest: str, layout: Layout) -> FillReport:
        from . import stager
        name = ds.name
        manifest = self.manifests.load(name, digest)
        vdir = layout.version_dir(name, digest)
        staging = layout.staging(name, digest)
        try:
            if os.path.lexists(vdir):
                # a copy without a valid mark: a crash between publish and mark, or tampering.
                # Take it back into staging; fill() verifies every file before it is published again.
                # (root writes into the read-only directories: no chmod that would lock out readers)
                if os.path.exists(staging):
                    shutil.rmtree(vdir)
                else:
                    os.rename(vdir, staging)
                _remove(layout.mark(name, digest))
            os.makedirs(staging, mode=0o700, exist_ok=True)
            older = self._older_versions(name, digest, layout)
            self._check_space(ds, manifest, older, layout)
            report = stager.fill(staging, manifest, ds.source, self.config.transfer, older)
            seal(staging, gid=0)
            os.rename(staging, vdir)
            st = os.lstat(vdir)
            write_json(layout.mark(name, digest), {
                "digest": digest, "files": manifest.files, "bytes": manifest.total_bytes,
                "staged_at": self.clock(), "ino": st.st_ino, "dev": st.st_dev, "node": self.node,
                "boot": boot_id(), "durable": False})
            _fsync_dir(os.path.dirname(vdir))
            flush_later(layout, name, digest)
        except DsstageError:
            raise
        except OSError as exc:
            raise StoreError(f"staging {name!r} into {layout.root} failed: {exc}; "
                             "check the local disk of this node") from None
        return report

    def _older_versions(self, name: str, digest: str, layout: Layout) -> list[tuple[str, Manifest]]:
        out = []
        for other in self.ready_digests(name, layout):
            if other == digest:
                continue
            try:
                out.append((layout.version_dir(name, other), self.manifests.load(name, other)))
            except DsstageError:
                continue  # its manifest was pruned: nothing to reuse from it
        return out

    def _check_space(self, ds: Dataset, manifest: Manifest, older: list[tuple[str, Manifest]],
                     layout: Layout) -> None:
        reusable = {(e.size, e.hash) for _, m in older for e in m.entries}
        needed = sum(e.size for e in manifest.entries if (e.size, e.hash) not in reusable)
        tier = self.config.tiers[ds.tier]
        fs = os.statvfs(layout.root)
        capacity = tier.capacity if isinstance(tier.capacity, int) else int(fs.f_blocks * fs.f_frsize * tier.capacity)
        used = self.tier_usage(layout)
        free = fs.f_bavail * fs.f_frsize
        if used + needed > capacity:
            raise NoSpace(f"tier {tier.name!r} on {self.node} holds {human(used)} of its {human(capacity)} capacity; "
                          f"dataset {ds.name!r} needs {human(needed)} more: release unused datasets or raise "
                          "the tier's capacity")
        if needed > free:
            raise NoSpace(f"tier {tier.name!r} on {self.node}: the filesystem of {layout.root} has {human(free)} free, "
                          f"dataset {ds.name!r} needs {human(needed)}: free space or lower the tier's capacity")

    def tier_usage(self, layout: Layout) -> int:
        """Bytes of the ready copies in a tier, from their marks."""
        total = 0
        ready = os.path.join(layout.root, "ready")
        for name in _listdir(ready):
            for f in _listdir(os.path.join(ready, name)):
                total += int(str(read_json(os.path.join(ready, name, f)).get("bytes") or 0))
        return total

    def ready_digests(self, name: str, layout: Layout) -> list[str]:
        out = []
        for f in _listdir(os.path.join(layout.root, "ready", name)):
            digest = read_json(os.path.join(layout.root, "ready", name, f)).get("digest")
            if isinstance(digest, str):
                out.append(digest)
        return out

    def _apply_access(self, ds: Dataset, layout: Layout) -> None:
        """Make the dataset's top directory reachable only by its groups (if restricted)."""
        path = layout.dataset_dir(ds.name)
        os.makedirs(path, mode=0o755, exist_ok=True)
        if ds.groups is None:
            os.chown(path, 0, 0)
            os.chmod(path, 0o755)
            _remove_acl(path)
            return
        gids = []
        for g in ds.groups:
            try:
                gids.append(group_id(g))
            except KeyError:
                raise ConfigError(f"{self.config.origin}: datasets.{ds.name}.groups: group {g!r} does not exist "
                                  f"on node {self.node}; fix the name or add the group") from None
        os.chown(path, 0, gids[0])
        os.chmod(path, 0o750)
        if len(gids) > 1:
            set_group_acl(path, gids)
        else:
            _remove_acl(path)

    # -- eviction ----------------------------------------------------------------

    def evict(self, name: str) -> list[Eviction]:
        """Remove this node's copies of ``name`` that no job holds a lease on.

        Follows the protocol in the module doc: under the lock, the ready mark goes first,
        then the leases are read; a copy with a lease gets its mark back and stays. An
        evicted copy is renamed into the tier's trash (instant, whatever its size) and
        deleted by a detached process, so an Epilog does not wait for it."""
        ds = self.dataset(name)
        layout = self.layout(ds.tier)
        ensure_layout(layout)
        from .lock import DatasetLock
        out: list[Eviction] = []
        with DatasetLock(layout.lock(name), timeout=self.config.lock_timeout, what=f"dataset {name!r}"):
            book = LeaseBook(layout.root)
            for version in sorted(_listdir(layout.dataset_dir(name))):
                mark_path = layout.mark(name, version)
                mark = read_json(mark_path)
                size = int(str(mark.get("bytes") or 0))
                _remove(mark_path)
                holders = sorted(x.job_id for x in book.of_dataset(name) if version_id(x.digest) == version)
                if holders:
                    if mark:
                        write_json(mark_path, mark)
                    out.append(Eviction(name, version, "kept", f"in use by job(s) {', '.join(holders)}", size))
                    continue
                trash = os.path.join(layout.root, "trash", f"{name}.{version}.{time.time_ns()}")
                os.rename(layout.version_dir(name, version), trash)
                out.append(Eviction(name, version, "evicted", "no job holds a lease on it", size))
        if any(e.action == "evicted" for e in out):
            purge_trash(layout)
        return out

    # -- release, verify -------------------------------------------------------

    def release(self, name: str, job_id: str) -> bool:
        ds = self.dataset(name)
        return LeaseBook(self.layout(ds.tier).root).release(name, job_id)

    def reclaim(self, job_alive: Callable[[str], bool]) -> list[Lease]:
        """Remove the leases on this node whose job (or process) is gone: left behind when
        an Epilog never ran, they would keep copies from ever being evicted."""
        gone: list[Lease] = []
        for tier in self.config.tiers.values():
            book = LeaseBook(self.layout(tier).root)
            for name in book.datasets():
                gone += book.reclaim(name, job_alive)
        return gone

    def release_job(self, job_id: str) -> list[Lease]:
        """Release every lease of ``job_id`` on this node (what the Epilog does)."""
        released = []
        for tier in self.config.tiers.values():
            book = LeaseBook(self.layout(tier).root)
            for lease in book.of_job(job_id):
                book.release(lease.dataset, lease.job_id)
                released.append(lease)
        return released

    def verify(self, name: str, *, full: bool = False) -> VerifyResult:
        ds = self.dataset(name)
        digest = self.manifests.require_current(name)
        layout = self.layout(ds.tier)
        state = self.ready_state(name, digest, layout)
        if not full or not state.ready:
            return VerifyResult(dataset=name, digest=digest, path=layout.version_dir(name, digest), mode="quick",
                                ok=state.ready, reason=state.reason)
        from .lock import DatasetLock
        with DatasetLock(layout.lock(name), timeout=self.config.lock_timeout, what=f"dataset {name!r}"):
            return self._verify_full_locked(ds, digest, layout)

    def _verify_full_locked(self, ds: Dataset, digest: str, layout: Layout) -> VerifyResult:
        """Re-hash the published copy; fetch again what is wrong, atomically per file."""
        from . import stager
        manifest = self.manifests.load(ds.name, digest)
        vdir = layout.version_dir(ds.name, digest)
        bad = stager.check_tree(vdir, manifest.entries, self.config.transfer.hash_threads)
        result = VerifyResult(dataset=ds.name, digest=digest, path=vdir, mode="full", ok=True,
                              reason="every file matches the manifest", checked_files=manifest.files)
        result.removed_extras = stager.sweep_extras(vdir, manifest.entries)
        if bad:
            by_path = {e.path: e for e in manifest.entries}
            part = Manifest(name=ds.name, digest=digest, entries=[by_path[b.path] for b in bad],
                            total_bytes=sum(by_path[b.path].size for b in bad), created=manifest.created)
            repair = layout.staging(ds.name, digest) + ".repair"
            shutil.rmtree(repair, ignore_errors=True)
            os.makedirs(repair, mode=0o700)
            try:
                stager.fill(repair, part, ds.source, self.config.transfer)
                seal(repair, gid=0)
                for e in part.entries:
                    target = os.path.join(vdir, e.path)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    # rename over the bad file: a job reading it keeps its open file
                    os.replace(os.path.join(repair, e.path), target)
            finally:
                shutil.rmtree(repair, ignore_errors=True)
            result.repaired = [b.path for b in bad]
            result.reason = f"repaired {len(bad)} file(s): " + "; ".join(b.describe() for b in bad[:3])
        if bad or result.removed_extras:
            seal(vdir, gid=0)
        return result

    # -- what is here ------------------------------------------------------------

    def inventory(self) -> list[dict[str, object]]:
        """Every dataset copy on this node, with its state and leases (for status)."""
        from .lock import is_held, read_owner
        rows: list[dict[str, object]] = []
        for tier in self.config.tiers.values():
            layout = self.layout(tier)
            book = LeaseBook(layout.root)
            names = set(_listdir(os.path.join(layout.root, "datasets"))) | {
                n.rsplit(".", 1)[0] for n in _listdir(os.path.join(layout.root, "staging"))}
            for name in sorted(names):
                try:
                    current = self.manifests.current(name)
                except DsstageError:
                    current = None
                leases = book.of_dataset(name)
                lock = layout.lock(name)
                staging_now = is_held(lock)
                for version in sorted(_listdir(layout.dataset_dir(name))):
                    mark = read_json(layout.mark(name, version))
                    digest = str(mark.get("digest", ""))
                    rows.append({"node": self.node, "tier": tier.name, "dataset": name, "version": version,
                                 "state": "ready" if mark else "incomplete",
                                 "current": bool(current and digest == current),
                                 "bytes": mark.get("bytes", 0), "files": mark.get("files", 0),
                                 "leases": sorted(lease.job_id for lease in leases if lease.digest == digest)})
                if staging_now:
                    owner = read_owner(lock)
                    rows.append({"node": self.node, "tier": tier.name, "dataset": name, "version": "",
                                 "state": "staging", "current": True, "bytes": 0, "files": 0,
                                 "leases": [], "job_id": owner.get("job_id", "")})
        return rows


# -- helpers ----------------------------------------------------------------------

def seal(root: str, gid: int = 0) -> None:
    """Make a tree root-owned and read-only: files 0444, directories 0555 (changing only
    what is not so already: the copier creates files that way)."""
    stack = [root]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for de in it:
                st = de.stat(follow_symlinks=False)
                want = 0o555 if de.is_dir(follow_symlinks=False) else 0o444
                if de.is_dir(follow_symlinks=False):
                    stack.append(de.path)
                if st.st_uid != 0 or st.st_gid != gid:
                    os.lchown(de.path, 0, gid)
                if stat.S_IMODE(st.st_mode) != want:
                    os.chmod(de.path, want, follow_symlinks=False)
        os.lchown(d, 0, gid)
        os.chmod(d, 0o555)


def flush_later(layout: Layout, name: str, digest: str) -> None:
    """Flush the tier's filesystem in a detached process, then mark the copy durable.

    The job need not wait for the disk; but until the flush is done, a crash of the node
    could leave files short or empty under a valid-looking mark. A mark that is not
    durable is trusted only during the boot that wrote it (see warm.not_ready)."""
    import subprocess
    subprocess.Popen([sys.executable, "-m", "dsstage.store", "flush", layout.root, name, digest],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)


def flush(root: str, name: str, digest: str) -> bool:
    """syncfs() the filesystem of ``root``, then set ``durable`` in the copy's ready mark
    (under the dataset lock: an eviction may have removed it meanwhile)."""
    import ctypes

    from .lock import DatasetLock
    layout = Layout(root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)
    with DatasetLock(layout.lock(name), timeout=3600, what=f"dataset {name!r}"):
        mark = read_json(layout.mark(name, digest))
        if not mark or mark.get("digest") != digest:
            return False
        mark["durable"] = True
        write_json(layout.mark(name, digest), mark)
    return True


def purge_trash(layout: Layout) -> None:
    """Delete the tier's trash in a detached process (its own session: it outlives an Epilog)."""
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import os, shutil, sys\n"
                      "for n in os.listdir(sys.argv[1]): shutil.rmtree(os.path.join(sys.argv[1], n), True)",
                      os.path.join(layout.root, "trash")],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)


def group_id(name: str) -> int:
    import grp
    return grp.getgrnam(name).gr_gid


# POSIX ACL in the xattr format of linux/posix_acl_xattr.h: version 2, then
# (tag u16, perm u16, id u32) entries sorted by tag and id.
_ACL_VERSION = 2
_USER_OBJ, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF


def set_group_acl(path: str, gids: list[int]) -> None:
    """Give each of ``gids`` read and search access to directory ``path``, and nobody else."""
    entries = [(_USER_OBJ, 7, _NO_ID), (_GROUP_OBJ, 0, _NO_ID)]
    entries += [(_GROUP, 5, gid) for gid in sorted(set(gids))]
    entries += [(_MASK, 5, _NO_ID), (_OTHER, 0, _NO_ID)]
    blob = struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", t, p, i) for t, p, i in entries)
    try:
        os.setxattr(path, "system.posix_acl_access", blob)
    except OSError as exc:
        raise StoreError(f"cannot restrict {path} to several groups: the filesystem refused a POSIX ACL "
                         f"({exc.strerror}); mount it with ACL support or give the dataset a single group") from None


def _remove_acl(path: str) -> None:
    try:
        os.removexattr(path, "system.posix_acl_access")
    except OSError:
        pass


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _listdir(path: str) -> list[str]:
    try:
        return [n for n in os.listdir(path) if not n.endswith(".tmp")]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


if __name__ == "__main__" and sys.argv[1:2] == ["flush"]:  # pragma: no cover - run by flush_later()
    flush(*sys.argv[2:5])
