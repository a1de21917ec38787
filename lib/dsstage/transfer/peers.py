"""Fan-out between the nodes of a job, and from any node that holds a version ready: the
shared filesystem serves a dataset about once.

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

Across jobs: nodes outside the job whose published reports show the version ready (its
*holders*, ``Group.holders``, found by dsstage.node.staging from the node reports) serve the
whole version, split among them; the node then copies nothing from the source itself, and
the source serves only what the holders fail to give. A holder that no longer has it is
given up at once.

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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from dsstage import proc
from dsstage.config.manifest import Entry, Mismatch
from dsstage.config.model import Peers
from dsstage.errors import CommandError, ConfigError, OutOfTime
from dsstage.fs import layout
from dsstage.transfer.peerd import USER, address, read_secret
from dsstage.transfer.rsync import PARTIAL, TransferStats, files_from, plan_streams
from dsstage.transfer.transport import Area, Copied, Transport

log = logging.getLogger(__name__)

#: seconds between two asks of a peer that had nothing new, doubling while it has nothing
#: (each ask sends the list of what is still missing, which the peer looks up) up to MAX_POLL
POLL = 0.5
MAX_POLL = 4.0


@dataclass(frozen=True)
class Group:
    """The nodes that stage together (a job's), this node among them, and how to reach them;
    ``holders``: nodes outside the job whose published reports show the version ready, for
    whichever job they staged it (then every file comes from them, the source serving only
    what they fail to give)."""

    nodes: tuple[str, ...]
    me: str
    conf: Peers
    secret: str = field(repr=False)
    holders: tuple[str, ...] = ()
    #: the holders hold the version ready (else: one is staging it now, dsstage.node.stagers):
    #: a ready holder without it has evicted it, and is given up at once
    ready: bool = True

    def others(self) -> list[str]:
        """The nodes to fetch from: the holders where there are any, else the job's other
        nodes, starting after this one: every node asks its peers in another order, so that
        they do not all ask the first node first."""
        if self.holders:
            return list(self.holders)
        i = self.nodes.index(self.me)
        return list(self.nodes[i + 1:] + self.nodes[:i])

    def split_among(self) -> tuple[str, ...]:
        """The nodes whose shares make up the version: the holders, else the job's nodes."""
        return self.holders or self.nodes

    def url(self, node: str, module: str, rel: str) -> str:
        return f"rsync://{USER}@{address(self.conf, node)}/{module}/{rel.strip('/')}/"




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


def group_for(conf: Peers, nodelist: str, me: str, holders: Sequence[str] = (), ready: bool = True) -> Group | None:
    """The group of a job's node list (a Slurm hostlist) and the ``holders`` of the version
    outside it (``choose_holders``), or None (logged when it is not for an ordinary reason such
    as a one-node job or peers off)."""
    if not conf.enabled or (not nodelist and not holders):
        return None
    from dsstage.hostlist import expand_nodes
    try:
        listed = expand_nodes(nodelist) if nodelist else [me]
        nodes, why = plan(conf, listed, me)
    except ValueError as exc:
        log.warning("peers: %s; staging from the source alone", exc)
        return None
    outside = choose_holders(holders, listed, me, conf.parallel)
    if nodes is None and outside and me in listed:
        nodes = (me,)  # one node of its own: it fetches from the holders alone
    if nodes is None:
        if len(set(listed)) > 1:
            log.warning("peers: %s; staging from the source alone", why)
        return None
    try:
        secret = read_secret(conf.secret_file)
    except ConfigError as exc:
        log.warning("peers: %s; staging from the source alone", exc)
        return None
    return Group(nodes=nodes, me=me, conf=conf, secret=secret, holders=outside, ready=ready)


def choose_holders(holders: Sequence[str], job_nodes: Sequence[str], me: str, most: int) -> tuple[str, ...]:
    """The holders this node fetches from: those outside its job, at most ``most``, chosen by
    rendezvous hashing of (node, holder), so that the nodes that stage a version at once spread
    over its holders rather than all asking the same ones, and a node asks the same holders
    again (pure)."""
    import hashlib
    outside = sorted(set(holders) - set(job_nodes) - {me})
    outside.sort(key=lambda h: hashlib.blake2b(f"{me}\0{h}".encode(), digest_size=8).digest())
    return tuple(outside[:max(1, most)])


def shares(entries: Sequence[Entry], nodes: Sequence[str]) -> dict[str, list[Entry]]:
    """Each node's share of ``entries``: about equal bytes, the same on every node (pure)."""
    lists = plan_streams(entries, len(nodes))
    out: dict[str, list[Entry]] = {n: [] for n in nodes}
    for node, lst in zip(nodes, lists):
        out[node] = lst
    return out


@dataclass
class PeerTransfer:
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


class Landing(Protocol):
    """The staging area as a cooperative fill sees it (dsstage.transfer.transport.Area): its
    path (rsync writes by it), the stage's deadline, which entries are there, hash-checking
    and removing some, and the progress of the bytes copied."""

    @property
    def path(self) -> str: ...

    @property
    def deadline(self) -> float | None: ...

    def present(self, entries: Sequence[Entry]) -> list[Entry]: ...

    def check(self, entries: Sequence[Entry]) -> list[Mismatch]: ...

    def remove(self, bad: Sequence[Mismatch]) -> None: ...

    def copying(self) -> Callable[[int, int], None] | None: ...


#: copies some entries from the source (the wrapped transport's ``copy``)
FromSource = Callable[[Sequence[Entry]], Copied]


@dataclass(frozen=True)
class Where:
    """Where a version is on a peer: its staging area, or (once published) its copy."""

    name: str
    digest: str
    tier: str

    def places(self) -> list[tuple[str, str]]:
        vid = layout.version_id(self.digest)
        return [(f"{self.tier}-staging", layout.staging_name(self.name, self.digest)),
                (f"{self.tier}-datasets", f"{self.name}/{vid}")]


@dataclass(frozen=True)
class Round:
    """One rsync run against one peer for some entries: what it said."""

    rc: int | None
    stderr: str

    def missing(self, progressed: bool) -> bool:
        """Whether the version may not be in the place asked (not staging yet, or published
        already): rsync could not select the directory (exit 3), or it brought nothing and said
        files were missing (exit 23, 24). Decided from the exit code, never rsync's text."""
        return self.rc == 3 or (self.rc in PARTIAL and not progressed)

    def failure(self) -> str:
        """Why the peer cannot serve, or "" (some files or the whole version not there (yet)
        is no failure). rsync's last lines are quoted for people; the decision is the exit
        code's (5: the daemon refused us: its secret, its allow list, its connection limit)."""
        if self.rc in (0, 3, *PARTIAL):
            return ""
        tail = " | ".join(self.stderr.strip().splitlines()[-2:]) or "no answer"
        if self.rc == 5:
            return (f"its daemon refused this node ({tail}): peers.secret_file must be the same on every node, "
                    "and this node's address in its peers.allow")
        return f"rsync exit {self.rc}: {tail}"


def fetch_round(group: Group, node: str, module: str, rel: str, dest_path: str, entries: Sequence[Entry],
                deadline: float | None) -> Round:
    """Ask ``node`` for ``entries`` once, into ``dest_path`` (no -l: a link is never made).
    The list goes on rsync's standard input: no file of it in a directory users can fill.
    At most the largest entry's size is accepted for any file."""
    timeout = group.conf.timeout
    largest = max((e.size for e in entries), default=0)
    url, names = files_from(group.url(node, module, rel), (e.path for e in entries))
    argv = ["rsync", "-t", "--from0", "--files-from=-", "--no-perms", "--chmod=u+rw", f"--max-size={largest + 1}",
            f"--partial-dir={layout.partial_dir(dest_path)}", f"--timeout={int(timeout)}",
            f"--contimeout={int(timeout)}", url, dest_path.rstrip("/") + "/"]
    limit = 6 * 3600.0
    if deadline is not None:
        limit = max(1.0, deadline - time.monotonic())
    try:
        res = proc.run(argv, timeout=limit, check=False, die_with_parent=True,
                       env=dict(os.environ, RSYNC_PASSWORD=group.secret),
                       stdin=names)
    except CommandError as exc:
        return Round(None, str(exc))
    return Round(res.returncode, res.stderr)


# -- the plan: what to do after each round against a peer (pure) -------------------------------

@dataclass(frozen=True)
class Step:
    """What a peer's fetch does next, and why."""

    action: str  # "again" | "probe" | "wait" | "give up"
    reason: str = ""
    delay: float = 0.0  # seconds, for "wait"
    move: bool = False  # ask the other place next (staging, or the published copy)


#: consecutive refusals (rsync exit 5) after which a peer is given up: a daemon at its
#: connection limit refuses for a while; a wrong secret or allow list refuses for good
REFUSALS = 3


def after_round(rnd: Round, *, progressed: bool, idle_for: float, wait: float, poll: float,
                refused: int = 0, probed: bool = False, holder: bool = False) -> Step:
    """The next step of fetching a share from one peer, after a round that left files to come.

    A refusal (exit 5) is waited out up to REFUSALS times in a row (``refused`` counts them,
    this round included): a daemon at its connection limit says so. Any other failure gives the
    peer up; a round that brought files goes again at once; a peer is given up once no peer
    of the job brought anything for ``wait`` seconds (``idle_for``).

    A round that brought nothing may have asked the wrong place (the version not staging
    yet, or published already: ``Round.missing``). The other place is then asked at once
    (``probe``), and only if that brought nothing either (``probed``: this round was the
    probe) does the fetch wait ``poll`` seconds, back at the first place. Waiting before
    the probe, as dsstage did from f7d642e to 94519b2, spent every other poll on the place
    where the version was not: while a peer was still staging, each of its files reached
    the others one poll later, and a 3-node fan-out took 1.5x one node's stage, not 1.06x
    (docs/benchmarks.md, "Many nodes, one read of the shared filesystem").

    A ``holder`` (its report showed the version ready, it is not staging it) that has it in
    neither place has evicted it since: it is given up at once, never waited for."""
    failure = rnd.failure()
    if failure and rnd.rc == 5 and refused < REFUSALS and idle_for <= wait:
        return Step("wait", "its daemon refused this node: busy, maybe", delay=poll)
    if failure:
        return Step("give up", failure if rnd.rc != 5 else f"{failure} ({refused} times in a row)")
    move = rnd.missing(progressed)
    if progressed:
        return Step("again", "it brought files", move=move)
    if idle_for > wait:
        return Step("give up", f"no peer of the job added anything for {wait:g}s")
    if move and not probed:
        return Step("probe", "nothing here: the other place, at once (the version may have moved)", move=True)
    if holder and move:
        return Step("give up", "it no longer holds the version (evicted since its report)")
    return Step("wait", "nothing new yet", delay=poll, move=move)


#: other peers asked for what is left of a given-up peer's share, before the source
FALLBACK_PEERS = 2


def fallbacks(group: Group, node: str, failed: set[str]) -> list[str]:
    """Whom to ask for what is left of ``node``'s share once it is given up: at most
    FALLBACK_PEERS other peers not given up, in the group's order; this node fetches the rest
    from the source. Bounded, so that a job whose peers lack the version makes O(N) rsync runs
    per node, not O(N^2)."""
    return [o for o in group.others() if o != node and o not in failed][:FALLBACK_PEERS]


# -- the runner ----------------------------------------------------------------------------------

class _Cooperation:
    """One cooperative fill: this node's share from the source, each peer's share from it (one
    thread per peer), with what came from where kept under one lock."""

    def __init__(self, group: Group, where: Where, landing: Landing, entries: Sequence[Entry],
                 from_source: FromSource, clock: Callable[[], float],
                 sleep: Callable[[float], object] | None = None) -> None:
        self.group, self.where, self.landing, self.dest_path = group, where, landing, landing.path
        self.split = shares(entries, group.split_among())
        self.split.setdefault(group.me, [])  # with holders, this node's own share is nothing
        self.present, self.check, self.remove = landing.present, landing.check, landing.remove
        self.from_source, self.deadline, self.clock = from_source, landing.deadline, clock
        copying = landing.copying()
        self.progress = (lambda n: copying(n, 0)) if copying else None
        self.out = PeerTransfer()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.sleep = sleep or self.stop.wait
        self.failed: set[str] = set()
        #: when a file last came from any peer: the job-wide clock ``peers.wait`` runs against
        self.last_progress = clock()

    def idle(self) -> float:
        """Seconds since any peer brought a file (or since the fill started)."""
        with self.lock:
            return self.clock() - self.last_progress

    def late(self) -> None:
        if self.stop.is_set():
            raise OutOfTime("the stage stopped")
        if self.deadline is not None and self.clock() > self.deadline:
            raise OutOfTime("the transfer used up the time budget; what arrived is kept and the next stage resumes")

    def source(self, todo: Sequence[Entry], *, probe: bool = False) -> None:
        """``todo`` from the source; with ``probe``, the source is asked even for nothing (a
        source that is gone raises SourceError at once)."""
        if not todo and not probe:
            return
        got = self.from_source(todo)
        with self.lock:
            self.out.source.add(got.source)
            self.out.bad += got.bad

    def give_up(self, node: str, why: str) -> None:
        with self.lock:
            self.failed.add(node)
            self.out.given_up.setdefault(node, why)

    def take(self, node: str, module: str, rel: str, todo: list[Entry]) -> tuple[list[Entry], Round]:
        """One round from ``node``: the entries still missing, and what rsync said. Files
        that arrived are checked; any that does not match is removed and gives the peer up."""
        rnd = fetch_round(self.group, node, module, rel, self.dest_path, todo, self.deadline)
        # past the deadline, what arrived is left unhashed: the next stage checks it (resumed)
        self.late()
        arrived = self.present(todo)
        if arrived:
            bad = self.check(arrived)
            if bad:
                self.remove(bad)
                more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
                shown = "; ".join(m.describe() for m in bad[:3]) + more
                log.warning("peer %s served %d file(s) of %s that do not match its manifest: %s; removed, "
                            "they come from elsewhere", node, len(bad), self.where.name, shown)
                self.give_up(node, f"served {len(bad)} file(s) that do not match the manifest: {shown}")
                bad_paths = {m.path for m in bad}
                arrived = [e for e in arrived if e.path not in bad_paths]
            with self.lock:
                got = self.out.peers.setdefault(node, TransferStats())
                got.files += len(arrived)
                got.bytes += sum(e.size for e in arrived)
                if arrived:
                    self.last_progress = self.clock()
            if self.progress:
                self.progress(sum(e.size for e in arrived))
        came = {e.path for e in arrived}  # a removed mismatch is still to come, from elsewhere
        return [e for e in todo if e.path not in came], rnd

    def from_peer(self, node: str) -> None:
        """Fetch ``node``'s share from it, step by step (``after_round``); what it does not
        give comes from up to FALLBACK_PEERS other peers, then from the source.

        ``peers.wait`` is one job-wide deadline: a peer is given up once no peer at all has
        brought a file for that long, so peers that lack the version cost the job about
        ``wait`` once, not ``wait`` for each wave of ``peers.parallel`` peers."""
        todo = _without(self.split[node], self.present(self.split[node]))
        places = self.where.places()
        holder = node in self.group.holders and self.group.ready
        # a ready holder's copy is published: asked there first
        at, idle, refused, probed = (1 if holder else 0), POLL, 0, False
        why = ""
        while todo and not why:
            self.late()
            module, rel = places[at]
            before = len(todo)
            todo, rnd = self.take(node, module, rel, todo)
            with self.lock:
                why = self.out.given_up.get(node, "") if node in self.failed else ""
            if why or not todo:
                break
            refused = refused + 1 if rnd.rc == 5 else 0
            step = after_round(rnd, progressed=len(todo) < before, idle_for=self.idle(),
                               wait=self.group.conf.wait, poll=idle, refused=refused, probed=probed,
                               holder=holder)
            if step.move:
                at = (at + 1) % len(places)
            probed = step.action == "probe"
            if step.action == "give up":
                why = step.reason
            elif step.action == "again":
                idle = POLL
            elif step.action == "probe":
                pass  # the other place at once; the poll's backoff is unchanged
            else:
                self.sleep(step.delay)
                idle = min(MAX_POLL, idle * 2)
        if not todo:
            return
        self.give_up(node, why)
        log.warning("peer %s: %s; %d file(s) of its share of %s come from the other peers or the source",
                    node, why, len(todo), self.where.name)
        with self.lock:
            others = fallbacks(self.group, node, self.failed)
        if self.idle() > self.group.conf.wait:
            others = []  # no peer has brought anything for peers.wait: asking more of them is no use
        for other in others:
            if not todo:
                break
            self.late()
            for module, rel in places:
                before = len(todo)
                todo, rnd = self.take(other, module, rel, todo)
                if rnd.failure() or not todo or not rnd.missing(len(todo) < before):
                    break
        self.late()
        self.source(todo)

    def run(self) -> PeerTransfer:
        mine = self.split[self.group.me]
        peers = self.group.others()
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.group.conf.parallel, len(peers))),
                                  thread_name_prefix="peer")
        try:
            futures = [pool.submit(self.from_peer, node) for node in peers]
            try:
                # asked even when this node's share is empty (fewer files than nodes, or
                # resumed): a source that is gone then ends the stage now, not after peers.wait
                # spent on peers that fail the same way; not with holders, which make the
                # source needed only for what they fail to give
                self.source(_without(mine, self.present(mine)), probe=not self.group.holders)
            except BaseException:
                self.stop.set()
                raise
            for f in futures:
                f.result()
        finally:
            self.stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
        return self.out


