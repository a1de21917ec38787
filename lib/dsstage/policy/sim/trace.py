"""Job traces for the simulator: a generated one, or a Standard Workload Format log.

A trace is a list of jobs, each with the dataset it reads, and the sizes of those
datasets. Both sources draw datasets by a seeded rule, so a run is repeatable; the rule
applied is written into ``Trace.rules`` for the report.
"""

from __future__ import annotations

import bisect
import gzip
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from dsstage.errors import DsstageError


class TraceError(DsstageError):
    """A trace file cannot be read, or the options do not describe a trace."""

    exit_code = 65  # EX_DATAERR


@dataclass(frozen=True)
class Job:
    id: str
    submit: float  # seconds
    runtime: float  # seconds it really runs
    limit: float  # seconds it asked for (the scheduler plans with this)
    slots: int  # processors (SWF) or whole nodes x slots per node (generated)
    user: str
    dataset: str


@dataclass(frozen=True)
class SizeModel:
    """Dataset sizes: lognormal with this median and sigma, redrawn until within [low, high]."""

    median: int = 300 * 10**9
    sigma: float = 1.0
    low: int = 50 * 10**9
    high: int = 4 * 10**12

    def describe(self) -> str:
        return (f"sizes lognormal (median {_tb(self.median)}, sigma {self.sigma:g}) truncated to "
                f"[{_tb(self.low)}, {_tb(self.high)}] by redrawing, rounded to GB")


@dataclass
class Trace:
    jobs: list[Job]
    sizes: dict[str, int]  # dataset -> bytes (every dataset of the catalogue)
    nodes: int  # nodes of the simulated cluster
    slots_per_node: int
    source: str  # "generated" | "swf"
    rules: list[str] = field(default_factory=list)  # what was generated or assigned, for the report
    skipped: dict[str, int] = field(default_factory=dict)  # why jobs of the file were left out

    def working_set(self) -> int:
        """Bytes of the datasets the jobs use (each counted once)."""
        return sum(self.sizes[d] for d in {j.dataset for j in self.jobs})


@dataclass(frozen=True)
class Draws:
    """What a trace draws its datasets from: a catalogue of ``datasets`` names (``ds00`` the
    most popular, Zipf ``zipf_s``) of sizes drawn by ``sizes``, every draw seeded by ``seed``."""

    datasets: int = 40
    zipf_s: float = 1.0
    seed: int = 1
    sizes: SizeModel = SizeModel()


def dataset_names(count: int) -> list[str]:
    """``ds00`` ... by popularity rank (``ds00`` the most popular)."""
    width = max(2, len(str(count - 1)))
    return [f"ds{i:0{width}d}" for i in range(count)]


def dataset_sizes(count: int, seed: int, model: SizeModel = SizeModel()) -> dict[str, int]:
    """The size of each dataset, from its own random stream (independent of the jobs)."""
    if not model.low <= model.median <= model.high:
        raise TraceError(f"size median {_tb(model.median)} is outside [{_tb(model.low)}, {_tb(model.high)}]")
    rng = random.Random(f"dsstage-sim:{seed}:sizes")
    mu = math.log(model.median)
    sizes = {}
    for name in dataset_names(count):
        while True:
            b = rng.lognormvariate(mu, model.sigma)
            if model.low <= b <= model.high:
                break
        sizes[name] = max(1, round(b / 1e9)) * 10**9
    return sizes


class Zipf:
    """Draws ranks 0..n-1 with probability proportional to 1 / (rank + 1) ** s."""

    def __init__(self, n: int, s: float):
        if n < 1:
            raise TraceError("the catalogue needs at least one dataset")
        weights = [1.0 / (i + 1) ** s for i in range(n)]
        total = sum(weights)
        acc = 0.0
        self.cumulative = []
        for w in weights:
            acc += w / total
            self.cumulative.append(acc)

    def draw(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self.cumulative, rng.random()), len(self.cumulative) - 1)


# -- the generated trace ---------------------------------------------------------------

#: node counts of generated jobs and their probabilities
NODE_COUNTS = ((1, 0.70), (2, 0.15), (4, 0.10), (8, 0.05))


