"""The body of this node's report, built from its store: every copy with its state and the
retention planner's verdict, what is staging with its progress, tier use, trash. ``refresh``
rebuilds and publishes it and writes the metrics' textfile; the hooks and CLI verbs that change
the store call it (the store itself never does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from dsstage import __version__
from dsstage.errors import DsstageError
from dsstage.fs import layout as fs_layout
from dsstage.fs import safe
from dsstage.fs.safe import RootDir
from dsstage.node import access, eviction, live, metrics, space
from dsstage.node.lease import LeaseBook
from dsstage.node.lock import is_held, read_owner
from dsstage.node.report import FORMAT, PREFETCH_KEPT, publish_target, replace
from dsstage.node.store import Store, open_tier
from dsstage.shards import views

log = logging.getLogger(__name__)


def build(store: Store, previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This node's report from its store: tiers, copies, leases and the planner's decisions.
    A stage still running keeps the progress it last noted in ``previous``."""
    now = store.clock()
    dem, _snap = store.demand()
    before = {(r.get("tier"), r.get("dataset"), r.get("version")): r
              for r in (previous or {}).get("copies") or [] if isinstance(r, dict)}
    tiers, rows = [], []
    for tier_conf in store.config.tiers.values():
        layout = store.layout(tier_conf)
        try:
            tier = open_tier(layout, create=False)
        except (DsstageError, FileNotFoundError):
            continue
        with tier:
            use = space.usage(tier)
            sp = eviction.space_of(store, tier, tier_conf, use=use)
            _cap, free = space.capacity_of(tier_conf.capacity, tier.fd)
            tiers.append({"tier": tier_conf.name, "path": layout.root, "capacity": sp.capacity, "used": use.copies,
                          "reserved": use.reserved, "free": free, "high": sp.high, "low": sp.low})
            copies = eviction.copies(store, tier, tier_conf)
            plan = eviction.plan(store, tier, tier_conf, dem, space=sp, have=copies)
            decided = {(d.copy.dataset, d.copy.version): d for d in plan.decisions}
            book = LeaseBook(tier)
            held: dict[str, list[Any]] = {}  # a dataset's leases, read once for all its copies (a shard each)
            for c in copies:
                if c.dataset not in held:
                    held[c.dataset] = book.of_dataset(c.dataset)
                leases = [x for x in held[c.dataset] if x.covers(c.version)]
                mark = safe.read_json_at(tier.has_dir("ready", c.dataset), fs_layout.mark_name(c.version))
                state = "failed" if mark.get("bad") else "ready" if mark else "incomplete"
                lock = layout.lock(c.dataset)
                if state == "ready" and is_held(lock) and read_owner(lock).get("action") == "verify":
                    state = "verifying"
                d = decided.get((c.dataset, c.version))
                rows.append({"tier": tier_conf.name, "dataset": c.dataset, "version": c.version, "state": state,
                             "current": c.current, "bytes": c.bytes, "files": space.as_bytes(mark.get("files")),
                             "leases": [{"job_id": x.job_id, "user": x.user, "since": x.taken} for x in leases],
                             "last_used": c.last_used or None,
                             "decision": {"action": d.action, "reason": d.reason} if d else None,
                             "progress": None, "prefetched_for": mark.get("prefetched_for") or None})
            rows += _staging_rows(store, tier, tier_conf.name, layout, before, is_held, read_owner)
            rows += _trash_rows(tier, tier_conf.name)
    return {"format": FORMAT, "node": store.node, "dsstage": __version__, "time": now,
            "demand": {"age": dem.age, "stale": dem.stale}, "tiers": tiers, "copies": rows,
            "prefetch": list((previous or {}).get("prefetch") or [])[-PREFETCH_KEPT:]}


