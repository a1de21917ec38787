"""Retention: which copies a node keeps, and which it evicts, with a reason for each.

``plan`` is a pure function (like borg's prune): the node's copies, what the queue wants
(the demand snapshot), the tier's capacity and watermarks and the clock go in; a Decision
per copy comes out. It does no I/O: the Epilog, the Prolog (making room before a stage),
``dsstage evict`` and the simulator all call it, and the store carries the decisions out.

The rules, in order:

1. A copy with a lease is kept ("leased by job 123"). Nothing else overrides this.
2. A copy that can never be used again is evicted without pressure: one flagged bad, and
   a superseded version once the current version is ready in the same tier ("old
   version ..., no lease"). A superseded version whose current one is not here yet is
   kept while there is room: the next stage reuses its unchanged files.
3. With ``max_idle`` set, a copy unused that long that nothing in the queue wants is
   evicted ("idle 3 d, no demand"); never on a stale snapshot.
4. Pressure. When the tier's usage (copies and reservations) is above the high watermark,
   unleased copies are evicted in eviction order until usage is below the low watermark,
   but a copy the queue wants only as far as needed to get below the high watermark (then
   the capacity). A stage (``Space.need``) may fill the tier to its capacity: it evicts
   only when usage plus its bytes would exceed the capacity, and then the fewest copies
   that make it fit. So the headroom between the high watermark and the capacity is a
   buffer the stages take without evicting, and the Epilog, off any job's path, gives it
   back (a stage that evicted to stay below the high watermark, as dsstage did before,
   left the headroom unused: every stage into a full tier evicted first, and the tier held
   10 % less; docs/simulation.md measures both). A copy used within ``min_keep`` is not evicted
   for space, but for a stage that cannot fit otherwise a recent copy that no pending job
   may still use on this node (none planned here, none unplanned) may go, after every other
   candidate: a job waiting for its data here outweighs a copy kept because it was used a
   moment ago or because jobs on other nodes use their own copies of it (the Prolog would
   fail the stage and read the source instead). With the copies known (peers), the one
   the cluster keeps of each version goes after recent copies other nodes hold, which a
   peer serves again (the reason says which). Usage
   is recomputed as copies go: bytes that two versions share (hard links) are freed only
   when both are gone.

The eviction order: superseded versions first; then, where the snapshot says which nodes
hold each version (``Demand.copies``: the poller reads the nodes' reports, and the nodes
pass it only with ``peers.enabled``, where another node's copy is what a stage reads
instead of the source), a copy the cluster does not need kept here before the one it keeps
(``keeper_rank``: one holder of each version keeps it for the cluster, and a keeper whose
version others hold goes before "the last copy in the cluster"); then by demand (each pending job that wants the
dataset, more if the backfill plan put it on this node, more the sooner it is expected to
start; running jobs on other nodes: the dataset is in use in the cluster); then by use
frequency; then the least recently used; then the larger copy (fewer evictions for the
room).

Why the cluster's copy before demand: with peers, a copy evicted while another node holds
the version is staged again from that node, and the last one from the shared filesystem,
the load dsstage exists to spare (one read of it per cluster). Each version's keeper is
one node, chosen from its holders by rendezvous hashing, so that the duty spreads over the
nodes (the first holder by name kept nearly everything on the first nodes, whose tiers then
had only keepers to evict) and holders that read the same snapshot agree on it.
Ordered after demand, as first built, the rule left the source serving 2.4-4.3 times each
dataset's first read on the generated traces (seeds 1-3; 10.4 times on the whole HPC2N
log); before demand, 1.00 times on seeds 1-8, for up to 15 % more bytes staged again, all
from peers (docs/simulation.md, section i).

Use frequency is ``Demand.uses``: per dataset, the job starts the demand poller saw in the
whole cluster, an exponentially decayed count (half-life ``HALF_LIFE``, 7 days).
This is LFU with aging, or GreedyDual-Size-Frequency with the cost of a miss set to the
copy's size: GDSF keeps the copies of highest frequency x cost / size, and when what a
miss costs is the bytes staged again (the metric retention is judged by) cost / size is 1,
so size drops out and a frequently used big copy is worth as much per byte as a small one.
The exponential decay plays the part of GDSF's inflation value L (old popularity fades)
without state kept per node between calls, which the planner, a pure function, does not
have. The counts are cluster-wide because they are what dsstage sees; a node's own
history is in its copies' recency, which breaks ties. Why frequency before recency: the
scheduler places jobs without looking at caches, so which datasets one node is asked for
next is close to a draw from the cluster's popularity, which the counts estimate and one
node's last use does not; and why after demand: a pending job's want is specific (this
dataset, soon), a count is a rate.

A stale snapshot (``Demand.stale``) carries no demand: its pending jobs may have started,
ended or gone, so it promises uses that will not come, and the reasons say "demand
unknown". Its counts are still used: they are history (job starts that happened), not a
claim about the queue, decayed to now like fresh ones; a stale snapshot misses only the
starts since it was written, which is little against a 7-day half-life.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dsstage.config.model import HIGH_WATERMARK, LOW_WATERMARK
from dsstage.units import human_duration

#: weight of a pending job by where the backfill plan put it
HERE, UNPLANNED, ELSEWHERE = 1.0, 0.5, 0.1
#: weight of a job running on another node (the dataset is in use in the cluster)
RUNNING_ELSEWHERE = 0.2
#: seconds over which a pending job's weight halves as its expected start recedes
SOON = 3600.0
#: seconds over which a dataset's count of job starts halves (the demand poller counts them)
HALF_LIFE = 7 * 86400.0


@dataclass(frozen=True)
class Copy:
    """One version of a dataset in one tier of this node."""

    dataset: str
    version: str  # the first 16 hex digits of the manifest digest
    bytes: int  # all its files' bytes
    last_used: float  # epoch seconds: the last lease taken or released, or when it was staged
    tier: str = ""
    leases: tuple[str, ...] = ()  # job ids (or lease ids) that hold it
    current: bool = True  # the dataset's current version
    ready: bool = True  # False: flagged bad (no job may get it)
    #: bytes it hard-links from older versions of the same dataset on the node, by version
    shared: Mapping[str, int] = field(default_factory=dict)
    #: a sharded dataset's shard: the pending jobs planned on this node whose plan gives this
    #: node other shards (dsstage.node.jobrecord.plan); their demand does not count for this copy
    not_for: frozenset[str] = frozenset()

    @property
    def key(self) -> tuple[str, str]:
        return (self.dataset, self.version)


@dataclass(frozen=True)
class Want:
    """A job's need of a dataset, from the demand snapshot."""

    job_id: str
    state: str  # "pending" | "running"
    partition: str = ""
    priority: int = 0
    start: float | None = None  # expected start (pending), epoch seconds; None: unknown
    nodes: tuple[str, ...] = ()  # running: its nodes; pending: the backfill plan's, () unknown
    user: str = ""


