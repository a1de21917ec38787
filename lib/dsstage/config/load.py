"""Loading and validating the dsstage configuration (tiers and the dataset catalog).

The file is found at ``$DSSTAGE_CONFIG`` or else ``/etc/dsstage/dsstage.yaml``. The
Prolog runs as root and acts on this file, so a file that anyone but root (or, for a
non-root caller, that user) could have written is refused.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from dsstage.config.model import (
    DEFAULT_PATH,
    DEFAULT_PROLOG_BUDGET,
    DEFAULT_SLURM_BIN,
    FAILURE_POLICIES,
    VERIFY_MODES,
    BurstBuffer,
    Config,
    Dataset,
    Fleet,
    Metrics,
    Peers,
    Placement,
    Prefetch,
    Report,
    Retention,
    SourceBudget,
    Tier,
    Transfer,
)
from dsstage.config.names import GROUP_RE, USER_MAX, USER_RE, check_name, control_char
from dsstage.config.source import parse_source
from dsstage.errors import ConfigError
from dsstage.fs.layout import env_var
from dsstage.units import parse_duration, parse_percent, parse_size

_TOP_KEYS = ("state_dir", "tiers", "datasets", "on_failure", "lock_timeout", "transfer", "slurm_bin",
             "prolog_budget", "source_user", "retention", "report", "fleet", "metrics", "prefetch", "placement",
             "burst_buffer", "peers", "sources")
_TIER_KEYS = ("path", "capacity", "high_watermark", "low_watermark", "root_filesystem")
_DATASET_KEYS = ("source", "tier", "groups", "verify", "on_failure", "description")
_TRANSFER_KEYS = ("streams", "rsh", "timeout", "hash_threads", "bwlimit", "max_parallel")
_RETENTION_KEYS = ("min_keep", "max_idle", "demand_max_age", "poll_interval", "manifest_keep")
_REPORT_KEYS = ("user", "interval", "max_age")
_FLEET_KEYS = ("user", "port", "key", "known_hosts", "connect_timeout", "timeout", "parallel", "command")
_METRICS_KEYS = ("textfile",)
_PREFETCH_KEYS = ("horizon", "interval", "bwlimit", "io_class")
_PLACEMENT_KEYS = ("features", "prefer", "prefix")
_BURST_BUFFER_KEYS = ("user", "status_dir", "status_max_age")
_PEERS_KEYS = ("enabled", "port", "hosts", "secret_file", "wait", "timeout", "parallel", "allow",
               "max_connections")
#: how a peer is reached: a host name or address, and optionally a port
PEER_HOST_RE = re.compile(r"[A-Za-z0-9_.-]+(:[0-9]{1,5})?")
#: an address, address/prefix or host name in peers.allow (rsync's "hosts allow")
PEER_ALLOW_RE = re.compile(r"[A-Za-z0-9_.:-]+(/[0-9]{1,3})?")
IO_CLASSES = ("idle", "best-effort")
#: a node feature: what Slurm's constraint syntax takes as one name
FEATURE_PREFIX_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,15}")


def config_path(explicit: str | None = None) -> str:
    """The configuration file to use: explicit, else $DSSTAGE_CONFIG, else the default."""
    return explicit or os.environ.get("DSSTAGE_CONFIG") or DEFAULT_PATH


def load(path: str | None = None, *, check_owner: bool = True) -> Config:
    """Read, check the safety of, and validate the configuration file."""
    path = config_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; copy conf/dsstage.yaml.example there "
                          "or point DSSTAGE_CONFIG at your configuration") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot open: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        if check_owner:
            _check_owner(path, os.fstat(fh.fileno()))
        text = fh.read()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]} "
                          f"{_yaml_where(exc)}") from None
    return from_dict(data, origin=path)


def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f"(line {mark.line + 1}, column {mark.column + 1})" if mark else ""


def _check_owner(path: str, st: os.stat_result) -> None:
    euid = os.geteuid()
    allowed = {0} if euid == 0 else {0, euid}
    if st.st_uid not in allowed:
        raise ConfigError(f"{path}: owned by uid {st.st_uid}; the Prolog runs as root and trusts this file, "
                          f"so it must belong to root: chown root:root {path}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                          f"the Prolog runs as root and trusts this file: chmod go-w {path}")


def from_dict(data: Any, origin: str = "<config>") -> Config:
    """Validate a parsed configuration; every error names the file, the key and the fix."""
    v = _Validator(origin)
    if not isinstance(data, dict):
        v.fail("", "the file must be a YAML mapping with state_dir, tiers and datasets")
    v.keys(data, "", _TOP_KEYS)
    state_dir = v.abs_path(data.get("state_dir"), "state_dir", required=True)
    on_failure = v.choice(data.get("on_failure", "fallback"), "on_failure", FAILURE_POLICIES)
    lock_timeout = v.number(data.get("lock_timeout", 6 * 3600), "lock_timeout", minimum=1)
    transfer = v.transfer(data.get("transfer") or {})
    slurm_bin = v.abs_path(data.get("slurm_bin", DEFAULT_SLURM_BIN), "slurm_bin")
    prolog_budget = v.number(data.get("prolog_budget", DEFAULT_PROLOG_BUDGET), "prolog_budget", minimum=1)
    source_user = v.user(data.get("source_user"), "source_user")
    retention = v.retention({} if data.get("retention") is None else data["retention"])
    report = v.report({} if data.get("report") is None else data["report"])
    fleet = v.fleet({} if data.get("fleet") is None else data["fleet"])
    metrics = v.metrics({} if data.get("metrics") is None else data["metrics"])
    prefetch = v.prefetch({} if data.get("prefetch") is None else data["prefetch"])
    placement = v.placement({} if data.get("placement") is None else data["placement"])
    burst_buffer = v.burst_buffer({} if data.get("burst_buffer") is None else data["burst_buffer"])
    peers = v.peers({} if data.get("peers") is None else data["peers"])
    sources = v.sources({} if data.get("sources") is None else data["sources"])

    raw_tiers = data.get("tiers")
    if not isinstance(raw_tiers, dict) or not raw_tiers:
        v.fail("tiers", "define at least one storage tier, e.g. nvme: {path: /local/nvme/dsstage, capacity: 90%}")
    tiers = {name: v.tier(name, spec) for name, spec in raw_tiers.items()}

    raw_datasets = data.get("datasets") or {}
    if not isinstance(raw_datasets, dict):
        v.fail("datasets", "must be a mapping of dataset name to its description")
    datasets = {name: v.dataset(name, spec, tiers, on_failure) for name, spec in raw_datasets.items()}
    v.distinct_env_vars(datasets)
    return Config(origin=origin, state_dir=state_dir, tiers=tiers, datasets=datasets,
                  on_failure=on_failure, lock_timeout=lock_timeout, transfer=transfer,
                  slurm_bin=slurm_bin, prolog_budget=prolog_budget, source_user=source_user,
                  retention=retention, report=report, fleet=fleet, metrics=metrics, prefetch=prefetch,
                  placement=placement, burst_buffer=burst_buffer, peers=peers, sources=sources)


class _Validator:
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, key: str, message: str) -> None:
        where = f"{self.origin}: {key}: " if key else f"{self.origin}: "
        raise ConfigError(where + message)

    def keys(self, mapping: Mapping[str, Any], prefix: str, allowed: tuple[str, ...]) -> None:
        for key in mapping:
            if key not in allowed:
                hint = difflib.get_close_matches(str(key), allowed, n=1)
                fix = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(allowed)}"
                self.fail(f"{prefix}{key}", f"unknown key; {fix}")

    def text(self, value: Any, key: str) -> str:
        """A string that may go into a file or an environment line: no control characters."""
        if not isinstance(value, str):
            self.fail(key, f"{value!r} is not a string")
        problem = control_char(value)
        if problem:
            self.fail(key, problem)
        return str(value)

    def abs_path(self, value: Any, key: str, required: bool = False) -> str:
        if value is None and required:
            self.fail(key, "missing; give an absolute path")
        if not isinstance(value, str) or not value.startswith("/"):
            self.fail(key, f"{value!r} is not an absolute path")
        return os.path.normpath(self.text(value, key))

    def user(self, value: Any, key: str) -> str | None:
        """A Unix user name, by its shape only (it is looked up where it is used), or None."""
        if value is None:
            return None
        if not isinstance(value, str) or len(value) > USER_MAX or not USER_RE.fullmatch(value):
            self.fail(key, f"{value!r} is not a Unix user name (letters, digits, '_', '.', '@', '-', "
                      "not starting with a digit or '-')")
        return str(value)

    def choice(self, value: Any, key: str, choices: tuple[str, ...]) -> str:
        if value not in choices:
            self.fail(key, f"{value!r} is not one of {', '.join(choices)}")
        return str(value)

    def number(self, value: Any, key: str, minimum: float = 0) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            self.fail(key, f"{value!r} is not a number >= {minimum:g}")
        return float(value)

    def transfer(self, spec: Any) -> Transfer:
        if not isinstance(spec, dict):
            self.fail("transfer", "must be a mapping (" + ", ".join(_TRANSFER_KEYS) + ")")
        self.keys(spec, "transfer.", _TRANSFER_KEYS)
        streams = int(self.number(spec.get("streams", 4), "transfer.streams", minimum=1))
        rsh = spec.get("rsh", Transfer.rsh)
        if not isinstance(rsh, str) or not rsh.strip():
            self.fail("transfer.rsh", "give the remote shell command rsync should use, e.g. 'ssh -o BatchMode=yes'")
        rsh = self.text(rsh, "transfer.rsh")
        timeout = self.number(spec.get("timeout", Transfer.timeout), "transfer.timeout", minimum=1)
        threads = int(self.number(spec.get("hash_threads", 0), "transfer.hash_threads", minimum=0))
        bwlimit = int(self.number(spec.get("bwlimit", 0), "transfer.bwlimit", minimum=0))
        max_parallel = self.number(spec.get("max_parallel", Transfer.max_parallel), "transfer.max_parallel", minimum=1)
        if max_parallel != int(max_parallel) or max_parallel > 1024:
            self.fail("transfer.max_parallel", f"{max_parallel:g} is not a whole number from 1 to 1024")
        return Transfer(streams=streams, rsh=rsh, timeout=timeout, hash_threads=threads, bwlimit=bwlimit,
                        max_parallel=int(max_parallel))

    def retention(self, spec: Any) -> Retention:
        if not isinstance(spec, dict):
            self.fail("retention", "must be a mapping (" + ", ".join(_RETENTION_KEYS) + ")")
        self.keys(spec, "retention.", _RETENTION_KEYS)
        d = Retention()
        values = {k: self.duration(spec.get(k, getattr(d, k)), f"retention.{k}") for k in _RETENTION_KEYS}
        if values["poll_interval"] < 1:
            self.fail("retention.poll_interval", "must be at least 1s")
        if values["demand_max_age"] < 2 * values["poll_interval"]:
            self.fail("retention.demand_max_age", f"{values['demand_max_age']:g}s is less than two poll intervals "
                      f"({2 * values['poll_interval']:g}s): every snapshot would turn stale before the next one")
        return Retention(**values)

    def _section(self, spec: Any, name: str, allowed: tuple[str, ...]) -> None:
        if not isinstance(spec, dict):
            self.fail(name, "must be a mapping (" + ", ".join(allowed) + ")")
        self.keys(spec, f"{name}.", allowed)

    def report(self, spec: Any) -> Report:
        self._section(spec, "report", _REPORT_KEYS)
        d = Report()
        interval = self.duration(spec.get("interval", d.interval), "report.interval")
        max_age = self.duration(spec.get("max_age", d.max_age), "report.max_age")
        if max_age < 60:
            self.fail("report.max_age", f"{max_age:g}s is too short: give at least 60s (a node refreshes "
                      "its report when it changes and on the dsstage-report timer)")
        return Report(user=self.user(spec.get("user"), "report.user"), interval=interval, max_age=max_age)

    def fleet(self, spec: Any) -> Fleet:
        self._section(spec, "fleet", _FLEET_KEYS)
        d = Fleet()
        user = self.user(spec.get("user", d.user), "fleet.user") or d.user
        port = int(self.number(spec.get("port", d.port), "fleet.port", minimum=1))
        if port > 65535:
            self.fail("fleet.port", f"{port} is not a TCP port")
        key = self.abs_path(spec["key"], "fleet.key") if spec.get("key") is not None else None
        known = self.abs_path(spec["known_hosts"], "fleet.known_hosts") if spec.get("known_hosts") is not None else None
        command = spec.get("command", list(d.command))
        if isinstance(command, str) and not command.split() == [command]:
            command = None  # a shell string: refused, nothing is run through a shell
        elif isinstance(command, str):
            command = [command]
        if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
            self.fail("fleet.command", "give the remote dsstage command as a list of arguments, "
                      "e.g. [/usr/bin/dsstage] or [/opt/dsstage/bin/dsstage, --config, /etc/dsstage/dsstage.yaml]")
        return Fleet(user=user, port=port, key=key, known_hosts=known,
                     connect_timeout=self.duration(spec.get("connect_timeout", d.connect_timeout),
                                                   "fleet.connect_timeout"),
                     timeout=self.duration(spec.get("timeout", d.timeout), "fleet.timeout"),
                     parallel=int(self.number(spec.get("parallel", d.parallel), "fleet.parallel", minimum=1)),
                     command=tuple(self.text(a, "fleet.command") for a in command))

    def metrics(self, spec: Any) -> Metrics:
        self._section(spec, "metrics", _METRICS_KEYS)
        textfile = spec.get("textfile")
        return Metrics(textfile=self.abs_path(textfile, "metrics.textfile") if textfile is not None else None)

    def prefetch(self, spec: Any) -> Prefetch:
        self._section(spec, "prefetch", _PREFETCH_KEYS)
        d = Prefetch()
        interval = self.duration(spec.get("interval", d.interval), "prefetch.interval")
        if interval < 1:
            self.fail("prefetch.interval", "must be at least 1s")
        bwlimit = spec.get("bwlimit", d.bwlimit)
        return Prefetch(horizon=self.duration(spec.get("horizon", d.horizon), "prefetch.horizon"), interval=interval,
                        bwlimit=int(self._parsed(parse_size, bwlimit, "prefetch.bwlimit")) if bwlimit else 0,
                        io_class=self.choice(spec.get("io_class", d.io_class), "prefetch.io_class", IO_CLASSES))

    def placement(self, spec: Any) -> Placement:
        self._section(spec, "placement", _PLACEMENT_KEYS)
        d = Placement()
        flags = {}
        for key in ("features", "prefer"):
            value = spec.get(key, getattr(d, key))
            if not isinstance(value, bool):
                self.fail(f"placement.{key}", f"{value!r} is not true or false")
            flags[key] = value
        prefix = spec.get("prefix", d.prefix)
        if not isinstance(prefix, str) or not FEATURE_PREFIX_RE.fullmatch(prefix):
            self.fail("placement.prefix", f"{prefix!r}: a node feature prefix starts with a letter and has at most "
                      "16 letters, digits, '_', '.' or '-' (e.g. ds_)")
        return Placement(features=flags["features"], prefer=flags["prefer"], prefix=prefix)

    def burst_buffer(self, spec: Any) -> BurstBuffer:
        self._section(spec, "burst_buffer", _BURST_BUFFER_KEYS)
        d = BurstBuffer()
        status_dir = self.abs_path(spec.get("status_dir", d.status_dir), "burst_buffer.status_dir")
        max_age = self.duration(spec.get("status_max_age", d.status_max_age), "burst_buffer.status_max_age")
        if not 1 <= max_age <= 3600:
            self.fail("burst_buffer.status_max_age", "must be between 1s and 1h")
        return BurstBuffer(user=self.user(spec.get("user"), "burst_buffer.user"), status_dir=status_dir,
                           status_max_age=max_age)

    def peers(self, spec: Any) -> Peers:
        self._section(spec, "peers", _PEERS_KEYS)
        d = Peers()
        enabled = spec.get("enabled", d.enabled)
        if not isinstance(enabled, bool):
            self.fail("peers.enabled", f"{enabled!r} is not true or false")
        port = self.number(spec.get("port", d.port), "peers.port", minimum=1)
        if port != int(port) or port > 65535:
            self.fail("peers.port", f"{port:g} is not a TCP port")
        hosts = spec.get("hosts") or {}
        if not isinstance(hosts, dict):
            self.fail("peers.hosts", "must map node names to how to reach them (host or host:port)")
        for node, host in hosts.items():
            if not isinstance(node, str) or not isinstance(host, str) or not PEER_HOST_RE.fullmatch(host) \
                    or (":" in host and not 0 < int(host.rsplit(":", 1)[1]) <= 65535):
                self.fail(f"peers.hosts.{node}", f"{host!r} is not a host name or address, with an optional :port")
        parallel = self.number(spec.get("parallel", d.parallel), "peers.parallel", minimum=1)
        if parallel != int(parallel) or parallel > 256:
            self.fail("peers.parallel", f"{parallel:g} is not a whole number from 1 to 256")
        allow = spec.get("allow") or []
        if isinstance(allow, str) or not isinstance(allow, list) or \
                not all(isinstance(a, str) and PEER_ALLOW_RE.fullmatch(a) for a in allow):
            self.fail("peers.allow", "must be a list of addresses, address/prefix (10.1.0.0/16) or host names")
        conns = self.number(spec.get("max_connections", d.max_connections), "peers.max_connections", minimum=1)
        if conns != int(conns) or conns > 4096:
            self.fail("peers.max_connections", f"{conns:g} is not a whole number from 1 to 4096")
        return Peers(enabled=enabled, port=int(port), hosts=dict(hosts), allow=tuple(allow),
                     max_connections=int(conns),
                     secret_file=self.abs_path(spec.get("secret_file", d.secret_file), "peers.secret_file"),
                     wait=self.duration(spec.get("wait", d.wait), "peers.wait"),
                     timeout=max(1.0, self.duration(spec.get("timeout", d.timeout), "peers.timeout")),
                     parallel=int(parallel))

    def sources(self, spec: Any) -> dict[str, SourceBudget]:
        if not isinstance(spec, dict):
            self.fail("sources", "must map a name to {prefix: ..., max_in_flight: N}")
        out = {}
        for name, entry in spec.items():
            key = f"sources.{name}"
            if not isinstance(entry, dict):
                self.fail(key, "must be {prefix: /lustre/, max_in_flight: 256}")
            self.keys(entry, f"{key}.", ("prefix", "max_in_flight"))
            prefix = self.text(entry.get("prefix"), f"{key}.prefix")
            if not prefix:
                self.fail(f"{key}.prefix", "give the start of the datasets' sources it covers, e.g. /lustre/")
            n = self.number(entry.get("max_in_flight"), f"{key}.max_in_flight", minimum=1)
            if n != int(n) or n > 1_000_000:
                self.fail(f"{key}.max_in_flight", f"{n:g} is not a whole number from 1 to 1000000")
            out[str(name)] = SourceBudget(name=str(name), prefix=prefix, max_in_flight=int(n))
        return out

    def duration(self, value: Any, key: str) -> float:
        return self._parsed(parse_duration, value, key)

    def tier(self, name: Any, spec: Any) -> Tier:
        key = f"tiers.{name}"
        problem = check_name(name, "tier")
        if problem:
            self.fail(key, problem)
        if not isinstance(spec, dict):
            self.fail(key, "must be a mapping with path and capacity")
        self.keys(spec, key + ".", _TIER_KEYS)
        path = self.abs_path(spec.get("path"), f"{key}.path")
        if path == "/":
            self.fail(f"{key}.path", "refusing the filesystem root; give a directory dsstage owns")
        capacity: int | float
        raw_cap = spec.get("capacity", "90%")
        try:
            capacity = parse_percent(raw_cap) if str(raw_cap).strip().endswith("%") else parse_size(raw_cap)
        except ValueError as exc:
            self.fail(f"{key}.capacity", str(exc))
        hw = self._percent(spec.get("high_watermark", "90%"), f"{key}.high_watermark")
        lw = self._percent(spec.get("low_watermark", "75%"), f"{key}.low_watermark")
        if lw >= hw:
            self.fail(f"{key}.low_watermark", f"{lw:.0%} must be below high_watermark {hw:.0%}: "
                      "eviction runs from the high mark down to the low mark")
        on_root = spec.get("root_filesystem", False)
        if not isinstance(on_root, bool):
            self.fail(f"{key}.root_filesystem", f"{on_root!r} is not true or false")
        return Tier(name=name, path=path, capacity=capacity, high_watermark=hw, low_watermark=lw,
                    root_filesystem=on_root)

    def _percent(self, value: Any, key: str) -> float:
        return self._parsed(parse_percent, value, key)

    def _parsed(self, parse: Callable[[Any], float], value: Any, key: str) -> float:
        try:
            return parse(value)
        except ValueError as exc:
            self.fail(key, str(exc))
        raise AssertionError  # pragma: no cover

    def dataset(self, name: Any, spec: Any, tiers: Mapping[str, Tier], on_failure: str) -> Dataset:
        key = f"datasets.{name}"
        problem = check_name(name)
        if problem:
            self.fail(key, problem)
        if not isinstance(spec, dict):
            self.fail(key, "must be a mapping with at least source")
        self.keys(spec, key + ".", _DATASET_KEYS)
        try:
            source = parse_source(spec.get("source"))  # type: ignore[arg-type]
        except ValueError as exc:
            self.fail(f"{key}.source", str(exc))
        tier = spec.get("tier")
        if tier is None:
            if len(tiers) != 1:
                self.fail(f"{key}.tier", f"missing; choose one of {', '.join(tiers)}")
            tier = next(iter(tiers))
        if tier not in tiers:
            hint = difflib.get_close_matches(str(tier), list(tiers), n=1)
            self.fail(f"{key}.tier", f"unknown tier {tier!r} (tiers: {', '.join(tiers)})"
                      + (f"; did you mean {hint[0]!r}?" if hint else ""))
        groups = spec.get("groups")
        if groups is not None:
            if isinstance(groups, str):
                groups = [groups]
            if not isinstance(groups, list) or not groups or \
                    not all(isinstance(g, str) and GROUP_RE.fullmatch(g) for g in groups):
                self.fail(f"{key}.groups", "must be a list of Unix group names; leave it out to allow everyone")
            groups = tuple(groups)
        verify = self.choice(spec.get("verify", "quick"), f"{key}.verify", VERIFY_MODES)
        policy = self.choice(spec.get("on_failure", on_failure), f"{key}.on_failure", FAILURE_POLICIES)
        description = self.text(str(spec.get("description", "")), f"{key}.description")
        return Dataset(name=name, source=source, tier=str(tier), groups=groups, verify=verify,
                       on_failure=policy, description=description)

    def distinct_env_vars(self, datasets: Mapping[str, Dataset]) -> None:
        """Two names that give one DSSTAGE_PATH_<NAME> would hand a job the wrong directory."""
        seen: dict[str, str] = {}
        for name in datasets:
            var = env_var(name)
            if var in seen:
                self.fail(f"datasets.{name}", f"gives the same environment variable {var} as dataset "
                          f"{seen[var]!r} ('.', '-' and '_' all become '_'): rename one of the two")
            seen[var] = name
