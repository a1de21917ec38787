"""A dataset's versions over time: `dsstage manifest list`, `use` (a rollback) and `check`
(has the source moved on from its manifest?), with the real CLI on a real store."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import Env


def build(env: Env, name: str) -> str:
    return env.cli_json("manifest", "build", name)["digest"]


def test_versions_are_listed_a_rollback_is_staged_and_a_moved_source_is_found(env: Env):
    src = env.add("coco", {"a": b"1" * 1000, "d/b": b"2" * 3000})
    first = build(env, "coco")
    env.cli("stage", "coco", "--job-id", "1")
    (src / "d" / "b").write_bytes(b"3" * 3500)
    second = build(env, "coco")
    staged = env.cli_json("stage", "coco", "--job-id", "2")
    assert second[:16] in staged["path"]
    env.cli("report")  # the node's published report: which nodes hold which version

    listing = env.cli_json("manifest", "list", "coco")["versions"]
    assert [v["digest"] for v in listing] == [second, first]  # newest first
    assert [v["current"] for v in listing] == [True, False]
    assert listing[0]["nodes"] == {"ready": env.node} and listing[0]["bytes"] == 4500
    assert listing[1]["nodes"] and listing[1]["bytes"] == 4000
    text = env.cli("manifest", "list", "coco").stdout
    assert f"* {second[:16]}" in text and f"  {first[:16]}" in text and f"ready on {env.node}" in text, text

    # the source matches the current version; a changed and an added file are found, by size and mtime
    assert env.cli("manifest", "check", "coco").returncode == 0
    (src / "new").write_bytes(b"n")
    os.utime(src / "a", ns=(1, 1))
    res = env.cli("manifest", "check", "coco", check=False)
    assert res.returncode == 1 and "1 added, 0 removed, 1 changed" in res.stdout and "added: new" in res.stdout, \
        res.stdout
    data = json.loads(env.cli("manifest", "check", "coco", "--json", check=False).stdout)
    assert (data["added"], data["removed"], data["changed"], data["same"]) == (["new"], [], ["a"], False)
    (src / "new").unlink()

    # a rollback: the first version is current again, and the next job finds the node's copy of it
    res = env.cli("manifest", "use", "coco", "abc", check=False)
    assert res.returncode != 0 and "at least 8 hex digits" in res.stderr, res.stderr
    out = env.cli("manifest", "use", "coco", first[:10]).stdout
    assert f"version {first[:16]}" in out and f"was {second[:16]}" in out, out
    assert (env.state / "manifests" / "coco" / "CURRENT").read_text().strip() == first
    again = env.cli_json("stage", "coco", "--job-id", "3")
    assert first[:16] in again["path"] and again["action"] == "cached", again
    assert env.cli("manifest", "check", "coco", check=False).returncode == 1  # the source holds the second


def test_a_source_checked_elsewhere_and_a_missing_manifest(env: Env, tmp_path: Path):
    env.add("coco", {"a": b"1"})
    res = env.cli("manifest", "list", "coco", check=False)
    assert res.returncode != 0 and "has no manifest yet: run `dsstage manifest build coco`" in res.stderr
    build(env, "coco")
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    res = env.cli("manifest", "check", "coco", "--from", str(copy), "--json", check=False)
    data = json.loads(res.stdout)
    assert res.returncode == 1
    assert data["removed"] == ["a"] and not data["same"]
