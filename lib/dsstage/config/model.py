"""The configuration's model: frozen dataclasses for the tiers, datasets, sources and each
section, with their defaults. Loading and validation are in dsstage.config.load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from dsstage.fs.runfiles import CONFIG_PATH

DEFAULT_PATH = CONFIG_PATH
DEFAULT_SLURM_BIN = "/usr/bin"
DEFAULT_PROLOG_BUDGET = 300.0
#: the most shards a dataset may be split into (each is a copy, a ready mark and a lease entry on a node)
MAX_SHARDS = 65536
VERIFY_MODES = ("quick", "full")
FAILURE_POLICIES = ("fallback", "hold")
#: how a job starts on a dataset not yet on its node: after the stage (within prolog_budget), or
#: at once on a live view whose files switch to the local copy as they land (dsstage.node.live)
START_MODES = ("wait", "at-once")
#: seconds an ``at-once`` dataset's stage may take in the Prolog before the job gets a live view
DEFAULT_START_BUDGET = 1.0


@dataclass(frozen=True)
class Source:
    """Where a dataset comes from: a mounted path, ``host:/path`` (ssh) or ``rsync://``."""

    raw: str
    kind: str  # "local" | "ssh" | "daemon"
    path: str  # the path part (for local: the whole path)

    def rsync_base(self) -> str:
        """The source as rsync wants it: the directory itself, with a trailing slash."""
        return self.raw.rstrip("/") + "/"


#: a tier's watermarks unless the configuration says otherwise. A stage may fill the tier to
#: its capacity; an Epilog that finds it above the high watermark brings it back to the low
#: one. 99 %/97 % stage fewer bytes again than 95 %/90 % on every trace simulated, and more
#: Prologs evict (and delete) before they stage, fewer than with LRU (docs/simulation.md,
#: "The watermarks" and section h)
HIGH_WATERMARK, LOW_WATERMARK = 0.99, 0.97


@dataclass(frozen=True)
class Tier:
    name: str
    path: str  # may contain {node}
    capacity: int | float  # bytes, or a fraction (<= 1.0) of the filesystem
    high_watermark: float
    low_watermark: float
    #: the tier is meant to be on the root filesystem (a test cluster, a RAM disk under /dev/shm
    #: is not: it is a filesystem of its own); otherwise a tier found there is refused, as the
    #: sign of a disk that is not mounted (dsstage.fs.safe.root_filesystem_problem)
    root_filesystem: bool = False

    def root(self, node: str) -> str:
        return self.path.replace("{node}", node)


@dataclass(frozen=True)
class Dataset:
    name: str
    source: Source
    tier: str
    groups: tuple[str, ...] | None  # None: everyone
    verify: str
    on_failure: str
    description: str = ""
    shards: int | None = None  # split into this many shards over a job's nodes (dsstage.shards); None: whole
    #: "at-once": a job that would wait for the stage starts on a live view (only a mounted,
    #: whole dataset's: the loader leaves the others "wait")
    start: str = "wait"


@dataclass(frozen=True)
class Transfer:
    streams: int = 4
    rsh: str = "ssh -o BatchMode=yes"
    timeout: float = 86400.0
    hash_threads: int = 0  # 0: one per CPU
    bwlimit: int = 0  # KiB/s per rsync stream; 0: no limit
    #: the most requests (files being read, directories listed) in flight at once against a
    #: mounted source; fewer while more are not faster (dsstage.parallel)
    max_parallel: int = 64


@dataclass(frozen=True)
class Retention:
    """How long copies stay, and how fresh the queue's demand must be to act on it."""

    min_keep: float = 600.0  # seconds: a copy used this recently is not evicted for space
    max_idle: float = 0.0  # seconds: evict a copy unused this long that no job wants (0: never)
    demand_max_age: float = 300.0  # seconds: an older demand snapshot is stale
    poll_interval: float = 30.0  # seconds between two demand snapshots (dsstage demand-poller)
    manifest_keep: float = 7 * 86400.0  # seconds an old manifest version is kept when no node holds it


@dataclass(frozen=True)
class Report:
    """Node reports: what each node publishes for `dsstage status` (see dsstage.report)."""

    user: str | None = None  # who writes <state_dir>/nodes (NFS root_squash); None: root
    interval: float = 5.0  # seconds: at most one report write per interval while staging
    max_age: float = 900.0  # seconds: status shows an older report as stale


@dataclass(frozen=True)
class Fleet:
    """How an admin node reaches compute nodes over SSH (dsstage.fleet)."""

    user: str = "root"
    port: int = 22
    key: str | None = None  # private key file; None: the SSH agent and ~/.ssh keys
    known_hosts: str | None = None  # extra known_hosts file (system and ~/.ssh ones are read too)
    connect_timeout: float = 10.0  # seconds to connect and authenticate
    timeout: float = 6 * 3600.0  # seconds one remote command may run
    parallel: int = 32  # nodes talked to at once
    command: tuple[str, ...] = ("dsstage",)  # the remote dsstage, argv (never a shell string)


@dataclass(frozen=True)
class Metrics:
    textfile: str | None = None  # node_exporter textfile collector file; None: no metrics
    controller_textfile: str | None = None  # the demand poller's (the controller's) file; None: none


@dataclass(frozen=True)
class Prefetch:
    """Pre-staging for pending jobs on the nodes the scheduler planned (dsstage.prefetch)."""

    horizon: float = 1800.0  # seconds: stage for jobs expected to start within this
    interval: float = 30.0  # seconds between two rounds of `dsstage prefetch`
    bwlimit: int = 0  # bytes/s for one prefetch, all streams together; 0: no limit
    io_class: str = "idle"  # ionice class of the prefetch's copy: idle | best-effort


