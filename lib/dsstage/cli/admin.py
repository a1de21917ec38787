"""The admins' and data owners' verbs: ``check-config``, ``ls``, ``manifest build``,
``export-catalog`` and ``simulate``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from dsstage.cli.common import emit, load_config, need_write, reader_of
from dsstage.config import catalog as cat
from dsstage.config import load, model
from dsstage.config import manifest as config_manifest
from dsstage.errors import DsstageError, NotPermitted
from dsstage.fs.safe import write_atomic
from dsstage.node import access
from dsstage.node.local import node_name
from dsstage.shards import index as shard_index
from dsstage.slurm import conf as slurm_conf
from dsstage.transfer import build as transfer_build
from dsstage.units import human

log = logging.getLogger("dsstage")


def cmd_check_config(args: argparse.Namespace) -> int:
    conf = load_config(args)
    slurm, problems = slurm_conf.check_host(conf, series=installed_series(conf), node=args.node or node_name())
    problems += tier_problems(conf, args.node or node_name())
    problems += shard_problems(conf, slurm.get("largest_job"))
    problems += access_notes(conf)
    from dsstage import __version__
    problems += [slurm_conf.Problem("note", key, f"unknown to dsstage {__version__}, like no key it knows: ignored "
                                    "(a newer dsstage's key? upgrade this host; a misspelling? fix it)")
                 for key in conf.unknown_keys]
    from dsstage.node import statedir
    problems += [slurm_conf.Problem(level, key, msg) for level, key, msg in statedir.problems(conf)]
    errors = [p for p in problems if p.level == "error"]
    data = {"config": conf.origin, "ok": not errors, "state_dir": conf.state_dir, "on_failure": conf.on_failure,
            "slurm_bin": conf.slurm_bin, "prolog_budget": conf.prolog_budget, "source_user": conf.source_user,
            "slurm": slurm, "peers": {"enabled": conf.peers.enabled, "port": conf.peers.port},
            "tiers": {t.name: {"path": t.path, "capacity": t.capacity, "high_watermark": t.high_watermark,
                               "low_watermark": t.low_watermark} for t in conf.tiers.values()},
            "datasets": sorted(conf.datasets),
            "problems": [{"level": p.level, "key": p.key, "message": p.message} for p in problems]}

    def text() -> None:
        print(f"{conf.origin}: {'OK' if not errors else f'{len(errors)} error(s)'}")
        print(f"  state_dir      {conf.state_dir}")
        print(f"  slurm_bin      {conf.slurm_bin}")
        timeout = slurm["prolog_epilog_timeout"]
        limit = "not read" if not slurm["read"] else "none, slurmd waits" if timeout is None else f"{timeout:g}s"
        key = slurm.get("prolog_timeout_key", "PrologEpilogTimeout")
        print(f"  prolog_budget  {conf.prolog_budget:g}s ({key}: {limit}, margin {slurm_conf.PROLOG_MARGIN:g}s)")
        print(f"  source_user    {conf.source_user or 'root (default)'}")
        for t in conf.tiers.values():
            cap = f"{t.capacity:.0%} of the filesystem" if isinstance(t.capacity, float) else human(t.capacity)
            marks = f"{t.low_watermark:.0%}-{t.high_watermark:.0%}"
            print(f"  tier {t.name:<8} {t.path}  capacity {cap}  watermarks {marks}")
        peers = (f"on, port {conf.peers.port}, secret {conf.peers.secret_file}" if conf.peers.enabled
                 else "off (every node reads from the source alone)")
        print(f"  peers          {peers}")
        print(f"  {len(conf.datasets)} dataset(s): {', '.join(sorted(conf.datasets)) or '-'}")
        for p in problems:
            if p.level == "note":
                print(f"  note: {p.key}: {p.message}")
    emit(args, data, text)
    for p in errors:
        print(f"dsstage: error: {conf.origin}: {p.key}: {p.message}", file=sys.stderr)
    return load.ConfigError.exit_code if errors else 0


def access_notes(conf: model.Config) -> list[slurm_conf.Problem]:
    """When the restricted datasets' access reaches the nodes (dsstage.node.inventory.reapply_access)."""
    restricted = sorted(ds.name for ds in conf.datasets.values() if ds.groups is not None)
    if not restricted:
        return []
    return [slurm_conf.Problem("note", "datasets.*.groups",
                               f"{len(restricted)} restricted dataset(s) ({', '.join(restricted[:5])}"
                               f"{', ...' if len(restricted) > 5 else ''}): a change of groups reaches the copies and "
                               "views a node already holds at its next report refresh (a job's Prolog or Epilog, "
                               "`dsstage report`, dsstage-report.timer), and every new copy at once")]


