"""The verbs that see the cluster: ``status``, the ``demand-poller`` and ``prefetch``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict
from typing import Any

from dsstage.cli.common import emit, live_reports, load_config
from dsstage.cluster import poller as cluster_poller
from dsstage.cluster import status, status_view
from dsstage.slurm import client as slurm_client

log = logging.getLogger("dsstage")


def cmd_demand_poller(args: argparse.Namespace) -> int:
    conf = load_config(args)
    if not args.debug:
        logging.getLogger().setLevel(logging.INFO)
    return cluster_poller.run(conf, slurm_client.client(conf.slurm_bin), once=args.once, interval=args.interval)


def cmd_prefetch(args: argparse.Namespace) -> int:
    from dsstage.cluster import prefetch
    conf = load_config(args)
    if not args.debug:
        logging.getLogger().setLevel(logging.INFO)
    pre = prefetch.Prefetcher(conf, args.node or "", config_path=args.config)
    if not args.dry_run:
        return pre.run(once=args.once)
    cands, skips, dem = pre.candidates()
    data = {"node": pre.node, "stale": dem.stale, "prefetch": [c.to_dict() for c in cands],
            "skipped": [asdict(s) for s in skips]}

    def text() -> None:
        if dem.stale:
            print(f"{pre.node}: the demand snapshot is stale or missing: nothing would be prefetched")
        for c in cands:
            print(f"{pre.node}: would prefetch {c.dataset}: {c.reason}")
        for s in skips:
            print(f"{pre.node}: not {s.dataset} (job {s.job_id}): {s.reason}")
        if not (cands or skips or dem.stale):
            print(f"{pre.node}: no pending job is planned here")
    emit(args, data, text)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    conf = load_config(args)
    from dsstage.ui import console
    filt = status.Filter.parse(dataset=args.dataset, nodes=args.nodes, user=args.user, job=args.job)
    client = None if args.no_queue else slurm_client.client(conf.slurm_bin)
    reports, unreachable = None, None
    if args.live:
        reports, unreachable = live_reports(args, conf, args.nodes, client)
    whole = status.collect(conf, client, reports=reports, unreachable=unreachable)
    whole = status.as_seen_by(conf, whole, os.getuid())
    st = status.select(whole, filt) if filt else whole
    maps: dict[str, dict[str, Any]] = {}
    if args.job:
        from dsstage.cluster import shardmaps
        job, nodes = status.job_of(whole, args.job)
        maps = shardmaps.for_job(conf, job, nodes) if job and whole.sharded else {}
    explain = status.explain_job(whole, args.job, maps) if args.job else ""

    def text() -> None:
        out = console()
        plain = not out.is_terminal
        if args.job:  # the question was about one job: its answer alone (--json has the rest)
            if plain:
                import textwrap
                print(textwrap.fill(explain, status_view.WIDTH))
            else:
                out.print(explain)
            return
        secs = status_view.sections(st, show_queue=not args.no_queue, plain=plain, all_rows=args.all)
        if plain:
            sys.stdout.write(status_view.render_plain(st, secs))
        else:
            status_view.render_rich(st, secs, out)
    if args.json:
        data = status.to_json(st)
        if args.job:
            data["explain"] = explain
            data["shard_maps"] = maps
        emit(args, data, text)
    else:
        text()
    return 0
