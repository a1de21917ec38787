"""The validator's primitives and the configuration sections of the services around the
hooks (fleet, metrics, prefetch, rollout, placement, burst_buffer, peers, sources): every
error names the file, the key and the fix. ``dsstage.config.load`` builds on it.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from dsstage.config.model import (
    BurstBuffer,
    Fleet,
    Metrics,
    Peers,
    Placement,
    Prefetch,
    Rollout,
    SourceBudget,
)
from dsstage.config.names import USER_MAX, USER_RE, control_char
from dsstage.errors import ConfigError
from dsstage.units import parse_duration, parse_percent, parse_size

_FLEET_KEYS = ("user", "port", "key", "known_hosts", "connect_timeout", "timeout", "parallel", "command")
_METRICS_KEYS = ("textfile", "controller_textfile")
_PREFETCH_KEYS = ("horizon", "interval", "bwlimit", "io_class")
_PLACEMENT_KEYS = ("features", "prefer", "prefix", "wait_for_data")
_ROLLOUT_KEYS = ("partitions", "nodes", "outside")
ROLLOUT_OUTSIDE = ("source", "refuse")
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


class Sections:
    def __init__(self, origin: str) -> None:
        self.origin = origin
        #: keys this version does not know and that resemble none it knows: ignored (a newer
        #: dsstage's, during an upgrade one node at a time), said by check-config and the hooks
        self.unknown: list[str] = []

    def fail(self, key: str, message: str) -> None:
        where = f"{self.origin}: {key}: " if key else f"{self.origin}: "
        raise ConfigError(where + message)

    def keys(self, mapping: Mapping[str, Any], prefix: str, allowed: tuple[str, ...]) -> None:
        """Refuse a key that looks like a known one misspelt (with the fix); a key like none this
        version knows is kept in ``unknown`` and ignored: a newer dsstage's key must not hold
        every dataset job on a node not upgraded yet."""
        for key in mapping:
            if key not in allowed:
                hint = difflib.get_close_matches(str(key), allowed, n=1)
                if hint:
                    self.fail(f"{prefix}{key}", f"unknown key; did you mean {hint[0]!r}?")
                self.unknown.append(f"{prefix}{key}")

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

    def _section(self, spec: Any, name: str, allowed: tuple[str, ...]) -> None:
        if not isinstance(spec, dict):
            self.fail(name, "must be a mapping (" + ", ".join(allowed) + ")")
        self.keys(spec, f"{name}.", allowed)

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
        textfile, controller = spec.get("textfile"), spec.get("controller_textfile")
        return Metrics(textfile=self.abs_path(textfile, "metrics.textfile") if textfile is not None else None,
                       controller_textfile=self.abs_path(controller, "metrics.controller_textfile")
                       if controller is not None else None)

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

    def rollout(self, spec: Any) -> Rollout:
        self._section(spec, "rollout", _ROLLOUT_KEYS)
        parts = spec.get("partitions")
        if parts is not None and (not isinstance(parts, list) or not parts
                                  or not all(isinstance(p, str) and p and p.strip() == p for p in parts)):
            self.fail("rollout.partitions", f"{parts!r}: a list of partition names, e.g. [gpu-pilot]; leave it out "
                      "for every partition")
        nodes = spec.get("nodes")
        if nodes is not None:
            from dsstage.hostlist import expand_nodes
            try:
                if not isinstance(nodes, str) or not expand_nodes(nodes):
                    raise ValueError(nodes)
            except ValueError:
                self.fail("rollout.nodes", f"{nodes!r}: a Slurm hostlist, e.g. gpu[001-008]; leave it out for every "
                          "node")
        outside = self.choice(spec.get("outside", Rollout().outside), "rollout.outside", ROLLOUT_OUTSIDE)
        return Rollout(partitions=tuple(parts) if parts is not None else None, nodes=nodes, outside=outside)

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
        wait = self.duration(spec.get("wait_for_data", d.wait_for_data), "placement.wait_for_data")
        if not 0 <= wait <= 7 * 86400:
            self.fail("placement.wait_for_data", "must be between 0 (never wait) and 7d")
        return Placement(features=flags["features"], prefer=flags["prefer"], prefix=prefix, wait_for_data=wait)

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

    def _percent(self, value: Any, key: str) -> float:
        return self._parsed(parse_percent, value, key)

    def _parsed(self, parse: Callable[[Any], float], value: Any, key: str) -> float:
        try:
            return parse(value)
        except ValueError as exc:
            self.fail(key, str(exc))
        raise AssertionError  # pragma: no cover
