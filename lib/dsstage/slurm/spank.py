"""Where Slurm loads dsstage's SPANK plugin, and whether it was built for this Slurm.

Slurm refuses a SPANK plugin built for another release series before any code of the
plugin runs (``spank: ...: Incompatible plugin version``): loaded ``required``, that stops
every sbatch, salloc and srun and slurmd itself; loaded ``optional``, only ``--dataset``
is unknown (``sbatch: unrecognized option``). So ``dsstage check-config`` reads the
plugin's file for the series it was built for (a string the build writes into it) and says
to rebuild before Slurm has to.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

#: what sbatch_ext/dsstage_spank.c writes into the plugin (SLURM_VERSION_NUMBER, in hex)
_BUILT_FOR = re.compile(rb"dsstage-spank built for SLURM_VERSION_NUMBER=(0x[0-9a-fA-F]+);")
PLUGIN_FILE = "dsstage_spank.so"
#: include depth Slurm itself would never need; a loop of includes stops here
_MAX_DEPTH = 8


@dataclass(frozen=True)
class Load:
    """One ``required``/``optional`` line of plugstack.conf that loads dsstage's plugin."""

    kind: str  # "required" | "optional"
    path: str  # the plugin's file, as resolved
    where: str  # "FILE:LINE"


def built_for(data: bytes) -> tuple[int, int, int] | None:
    """The Slurm release (major, minor, micro) the plugin file ``data`` was built against, or
    None for a file built before dsstage recorded it (or not dsstage's)."""
    m = _BUILT_FOR.search(data)
    if not m:
        return None
    n = int(m.group(1), 16)
    return (n >> 16) & 0xFF, (n >> 8) & 0xFF, n & 0xFF


def loads(path: str, plugin_dirs: list[str], depth: int = 0) -> list[Load]:
    """The lines of plugstack.conf ``path`` (and the files it includes) that load
    dsstage_spank.so. A relative plugin path is looked up in ``plugin_dirs`` (slurm.conf's
    PluginDir), as Slurm does. A file that cannot be read loads nothing."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    out: list[Load] = []
    for number, raw in enumerate(lines, 1):
        words = raw.split("#", 1)[0].split()
        if len(words) < 2:
            continue
        if words[0] == "include" and depth < _MAX_DEPTH:
            pattern = words[1] if os.path.isabs(words[1]) else os.path.join(os.path.dirname(path), words[1])
            for included in sorted(glob.glob(pattern)):
                out += loads(included, plugin_dirs, depth + 1)
        elif words[0] in ("required", "optional") and os.path.basename(words[1]) == PLUGIN_FILE:
            plugin = words[1]
            if not os.path.isabs(plugin):
                plugin = next((os.path.join(d, plugin) for d in plugin_dirs
                               if os.path.exists(os.path.join(d, plugin))), plugin)
            out.append(Load(words[0], plugin, f"{path}:{number}"))
    return out


def series_of(release: tuple[int, int, int]) -> str:
    return f"{release[0]:02d}.{release[1]:02d}"


def problems(found: list[Load], series: str | None, read: dict[str, bytes | None]) -> list[tuple[str, str]]:
    """(level, message) for each thing wrong with how the plugin is loaded: ``found`` the
    lines that load it, ``series`` this host's Slurm series ("24.11"; None: unknown), ``read``
    each plugin file's bytes (None: unreadable)."""
    if not found:
        return [("note", "no plugstack.conf line loads dsstage_spank.so on this host: sbatch, salloc and srun "
                         "have no --dataset here (jobs can still ask with #BB_LUA dataset=NAME); on login and "
                         "compute nodes add `optional /PATH/dsstage_spank.so` (the dsstage-spank package does)")]
    out = []
    for load in found:
        data = read.get(load.path)
        if data is None:
            out.append(("error", f"{load.where} loads {load.path}, which cannot be read: install dsstage-spank or "
                                 "build it (make -C sbatch_ext install)"))
            continue
        release = built_for(data)
        if release is None:
            out.append(("note", f"{load.path} does not say which Slurm it was built for (built before dsstage "
                                "recorded it): rebuild it to have it checked"))
        elif series is not None and series_of(release) != series:
            out.append(("error", f"{load.path} was built for Slurm {series_of(release)}.{release[2]} and this host "
                                 f"runs {series}: Slurm refuses it (Incompatible plugin version), so --dataset is "
                                 "unknown to sbatch; rebuild it against this Slurm (apt-get source dsstage, or make "
                                 "-C sbatch_ext install) and install it on every login and compute node"))
        if load.kind == "required":
            out.append(("note", f"{load.where} loads the plugin as required: when it cannot be loaded (a Slurm "
                                "upgrade without a rebuild) every sbatch, salloc and srun fails and slurmd does not "
                                "start; `optional` (the package's line) fails only --dataset, and job_submit.lua "
                                "refuses what it must either way"))
    return out