@dataclass(frozen=True)
class Demand:
    """What the queue wants, by dataset; ``stale``: the snapshot is too old to act on
    (``age`` says how old), and its demand counts for nothing."""

    wants: Mapping[str, Sequence[Want]] = field(default_factory=dict)
    stale: bool = False
    age: float = 0.0
    #: dataset -> job starts seen in the cluster, decayed count as of now (valid when stale too)
    uses: Mapping[str, float] = field(default_factory=dict)
    #: dataset -> version -> the nodes whose reports show it ready, as the poller last read
    #: them; empty: not known (or peers off: another node's copy spares the source nothing)
    copies: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Space:
    """A tier: capacity in bytes, watermarks as fractions, bytes reserved beside the copies
    (stages in progress, the trash), and bytes a stage about to start needs."""

    capacity: int
    high: float = HIGH_WATERMARK
    low: float = LOW_WATERMARK
    reserved: int = 0
    need: int = 0

    @property
    def limit(self) -> float:
        """The usage above which the plan evicts: the capacity for a stage (it takes the
        headroom above the high watermark and evicts only to fit), the high watermark
        otherwise (the Epilog gives the headroom back)."""
        return float(self.capacity) if self.need else self.high * self.capacity

    def over(self, usage: int) -> bool:
        """Whether ``usage`` (copies and reservations, without ``need``) plus ``need`` is above
        ``limit``: the plan may have something to evict for space."""
        return usage + self.need > self.limit