def generate(*, jobs: int = 3000, nodes: int = 16, draws: Draws = Draws(), load: float = 0.9,
             runtime_median: float = 7200.0, runtime_sigma: float = 1.0) -> Trace:
    """A seeded synthetic trace of whole-node jobs (one slot per node).

    Each job reads one dataset drawn independently from a Zipf distribution; it asks for
    1, 2, 4 or 8 nodes (70/15/10/5 %, capped at the cluster); its run time is lognormal,
    its time limit the run time times U(1.2, 3) rounded up to 15 min; arrivals are Poisson
    at the rate that offers ``load`` of the cluster's node-seconds."""
    if jobs < 1 or nodes < 1:
        raise TraceError("a generated trace needs at least one job and one node")
    if not 0 < load:
        raise TraceError("--load must be positive")
    datasets, zipf_s, seed, sizes = draws.datasets, draws.zipf_s, draws.seed, draws.sizes
    rng = random.Random(f"dsstage-sim:{seed}:jobs")
    names = dataset_names(datasets)
    zipf = Zipf(datasets, zipf_s)
    counts = [min(n, nodes) for n, _ in NODE_COUNTS]
    cum = list(_accumulate(p for _, p in NODE_COUNTS))
    lo, hi = 600.0, 48 * 3600.0
    drawn = []
    for _ in range(jobs):
        k = counts[min(bisect.bisect_left(cum, rng.random()), len(counts) - 1)]
        while True:
            run = rng.lognormvariate(math.log(runtime_median), runtime_sigma)
            if lo <= run <= hi:
                break
        run = float(round(run))
        limit = math.ceil(run * rng.uniform(1.2, 3.0) / 900.0) * 900.0
        drawn.append((k, run, limit, zipf.draw(rng)))
    node_seconds = sum(k * run for k, run, _, _ in drawn) / jobs
    rate = load * nodes / node_seconds  # jobs per second
    t = 0.0
    out = []
    for i, (k, run, limit, rank) in enumerate(drawn):
        t += rng.expovariate(rate)
        out.append(Job(id=str(i + 1), submit=round(t, 3), runtime=run, limit=limit, slots=k, user=f"u{rank}",
                       dataset=names[rank]))
    used = len({j.dataset for j in out})
    rules = [
        f"generated, seed {seed}: {jobs} jobs on {nodes} whole nodes, offered load {load:g}",
        f"datasets: {datasets} (ds00 most popular), each job draws one independently, Zipf s={zipf_s:g}; "
        f"{used} used; " + sizes.describe(),
        "nodes per job 1/2/4/8 with probability 70/15/10/5 %; run time lognormal (median "
        f"{runtime_median / 3600:g} h, sigma {runtime_sigma:g}) in [10 min, 48 h]; time limit = run time x "
        "U(1.2, 3) rounded up to 15 min; Poisson arrivals",
    ]
    return Trace(out, dataset_sizes(datasets, seed, sizes), nodes, 1, "generated", rules)


def _accumulate(values: Iterable[float]) -> Iterator[float]:
    acc = 0.0
    for v in values:
        acc += v
        yield acc


# -- Standard Workload Format ----------------------------------------------------------

@dataclass(frozen=True)
class SwfRecord:
    """The fields of one SWF line that the simulator uses (-1: unknown)."""

    job: int
    submit: float
    wait: float
    runtime: float
    allocated: int
    requested: int
    limit: float
    status: int
    user: int


def parse_swf(lines: Iterable[str]) -> tuple[dict[str, str], Iterator[SwfRecord]]:
    """The header (``; Key: value`` lines) and an iterator over the job records.

    The header is read eagerly up to the first record; the records lazily."""
    it = iter(lines)
    header: dict[str, str] = {}
    first: str | None = None
    for line in it:
        s = line.strip()
        if not s:
            continue
        if s.startswith(";"):
            key, sep, value = s[1:].partition(":")
            if sep and key.strip() and " " not in key.strip():
                header.setdefault(key.strip(), value.strip())
            continue
        first = s
        break

    def records() -> Iterator[SwfRecord]:
        if first is not None:
            yield _record(first, 0)
        for n, line in enumerate(it, 1):
            s = line.strip()
            if s and not s.startswith(";"):
                yield _record(s, n)
    return header, records()


def _record(line: str, n: int) -> SwfRecord:
    f = line.split()
    if len(f) < 12:
        raise TraceError(f"SWF record {n + 1} has {len(f)} fields, not 18: {line[:80]!r}")
    try:
        return SwfRecord(job=int(f[0]), submit=float(f[1]), wait=float(f[2]), runtime=float(f[3]),
                         allocated=int(float(f[4])), requested=int(float(f[7])), limit=float(f[8]),
                         status=int(f[10]), user=int(f[11]))
    except ValueError:
        raise TraceError(f"SWF record {n + 1} is not numeric: {line[:80]!r}") from None


def assign_datasets(records: Iterable[SwfRecord], *, names: Sequence[str], zipf_s: float, seed: int,
                    other: float) -> Iterator[tuple[SwfRecord, str]]:
    """Pair each record with a dataset, by a rule that depends only on the seed, the user and
    the job number (so a window of the log gets the datasets the whole log would):

    each user has a home dataset, drawn from Zipf(s) over ``names`` with a stream seeded by
    (seed, user); each job reads its user's home dataset, except with probability ``other``
    a dataset drawn from the same Zipf with a stream seeded by (seed, job number)."""
    zipf = Zipf(len(names), zipf_s)
    home: dict[int, str] = {}
    for r in records:
        if r.user not in home:
            home[r.user] = names[zipf.draw(random.Random(f"dsstage-sim:{seed}:user:{r.user}"))]
        rng = random.Random(f"dsstage-sim:{seed}:job:{r.job}")
        yield r, (names[zipf.draw(rng)] if rng.random() < other else home[r.user])


