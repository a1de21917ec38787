"""The catalog that slurmctld's job_submit.lua checks, generated from the YAML.

The catalog is kept in one place (the YAML); ``dsstage export-catalog`` renders what the
Lua needs (names, groups, and the uids those groups allow) so it is never maintained twice.

slurmctld runs job_submit.lua for every submission and must never wait on dsstage: the Lua
looks nobody up. Group membership is resolved here, outside slurmctld, into the uids that
may use each restricted dataset; a timer running ``dsstage export-catalog`` keeps it
current. The Prolog on the node checks groups again with the node's own lookups and is the
authority; the submit-time check only turns a request that would fail away early.
"""

from __future__ import annotations

import grp
import logging
import pwd
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import blake3

from dsstage.config.catalog import VALUE_MAX, group_members
from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.fs.layout import NAME_MAX

log = logging.getLogger("dsstage")


def _lua_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def sizes(config: Config) -> dict[str, dict[str, Any]]:
    """What the submit check needs to refuse a job whose nodes cannot hold a dataset: for each
    dataset with a current manifest and a tier of a set size, its bytes, a node's room (the
    tier's capacity up to its high watermark) and, for a sharded dataset, the fewest nodes that
    hold it (dsstage.shards.split.least_nodes; None if one shard alone is too big). A dataset
    whose manifest or shards cannot be read here gets no check (the Prolog still refuses)."""
    from dsstage.config.manifest import Catalog, header_bytes, read_header
    from dsstage.shards import index as shard_index
    from dsstage.shards.split import least_nodes
    from dsstage.units import human
    manifests = Catalog(config.state_dir)
    out: dict[str, dict[str, Any]] = {}
    for name, ds in sorted(config.datasets.items()):
        capacity = config.tiers[ds.tier].capacity
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            continue  # a share of each node's filesystem: only the node knows how much
        room = int(capacity * config.tiers[ds.tier].high_watermark)
        try:
            digest = manifests.current(name)
            if digest is None:
                continue
            path = manifests.path(name, digest)
            total = header_bytes(read_header(path), path)
            row: dict[str, Any] = {"bytes": total, "room": room, "size": human(total), "room_text": human(room)}
            if ds.shards:
                index = shard_index.load(manifests, name, digest, ds.shards)
                row.update(shards=ds.shards, least=least_nodes(index.shards, room))
        except (DsstageError, OSError, ValueError) as exc:
            log.warning("dataset %s: no size for the submit check: %s", name, exc)
            continue
        out[name] = row
    return out


def _size_fields(row: dict[str, Any] | None) -> str:
    if not row:
        return ""
    fields = [f"bytes = {row['bytes']}", f"room = {row['room']}", f"size = {_lua_str(row['size'])}",
              f"room_text = {_lua_str(row['room_text'])}"]
    if row.get("shards"):
        fields.append(f"shards = {row['shards']}")
        if row.get("least") is not None:
            fields.append(f"least = {row['least']}")
    return ", " + ", ".join(fields)


def _rollout_fields(config: Config) -> list[str]:
    """The pilot's partitions for the submit check (none: every partition is in)."""
    parts = config.rollout.partitions
    if parts is None:
        return []
    names = ", ".join(f"[{_lua_str(p)}] = true" for p in parts)
    return [f"  rollout = {{ partitions = {{ {names} }}, outside = {_lua_str(config.rollout.outside)} }},"]


def render(config: Config, *,
           getgrnam: Callable[[str], Any] = grp.getgrnam,
           getpwnam: Callable[[str], Any] = pwd.getpwnam,
           getpwall: Callable[[], list[Any]] = pwd.getpwall,
           now: Callable[[], float] = time.time, command: Sequence[str] = (),
           slurm_version: str | None = None, sized: dict[str, dict[str, Any]] | None = None) -> str:
    """Lua source returning ``{generated = T, datasets = {name = {groups = {...}, uids = {...}}}, ...}``;
    ``command``: how burst_buffer.lua runs dsstage on the controller (argv); ``slurm_version``:
    the Slurm series there ("24.11"), which tells burst_buffer.lua how bbstat passes its words;
    ``sized``: ``sizes(config)``, for the check that a job's nodes can hold each dataset.

    Raises DsstageError when no group of any restricted dataset resolves (the directory
    service is most likely down): an empty table would refuse every restricted request."""
    all_groups = {g for ds in config.datasets.values() for g in ds.groups or ()}
    passwd = list(getpwall()) if all_groups else []
    body = ["return {", f"  value_max = {VALUE_MAX},", f"  name_max = {NAME_MAX},",
            f"  generated = {int(now())},",
            f"  placement = {{ prefer = {'true' if config.placement.prefer else 'false'}, "
            f"prefix = {_lua_str(config.placement.prefix)} }},",
            *_rollout_fields(config),
            "  command = {" + ", ".join(_lua_str(a) for a in command) + "},",
            *([f"  slurm_version = {_lua_str(slurm_version)},"] if slurm_version else []),
            f"  bbstat = {{ dir = {_lua_str(config.burst_buffer.status_dir)}, "
            f"max_age = {int(config.burst_buffer.status_max_age)} }},",
            "  datasets = {"]
    missing: dict[str, list[str]] = {}
    for name in sorted(config.datasets):
        ds = config.datasets[name]
        more = _size_fields((sized or {}).get(name))
        if ds.groups is None:
            body.append(f"    [{_lua_str(name)}] = {{ groups = nil{more} }},")
            continue
        members = group_members(ds.groups, passwd, getgrnam=getgrnam, getpwnam=getpwnam)
        for group in members.missing_groups:
            missing.setdefault(group, []).append(name)
        if members.unknown_users:
            log.warning("dataset %s: members %s of its groups are unknown to passwd; ignored",
                        name, ", ".join(members.unknown_users))
        groups = "{" + ", ".join(_lua_str(g) for g in ds.groups) + "}"
        uids = "{" + ", ".join(f"[{uid}] = true" for uid in sorted(members.uids)) + "}"
        body.append(f"    [{_lua_str(name)}] = {{ groups = {groups}, uids = {uids}{more} }},")
    if all_groups and set(missing) == all_groups:
        raise DsstageError(f"no group of any restricted dataset resolves ({', '.join(sorted(missing))}): the "
                           "directory service may be unreachable from this host, or the names misspelt; "
                           "the catalog is left as it was")
    for group, names in sorted(missing.items()):
        log.warning("group %s (dataset %s) does not exist here: it lets nobody in at submit time; "
                    "create the group or fix the configuration", group, ", ".join(names))
    body += ["  },", "}", ""]
    text = "\n".join(body)
    stamp = blake3.blake3(text.encode()).hexdigest()[:16]
    # the first line changes with the content: job_submit.lua re-reads the file when it does
    return f"-- dsstage catalog {stamp}, generated from {config.origin}: edit that file, not this one\n" + text


def slurm_series(version_text: str) -> str | None:
    """"24.11" from what ``scontrol --version`` prints ("slurm 24.11.5", "slurm-wlm 26.05.5")."""
    m = re.search(r"\b(\d+)\.(\d+)(?:\.\d+)?\s*$", version_text.strip())
    return f"{int(m.group(1))}.{m.group(2)}" if m else None