@dataclass(frozen=True)
class Policy:
    min_keep: float = 600.0  # seconds: a copy used this recently is not evicted for space
    max_idle: float = 0.0  # seconds: evict an unwanted copy unused this long (0: never)


@dataclass(frozen=True)
class Asked:
    """What the caller asks of one plan. ``protect``: datasets whose copies stay whatever the
    pressure (the one a stage is about to stage again reuses their files). ``evict``:
    datasets an admin asked to evict (``dsstage evict NAME``): their unleased copies go, but
    not one the queue wants unless ``force``."""

    protect: tuple[str, ...] = ()
    evict: tuple[str, ...] = ()
    force: bool = False


@dataclass(frozen=True)
class Decision:
    copy: Copy
    evict: bool
    reason: str
    rule: str = ""  # the reason as a short key, for metrics: forced, bad, old_version, idle, pressure, make_room

    @property
    def action(self) -> str:
        return "evict" if self.evict else "keep"


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...]
    usage_before: int
    usage_after: int  # copies + reserved + need, once the evictions are done
    space: Space
    fits: bool  # usage_after is within the capacity (for a stage: its bytes fit)

    def evictions(self) -> list[Decision]:
        return [d for d in self.decisions if d.evict]

    def holding(self) -> str:
        """What holds the tier's space (for the message of a stage that does not fit)."""
        kept = sorted((d for d in self.decisions if not d.evict), key=lambda d: -d.copy.bytes)
        parts = [f"{d.copy.dataset} {d.copy.version} ({_size(d.copy.bytes)}: {d.reason})" for d in kept[:4]]
        if len(kept) > 4:
            parts.append(f"{len(kept) - 4} more")
        if self.space.reserved:
            parts.append(f"{_size(self.space.reserved)} reserved by stages in progress and the trash")
        return "; ".join(parts) or "nothing"


# -- the planner ------------------------------------------------------------------------

def plan(copies: Sequence[Copy], demand: Demand, space: Space, now: float, *, policy: Policy = Policy(),
         node: str = "", asked: Asked = Asked()) -> Plan:
    """Keep or evict each of ``copies`` (one tier of node ``node``), with reasons, doing what
    the caller ``asked`` (Asked: datasets protected, or asked to evict)."""
    protected = set(asked.protect)
    force = asked.force
    to_evict = set(asked.evict)
    ready_current = {c.dataset for c in copies if c.current and c.ready}
    decided: dict[tuple[str, str], Decision] = {}
    candidates: list[Copy] = []
    for c in copies:
        d = _rule(c, demand, now, policy, node, ready_current, protected)
        if c.dataset in to_evict and (d is None or not d.evict) and not c.leases:
            wanted = _demand_text(c.dataset, demand, node, now, c.not_for)
            if wanted and not force:
                d = Decision(c, False, f"{wanted}: not evicted without --force")
            else:
                kept = keeper(c, demand, node)
                d = Decision(c, True, "asked to evict" + (f" (with --force, although {wanted})" if wanted else "")
                             + (f"; it was {kept}" if kept else ""), "forced" if wanted else "asked")
        if d is not None:
            decided[c.key] = d
        else:
            candidates.append(c)

    remaining = {c.key: c for c in copies if not (c.key in decided and decided[c.key].evict)}
    before = used(copies) + space.reserved + space.need
    total = used(remaining.values()) + space.reserved + space.need
    pressured: list[Copy] = []
    recent = {c.key for c in candidates if c.current and now - c.last_used < policy.min_keep}
    if total > space.limit:
        order = sorted(candidates, key=lambda c: eviction_key(c, demand, node, now))
        hot = {c.key for c in candidates if c.current and demand_score(c.dataset, demand, node, now, c.not_for) > 0}
        fits_room = [c for c in order if c.key not in recent]
        if space.need:
            # min_keep must not fail a stage: a recent copy no job may still use here goes, last of all
            fits_room += [c for c in order if c.key in recent and not wanted_here(c.dataset, demand, node, c.not_for)]
            # and the cluster's copies after all others, recent ones included: a copy another node
            # holds is staged again from it, the one the cluster keeps from the source
            fits_room.sort(key=lambda c: keeper_rank(c, demand, node))
        pressured = _shortest_prefix(fits_room, remaining, space, hot)
    # a recent copy evicted although the stage fits without the recent copies went for the keeper rule
    fits_without_recent = False
    if any(c.key in recent for c in pressured):
        older = {c.key for c in candidates if c.key not in recent}
        fits_without_recent = used(c for k, c in remaining.items() if k not in older) + space.reserved \
            + space.need <= space.capacity
    for c in candidates:
        if c in pressured:
            why = _pressure_reason(c, demand, node, space, now)
            if c.key in recent:
                why += (f" (within min_keep {human_duration(policy.min_keep)}, but other nodes hold it: it goes "
                        "before the copy the cluster keeps)" if fits_without_recent else
                        f" (within min_keep {human_duration(policy.min_keep)}, but the stage cannot fit otherwise)")
            decided[c.key] = Decision(c, True, why, "make_room" if space.need else "pressure")
        else:
            decided[c.key] = Decision(c, False, _keep_reason(c, demand, node, now, policy))
    for c in pressured:
        remaining.pop(c.key, None)
    after = used(remaining.values()) + space.reserved + space.need
    return Plan(tuple(decided[c.key] for c in copies), before, after, space, after <= space.capacity)