def _staging_rows(store: Store, tier: RootDir, tier_name: str, layout: Any, before: Mapping[Any, Any],
                  is_held: Callable[[str], bool],
                  read_owner: Callable[[str], dict[str, object]]) -> list[dict[str, Any]]:
    from dsstage.node import space
    rows = []
    reserved = tier.has_dir("reserved")
    for entry in tier.names("staging"):
        name, _dot, version = entry.rpartition(".")
        if not name or version == "repair":
            continue
        try:
            current = store.manifests.current(name)
        except Exception:  # noqa: BLE001 - a damaged manifest entry: shown as not current
            current = None
        row: dict[str, Any] = {"tier": tier_name, "dataset": name, "version": version,
                               "current": bool(current and fs_layout.version_id(current) == version),
                               "bytes": space.as_bytes(safe.read_json_at(reserved, space.stage_record(entry))
                                                       .get("bytes")),
                               "files": 0, "leases": [], "last_used": None, "decision": None, "progress": None}
        if is_held(layout.lock(name)):
            prev = before.get((tier_name, name, version)) or {}
            progress = prev.get("progress") if prev.get("state") in ("staging", "verifying") else None
            row.update(state=prev.get("state") if progress else "staging", progress=progress,
                       job_id=str(read_owner(layout.lock(name)).get("job_id") or ""))
        else:
            row.update(state="interrupted")  # left by a killed stage: resumed or removed by the next
        view = live.progress_of(tier, name, version)
        if view is not None:  # jobs read it while it is staged
            row["live"] = view
        rows.append(row)
    return rows


def _trash_rows(tier: RootDir, tier_name: str) -> list[dict[str, Any]]:
    """Evicted copies whose files the background purge is still deleting."""
    from dsstage.node import space
    rows = []
    reserved = tier.has_dir("reserved")
    for entry in tier.names("trash"):
        parts = entry.split(".")
        if len(parts) < 3 or entry.startswith((views.TRASH_PREFIX, live.TRASH_PREFIX)):
            continue
        rows.append({"tier": tier_name, "dataset": ".".join(parts[:-2]), "version": parts[-2], "state": "evicting",
                     "current": False, "files": 0, "leases": [], "last_used": None, "decision": None,
                     "progress": None,
                     "bytes": space.as_bytes(safe.read_json_at(reserved, space.trash_record(entry)).get("bytes"))})
    return rows


def reapply_access(store: Store) -> None:
    """Give every copy and view of each dataset on this node its dataset's access as the
    configuration says now: a ``groups:`` added (or removed) by the admin reaches what nodes
    cached before, at their next refresh (the hooks, ``dsstage report`` and its timer). Root's
    work only; a tier that cannot be opened, or a group this node does not know, is logged."""
    if os.geteuid() != 0:
        return
    by_tier: dict[str, list[Any]] = {}
    for ds in store.config.datasets.values():
        by_tier.setdefault(ds.tier, []).append(ds)
    for tier_name, datasets in by_tier.items():
        try:
            tier = open_tier(store.layout(tier_name), create=False)
        except (DsstageError, OSError):
            continue
        with tier:
            for ds in datasets:
                try:
                    access.reapply(tier, ds, origin=store.config.origin, node=store.node)
                except (DsstageError, OSError) as exc:
                    log.warning("access of %s on %s not brought up to date: %s", ds.name, tier_name, exc)


def refresh(store: Store, run_dir: str | None = None) -> dict[str, Any]:
    """Rebuild this node's report from its store, write it and publish it, and write the
    metrics' textfile if configured (best effort: a failure is logged, never raised). The hooks
    and verbs that change the store call it; the store never does."""
    run_dir = run_dir or store.run_dir
    try:
        reapply_access(store)
        rep = replace(run_dir, store.node, lambda prev: build(store, prev), publish_target(store.config))
    except DsstageError as exc:  # the store's own fault: the operation at hand meets and reports it
        log.info("the node report of %s is not rebuilt: %s", store.node, exc)
        return {}
    except Exception as exc:  # noqa: BLE001 - status is informative; the hooks go on
        log.warning("cannot write the node report of %s: %s", store.node, exc)
        return {}
    textfile = store.config.metrics.textfile
    if rep and textfile:
        try:
            metrics.export(textfile.replace("{node}", store.node), run_dir, store.node, rep["tiers"], rep["copies"])
        except (OSError, DsstageError) as exc:
            log.warning("cannot write the metrics file %s: %s", textfile, exc)
    return rep