def shard_problems(conf: model.Config, largest_job: int | None) -> list[slurm_conf.Problem]:
    """For each sharded dataset: how big its shards are, and how uneven a job's per-node
    parts get for the job sizes slurm.conf allows (``largest_job`` nodes at most)."""
    from dsstage.hooks.shardjob import failure_note
    from dsstage.shards.split import worst_unevenness
    out = []
    manifests = config_manifest.Catalog(conf.state_dir)
    for ds in sorted(conf.datasets.values(), key=lambda d: d.name):
        if not ds.shards:
            continue
        key = f"datasets.{ds.name}.shards"
        out.append(slurm_conf.Problem("note", f"datasets.{ds.name}.on_failure", failure_note(ds)))
        try:
            index = shard_index.load(manifests, ds.name, manifests.require_current(ds.name), ds.shards)
        except DsstageError as exc:
            out.append(slurm_conf.Problem("note", key, str(exc)))
            continue
        out.append(slurm_conf.Problem("note", key, describe_shards(shard_sizes(index))))
        worst, at = worst_unevenness(ds.shards, largest_job or 0)
        if worst > 0.1:
            out.append(slurm_conf.Problem("note", key, (
                f"a job on {at} nodes gets {ds.shards // at} or {-(-ds.shards // at)} shards per node: some nodes "
                f"hold {worst:.0%} more than others, and data-parallel ranks wait for the slowest; jobs here may "
                f"have up to {largest_job} nodes: choose shards of at least {10 * (largest_job or 1)} (ten per node "
                "of the largest job), aligned with the dataset's own record files")))
    return out