def _rule(c: Copy, demand: Demand, now: float, policy: Policy, node: str, ready_current: set[str],
          protected: set[str]) -> Decision | None:
    """The decision the rules make without looking at space; None: it depends on space."""
    if c.leases:
        return Decision(c, False, leased(c.leases))
    if c.dataset in protected:
        return Decision(c, False, "its files are reused by the stage in progress")
    if not c.ready:
        return Decision(c, True, "flagged bad, no lease: no job can get it", "bad")
    if not c.current and c.dataset in ready_current:
        return Decision(c, True, "old version (the current one is ready here), no lease", "old_version")
    idle = now - c.last_used
    if policy.max_idle and not demand.stale and idle >= policy.max_idle and not demand.wants.get(c.dataset):
        return Decision(c, True, f"idle {human_duration(idle)}, no demand", "idle")
    return None


def leased(holders: Sequence[str]) -> str:
    return f"leased by job{'s' if len(holders) > 1 else ''} {', '.join(holders)}"


def used(copies: Iterable[Copy]) -> int:
    """Bytes ``copies`` take together, as space.copies_usage counts the marks: a copy's
    ``shared`` bytes are not counted while the version it links them from is there."""
    copies = list(copies)
    present = {c.key for c in copies}
    return sum(c.bytes - sum(b for v, b in c.shared.items() if (c.dataset, v) in present) for c in copies)


def _shortest_prefix(order: list[Copy], remaining: dict[tuple[str, str], Copy], space: Space,
                     wanted: set[tuple[str, str]]) -> list[Copy]:
    """The copies to evict, from the front of ``order``.

    Without a stage: the unwanted copies until usage is below the low watermark; a copy
    the queue wants goes only if that is needed to get below the high watermark (else the
    capacity); if nothing gets there, every candidate goes. For a stage (``space.need``):
    the fewest copies that make it fit within the capacity, else none: the Epilog brings
    the tier down to the low watermark, a job waiting for its data need not."""
    rest = dict(remaining)
    totals = []
    for c in order:
        rest.pop(c.key, None)
        totals.append(used(rest.values()) + space.reserved + space.need)

    def first_within(limit: float, upto: int) -> int | None:
        return next((i + 1 for i, t in enumerate(totals[:upto]) if t <= limit), None)

    if space.need:
        n = first_within(space.capacity, len(order))
        return order[:n] if n else []
    free = next((i for i, c in enumerate(order) if c.key in wanted), len(order))  # unwanted ones come first
    n = first_within(space.low * space.capacity, free)
    if n is None and free and totals[free - 1] <= space.high * space.capacity:
        n = free  # the low watermark is out of reach without wanted copies: keep those
    n = n or first_within(space.high * space.capacity, len(order)) or first_within(space.capacity, len(order))
    return order[:n] if n else order


def wants_of(dataset: str, demand: Demand, skip: frozenset[str] = frozenset()) -> list[Want]:
    """The queue's wants of ``dataset`` but those of the jobs in ``skip`` (Copy.not_for)."""
    return [w for w in demand.wants.get(dataset, ()) if w.job_id not in skip]


