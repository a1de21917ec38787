"""check-config on how plugstack.conf loads dsstage's SPANK plugin (dsstage.slurm.spank)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsstage.config import load
from dsstage.slurm import spank
from dsstage.slurm.conf import check_host

CONF = {"state_dir": "/shared/dsstage", "prolog_budget": 600, "placement": {"prefer": False},
        "tiers": {"nvme": {"path": "/local/nvme/{node}", "capacity": "3.5TB"}},
        "datasets": {"x": {"source": "/data/x", "tier": "nvme"}}}


def plugin_bytes(number: int) -> bytes:
    return b"\x7fELF...dsstage-spank built for SLURM_VERSION_NUMBER=" + hex(number).encode() + b";\0..."


def test_the_release_a_plugin_was_built_for_is_read_from_its_file():
    assert spank.built_for(plugin_bytes(0x160508)) == (22, 5, 8)
    assert spank.built_for(plugin_bytes(0x180b06)) == (24, 11, 6)
    assert spank.built_for(b"\x7fELF an older build") is None
    assert spank.series_of((26, 5, 5)) == "26.05"
    # the real build's: tests/unit/test_admin_guide.py::test_make_install_puts_the_plugin_in_the_multiarch_directory


def write_site(tmp_path: Path, plugstack: str, plugin: bytes | None) -> Path:
    (tmp_path / "lib").mkdir()
    if plugin is not None:
        (tmp_path / "lib" / "dsstage_spank.so").write_bytes(plugin)
    (tmp_path / "plugstack.conf.d").mkdir()
    (tmp_path / "plugstack.conf").write_text("include plugstack.conf.d/*.conf\n")
    (tmp_path / "plugstack.conf.d" / "dsstage.conf").write_text(plugstack)
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"PrologEpilogTimeout=900\nPrologFlags=Alloc\nPluginDir=/nonexistent:{tmp_path}/lib\n")
    return conf


@pytest.mark.parametrize("plugstack, plugin, series, expect", [
    ("optional {lib}/dsstage_spank.so\n", plugin_bytes(0x180b06), "24.11", []),
    ("optional dsstage_spank.so  # relative: PluginDir\n", plugin_bytes(0x180b06), "24.11", []),
    ("optional {lib}/dsstage_spank.so\n", plugin_bytes(0x160508), "24.11",
     [("error", "was built for Slurm 22.05.8 and this host runs 24.11")]),
    ("required {lib}/dsstage_spank.so\n", plugin_bytes(0x180b06), "24.11", [("note", "loads the plugin as required")]),
    ("optional {lib}/dsstage_spank.so\n", b"old", "24.11", [("note", "does not say which Slurm")]),
    ("optional {lib}/dsstage_spank.so\n", None, "24.11", [("error", "cannot be read")]),
    ("# optional {lib}/dsstage_spank.so\n", plugin_bytes(0x180b06), "24.11", [("note", "no plugstack.conf line")]),
    ("optional {lib}/dsstage_spank.so\n", plugin_bytes(0x160508), None, []),  # series unknown: not compared
])
def test_check_config_says_how_the_plugin_is_loaded_and_to_rebuild_it(tmp_path, plugstack, plugin, series, expect):
    conf = write_site(tmp_path, plugstack.format(lib=tmp_path / "lib"), plugin)
    _found, problems = check_host(load.from_dict(CONF), str(conf), series=series)
    got = [p for p in problems if p.key == "spank"]
    assert [p.level for p in got] == [level for level, _ in expect], got
    for p, (_level, needle) in zip(got, expect):
        assert needle in p.message, p.message
    if expect and "22.05.8" in expect[0][1]:
        assert "rebuild it against this Slurm" in got[0].message