def tier_problems(conf: model.Config, node: str) -> list[slurm_conf.Problem]:
    """The tiers of this host that cannot hold what the catalog puts on them: one on the root
    filesystem that is not meant to be there (a disk not mounted), and a dataset with several
    groups needs POSIX ACLs. A tier that does not exist here is not checked for ACLs."""
    from dsstage.fs import safe
    out = []
    for tier in conf.tiers.values():
        on_root = None if tier.root_filesystem else safe.root_filesystem_problem(tier.root(node))
        if on_root:  # an error where the tier is (a compute node); elsewhere what a node would do
            there = os.path.isdir(tier.root(node))
            out.append(slurm_conf.Problem("error" if there else "note", f"tiers.{tier.name}", on_root if there else
                                          f"on this host, {on_root} (a compute node's Prolog refuses it and drains)"))
            continue
        several = sorted(d.name for d in conf.datasets.values() if d.tier == tier.name and len(d.groups or ()) > 1)
        if not several:
            continue
        root = tier.root(node)
        try:
            why = access.acl_problem(root)
        except FileNotFoundError:
            out.append(slurm_conf.Problem("note", f"tiers.{tier.name}", f"{root} does not exist on this host: "
                                          "run check-config on a compute node to check its POSIX ACLs"))
            continue
        except (OSError, DsstageError) as exc:
            why = f"{root}: cannot check POSIX ACLs ({exc})"
        if why:
            out.append(slurm_conf.Problem("error", f"tiers.{tier.name}",
                                          f"{why}; {', '.join(several)} name several groups"))
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    conf = load_config(args)
    manifests = config_manifest.Catalog(conf.state_dir)
    rows = []
    for ds in sorted(conf.datasets.values(), key=lambda d: d.name):
        row: dict[str, Any] = {"name": ds.name, "source": ds.source.raw, "tier": ds.tier,
                               "groups": list(ds.groups) if ds.groups else None, "verify": ds.verify,
                               "on_failure": ds.on_failure, "version": None, "files": None, "bytes": None,
                               "shards": ds.shards}
        try:
            digest = manifests.current(ds.name)
            if digest:
                header = config_manifest.read_header(manifests.path(ds.name, digest))
                row.update(version=digest[:16], files=header.get("files"), bytes=header.get("bytes"))
        except DsstageError as exc:
            row["problem"] = str(exc)
        rows.append(row)

    def text() -> None:
        from rich.table import Table

        from dsstage.ui import console
        table = Table(title="dsstage catalog", title_justify="left")
        for col in ("dataset", "version", "files", "size", "tier", "groups", "source"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["name"], r["version"] or "[yellow]no manifest[/]",
                          str(r["files"] if r["files"] is not None else "-"),
                          (human(int(r["bytes"])) if r["bytes"] is not None else "-")
                          + (f" in {r['shards']} shards" if r["shards"] else ""), r["tier"],
                          ",".join(r["groups"]) if r["groups"] else "everyone", r["source"])
        console().print(table)
    emit(args, rows, text)
    return 0


def source_root(ds: model.Dataset, from_path: str | None, verb: str) -> str:
    """Where ``manifest build|check`` reads the dataset: ``--from``, or a mounted source."""
    if from_path:
        return from_path
    if ds.source.kind == "local":
        return ds.source.path
    raise DsstageError(f"dataset {ds.name!r} comes from {ds.source.raw}; {verb} its manifest where the data is "
                       f"mounted: dsstage manifest {verb} {ds.name} --from /mounted/path")


def cmd_manifest_build(args: argparse.Namespace) -> int:
    conf = load_config(args)
    ds = cat.lookup(conf, args.name)
    manifests = config_manifest.Catalog(conf.state_dir)
    need_write("manifest build", manifests.dir(ds.name))
    root = source_root(ds, args.from_path, "build")
    previous = None
    if manifests.current(ds.name):
        try:
            previous = manifests.load(ds.name)
        except DsstageError as exc:
            log.warning("previous manifest unusable, hashing everything: %s", exc)
    from dsstage.ui import progress_bar
    with progress_bar(f"hashing {ds.name}", enabled=not args.json) as advance:
        how = transfer_build.ReadOptions(reader_of(conf), conf.transfer.hash_threads, conf.transfer.max_parallel)
        report = transfer_build.build(ds.name, root, source=ds.source.raw, previous=previous, how=how,
                                      progress=advance)
    m = report.manifest
    # a sharded dataset's shards are written before CURRENT names the version: no Prolog sees one without them
    shards = shard_index.publish(manifests, m, ds.shards) if ds.shards else None
    path = manifests.publish(m)
    data = {"dataset": ds.name, "digest": m.digest, "version": m.digest[:16], "files": m.files,
            "bytes": m.total_bytes, "hashed": report.hashed, "reused": report.reused,
            "unchanged": report.unchanged, "path": path,
            "skipped": {k: len(v) for k, v in report.skipped.items()}}
    sizes = shard_sizes(shards) if shards else None
    if sizes:
        data["shards"] = sizes

    def text() -> None:
        print(f"{ds.name}: version {m.digest[:16]}{' (unchanged)' if report.unchanged else ''}, "
              f"{m.files} files, {human(m.total_bytes)}; hashed {report.hashed}, reused {report.reused}")
        if sizes:
            print(f"  {describe_shards(sizes)}")
        for kind, paths in sorted(report.skipped.items()):
            print(f"  skipped {len(paths)} {kind}(s), e.g. {paths[0]!r}: a manifest holds regular files only")
        print(f"  {path}")
    emit(args, data, text)
    return 0


