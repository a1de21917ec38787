"""`dsstage manifest build` of a dataset with ``shards: N``: the version's shards (each a
manifest of its own, and an index) are written before CURRENT names the version, an
unchanged shard keeps its manifest across versions, `manifest list` shows versions only,
and the manifest GC keeps what the current version and the nodes need."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from dsstage.cluster import manifests_gc
from dsstage.config import manifest as config_manifest
from dsstage.errors import ManifestError
from dsstage.shards import index as shard_index
from helpers import Env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the store is root-owned: run as root")

FILES = {f"train-{i:05d}-of-00012": bytes([i]) * (1000 + 10 * i) for i in range(12)}


def test_a_sharded_build_writes_its_shards_first(env: Env):
    env.add("big", FILES, shards=3)
    built = env.cli_json("manifest", "build", "big")
    assert built["shards"]["count"] == 3 and built["shards"]["files_min"] == built["shards"]["files_max"] == 4
    catalog = config_manifest.Catalog(str(env.state))
    index = shard_index.load(catalog, "big", built["digest"], 3)
    assert [s.files for s in index.shards] == [4, 4, 4] and index.bytes == built["bytes"]
    parts = [shard_index.shard_manifest(catalog, "big", s, built["digest"]) for s in index.shards]
    assert [e.path for p in parts for e in p.entries] == sorted(FILES)  # contiguous, in order, all of it
    assert all(p.shard_of == built["digest"] for p in parts)
    assert "3 shards of" in env.cli("manifest", "build", "big").stdout
    assert next(r for r in env.cli_json("ls") if r["name"] == "big")["shards"] == 3
    assert [v["digest"] for v in env.cli_json("manifest", "list", "big")["versions"]] == [built["digest"]]
    with pytest.raises(ManifestError, match="was not split into 4 shards.*manifest build big"):
        shard_index.load(catalog, "big", built["digest"], 4)

    # a new version: the shards whose files did not change keep their manifests (and so their copies)
    (env.source("big") / "train-00011-of-00012").write_bytes(b"changed")
    again = env.cli_json("manifest", "build", "big")
    new = shard_index.load(catalog, "big", again["digest"], 3)
    assert [s.id for s in new.shards[:2]] == [s.id for s in index.shards[:2]] and new.shards[2].id != index.shards[2].id

    # the GC keeps the current version and its shards, and what a node holds; the rest goes
    env.extra["retention"] = {"manifest_keep": "1s"}
    env.write()
    past = time.time() + 3600
    removed = {digest for _name, digest in manifests_gc.prune(env.config(), past)}
    assert removed == {built["digest"], index.shards[2].digest}
    left = sorted(os.listdir(catalog.dir("big")))
    assert shard_index.index_name(built["digest"], 3) not in left  # the old version's index went with it
    assert shard_index.index_name(again["digest"], 3) in left
    for s in new.shards:
        assert f"{s.digest}.manifest" in left


def check_config(env: Env, slurm_conf) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dsstage", "check-config"], text=True, capture_output=True,
                          env={**env.env(), "SLURM_CONF": str(slurm_conf)})


def test_check_config_says_how_big_the_shards_are_and_when_parts_get_uneven(env: Env, tmp_path):
    env.add("big", FILES, shards=6)
    env.cli("manifest", "build", "big")
    conf = tmp_path / "slurm.conf"
    conf.write_text("NodeName=n[1-4]\nPrologEpilogTimeout=900\n")
    res = check_config(env, conf)
    notes = [line for line in res.stdout.splitlines() if "datasets.big.shards" in line]
    assert any("6 shards of" in line and "2 to 2 files" in line for line in notes), res.stdout
    assert any("a job on 4 nodes gets 1 or 2 shards per node" in line and "at least 40" in line for line in notes), \
        res.stdout
    # what its on_failure means for a job whose node cannot stage its part
    assert "note: datasets.big.on_failure: a node whose part fails to stage reads that part at the source" \
        in res.stdout, res.stdout
    env.datasets["big"]["shards"] = 4
    env.write()
    res = check_config(env, conf)
    assert "was not split into 4 shards" in res.stdout and "manifest build big" in res.stdout, res.stdout