def demand_score(dataset: str, demand: Demand, node: str, now: float, skip: frozenset[str] = frozenset()) -> float:
    """How much the queue wants ``dataset`` on ``node`` (0 on a stale snapshot); ``skip``:
    jobs whose want does not count (Copy.not_for)."""
    if demand.stale:
        return 0.0
    score = 0.0
    for w in wants_of(dataset, demand, skip):
        if w.state == "running":
            score += 0.0 if node in w.nodes else RUNNING_ELSEWHERE
            continue
        where = UNPLANNED if not w.nodes else HERE if node in w.nodes else ELSEWHERE
        score += where * soonness(w, now)
    return score


def wanted_here(dataset: str, demand: Demand, node: str, skip: frozenset[str] = frozenset()) -> bool:
    """Whether a pending job may still use this node's copy of ``dataset``: one the backfill
    plan put here, or one not planned yet (it may land anywhere). A job running or planned
    on another node reads its own node's copy, not this one. A stale snapshot carries no
    demand (as in ``demand_score``)."""
    if demand.stale:
        return False
    return any(w.state == "pending" and (not w.nodes or node in w.nodes) for w in wants_of(dataset, demand, skip))


def soonness(w: Want, now: float) -> float:
    """1 for a job expected to start now, 1/2 one SOON later, and so on; 1/2 if unknown."""
    if w.start is None:
        return 0.5
    return 1.0 / (1.0 + max(0.0, w.start - now) / SOON)


def eviction_key(c: Copy, demand: Demand, node: str, now: float) -> tuple[int, int, float, float, float, int]:
    """Lowest first: superseded versions, then a copy the cluster does not need kept here
    before the one it keeps (``keeper_rank``), then by demand, then by use frequency, then
    least recently used, then the larger copy."""
    return (1 if c.current else 0, keeper_rank(c, demand, node),
            demand_score(c.dataset, demand, node, now, c.not_for), demand.uses.get(c.dataset, 0.0),
            c.last_used, -c.bytes)


def keeper_rank(c: Copy, demand: Demand, node: str) -> int:
    """0: the cluster does not need ``c`` kept here; 1: this node keeps the version for the
    cluster, which holds it elsewhere too; 2: the last copy in the cluster. A keeper whose
    version other nodes hold goes before a last copy: the others still serve it (seeds 2,
    7 and 8 of the simulator read the source 1.15, 1.05 and 1.03 times each dataset with
    the two ranked alike, 1.00 times apart)."""
    holders = _holders(c, demand, node)
    if not holders or _keeper_of(c.dataset, c.version, holders) != node:
        return 0
    return 2 if len(holders) == 1 else 1


def keeper(c: Copy, demand: Demand, node: str) -> str:
    """Why ``c`` is the copy the cluster keeps of its version, or "": ``Demand.copies`` (known)
    shows it ready on no other node ("the last copy in the cluster"), or this node is the
    one of its holders that ``keeper_of`` picks (one keeper per version: holders that read
    the same snapshot agree on it). "" where the copies are not known, for an old version,
    and on a stale snapshot (which nodes hold what is then as old as its queue)."""
    rank = keeper_rank(c, demand, node)
    if not rank:
        return ""
    return "the last copy in the cluster" if rank == 2 else \
        f"the copy the cluster keeps (on this node, 1 of its {len(_holders(c, demand, node))} holders)"


def _holders(c: Copy, demand: Demand, node: str) -> frozenset[str]:
    """The nodes that hold ``c``'s version, this one included; empty where that is not known
    (no copies in the snapshot, or a stale one) or does not count (an old or bad version)."""
    if not demand.copies or demand.stale or not c.current or not c.ready:
        return frozenset()
    return demand.copies.get(c.dataset, {}).get(c.version, frozenset()) | {node}


def keeper_of(dataset: str, version: str, holders: Iterable[str]) -> str:
    """The holder that keeps ``version`` of ``dataset`` for the cluster: rendezvous (highest
    random weight) hashing, the holder whose BLAKE2b of dataset, version and name is highest
    (CRC-32, linear, gave some nodes three times others' share).
    Every node computes the same pick from the same holders; the picks spread evenly over
    the nodes; a holder that comes or goes moves only the versions it is or becomes the
    pick of."""
    return _keeper_of(dataset, version, frozenset(holders))