@dataclass(frozen=True)
class Peers:
    """Fan-out between the nodes of one job (dsstage.transfer.peers): each node reads a share of a
    dataset from the source and the rest from the other nodes' rsync daemons; and from any
    node whose report shows the version ready, whatever job staged it there."""

    enabled: bool = False  # sites that forbid node-to-node traffic leave it off
    port: int = 873  # where every node's `dsstage peers serve` listens: below 1024, so no user can take it
    hosts: Mapping[str, str] = field(default_factory=dict)  # node -> host or host:port, where not the node name
    secret_file: str = "/etc/dsstage/peers.secret"  # root-only, the same on every node
    wait: float = 120.0  # seconds a peer may add nothing before its share comes from the source
    timeout: float = 60.0  # seconds a peer's transfer may stall (rsync --timeout)
    parallel: int = 8  # peers fetched from at once
    #: who may connect to a node's daemon (addresses, address/prefix, host names); empty: the
    #: nodes' own addresses (peers.hosts, else Slurm's NodeAddr), asked when the daemon starts
    allow: tuple[str, ...] = ()
    max_connections: int = 64  # connections one daemon serves at once; more are told to try later


@dataclass(frozen=True)
class Rollout:
    """Where dsstage acts, for a pilot: jobs in these partitions, on these nodes (None: all).
    Elsewhere, and while the cluster-wide switch (``dsstage disable``) is on, a job that asked
    for a dataset runs against its source with a message."""

    partitions: tuple[str, ...] | None = None
    nodes: str | None = None  # a Slurm hostlist
    #: what job_submit.lua does with a ``--dataset`` job outside ``partitions``: ``source``
    #: (accept it as if dsstage were not installed: no preference, no record; it reads the
    #: source) or ``refuse`` (refuse it at submit, naming the pilot partitions)
    outside: str = "source"


@dataclass(frozen=True)
class Placement:
    """Data-aware placement: node features for ready datasets, and --prefer at submit."""

    features: bool = True  # the demand poller keeps a feature per ready dataset on each node
    prefer: bool = True  # job_submit.lua adds --prefer for the requested datasets' features
    prefix: str = "ds_"  # feature name = prefix + dataset name
    #: seconds a pending job may wait for the nodes that hold its data (the demand poller
    #: excludes the others meanwhile, dsstage.policy.datawait); 0: never, --prefer alone (off
    #: until an admin turns it on: it changes where jobs start)
    wait_for_data: float = 0.0


@dataclass(frozen=True)
class BurstBuffer:
    """``#BB_LUA dataset=`` requests (dsstage.bbrequest, sbatch_ext/burst_buffer.lua)."""

    user: str | None = None  # who runs burst_buffer.lua (Slurm's SlurmUser) and writes <state_dir>/bb
    #: where `scontrol show bbstat` answers wait for burst_buffer.lua, on the controller's own disk
    #: (dsstage.cluster.bbstat): computed in the background, read in slurmctld's time
    status_dir: str = "/run/dsstage/bbstat"
    status_max_age: float = 10.0  # seconds an answer is given as current before it is computed again


@dataclass(frozen=True)
class SourceBudget:
    """A shared filesystem or server many datasets come from, and the requests in flight it
    takes from all nodes at once (``sources.<name>``): every stage from it holds slots of that
    budget, the cluster's (dsstage.node.budget)."""

    name: str
    prefix: str  # the datasets whose source begins with it: /lustre/, host:/export/, rsync://host/
    max_in_flight: int


@dataclass(frozen=True)
class Config:
    origin: str
    state_dir: str
    tiers: Mapping[str, Tier]
    datasets: Mapping[str, Dataset]
    on_failure: str = "fallback"
    lock_timeout: float = 6 * 3600.0
    transfer: Transfer = field(default_factory=Transfer)
    slurm_bin: str = DEFAULT_SLURM_BIN  # where scontrol and squeue are: hooks run with no search path
    prolog_budget: float = DEFAULT_PROLOG_BUDGET  # seconds the Prolog may spend before it decides
    start_budget: float = DEFAULT_START_BUDGET  # seconds an at-once dataset's stage may take in the Prolog
    source_user: str | None = None  # who reads mounted sources; None: root
    retention: Retention = field(default_factory=Retention)
    report: Report = field(default_factory=Report)
    fleet: Fleet = field(default_factory=Fleet)
    metrics: Metrics = field(default_factory=Metrics)
    prefetch: Prefetch = field(default_factory=Prefetch)
    placement: Placement = field(default_factory=Placement)
    burst_buffer: BurstBuffer = field(default_factory=BurstBuffer)
    peers: Peers = field(default_factory=Peers)
    sources: Mapping[str, SourceBudget] = field(default_factory=dict)
    rollout: Rollout = field(default_factory=Rollout)
    #: keys of the file this version does not know and ignores (a newer dsstage's, during an upgrade)
    unknown_keys: tuple[str, ...] = ()

    def budget_of(self, source: Source) -> SourceBudget | None:
        """The ``sources`` entry a dataset's source falls under (the longest prefix), if any."""
        fits = [b for b in self.sources.values() if source.raw.startswith(b.prefix)]
        return max(fits, key=lambda b: len(b.prefix)) if fits else None

    def slurm_command(self, name: str) -> str:
        """The full path of a Slurm client command (``scontrol``, ``squeue``)."""
        return os.path.join(self.slurm_bin, name)

    def manifest_dir(self, name: str) -> str:
        return os.path.join(self.state_dir, "manifests", name)
