"""Fan-out between the nodes of one job: the shared filesystem serves a dataset about once.

When every node of a multi-node job stages the same dataset version at the same moment,
each node reading the whole dataset makes the shared filesystem serve N times its bytes
just as everyone starts. With ``peers.enabled``, the nodes of the job split the dataset's
files into as many shares as there are nodes (the same split on every node: the manifest
and the job's node list decide it), and each node

- copies its own share from the source, as a stage always does, and meanwhile
- fetches every other share from the node whose share it is, over that node's read-only
  rsync daemon (``dsstage peers serve``), as the files land there: a file appears in a
  peer's staging area under its final name only once it is whole (and, from the verifying
  copier, verified), and once published the copy is served from the tier's datasets.

Every file that arrives from a peer is hashed against the manifest on this node, as any
file from the source: a peer is trusted with nothing. A peer that serves a file that does
not match (it is named in the log, with the file), that stops answering or dies mid-
transfer (rsync fails, or its --timeout passes), or that adds nothing for ``peers.wait``
seconds, is given up: what is left of its share is asked once of each other peer, which
may hold it by then, and the rest comes from the source. So a peer can cost time, never a
wrong byte, and a stage never fails because of a peer.

The daemons authenticate the peers with a shared secret (``peers.secret_file``, root's
only, the same on every node), so users on a node, who cannot read it, cannot read
datasets through them, restricted ones included; they serve only the tiers' ``staging``
and ``datasets`` directories, read-only. A site that forbids node-to-node traffic leaves
``peers.enabled`` off (the default), and every node reads from the source alone.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import nodefs, proc
from .config import Config, Peers
from .errors import CommandError, ConfigError, OutOfTime
from .manifest import Entry, Mismatch
from .transfer import NO_SPACE, PARTIAL, TransferStats, plan_streams

log = logging.getLogger(__name__)

#: the user name the daemons know the peers by (the secret is what authenticates)
USER = "dsstage"
#: the shortest secret accepted (rsync's challenge-response can be attacked offline)
MIN_SECRET = 32
#: seconds between two asks of a peer that had nothing new, doubling while it has nothing
#: (each ask sends the list of what is still missing, which the peer looks up) up to MAX_POLL
POLL = 0.5
MAX_POLL = 4.0
#: where the rsync client keeps an interrupted file, as for the source (swept at the end)
PARTIAL_DIR = ".dsstage-partial"


@dataclass(frozen=True)
class Group:
    """The nodes that stage together (a job's), this node among them, and how to reach them."""

    nodes: tuple[str, ...]
    me: str
    conf: Peers
    secret: str = field(repr=False)

    def others(self) -> list[str]:
        """The other nodes, starting after this one: every node asks its peers in another
        order, so that they do not all ask the first node first."""
        i = self.nodes.index(self.me)
        return list(self.nodes[i + 1:] + self.nodes[:i])

    def url(self, node: str, module: str, rel: str) -> str:
        return f"rsync://{USER}@{address(self.conf, node)}/{module}/{rel.strip('/')}/"


def address(conf: Peers, node: str) -> str:
    """host:port of ``node``'s daemon."""
    host = conf.hosts.get(node, node)
    return host if ":" in host else f"{host}:{conf.port}"


def plan(conf: Peers, nodes: Sequence[str], me: str) -> tuple[tuple[str, ...] | None, str]:
    """The group to stage with, or None and why not (pure)."""
    if not conf.enabled:
        return None, "peers.enabled is off"
    group = tuple(sorted(set(nodes)))
    if len(group) < 2:
        return None, "the job has one node"
    if me not in group:
        return None, f"this node ({me}) is not in the job's node list; set SLURMD_NODENAME to its Slurm name"
    return group, f"staging with {len(group) - 1} peer(s)"


def group_for(conf: Peers, nodelist: str, me: str) -> Group | None:
    """The group of a job's node list (a Slurm hostlist), or None (logged when it is not
    for an ordinary reason such as a one-node job or peers off)."""
    if not conf.enabled or not nodelist:
        return None
    from .slurm import expand_nodes
    try:
        nodes, why = plan(conf, expand_nodes(nodelist), me)
    except ValueError as exc:
        log.warning("peers: %s; staging from the source alone", exc)
        return None
    if nodes is None:
        if len(set(expand_nodes(nodelist))) > 1:
            log.warning("peers: %s; staging from the source alone", why)
        return None
    try:
        secret = read_secret(conf.secret_file)
    except ConfigError as exc:
        log.warning("peers: %s; staging from the source alone", exc)
        return None
    return Group(nodes=nodes, me=me, conf=conf, secret=secret)


def shares(entries: Sequence[Entry], nodes: Sequence[str]) -> dict[str, list[Entry]]:
    """Each node's share of ``entries``: about equal bytes, the same on every node (pure)."""
    lists = plan_streams(entries, len(nodes))
    out: dict[str, list[Entry]] = {n: [] for n in nodes}
    for node, lst in zip(nodes, lists):
        out[node] = lst
    return out


def read_secret(path: str) -> str:
    """The shared secret: the first line of a regular file only root can read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"peers.secret_file {path}: cannot open ({exc.strerror}); create it on every node, "
                          "the same on all, mode 0600, owned by root") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            raise ConfigError(f"peers.secret_file {path}: must be a regular file owned by root that nobody else "
                              "can read or write (chown root: and chmod 0600 it)")
        text = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    secret = text.splitlines()[0].strip() if text.strip() else ""
    if not secret or any(ord(c) < 32 for c in secret):
        raise ConfigError(f"peers.secret_file {path}: its first line must be the secret (printable, not empty)")
    if len(secret) < MIN_SECRET:
        raise ConfigError(f"peers.secret_file {path}: the secret has {len(secret)} characters; give at least "
                          f"{MIN_SECRET} random ones (e.g. head -c 24 /dev/urandom | base64): a daemon's challenge "
                          "can be answered offline for a short one")
    return secret


# -- the daemon every node runs -------------------------------------------------------------------

def modules(config: Config, node: str) -> dict[str, str]:
    """The daemon's modules on ``node``: ``<tier>-staging`` and ``<tier>-datasets`` -> path."""
    out = {}
    for tier in config.tiers.values():
        root = tier.root(node)
        out[f"{tier.name}-staging"] = os.path.join(root, "staging")
        out[f"{tier.name}-datasets"] = os.path.join(root, "datasets")
    return out


def daemon_config(config: Config, node: str, secrets_file: str) -> str:
    """rsyncd.conf for ``node``: read-only, authenticated, only the tiers' data (pure)."""
    lines = [f"# dsstage peers serve: node {node}, from {config.origin}",
             "use chroot = yes", "read only = yes", "write only = no", "list = no",
             # the staging areas are root's only (0700); nothing is written
             "uid = root", "gid = root", "reverse lookup = no",
             f"auth users = {USER}:ro", f"secrets file = {secrets_file}", "strict modes = yes",
             f"timeout = {int(config.peers.timeout)}",
             "refuse options = delete* remove-source-files", ""]
    for name, path in modules(config, node).items():
        lines += [f"[{name}]", f"path = {path}", ""]
    return "\n".join(lines)


def serve_argv(config: Config, node: str, workdir: str) -> list[str]:
    """Write the daemon's configuration and secrets into ``workdir`` (root's, private) and
    return the rsync command that serves them in the foreground."""
    secret = read_secret(config.peers.secret_file)
    secrets = os.path.join(workdir, "secrets")
    conf = os.path.join(workdir, "rsyncd.conf")
    _write_private(secrets, f"{USER}:{secret}\n")
    _write_private(conf, daemon_config(config, node, secrets))
    host, _, port = address(config.peers, node).rpartition(":")
    argv = ["rsync", "--daemon", "--no-detach", f"--config={conf}", f"--port={port}", "--log-file=/dev/stderr"]
    if node in config.peers.hosts:
        argv.append(f"--address={host}")  # the address the site gave for this node
    return argv


def _write_private(path: str, text: str) -> None:
    """Write ``path`` (in a directory only root can write) as root's alone, replacing it whole."""
    tmp = os.path.join(os.path.dirname(path), nodefs.temp_name())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        nodefs.write_all(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def private_dir(path: str) -> str:
    """``path``, a directory only root can enter, created if missing; refused if it is
    anything else (a link, another owner, open to others)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(f"{path}: must be a directory of root's that nobody else can enter; remove it and "
                          "start again")
    return path


def serve(config: Config, node: str, run_dir: str) -> None:
    """Become this node's daemon (exec rsync in the foreground): its configuration and the
    secrets file are written to ``<run_dir>/peers-<node>``, root's alone."""
    os.makedirs(run_dir, mode=0o755, exist_ok=True)
    workdir = private_dir(os.path.join(run_dir, f"peers-{node}"))
    argv = serve_argv(config, node, workdir)
    log.info("serving %s to peers on %s", ", ".join(modules(config, node)), address(config.peers, node))
    for h in logging.getLogger().handlers:
        h.flush()
    os.execvp(argv[0], argv)


# -- fetching from peers ---------------------------------------------------------------------------

@dataclass
class Outcome:
    """What a cooperative stage moved, and from where."""

    source: TransferStats = field(default_factory=TransferStats)
    peers: dict[str, TransferStats] = field(default_factory=dict)
    bad: list[Mismatch] = field(default_factory=list)  # from the source: fetched again by the caller
    given_up: dict[str, str] = field(default_factory=dict)  # peer -> why

    @property
    def from_peers(self) -> TransferStats:
        total = TransferStats()
        for s in self.peers.values():
            total.add(s)
        return total


#: callbacks the stager gives: which entries are present, hash-check some, remove some,
#: copy some from the source
Present = Callable[[Sequence[Entry]], list[Entry]]
Check = Callable[[Sequence[Entry]], list[Mismatch]]
Remove = Callable[[Sequence[Mismatch]], None]
FromSource = Callable[[Sequence[Entry]], tuple[TransferStats, list[Mismatch]]]


@dataclass(frozen=True)
class Where:
    """Where a version is on a peer: its staging area, or (once published) its copy."""

    name: str
    digest: str
    tier: str

    def places(self) -> list[tuple[str, str]]:
        vid = nodefs.version_id(self.digest)
        return [(f"{self.tier}-staging", nodefs.staging_name(self.name, self.digest)),
                (f"{self.tier}-datasets", f"{self.name}/{vid}")]


class _Round:
    """One rsync run against one peer for some entries: what it said."""

    def __init__(self, rc: int | None, stderr: str) -> None:
        self.rc, self.stderr = rc, stderr

    @property
    def missing_base(self) -> bool:
        return "change_dir" in self.stderr and "No such file or directory" in self.stderr

    def failure(self) -> str:
        """Why the peer cannot serve, or "" (some files or the whole version not there (yet)
        is no failure)."""
        if self.rc in (0, *PARTIAL) or (self.rc == 3 and self.missing_base):
            return ""
        tail = " | ".join(self.stderr.strip().splitlines()[-2:]) or "no answer"
        if "auth failed" in self.stderr:
            return f"its daemon refused the secret ({tail}): peers.secret_file must be the same on every node"
        return f"rsync exit {self.rc}: {tail}"


def fetch_round(group: Group, node: str, module: str, rel: str, dest_path: str, entries: Sequence[Entry],
                deadline: float | None) -> _Round:
    """Ask ``node`` for ``entries`` once, into ``dest_path`` (no -l: a link is never made).
    The list goes on rsync's standard input: no file of it in a directory users can fill.
    At most the largest entry's size is accepted for any file."""
    timeout = group.conf.timeout
    largest = max((e.size for e in entries), default=0)
    argv = ["rsync", "-t", "--from0", "--files-from=-", "--no-perms", "--chmod=u+rw", f"--max-size={largest + 1}",
            f"--partial-dir={PARTIAL_DIR}", f"--timeout={int(timeout)}", f"--contimeout={int(timeout)}",
            group.url(node, module, rel), dest_path.rstrip("/") + "/"]
    limit = 6 * 3600.0
    if deadline is not None:
        limit = max(1.0, deadline - time.monotonic())
    try:
        res = proc.run(argv, timeout=limit, check=False, die_with_parent=True,
                       env=dict(os.environ, RSYNC_PASSWORD=group.secret),
                       stdin=b"\0".join(os.fsencode(e.path) for e in entries) + b"\0")
    except CommandError as exc:
        return _Round(None, str(exc))
    return _Round(res.returncode, res.stderr)


def cooperate(group: Group, where: Where, dest_path: str, entries: Sequence[Entry], *,
              present: Present, check: Check, remove: Remove, from_source: FromSource,
              deadline: float | None = None, progress: Callable[[int], None] | None = None,
              clock: Callable[[], float] = time.monotonic) -> Outcome:
    """Fill ``dest_path`` with ``entries`` (the whole manifest, in the same order on every
    node): this node's share from the source, the others' from the peers (see the module
    doc). Returns what came from where; files from the source that did not match are in
    ``bad`` (not written), for the caller to fetch again."""
    split = shares(entries, group.nodes)
    out = Outcome()
    lock = threading.Lock()
    stop = threading.Event()
    failed: set[str] = set()

    def late() -> None:
        if stop.is_set():
            raise OutOfTime("the stage stopped")
        if deadline is not None and clock() > deadline:
            raise OutOfTime("the transfer used up the time budget; what arrived is kept and the next stage resumes")

    def source(todo: Sequence[Entry]) -> None:
        if not todo:
            return
        stats, bad = from_source(todo)
        with lock:
            out.source.add(stats)
            out.bad += bad

    def take(node: str, module: str, rel: str, todo: list[Entry]) -> tuple[list[Entry], _Round]:
        """One round from ``node``: the entries still missing, and what rsync said. Files
        that arrived are checked; any that does not match is removed and gives the peer up."""
        rnd = fetch_round(group, node, module, rel, dest_path, todo, deadline)
        # past the deadline, what arrived is left unhashed: the next stage checks it (resumed)
        late()
        arrived = present(todo)
        if arrived:
            bad = check(arrived)
            if bad:
                remove(bad)
                more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
                shown = "; ".join(m.describe() for m in bad[:3]) + more
                log.warning("peer %s served %d file(s) of %s that do not match its manifest: %s; removed, "
                            "they come from elsewhere", node, len(bad), where.name, shown)
                with lock:
                    failed.add(node)
                    out.given_up.setdefault(node, f"served {len(bad)} file(s) that do not match the manifest: {shown}")
            bad_paths = {m.path for m in bad}
            arrived = [e for e in arrived if e.path not in bad_paths]
            good = arrived
            with lock:
                got = out.peers.setdefault(node, TransferStats())
                got.files += len(good)
                got.bytes += sum(e.size for e in good)
            if progress:
                progress(sum(e.size for e in good))
        came = {e.path for e in arrived}  # a removed mismatch is still to come, from elsewhere
        return [e for e in todo if e.path not in came], rnd

    def from_peer(node: str) -> None:
        todo = _without(split[node], present(split[node]))
        places = where.places()
        at = 0
        last = clock()
        why = ""
        idle = POLL
        while todo:
            late()
            module, rel = places[at]
            before = len(todo)
            todo, rnd = take(node, module, rel, todo)
            failure = rnd.failure()
            if failure and NO_SPACE in rnd.stderr:
                failure += " (if the tier is full, the copy from the source says so)"
            with lock:
                if node in failed:
                    why = out.given_up[node]
            if why:
                break
            if failure:
                why = failure
                break
            if rnd.missing_base:
                at = (at + 1) % len(places)  # not staging (yet, or any more): published?
            if len(todo) < before:
                last, idle = clock(), POLL
                continue
            if clock() - last > group.conf.wait:
                why = f"it added nothing for {group.conf.wait:g}s"
                break
            stop.wait(idle)
            idle = min(MAX_POLL, idle * 2)
        if not todo:
            return
        with lock:
            failed.add(node)
            out.given_up.setdefault(node, why)
        log.warning("peer %s: %s; %d file(s) of its share of %s come from the other peers or the source",
                    node, why, len(todo), where.name)
        for other in group.others():
            with lock:
                if other in failed or other == node:
                    continue
            if not todo:
                break
            late()
            for module, rel in places:
                todo, rnd = take(other, module, rel, todo)
                if rnd.failure() or not rnd.missing_base or not todo:
                    break
        late()
        source(todo)

    mine = split[group.me]
    peers = group.others()
    pool = ThreadPoolExecutor(max_workers=max(1, min(group.conf.parallel, len(peers))), thread_name_prefix="peer")
    try:
        futures = [pool.submit(from_peer, node) for node in peers]
        try:
            source(_without(mine, present(mine)))
        except BaseException:
            stop.set()
            raise
        for f in futures:
            f.result()
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    got = out.from_peers
    log.info("%s: %d file(s) (%d bytes) from peers%s, %d file(s) (%d bytes) from the source", where.name,
             got.files, got.bytes, f" ({', '.join(sorted(out.peers))})" if out.peers else "",
             out.source.files, out.source.bytes)
    return out


def _without(entries: Sequence[Entry], drop: Sequence[Entry]) -> list[Entry]:
    gone = {e.path for e in drop}
    return [e for e in entries if e.path not in gone]
