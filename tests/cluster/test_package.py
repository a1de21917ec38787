"""The devcluster runs the dsstage it was asked to run: the checkout's, or with
DSSTAGE_FROM_PACKAGE=1 only what the installed packages put on the system.

packaging/run-tests (no arguments, as CI runs it) runs the cluster tests twice: from the
checkout, then, after packaging/build-deb and installing the .debs, with
DSSTAGE_FROM_PACKAGE=1. These tests check that each pass runs what it claims to.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
FROM_PACKAGE = os.environ.get("DSSTAGE_FROM_PACKAGE", "0") not in ("", "0")
HOOKS = ("dsstage-prolog", "dsstage-taskprolog", "dsstage-epilog")
LUA = ("job_submit.lua", "dsstage_submit.lua", "burst_buffer.lua")


def read_defaults(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def with_defaults(script: str, defaults: Path) -> str:
    """``script`` as installed to read ``defaults`` (what `make install-hooks DEFAULTS=` does)."""
    lines = script.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.startswith("defaults=")]
    assert len(at) == 1, "each hook script has one defaults= line"
    lines[at[0]] = lines[at[0]].replace("/etc/default/dsstage", str(defaults))
    return "".join(lines)


def package_of(path: str) -> str:
    """The Debian package that installed ``path`` (dpkg -S), or fail."""
    res = subprocess.run(["dpkg-query", "-S", path], text=True, capture_output=True)
    assert res.returncode == 0, f"{path} belongs to no package: {res.stderr}"
    return res.stdout.split(":", 1)[0]


def selected(cluster) -> dict[str, object]:
    """Where the hooks, the Lua files, the plugin and the Python come from in this pass."""
    if cluster.series != "22.05":  # the checkout, in the series' root (packaging/devcluster)
        return {"python": "/opt/dsstage-venv/bin/python", "cli": str(cluster.dir / "bin" / "dsstage"),
                "hooks": None, "lua": ROOT / "sbatch_ext"}
    if FROM_PACKAGE:
        return {"python": "/usr/lib/dsstage/venv/bin/python", "cli": "/usr/bin/dsstage",
                "hooks": Path("/usr/libexec/dsstage"), "lua": Path("/usr/share/dsstage/lua")}
    return {"python": str(ROOT / ".venv" / "bin" / "python"), "cli": str(ROOT / ".venv" / "bin" / "dsstage"),
            "hooks": None, "lua": ROOT / "sbatch_ext"}


def test_the_cluster_runs_the_selected_dsstage(cluster):
    sel = selected(cluster)
    defaults = cluster.etc / "defaults"
    assert read_defaults(defaults)["DSSTAGE_PYTHON"] == sel["python"]
    origin = {"dsstage-prolog": ROOT / "prolog", "dsstage-taskprolog": ROOT / "prolog",
              "dsstage-epilog": ROOT / "epilog"}
    for hook in HOOKS:
        source = (sel["hooks"] or origin[hook]) / hook
        assert (cluster.dir / "hooks" / hook).read_text() == with_defaults(source.read_text(), defaults), hook
    for name in LUA:
        assert (cluster.etc / name).read_bytes() == (sel["lua"] / name).read_bytes(), name
    plugstack = (cluster.etc / "plugstack.conf").read_text().split()
    where = "import dsstage; print(dsstage.__file__)"
    imported = subprocess.run(cluster.in_root(str(sel["python"]), "-I", "-c", where),
                              cwd="/", text=True, capture_output=True, check=True).stdout.strip()
    if not FROM_PACKAGE:
        assert plugstack == ["optional", f"{cluster.dir}/lib/dsstage_spank.so"]
        assert Path(imported).is_relative_to(ROOT / "lib")
        return
    assert Path(imported).is_relative_to("/usr/lib/dsstage/venv")
    assert plugstack == ["include", "/etc/slurm/plugstack.conf.d/dsstage.conf"]
    snippet = [line.split() for line in Path(plugstack[1]).read_text().splitlines() if line and line[0] != "#"]
    arch = subprocess.run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"], text=True, capture_output=True,
                          check=True).stdout.strip()
    plugin = f"/usr/lib/{arch}/slurm-wlm/dsstage_spank.so"
    assert snippet == [["optional", plugin]]
    assert package_of(plugin) == package_of(plugstack[1]) == "dsstage-spank"
    for path in [sel["cli"], *(f"{sel['hooks']}/{h}" for h in HOOKS), *(f"{sel['lua']}/{n}" for n in LUA)]:
        assert package_of(str(path)) == "dsstage", path
    # the command is the project's launcher behind the venv's Python, not pip's (which imports re)
    shebang, launcher = Path(sel["cli"]).resolve().read_text().split("\n", 1)
    assert shebang == "#!/usr/lib/dsstage/venv/bin/python"
    assert launcher == (ROOT / "packaging" / "launcher.py").read_text()
    for name in LUA:  # linked, as docs/install.md tells sites to
        assert os.readlink(cluster.etc / name) == f"{sel['lua']}/{name}"
    # the live configuration is no conffile (an upgrade never asks about it): postinst wrote
    # it from the packaged example; a machine that had an older package keeps that entry, obsolete
    assert package_of("/usr/share/dsstage/dsstage.yaml.example") == "dsstage"
    assert Path("/etc/dsstage/dsstage.yaml").is_file()
    conffiles = subprocess.run(["dpkg-query", "-W", "-f=${Conffiles}\n", "dsstage"], text=True, capture_output=True,
                               check=True).stdout.splitlines()
    assert all(line.split()[-1] == "obsolete" for line in conffiles if "/etc/dsstage/dsstage.yaml" in line), conffiles


def test_the_selected_command_reads_what_the_hooks_did(cluster):
    """A job stages with the selected Prolog; the selected `dsstage status` (not the
    fixture's, which is the checkout's) sees the copy on the job's node."""
    job = cluster.submit('#SBATCH --dataset=sample\nhead -n 1 "$DSSTAGE_DATASET_DIR/labels.txt"\n', user="nobody")
    info = cluster.wait(job)
    assert info["JobState"] == "COMPLETED", cluster.output(job)
    assert cluster.output(job) == "n00000000 class 0\n"
    res = cluster.run(str(selected(cluster)["cli"]), "status", "--json", "--no-queue", "--dataset", "sample")
    copies = json.loads(res.stdout)["copies"]
    assert any(c["node"] == info["NodeList"] and c["dataset"] == "sample" and c["state"] == "ready"
               for c in copies), copies