def shard_sizes(index: shard_index.Index) -> dict[str, int]:
    """How big a version's shards are: their count, and the least and most bytes and files."""
    return {"count": index.count, "bytes_min": min(s.bytes for s in index.shards),
            "bytes_max": max(s.bytes for s in index.shards), "files_min": min(s.files for s in index.shards),
            "files_max": max(s.files for s in index.shards)}


def describe_shards(sizes: dict[str, int]) -> str:
    return (f"{sizes['count']} shards of {human(sizes['bytes_min'])} to {human(sizes['bytes_max'])} "
            f"({sizes['files_min']} to {sizes['files_max']} files)")


def _versions(conf: model.Config, name: str) -> list[dict[str, Any]]:
    """Every manifest of ``name``, newest first: version, when, files, bytes, current, and the
    nodes whose published reports hold it (ready or otherwise)."""
    from dsstage.cluster import reports
    from dsstage.hostlist import fold_nodes
    manifests = config_manifest.Catalog(conf.state_dir)
    current = manifests.current(name)
    holders: dict[str, dict[str, list[str]]] = {}
    for rep in reports.read_all(conf.state_dir):
        for c in rep["copies"]:
            if c.get("dataset") == name and isinstance(c.get("version"), str):
                holders.setdefault(c["version"], {}).setdefault(str(c.get("state")), []).append(rep["node"])
    out = []
    try:
        files = [f for f in os.listdir(manifests.dir(name)) if f.endswith(config_manifest.SUFFIX)]
    except FileNotFoundError:
        files = []
    for f in files:
        path = os.path.join(manifests.dir(name), f)
        try:
            header = config_manifest.read_header(path)
        except DsstageError as exc:
            out.append({"version": f[:16], "digest": f[:-len(config_manifest.SUFFIX)], "problem": str(exc),
                        "current": False, "created": 0.0, "files": 0, "bytes": 0, "nodes": {}})
            continue
        digest = str(header["digest"])
        if header.get("shard_of"):
            continue  # a shard of a version (dsstage.shards.index), not a version
        try:  # what the digest does not cover is checked where it is shown
            created, nbytes = config_manifest.header_created(header, path), config_manifest.header_bytes(header, path)
            count = header["files"] if type(header.get("files")) is int else 0
        except DsstageError as exc:
            out.append({"version": digest[:16], "digest": digest, "problem": str(exc), "current": digest == current,
                        "created": 0.0, "files": 0, "bytes": 0, "nodes": {}})
            continue
        out.append({"version": digest[:16], "digest": digest, "current": digest == current,
                    "created": created, "files": count, "bytes": nbytes,
                    "nodes": {state: fold_nodes(nodes) for state, nodes in
                              sorted(holders.get(digest[:16], {}).items())}})
    return sorted(out, key=lambda v: -v["created"])


def cmd_manifest_list(args: argparse.Namespace) -> int:
    conf = load_config(args)
    ds = cat.lookup(conf, args.name)
    rows = _versions(conf, ds.name)
    if not rows:
        raise DsstageError(f"dataset {ds.name!r} has no manifest yet: run `dsstage manifest build {ds.name}`")

    def text() -> None:
        import datetime
        for v in rows:
            when = datetime.datetime.fromtimestamp(v["created"]).strftime("%Y-%m-%d %H:%M") if v["created"] else "?"
            held = "; ".join(f"{state} on {nodes}" for state, nodes in v["nodes"].items()) or "on no node"
            mark = "* " if v["current"] else "  "
            print(f"{mark}{v['version']}  {when}  {v['files']} files  {human(v['bytes'])}  {held}"
                  + (f"  ({v['problem']})" if v.get("problem") else ""))
        print("(* the current version: what jobs stage; `dsstage manifest use NAME VERSION` makes another one "
              "current)")
    emit(args, {"dataset": ds.name, "versions": rows}, text)
    return 0