def cooperate(group: Group, where: Where, landing: Landing, entries: Sequence[Entry], from_source: FromSource,
              *, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], object] | None = None) -> PeerTransfer:
    """Fill ``landing`` with ``entries`` (the whole manifest, in the same order on every
    node): this node's share from the source, the others' from the peers (see the module
    doc). Returns what came from where; files from the source that did not match are in
    ``bad`` (not written), for the caller to fetch again."""
    out = _Cooperation(group, where, landing, entries, from_source, clock, sleep).run()
    got = out.from_peers
    log.info("%s: %d file(s) (%d bytes) from peers%s, %d file(s) (%d bytes) from the source", where.name,
             got.files, got.bytes, f" ({', '.join(sorted(out.peers))})" if out.peers else "",
             out.source.files, out.source.bytes)
    return out


@dataclass
class PeersFirst:
    """A transport (dsstage.transfer.transport) that wraps the source's: the version's files
    from the job's other nodes and the holders (``group``, where the version is on them:
    ``where``), this node's share and what the peers fail to give through ``inner``."""

    group: Group
    where: Where
    inner: Transport
    area: Area
    verified_on_arrival = False  # what rsync brings from a peer stands at its final name before its hash
    checks_all = False

    @property
    def origin(self) -> Transport:
        return self.inner.origin

    def copy(self, entries: Sequence[Entry]) -> Copied:
        out = cooperate(self.group, self.where, self.area, entries, self.inner.copy)
        return Copied(out.source, out.bad, out.from_peers, out.given_up)


def _without(entries: Sequence[Entry], drop: Sequence[Entry]) -> list[Entry]:
    gone = {e.path for e in drop}
    return [e for e in entries if e.path not in gone]