@functools.lru_cache(maxsize=4096)
def _keeper_of(dataset: str, version: str, holders: frozenset[str]) -> str:
    """keeper_of, once per version and holders: a plan asks it several times per copy."""
    prefix = f"{dataset}\0{version}\0".encode()
    return max(sorted(holders), key=lambda h: hashlib.blake2b(prefix + h.encode(), digest_size=8).digest())


# -- reasons -------------------------------------------------------------------------

def _pressure_reason(c: Copy, demand: Demand, node: str, space: Space, now: float) -> str:
    why = (f"over high watermark ({space.high:.0%} of {_size(space.capacity)})" if space.need == 0 else
           f"room for the stage in progress ({_size(space.need)} in a tier of {_size(space.capacity)})")
    what = "old version" if not c.current else _demand_text(c.dataset, demand, node, now, c.not_for) or "no demand"
    kept = keeper(c, demand, node)
    others = len(_holders(c, demand, node)) - 1
    last = f"; {kept}" if kept else f"; held on {others} other node{'s' if others > 1 else ''}" if others > 0 else ""
    return (f"{why}; {what}{_uses_text(c.dataset, demand)}{last}, "
            f"idle {human_duration(now - c.last_used)}")


def _keep_reason(c: Copy, demand: Demand, node: str, now: float, policy: Policy) -> str:
    if not c.current:
        return "old version, kept while there is room: staging the current one reuses its files"
    wanted = _demand_text(c.dataset, demand, node, now, c.not_for)
    kept = keeper(c, demand, node)
    if wanted:
        return wanted + (f"; {kept}" if kept else "")
    idle = now - c.last_used
    if kept:
        return f"{kept}{_uses_text(c.dataset, demand)}, idle {human_duration(idle)}"
    if idle < policy.min_keep:
        return f"used {human_duration(idle)} ago (min_keep {human_duration(policy.min_keep)})"
    uses = _uses_text(c.dataset, demand)
    if demand.stale:
        snapshot = "no snapshot" if demand.age == float("inf") else f"snapshot {human_duration(demand.age)} old"
        return f"demand unknown ({snapshot}){uses}, idle {human_duration(idle)}: kept while there is room"
    return f"no demand{uses}, idle {human_duration(idle)}: kept while there is room"


def _uses_text(dataset: str, demand: Demand) -> str:
    """"; used by 12 jobs in the cluster (...)", or "" if no count is known at all."""
    if not demand.uses:
        return ""  # no poller history (an older snapshot, or none): say nothing rather than "0"
    n = demand.uses.get(dataset, 0.0)
    r = round(n)  # a job counted a minute ago has decayed to 0.9999: "1 job", not "<1 job"
    count = "no job" if n < 0.05 else "<1 job" if r < 1 else f"{r} job" + ("s" if r != 1 else "")
    return f"; used by {count} in the cluster (decayed count, half-life {human_duration(HALF_LIFE)})"


def _demand_text(dataset: str, demand: Demand, node: str, now: float, skip: frozenset[str] = frozenset()) -> str:
    if demand.stale:
        return ""
    wants = wants_of(dataset, demand, skip)
    pending = [w for w in wants if w.state == "pending"]
    if pending:
        best = min(pending, key=lambda w: (0 if node in w.nodes else 1, w.start if w.start is not None else 1e300))
        parts = [f"partition {best.partition}"] if best.partition else []
        if best.start is not None:
            parts.append(f"expected in {human_duration(max(0.0, best.start - now))}")
        parts.append("planned on this node" if node in best.nodes else
                     "planned elsewhere" if best.nodes else "not placed yet")
        more = f" and {len(pending) - 1} more" if len(pending) > 1 else ""
        return f"wanted by pending job {best.job_id}{more} ({', '.join(parts)})"
    running = [w for w in wants if w.state == "running" and node not in w.nodes]  # here: its lease says it
    if running:
        return f"in use by running job {running[0].job_id}" + (f" and {len(running) - 1} more" if len(running) > 1
                                                                else "") + " on other nodes"
    return ""


def _size(n: int) -> str:
    from dsstage.units import human
    return human(n)