def read_swf(path: str, *, nodes: int | None = None, cores_per_node: int = 2, draws: Draws = Draws(),
             other: float = 0.1, start: int = 0, limit: int | None = None) -> Trace:
    """Jobs from an SWF log (gzip if the name ends in .gz), with datasets assigned from
    ``draws`` (a job reads its user's home dataset, or with probability ``other`` another).

    ``start``: skip that many job records (in file order, before any filter); ``limit``:
    replay at most that many of the jobs kept after it. Left out: cancelled jobs (status 5),
    jobs that did not run (run time <= 0), without a processor count, or larger than the
    cluster. A job takes its processors as slots: up to ``cores_per_node`` on one node
    (shared with other small jobs), more as whole nodes."""
    if cores_per_node < 1:
        raise TraceError("--cores-per-node must be at least 1")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="ascii", errors="replace") as fh:
            return _read_swf(fh, path, nodes, cores_per_node, draws, other, start, limit)
    except OSError as exc:
        raise TraceError(f"cannot read the trace {path}: {exc.strerror or exc}: give an SWF file "
                         "(.swf or .swf.gz)") from None


def _read_swf(fh: Iterable[str], path: str, nodes: int | None, cpn: int, draws: Draws, other: float, start: int,
              limit: int | None) -> Trace:
    datasets, zipf_s, seed, sizes = draws.datasets, draws.zipf_s, draws.seed, draws.sizes
    header, records = parse_swf(fh)
    procs = _header_int(header, "MaxProcs") or _header_int(header, "MaxNodes")
    if nodes is None:
        if not procs:
            raise TraceError(f"{path} has no MaxProcs in its header: give --nodes")
        nodes = max(1, procs // cpn)
    names = dataset_names(datasets)
    skipped = {"before --start": 0, "cancelled": 0, "no run time": 0, "no processor count": 0,
               "larger than the cluster": 0}
    jobs: list[Job] = []
    window = _skip(records, start, skipped)
    for r, ds in assign_datasets(window, names=names, zipf_s=zipf_s, seed=seed, other=other):
        if limit is not None and len(jobs) >= limit:
            break
        slots = r.allocated if r.allocated > 0 else r.requested
        why = ("cancelled" if r.status == 5 else "no run time" if r.runtime <= 0 else
               "no processor count" if slots <= 0 else
               "larger than the cluster" if (slots > cpn and -(-slots // cpn) > nodes) else "")
        if why:
            skipped[why] += 1
            continue
        lim = r.limit if r.limit > 0 else r.runtime
        jobs.append(Job(id=str(r.job), submit=r.submit, runtime=r.runtime, limit=lim, slots=slots,
                        user=f"u{r.user}", dataset=ds))
    if not jobs:
        raise TraceError(f"{path}: no job left to replay (check --start and --limit)")
    first, last = jobs[0], jobs[-1]
    span = (last.submit - first.submit) / 86400
    rules = [
        f"SWF {path}: jobs {first.id} to {last.id} ({len(jobs)} replayed, submitted over {span:.1f} days); "
        f"header MaxProcs {procs or 'unknown'}",
        f"{nodes} nodes of {cpn} cores: a job of up to {cpn} processors shares one node, a larger one takes "
        f"ceil(processors / {cpn}) whole nodes; processors = allocated, else requested",
        f"datasets: {datasets} (ds00 most popular); each user has a home dataset drawn from Zipf s={zipf_s:g} "
        f"(stream seeded by seed {seed} and the user id); a job reads it, or with probability {other:g} another "
        "Zipf draw (stream seeded by the seed and the job number); " + sizes.describe(),
        "time limit = requested time (run time where unknown); the log's own start times are not used: "
        "the simulated scheduler places the jobs",
        "left out: " + (", ".join(f"{n} {why}" for why, n in skipped.items() if n) or "none"),
    ]
    return Trace(jobs, dataset_sizes(datasets, seed, sizes), nodes, cpn, "swf", rules,
                 {k: v for k, v in skipped.items() if v})


def _skip(records: Iterator[SwfRecord], start: int, skipped: dict[str, int]) -> Iterator[SwfRecord]:
    for i, r in enumerate(records):
        if i < start:
            skipped["before --start"] += 1
            continue
        yield r


def _header_int(header: dict[str, str], key: str) -> int:
    try:
        return int(header.get(key, "").split()[0])
    except (ValueError, IndexError):
        return 0


def _tb(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.0f} GB"
