"""Loading and validating the dsstage configuration (tiers and the dataset catalog).

The file is found at ``$DSSTAGE_CONFIG`` or else ``/etc/dsstage/dsstage.yaml``. The
Prolog runs as root and acts on this file, so a file that anyone but root (or, for a
non-root caller, that user) could have written is refused.

Parsing the YAML (importing PyYAML, then building the document) cost a command of root's more
than the rest of loading: what the file parsed to is kept in the run directory
(dsstage.fs.runfiles.keep_parsed_config), for the file's exact state, and the next command
validates that instead. Validation runs every time: user and group names are looked up
afresh, and every check is the code's own.
"""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dsstage.config.model import (
    DEFAULT_PATH,
    DEFAULT_PROLOG_BUDGET,
    DEFAULT_SLURM_BIN,
    DEFAULT_START_BUDGET,
    FAILURE_POLICIES,
    HIGH_WATERMARK,
    LOW_WATERMARK,
    MAX_SHARDS,
    START_MODES,
    VERIFY_MODES,
    Config,
    Dataset,
    Report,
    Retention,
    Tier,
    Transfer,
)
from dsstage.config.names import GROUP_RE, check_name
from dsstage.config.sections import Sections
from dsstage.config.source import parse_source
from dsstage.errors import ConfigError
from dsstage.fs import runfiles
from dsstage.fs.layout import env_var
from dsstage.units import parse_percent, parse_size

if TYPE_CHECKING:
    import yaml

_TOP_KEYS = ("state_dir", "tiers", "datasets", "on_failure", "lock_timeout", "transfer", "slurm_bin",
             "prolog_budget", "source_user", "retention", "report", "fleet", "metrics", "prefetch", "placement",
             "burst_buffer", "peers", "sources", "rollout", "start", "start_budget")
_TIER_KEYS = ("path", "capacity", "high_watermark", "low_watermark", "root_filesystem")
_DATASET_KEYS = ("source", "tier", "groups", "verify", "on_failure", "description", "shards", "start")
_TRANSFER_KEYS = ("streams", "rsh", "timeout", "hash_threads", "bwlimit", "max_parallel")
_RETENTION_KEYS = ("min_keep", "max_idle", "demand_max_age", "poll_interval", "manifest_keep")
_REPORT_KEYS = ("user", "interval", "max_age")


def config_path(explicit: str | None = None) -> str:
    """The configuration file to use: explicit, else $DSSTAGE_CONFIG, else the default."""
    return explicit or os.environ.get("DSSTAGE_CONFIG") or DEFAULT_PATH


def load(path: str | None = None, *, check_owner: bool = True, run_dir: str | None = None) -> Config:
    """Read, check the safety of, and validate the configuration file. With ``run_dir`` (root's
    run directory), what the file parsed to is taken from there when it was kept for this
    very state of the file, and kept there when it was not."""
    path = config_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; copy conf/dsstage.yaml.example there "
                          "or point DSSTAGE_CONFIG at your configuration") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot open: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if check_owner:
            _check_owner(path, st)
        data = runfiles.parsed_config(run_dir, path, st) if run_dir else None
        if data is None:
            data = parse(path, fh.read())
            if run_dir:
                runfiles.keep_parsed_config(run_dir, path, st, data)
    return from_dict(data, origin=path)


def parse(path: str, text: bytes) -> Any:
    """The YAML document in ``text`` (with libyaml where PyYAML has it: the same safe loader)."""
    import yaml
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (safe loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]} "
                          f"{_yaml_where(exc)}") from None


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
    start = v.choice(data.get("start", "wait"), "start", START_MODES)
    start_budget = v.number(data.get("start_budget", DEFAULT_START_BUDGET), "start_budget", minimum=0)
    if start_budget >= prolog_budget:
        v.fail("start_budget", f"{start_budget:g}s is not below prolog_budget ({prolog_budget:g}s): it is the "
               "part of the Prolog's time an at-once dataset's stage may take before the job starts on a live view")
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
    rollout = v.rollout({} if data.get("rollout") is None else data["rollout"])

    raw_tiers = data.get("tiers")
    if not isinstance(raw_tiers, dict) or not raw_tiers:
        v.fail("tiers", "define at least one storage tier, e.g. nvme: {path: /local/nvme/dsstage, capacity: 90%}")
    tiers = {name: v.tier(name, spec) for name, spec in raw_tiers.items()}

    raw_datasets = data.get("datasets") or {}
    if not isinstance(raw_datasets, dict):
        v.fail("datasets", "must be a mapping of dataset name to its description")
    datasets = {name: v.dataset(name, spec, tiers, on_failure, start) for name, spec in raw_datasets.items()}
    v.distinct_env_vars(datasets)
    return Config(origin=origin, state_dir=state_dir, tiers=tiers, datasets=datasets,
                  on_failure=on_failure, lock_timeout=lock_timeout, transfer=transfer,
                  slurm_bin=slurm_bin, prolog_budget=prolog_budget, start_budget=start_budget,
                  source_user=source_user,
                  retention=retention, report=report, fleet=fleet, metrics=metrics, prefetch=prefetch,
                  placement=placement, burst_buffer=burst_buffer, peers=peers, sources=sources, rollout=rollout,
                  unknown_keys=tuple(v.unknown))


