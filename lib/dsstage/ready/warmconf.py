"""The configuration the warm paths read: what they need of ``Config``, typed and versioned.

The full Prolog and the full ``dsstage stage`` build it from the loaded configuration
(dsstage.hooks.configcache) and keep it in the run directory as ``config-cache.json``, keyed by
the configuration file's exact state (dsstage.fs.runfiles.load_cache); the warm Prolog, the
hooks' bound and the fast ``stage``/``verify`` read it instead of the YAML. A cache of another
``VERSION``, or with a field of the wrong type, is no cache: the full path runs and writes it
again. A dataset's entry is checked when it is read (a warm Prolog reads one or two of a
catalog's hundreds).
"""

from __future__ import annotations

from dsstage.fs import layout, runfiles

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

#: the cache's format; a reader meets only this one (an older dsstage's cache is rewritten by the full path)
VERSION = 2
VERIFY = ("quick", "full")


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


class WarmDataset:
    """A dataset as the warm paths see it: its tier (name and root path, ``{node}`` in it),
    how a ready copy is verified, the groups that may use it (None: everyone), its shards
    (None: whole)."""

    __slots__ = ("name", "root", "tier", "verify", "groups", "shards")

    def __init__(self, name: str, entry: Mapping[str, Any]) -> None:
        root, tier, verify = entry.get("root"), entry.get("tier"), entry.get("verify")
        groups, shards = entry.get("groups"), entry.get("shards")
        if not isinstance(root, str) or not root or not isinstance(tier, str) or verify not in VERIFY \
                or not (groups is None or _strings(groups)) \
                or not (shards is None or (type(shards) is int and shards > 0)):
            raise ValueError(f"the configuration cache's entry for {name!r} is not one this dsstage wrote")
        self.name, self.root, self.tier, self.verify = name, root, tier, verify
        self.groups: frozenset[str] | None = frozenset(groups) if groups is not None else None
        self.shards: int | None = shards

    def root_on(self, node: str) -> str:
        return self.root.replace("{node}", node)

    def record(self) -> dict[str, Any]:
        return {"root": self.root, "tier": self.tier, "verify": self.verify,
                "groups": sorted(self.groups) if self.groups is not None else None, "shards": self.shards}


class WarmConfig:
    """What the warm paths read of the configuration."""

    __slots__ = ("state_dir", "report_user", "bb_uid", "prolog_budget", "hash_threads", "rollout_partitions",
                 "rollout_nodes", "_datasets")

    def __init__(self, state_dir: str, datasets: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Any]) -> None:
        """``settings``: report_user, bb_uid, prolog_budget, hash_threads, rollout_partitions,
        rollout_nodes (a hostlist expanded). ValueError if any has the wrong type."""
        s = settings
        ok = isinstance(state_dir, str) and bool(state_dir) and isinstance(datasets, dict) \
            and isinstance(s.get("report_user"), (str, type(None))) \
            and (s.get("bb_uid") is None or type(s.get("bb_uid")) is int) \
            and type(s.get("prolog_budget")) in (int, float) and type(s.get("hash_threads")) is int \
            and (s.get("rollout_partitions") is None or _strings(s.get("rollout_partitions"))) \
            and (s.get("rollout_nodes") is None or _strings(s.get("rollout_nodes")))
        if not ok:
            raise ValueError("the configuration cache is not one this dsstage wrote")
        self.state_dir: str = state_dir
        self._datasets: dict[str, Any] = dict(datasets)
        self.report_user: str | None = s.get("report_user")
        self.bb_uid: int | None = s.get("bb_uid")
        self.prolog_budget = float(s["prolog_budget"])
        self.hash_threads: int = s["hash_threads"]
        self.rollout_partitions: list[str] | None = s.get("rollout_partitions")
        self.rollout_nodes: list[str] | None = s.get("rollout_nodes")

    def dataset(self, name: str) -> WarmDataset | None:
        """The catalog's dataset ``name``; None if the catalog has none of that name.
        ValueError if its entry is damaged."""
        entry = self._datasets.get(name) if layout.name_ok(name) else None
        return WarmDataset(name, entry) if isinstance(entry, dict) else None

    def names(self) -> list[str]:
        return sorted(self._datasets)

    def record(self) -> dict[str, Any]:
        """What ``from_record`` reads back (without the file's key: ``write`` adds it)."""
        return {"version": VERSION, "state_dir": self.state_dir, "datasets": self._datasets,
                "report_user": self.report_user, "bb_uid": self.bb_uid, "prolog_budget": self.prolog_budget,
                "hash_threads": self.hash_threads, "rollout_partitions": self.rollout_partitions,
                "rollout_nodes": self.rollout_nodes}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> WarmConfig | None:
        """The configuration a cache record holds; None if it is of another version or damaged."""
        if rec.get("version") != VERSION:
            return None
        try:
            return cls(rec.get("state_dir"), rec.get("datasets"), rec)  # type: ignore[arg-type]
        except ValueError:
            return None


def read(run_dir: str, config_path: str) -> WarmConfig | None:
    """The warm configuration for this very state of ``config_path``, if root kept one."""
    rec = runfiles.load_cache(run_dir, config_path)
    return None if rec is None else WarmConfig.from_record(rec)


def write(run_dir: str, origin: str, conf: WarmConfig) -> bool:
    """Keep ``conf`` as the warm configuration of configuration file ``origin`` in its present
    state; False if the file cannot be reached (nothing is kept) or the cache holds it already."""
    key = runfiles.config_key(origin)
    if key is None:
        return False
    return runfiles.write_cache(run_dir, {**conf.record(), "origin": origin, "key": key})
