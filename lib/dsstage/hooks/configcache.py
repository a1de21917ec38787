"""The configuration cache: what the warm paths need of the configuration, without YAML.

The full Prolog (dsstage.hooks.job) and the full ``dsstage stage`` write it in the run
directory after loading the configuration; the warm Prolog (dsstage.hooks.warm) and the fast
``dsstage stage`` (dsstage.cli.fast) read it, and only while the configuration file is in
the very state it was written for (dsstage.fs.runfiles.load_cache).
"""

from __future__ import annotations

import logging

from dsstage.config.model import Config
from dsstage.errors import DsstageError
from dsstage.fs import runfiles
from dsstage.hooks import bbrequest
from dsstage.hostlist import expand_nodes

log = logging.getLogger(__name__)


def write_config_cache(run_dir: str, conf: Config) -> None:
    """What the warm path needs of the configuration, keyed by the file's exact state."""
    record = runfiles.cache_record(conf.origin, conf.state_dir, {
        name: {"root": conf.tiers[ds.tier].path, "tier": ds.tier, "verify": ds.verify,
               "groups": list(ds.groups) if ds.groups is not None else None, "shards": ds.shards}
        for name, ds in conf.datasets.items()}, conf.report.user)
    if record["key"] is None:
        return
    try:
        record["bb_uid"] = bbrequest.writer_uid(conf.burst_buffer.user)
        record["prolog_budget"] = conf.prolog_budget  # what bounds the hooks (dsstage.hooks.__main__)
        record["hash_threads"] = conf.transfer.hash_threads  # the fast verify --full (dsstage.cli.fast)
        record["rollout_partitions"] = list(conf.rollout.partitions) if conf.rollout.partitions is not None else None
        record["rollout_nodes"] = expand_nodes(conf.rollout.nodes) if conf.rollout.nodes is not None else None
        runfiles.write_cache(run_dir, record)
    except (OSError, DsstageError) as exc:
        log.warning("cannot write the configuration cache in %s: %s", run_dir, exc)