class _Validator(Sections):
    """The configuration's own parts: transfer, retention, report, tiers, datasets."""

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

    def report(self, spec: Any) -> Report:
        self._section(spec, "report", _REPORT_KEYS)
        d = Report()
        interval = self.duration(spec.get("interval", d.interval), "report.interval")
        max_age = self.duration(spec.get("max_age", d.max_age), "report.max_age")
        if max_age < 60:
            self.fail("report.max_age", f"{max_age:g}s is too short: give at least 60s (a node refreshes "
                      "its report when it changes and on the dsstage-report timer)")
        return Report(user=self.user(spec.get("user"), "report.user"), interval=interval, max_age=max_age)

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
        hw = self._percent(spec.get("high_watermark", f"{HIGH_WATERMARK:.0%}"), f"{key}.high_watermark")
        if "low_watermark" in spec:
            lw = self._percent(spec["low_watermark"], f"{key}.low_watermark")
        else:  # as far below the high mark as the defaults are: a high mark alone stays valid
            lw = max(0.0, round(hw - (HIGH_WATERMARK - LOW_WATERMARK), 4))
        if lw >= hw:
            self.fail(f"{key}.low_watermark", f"{lw:.0%} must be below high_watermark {hw:.0%}: "
                      "eviction runs from the high mark down to the low mark")
        on_root = spec.get("root_filesystem", False)
        if not isinstance(on_root, bool):
            self.fail(f"{key}.root_filesystem", f"{on_root!r} is not true or false")
        return Tier(name=name, path=path, capacity=capacity, high_watermark=hw, low_watermark=lw,
                    root_filesystem=on_root)

    def dataset(self, name: Any, spec: Any, tiers: Mapping[str, Tier], on_failure: str,
                start: str = "wait") -> Dataset:
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
        shards = spec.get("shards")
        if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int) or not
                                   2 <= shards <= MAX_SHARDS):
            self.fail(f"{key}.shards", f"{shards!r} is not a whole number from 2 to {MAX_SHARDS}: the number of "
                      "parts the dataset's files are split into, spread over a job's nodes; leave it out for a "
                      "dataset every node holds whole")
        mode = self.choice(spec.get("start", start), f"{key}.start", START_MODES)
        if mode == "at-once" and (source.kind != "local" or shards):
            if "start" in spec:  # asked for this dataset: say why it cannot be
                why = (f"its source {source.raw} is not mounted on the nodes, so a job cannot read it while it "
                       "is staged" if source.kind != "local" else "a sharded dataset's part is staged whole")
                self.fail(f"{key}.start", f"at-once is not possible: {why}; leave start out (the job waits "
                          "for the stage, as before)")
            mode = "wait"  # the site's default applies to the datasets it can
        return Dataset(name=name, source=source, tier=str(tier), groups=groups, verify=verify,
                       on_failure=policy, description=description, shards=shards, start=mode)

    def distinct_env_vars(self, datasets: Mapping[str, Dataset]) -> None:
        """Two names that give one DSSTAGE_PATH_<NAME> would hand a job the wrong directory."""
        seen: dict[str, str] = {}
        for name in datasets:
            var = env_var(name)
            if var in seen:
                self.fail(f"datasets.{name}", f"gives the same environment variable {var} as dataset "
                          f"{seen[var]!r} ('.', '-' and '_' all become '_'): rename one of the two")
            seen[var] = name