def cmd_manifest_use(args: argparse.Namespace) -> int:
    conf = load_config(args)
    ds = cat.lookup(conf, args.name)
    manifests = config_manifest.Catalog(conf.state_dir)
    need_write("manifest use", manifests.dir(ds.name))
    wanted = args.version.lower()
    matches = [v for v in _versions(conf, ds.name) if v["digest"].startswith(wanted) and not v.get("problem")]
    if len(wanted) < 8 or len(matches) != 1:
        known = ", ".join(v["version"] for v in _versions(conf, ds.name)) or "none"
        raise DsstageError(f"{ds.name}: {args.version!r} names {'no' if not matches else 'more than one'} version "
                           f"(give at least 8 hex digits of one of: {known}); `dsstage manifest list {ds.name}`")
    chosen = matches[0]
    m = manifests.load(ds.name, chosen["digest"])  # checks it whole: its digest, its paths
    if ds.shards:
        shard_index.publish(manifests, m, ds.shards)  # split as the configuration says now
    before = manifests.current(ds.name)
    write_atomic(os.path.join(manifests.dir(ds.name), config_manifest.CURRENT), m.digest + "\n")
    log.warning("%s: current version set to %s (was %s) by `dsstage manifest use`", ds.name, m.digest[:16],
                (before or "none")[:16])
    data = {"dataset": ds.name, "current": m.digest, "previous": before}
    emit(args, data, lambda: print(
        f"{ds.name}: version {m.digest[:16]} ({m.files} files, {human(m.total_bytes)}) is current again "
        f"(was {(before or 'none')[:16]}): jobs that start from now stage it; running jobs keep theirs. Nodes "
        f"holding it: {'; '.join(f'{s} on {n}' for s, n in chosen['nodes'].items()) or 'none'}. Others stage "
        f"it from the source, which must hold this version's data: `dsstage manifest check {ds.name}` says"))
    return 0


def cmd_manifest_check(args: argparse.Namespace) -> int:
    conf = load_config(args)
    ds = cat.lookup(conf, args.name)
    manifests = config_manifest.Catalog(conf.state_dir)
    m = manifests.load(ds.name)
    root = source_root(ds, args.from_path, "check")
    d = transfer_build.drift(m, root, reader=reader_of(conf), max_parallel=conf.transfer.max_parallel,
                             threads=conf.transfer.hash_threads)
    data = {"dataset": ds.name, "version": m.digest[:16], "same": d.same, "added": d.added, "removed": d.removed,
            "changed": d.changed}

    def text() -> None:
        if d.same:
            print(f"{ds.name}: {root} matches version {m.digest[:16]} ({m.files} files, by size and mtime)")
            return
        print(f"{ds.name}: {root} no longer matches version {m.digest[:16]}: {len(d.added)} added, "
              f"{len(d.removed)} removed, {len(d.changed)} changed (size or mtime). Stages of this version now "
              f"fail verification; run `dsstage manifest build {ds.name}` once the data is final.")
        for kind, paths in (("added", d.added), ("removed", d.removed), ("changed", d.changed)):
            for p in paths[:args.limit]:
                print(f"  {kind}: {p}")
            if len(paths) > args.limit:
                print(f"  ... {len(paths) - args.limit} more {kind}")
    emit(args, data, text)
    return 0 if d.same else 1


