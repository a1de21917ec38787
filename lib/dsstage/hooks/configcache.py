"""The configuration cache: the warm configuration (dsstage.ready.warmconf) built from ``Config``.

The full Prolog (dsstage.hooks.job) and the full ``dsstage stage`` write it in the run
directory after loading the configuration; the warm Prolog (dsstage.hooks.warm) and the fast
``dsstage stage`` (dsstage.cli.fast) read it, and only while the configuration file is in
the very state it was written for (dsstage.fs.runfiles.load_cache).
"""

from __future__ import annotations

import logging

from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.hooks import bbrequest
from dsstage.hostlist import expand_nodes
from dsstage.ready import warmconf

log = logging.getLogger(__name__)


def warm_config(conf: Config) -> warmconf.WarmConfig:
    """What the warm paths read of ``conf``."""
    datasets = {name: warmconf.WarmDataset(name, {
        "root": conf.tiers[ds.tier].path, "tier": ds.tier, "verify": ds.verify,
        "groups": list(ds.groups) if ds.groups is not None else None, "shards": ds.shards}).record()
        for name, ds in conf.datasets.items()}
    return warmconf.WarmConfig(conf.state_dir, datasets, {
        "report_user": conf.report.user,
        "bb_uid": bbrequest.writer_uid(conf.burst_buffer.user),
        "prolog_budget": conf.prolog_budget,  # what bounds the hooks (dsstage.hooks.__main__)
        "hash_threads": conf.transfer.hash_threads,  # the fast verify --full (dsstage.cli.fast)
        "rollout_partitions": list(conf.rollout.partitions) if conf.rollout.partitions is not None else None,
        "rollout_nodes": expand_nodes(conf.rollout.nodes) if conf.rollout.nodes is not None else None})


def write_config_cache(run_dir: str, conf: Config) -> None:
    """What the warm path needs of the configuration, keyed by the file's exact state."""
    try:
        warmconf.write(run_dir, conf.origin, warm_config(conf))
    except (OSError, ValueError, DsstageError) as exc:
        log.warning("cannot write the configuration cache in %s: %s", run_dir, exc)
