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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import ConfigError
from .units import parse_percent, parse_size
from .warm import NAME_MAX, name_ok

DEFAULT_PATH = "/etc/dsstage/dsstage.yaml"
GROUP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]*\$?$")
VERIFY_MODES = ("quick", "full")
FAILURE_POLICIES = ("fallback", "hold")


@dataclass(frozen=True)
class Source:
    """Where a dataset comes from: a mounted path, ``host:/path`` (ssh) or ``rsync://``."""

    raw: str
    kind: str  # "local" | "ssh" | "daemon"
    path: str  # the path part (for local: the whole path)

    def rsync_base(self) -> str:
        """The source as rsync wants it: the directory itself, with a trailing slash."""
        return self.raw.rstrip("/") + "/"


@dataclass(frozen=True)
class Tier:
    name: str
    path: str  # may contain {node}
    capacity: int | float  # bytes, or a fraction (<= 1.0) of the filesystem
    high_watermark: float
    low_watermark: float

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


@dataclass(frozen=True)
class Transfer:
    streams: int = 4
    rsh: str = "ssh -o BatchMode=yes"
    timeout: float = 86400.0
    hash_threads: int = 0  # 0: one per CPU
    bwlimit: int = 0  # KiB/s per rsync stream; 0: no limit


@dataclass(frozen=True)
class Config:
    origin: str
    state_dir: str
    tiers: Mapping[str, Tier]
    datasets: Mapping[str, Dataset]
    on_failure: str = "fallback"
    lock_timeout: float = 6 * 3600.0
    transfer: Transfer = field(default_factory=Transfer)

    def manifest_dir(self, name: str) -> str:
        return os.path.join(self.state_dir, "manifests", name)


_TOP_KEYS = ("state_dir", "tiers", "datasets", "on_failure", "lock_timeout", "transfer")
_TIER_KEYS = ("path", "capacity", "high_watermark", "low_watermark")
_DATASET_KEYS = ("source", "tier", "groups", "verify", "on_failure", "description")
_TRANSFER_KEYS = ("streams", "rsh", "timeout", "hash_threads", "bwlimit")


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

    raw_tiers = data.get("tiers")
    if not isinstance(raw_tiers, dict) or not raw_tiers:
        v.fail("tiers", "define at least one storage tier, e.g. nvme: {path: /local/nvme/dsstage, capacity: 90%}")
    tiers = {name: v.tier(name, spec) for name, spec in raw_tiers.items()}

    raw_datasets = data.get("datasets") or {}
    if not isinstance(raw_datasets, dict):
        v.fail("datasets", "must be a mapping of dataset name to its description")
    datasets = {name: v.dataset(name, spec, tiers, on_failure) for name, spec in raw_datasets.items()}
    return Config(origin=origin, state_dir=state_dir, tiers=tiers, datasets=datasets,
                  on_failure=on_failure, lock_timeout=lock_timeout, transfer=transfer)


def check_name(name: Any, what: str = "dataset") -> str | None:
    """Why ``name`` is not a valid dataset/tier name, or None when it is."""
    if not isinstance(name, str) or not name:
        return f"a {what} name must be a non-empty string"
    if len(name) > NAME_MAX:
        return f"{what} name {name[:20]!r}... is longer than {NAME_MAX} characters"
    if not name_ok(name):
        return (f"{what} name {name!r} is not allowed: use lower-case letters, digits, '.', '_' and '-', "
                "starting with a letter or digit")
    return None


def parse_source(raw: str) -> Source:
    """Classify a source string; raises ValueError with the fix for a bad one."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("give a source: /mounted/path, host:/path or rsync://host/module/path")
    if raw.startswith("rsync://"):
        rest = raw[len("rsync://"):]
        host, _, path = rest.partition("/")
        if not host or not path.strip("/"):
            raise ValueError(f"{raw!r} lacks a module: write rsync://host/module/path")
        return Source(raw=raw, kind="daemon", path="/" + path)
    if raw.startswith("/"):
        if "/../" in raw + "/":
            raise ValueError(f"{raw!r} contains '..': give the real path")
        return Source(raw=os.path.normpath(raw), kind="local", path=os.path.normpath(raw))
    m = re.match(r"^([^/:\s]+):(.*)$", raw)
    if m:
        if not m.group(2).startswith("/"):
            raise ValueError(f"{raw!r} is relative to a home directory: write host:/absolute/path")
        return Source(raw=raw, kind="ssh", path=m.group(2))
    raise ValueError(f"{raw!r} is a relative path: give an absolute path, host:/path or rsync://host/module/path")


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

    def abs_path(self, value: Any, key: str, required: bool = False) -> str:
        if value is None and required:
            self.fail(key, "missing; give an absolute path")
        if not isinstance(value, str) or not value.startswith("/"):
            self.fail(key, f"{value!r} is not an absolute path")
        return os.path.normpath(value)

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
        timeout = self.number(spec.get("timeout", Transfer.timeout), "transfer.timeout", minimum=1)
        threads = int(self.number(spec.get("hash_threads", 0), "transfer.hash_threads", minimum=0))
        bwlimit = int(self.number(spec.get("bwlimit", 0), "transfer.bwlimit", minimum=0))
        return Transfer(streams=streams, rsh=rsh, timeout=timeout, hash_threads=threads, bwlimit=bwlimit)

    def tier(self, name: Any, spec: Any) -> Tier:
        key = f"tiers.{name}"
        problem = check_name(name, "tier")
        if problem:
            self.fail(key, problem)
        if not isinstance(spec, dict):
            self.fail(key, "must be a mapping with path and capacity")
        self.keys(spec, key + ".", _TIER_KEYS)
        path = spec.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            self.fail(f"{key}.path", f"{path!r} is not an absolute path")
        if path.rstrip("/") in ("", "/"):
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
        return Tier(name=name, path=os.path.normpath(path), capacity=capacity, high_watermark=hw, low_watermark=lw)

    def _percent(self, value: Any, key: str) -> float:
        try:
            return parse_percent(value)
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
                    not all(isinstance(g, str) and GROUP_RE.match(g) for g in groups):
                self.fail(f"{key}.groups", "must be a list of Unix group names; leave it out to allow everyone")
            groups = tuple(groups)
        verify = self.choice(spec.get("verify", "quick"), f"{key}.verify", VERIFY_MODES)
        policy = self.choice(spec.get("on_failure", on_failure), f"{key}.on_failure", FAILURE_POLICIES)
        return Dataset(name=name, source=source, tier=str(tier), groups=groups, verify=verify,
                       on_failure=policy, description=str(spec.get("description", "")))