def cmd_state_dir_init(args: argparse.Namespace) -> int:
    """``dsstage state-dir init``: the layout of dsstage.node.statedir, made and owned."""
    from dsstage.node import statedir
    conf = load_config(args)
    try:
        done = statedir.init(conf)
    except OSError as exc:
        raise NotPermitted(f"cannot make or give {exc.filename or conf.state_dir} ({exc.strerror}): run "
                           "`dsstage state-dir init` where root may chown there (on the NFS server, or a client "
                           "whose root is not squashed)") from None
    emit(args, {"state_dir": conf.state_dir, "done": done}, lambda: print(
        "\n".join(done) or f"{conf.state_dir}: every directory exists with its owner"))
    return 0


def cmd_disable(args: argparse.Namespace) -> int:
    """``dsstage disable --reason TEXT``: off on every node at once (jobs read their sources)."""
    import getpass
    import time

    from dsstage.fs.identity import writing_as
    from dsstage.node import rollout
    conf = load_config(args)
    need_write("disable", conf.state_dir)
    record = {"reason": " ".join(args.reason.split()), "by": os.environ.get("SUDO_USER") or getpass.getuser(),
              "time": time.time()}
    with writing_as(conf.report.user):
        path = rollout.write_switch(conf.state_dir, record)
    log.warning("dsstage disabled on the whole cluster by %s: %s", record["by"], record["reason"])
    emit(args, {"disabled": True, **record, "path": path}, lambda: print(
        f"dsstage is disabled on every node ({path}): from the next job on, a job that asks for a dataset runs "
        "against its source with a warning, never held; leases are still given back and nothing is prefetched. "
        "`dsstage enable` turns it back on."))
    return 0


def cmd_enable(args: argparse.Namespace) -> int:
    from dsstage.fs.identity import writing_as
    from dsstage.node import rollout
    conf = load_config(args)
    need_write("enable", conf.state_dir)
    with writing_as(conf.report.user):
        was = rollout.clear_switch(conf.state_dir)
    if was:
        log.warning("dsstage enabled again on the whole cluster")
    emit(args, {"disabled": False, "was_disabled": was}, lambda: print(
        "dsstage is enabled again: the next Prologs stage" if was else "dsstage was not disabled"))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from dsstage.policy.sim import cli as simulate
    return simulate.main(args.args)


def installed_series(conf: model.Config) -> str | None:
    """The Slurm series of this host's commands (scontrol --version: no call to slurmctld), or
    None where it cannot be told."""
    from dsstage import proc
    from dsstage.errors import CommandError
    from dsstage.slurm import luacatalog
    try:
        out = proc.run([conf.slurm_command("scontrol"), "--version"], timeout=10, check=False).stdout
    except (CommandError, OSError):
        return None
    return luacatalog.slurm_series(out)


def make_status_dir(conf: model.Config) -> None:
    """``burst_buffer.status_dir``: Slurm's SlurmUser's (burst_buffer.user, else root) alone."""
    path = conf.burst_buffer.status_dir
    owner = 0
    if conf.burst_buffer.user:
        import pwd
        try:
            owner = pwd.getpwnam(conf.burst_buffer.user).pw_uid
        except KeyError:
            log.warning("burst_buffer.user %s does not exist here: %s is left to root", conf.burst_buffer.user, path)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, owner, -1)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def cmd_export_catalog(args: argparse.Namespace) -> int:
    from dsstage.slurm import luacatalog
    conf = load_config(args)
    # how burst_buffer.lua runs dsstage on this host: this installation, this configuration
    here = os.path.join(os.path.dirname(sys.executable), "dsstage")
    command = [here if os.access(here, os.X_OK) else "/usr/bin/dsstage", "--config", os.path.abspath(conf.origin)]
    text = luacatalog.render(conf, command=command, slurm_version=installed_series(conf), sized=luacatalog.sizes(conf))
    if args.output:
        need_write("export-catalog", args.output)
        write_atomic(os.path.abspath(args.output), text)
        if os.geteuid() == 0:  # where burst_buffer.lua finds its bbstat answers (cluster.bbstat)
            make_status_dir(conf)
    else:
        sys.stdout.write(text)
    return 0
