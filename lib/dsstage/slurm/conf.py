"""Checks of this host against the configuration: slurm.conf's PrologEpilogTimeout against
``prolog_budget``, the SchedulerParameters ``--prefer`` needs, the peers' secret, Slurm's
commands. Each problem says what to change (``dsstage check-config``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsstage import privatedata
from dsstage.config.model import Config
from dsstage.errors import ConfigError
from dsstage.slurm import conffile

#: seconds kept free between prolog_budget and slurm.conf's PrologEpilogTimeout: the Prolog
#: starts, decides and writes its results around the budget it spends
PROLOG_MARGIN = 30.0
DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"
#: PrologEpilogTimeout values that make slurmd wait for the Prolog forever (22.05: unset is
#: NO_VAL16, and a zero timeout is a blocking wait)
_NO_TIMEOUT = (0, 65534)


@dataclass(frozen=True)
class Problem:
    """Something ``dsstage check-config`` reports: an ``error`` fails it, a ``note`` informs."""

    level: str  # "error" | "note"
    key: str
    message: str


_SLURM_NUMBER = re.compile(r"(0[xX][0-9a-fA-F]+)|(0[0-7]*)|([1-9][0-9]*)")


def slurm_conf_path(environ: Mapping[str, str] = os.environ) -> str:
    """Where Slurm's clients find slurm.conf: ``$SLURM_CONF``, else the default."""
    return environ.get("SLURM_CONF") or DEFAULT_SLURM_CONF


def setting(text: str, key: str) -> str | None:
    """The value of ``key`` in slurm.conf ``text`` (None if absent): keys are case-insensitive,
    ``#`` starts a comment, the last setting wins. ``Include`` files are read by
    conffile.read, which puts their text in place."""
    found = conffile.values(text, key)
    return found[-1] if found else None


def prolog_epilog_timeout(text: str, key: str = "PrologEpilogTimeout") -> float | None:
    """``PrologEpilogTimeout`` (or ``key``) in slurm.conf ``text``, in seconds, as slurmd reads it.

    None: slurmd waits for the Prolog forever (the key absent, 0, or 65534). ``UNLIMITED``
    and ``INFINITE`` are stored as 65535, which slurmd takes as 65535 seconds. Raises
    ValueError for a value Slurm itself would refuse.
    """
    value = setting(text, key)
    if value is None:
        return None
    if value.lower() in ("unlimited", "infinite"):
        return 65535.0
    number = _SLURM_NUMBER.fullmatch(value)  # strtoul(value, 0): hexadecimal, octal, decimal
    if not number:
        raise ValueError(f"{key}={value} is not a number of seconds")
    seconds = int(value, 16 if number.group(1) else 8 if number.group(2) else 10)
    if seconds > 65535:
        raise ValueError(f"{key}={value} is greater than 65535")
    return None if seconds in _NO_TIMEOUT else float(seconds)


def prolog_timeout(text: str) -> tuple[str, float | None]:
    """The setting that bounds the Prolog, and its seconds: ``PrologTimeout`` where it is set
    (Slurm 25.05 split PrologEpilogTimeout into PrologTimeout and EpilogTimeout, and reads
    the old key as both where the new ones are absent), else ``PrologEpilogTimeout``."""
    if setting(text, "PrologTimeout") is not None:
        return "PrologTimeout", prolog_epilog_timeout(text, "PrologTimeout")
    return "PrologEpilogTimeout", prolog_epilog_timeout(text)


#: PrologFlags that make the Prolog run at allocation on every node (Contain, X11 and
#: RunInJob imply Alloc)
_ALLOC_FLAGS = frozenset({"alloc", "contain", "x11", "runinjob"})


def prolog_flags(text: str) -> frozenset[str]:
    return frozenset(f.strip().lower() for f in (setting(text, "PrologFlags") or "").split(",") if f.strip())


def flags_problems(flags: frozenset[str], where: str) -> list[Problem]:
    """What PrologFlags mean for dsstage's hooks."""
    out = []
    if not flags & _ALLOC_FLAGS:
        out.append(Problem("error", "PrologFlags", f"{where} has no PrologFlags=Alloc: the Prolog then runs on a node "
                           "only when a step of the job reaches it, so the batch host starts the job before the "
                           "other nodes have staged its data, and waits for peers whose Prologs have not run; add "
                           "PrologFlags=Alloc"))
    if "runinjob" in flags:
        out.append(Problem("error", "PrologFlags", f"{where} has PrologFlags=RunInJob (Slurm 24.05 and later): the "
                           "Prolog and Epilog then run inside the job's cgroup, where the flush and purge dsstage "
                           "leaves running after a stage or an eviction die with the job's extern step, and the "
                           "page cache a stage fills counts against the job's memory limit; remove RunInJob"))
    return out


def budget_problem(budget: float, timeout: float | None, where: str, key: str = "PrologEpilogTimeout") -> str | None:
    """Why a Prolog that spends ``budget`` seconds would be killed by slurmd, or None."""
    if timeout is None or budget + PROLOG_MARGIN < timeout:
        return None
    fix = f"raise {key} in {where} above {budget + PROLOG_MARGIN:g}"
    if timeout - PROLOG_MARGIN > 1:
        fix = f"lower prolog_budget below {timeout - PROLOG_MARGIN:g} or " + fix
    return (f"{budget:g} s plus a safety margin of {PROLOG_MARGIN:g} s is not below {key}="
            f"{timeout:g} in {where}: slurmd would kill a Prolog that used its budget and drain the node; {fix}")


#: the installed hooks (the packages'); a site may point slurm.conf at copies or wrappers
HOOKS = {"Prolog": "dsstage-prolog", "Epilog": "dsstage-epilog", "TaskProlog": "dsstage-taskprolog"}
HOOK_DIR = "/usr/libexec/dsstage"


def runs_hook(path: str, name: str) -> bool:
    """Whether program ``path`` is dsstage's hook ``name`` (dsstage-prolog, ...), or a site's
    script that runs it (names it)."""
    if os.path.basename(os.path.realpath(path)) == name:
        return True
    try:
        with open(path, "rb") as fh:
            head = fh.read(65536)
    except OSError:
        return False
    return name.encode() in head


def hooks_problems(text: str, base: str, where: str) -> list[Problem]:
    """Whether slurm.conf runs dsstage's Prolog, Epilog and TaskProlog: each Prolog and Epilog
    line (a program, a comma-separated list, globs) and the one TaskProlog."""
    out = []
    for key in ("Prolog", "Epilog"):
        files, empty = conffile.programs(text, key, base)
        if any(runs_hook(f, HOOKS[key]) for f in files):
            continue
        named = ", ".join(files + [f"{e} (no such file)" for e in empty]) or "none"
        out.append(Problem("error", "hooks", f"{where}: no {key} runs dsstage's ({key}: {named}): jobs asking for "
                           f"a dataset would get nothing; add {key}={HOOK_DIR}/{HOOKS[key]} (a {key} line of its "
                           f"own, a comma after the site's, or a link in a {key}=/etc/slurm/{key.lower()}.d/* "
                           "directory)"))
    task = setting(text, "TaskProlog")
    if task is None:
        out.append(Problem("error", "hooks", f"{where}: no TaskProlog: tasks would not get DSSTAGE_DATASET_DIR and "
                           f"the held job's message; add TaskProlog={HOOK_DIR}/{HOOKS['TaskProlog']}"))
    else:
        path = task if os.path.isabs(task) else os.path.join(base, task)
        if not runs_hook(path, HOOKS["TaskProlog"]):
            out.append(Problem("error", "hooks", f"{where}: TaskProlog={task} does not run dsstage's: Slurm runs one "
                               "TaskProlog, so make it a script that runs the site's and then "
                               f"{HOOK_DIR}/{HOOKS['TaskProlog']}, printing both outputs (admin guide, 'Where the "
                               "pieces go')"))
    return out


def shm_problems(conf: Config, text: str, where: str) -> list[Problem]:
    """A tier under /dev/shm where each job gets a /dev/shm of its own (job_container/tmpfs):
    jobs would not see the copies there."""
    container = setting(text, "JobContainerType") or ""
    if "tmpfs" not in container:
        return []
    return [Problem("error", f"tiers.{t.name}", f"tier {t.name} is under /dev/shm ({t.path}), and {where} has "
                    f"JobContainerType={container}, which gives each job its own /dev/shm: jobs would not see "
                    "the copies; put the RAM tier on a tmpfs of its own (e.g. mount -t tmpfs ... /local/ram)")
            for t in conf.tiers.values() if os.path.normpath(t.path).startswith("/dev/shm")]


def scratch_places(text: str, slurm_conf: str) -> list[str]:
    """Where jobs write scratch on a node: slurm.conf's TmpFS (default /tmp) and, with
    job_container/tmpfs, job_container.conf's BasePath (beside slurm.conf)."""
    places = [setting(text, "TmpFS") or "/tmp"]
    if "tmpfs" in (setting(text, "JobContainerType") or ""):
        try:
            with open(os.path.join(os.path.dirname(slurm_conf), "job_container.conf"), encoding="utf-8",
                      errors="replace") as fh:
                base = setting(fh.read(), "BasePath")
        except OSError:
            base = None
        if base:
            places.append(base)
    return places


def scratch_problems(conf: Config, text: str, where: str, node: str) -> list[Problem]:
    """A tier on the filesystem where jobs write scratch (TmpFS, job_container's BasePath):
    the tier fills to its high watermark of capacity whatever the jobs wrote there, so the
    two compete for the disk; say so, with the fix (a reserve, or a quota)."""
    out = []
    for place in scratch_places(text, where):
        try:
            scratch = os.stat(place).st_dev
        except OSError:
            continue
        for t in conf.tiers.values():
            try:
                here = os.stat(t.root(node)).st_dev
            except OSError:
                continue  # not on this host
            if here != scratch:
                continue
            size = f"{t.capacity:.0%} of the filesystem" if isinstance(t.capacity, float) else f"{t.capacity} bytes"
            out.append(Problem("note", f"tiers.{t.name}", (
                f"tier {t.name} ({t.root(node)}) is on the filesystem where jobs write scratch ({place}, from "
                f"{where}): dsstage fills it up to {t.high_watermark:.0%} of its capacity ({size}) whatever jobs "
                "wrote there; leave them room: a capacity below the disk by what jobs write (a reserve), or a "
                "quota on the jobs' scratch")))
    return out


def spank_problems(text: str, slurm_conf: str, series: str | None) -> list[Problem]:
    """How this host's plugstack.conf (slurm.conf's PlugStackConfig, else beside slurm.conf)
    loads dsstage's SPANK plugin, against the Slurm ``series`` here."""
    from dsstage.slurm import spank
    plugstack = setting(text, "PlugStackConfig") or os.path.join(os.path.dirname(slurm_conf), "plugstack.conf")
    plugin_dirs = [d for d in (setting(text, "PluginDir") or "").split(":") if d]
    found = spank.loads(plugstack, plugin_dirs)
    read: dict[str, bytes | None] = {}
    for load in found:
        try:
            with open(load.path, "rb") as fh:
                read[load.path] = fh.read()
        except OSError:
            read[load.path] = None
    return [Problem(level, "spank", message) for level, message in spank.problems(found, series, read)]


def largest_job(text: str) -> int | None:
    """The most nodes a job may have in slurm.conf ``text``: the largest partition MaxNodes,
    or every node where a partition has none (UNLIMITED); None if no node is named."""
    from dsstage.hostlist import expand_nodes
    nodes: set[str] = set()
    for value in conffile.values(text, "NodeName"):
        if value.upper() != "DEFAULT":
            try:
                nodes.update(expand_nodes(value))
            except ValueError:
                continue
    if not nodes:
        return None
    limits = [v for v in conffile.values(text, "MaxNodes")]
    if not limits or any(not v.isdigit() for v in limits):
        return len(nodes)
    return min(len(nodes), max(int(v) for v in limits))


def check_host(conf: Config, slurm_conf: str | None = None,
               series: str | None = None, node: str | None = None) -> tuple[dict[str, Any], list[Problem]]:
    """The configuration against this host's Slurm (of ``series``, where known): what was
    found, and the problems. ``node``: this host's node name, for its tiers' paths."""
    path = slurm_conf or slurm_conf_path()
    found: dict[str, Any] = {"slurm_conf": path, "read": False, "prolog_epilog_timeout": None}
    problems: list[Problem] = []
    try:
        read = conffile.read(path)
    except OSError as exc:
        problems.append(Problem("note", "prolog_budget", f"cannot read {path} ({exc.strerror}): prolog_budget "
                                "is not checked against PrologEpilogTimeout; run check-config where slurm.conf "
                                "is, or point SLURM_CONF at it"))
        text = None
    else:
        text, path = read.text, read.path
        found.update(slurm_conf=path, files=read.files)
        if read.configless:
            problems.append(Problem("note", "slurm.conf", f"configless node: read slurmd's copy {path}"))
        for why in read.unread:
            problems.append(Problem("note", "slurm.conf", f"Include {why}: what it sets is not checked"))
    if text is not None:
        try:
            key, timeout = prolog_timeout(text)
        except ValueError as exc:
            problems.append(Problem("note", "prolog_budget", f"{path}: {exc}; prolog_budget is not checked"))
        else:
            found.update(read=True, prolog_epilog_timeout=timeout, prolog_timeout_key=key)
            problem = budget_problem(conf.prolog_budget, timeout, path, key)
            if problem:
                problems.append(Problem("error", "prolog_budget", problem))
            if key == "PrologTimeout" and setting(text, "EpilogTimeout") is not None:
                # the budget bounds the Epilog too (dsstage.hooks.bounded)
                try:
                    problem = budget_problem(conf.prolog_budget, prolog_epilog_timeout(text, "EpilogTimeout"), path,
                                             "EpilogTimeout")
                except ValueError as exc:
                    problem = f"{path}: {exc}"
                if problem:
                    problems.append(Problem("error", "prolog_budget", problem.replace("a Prolog", "an Epilog")))
            flags = prolog_flags(text)
            found["prolog_flags"] = sorted(flags)
            problems += flags_problems(flags, path)
            params = (setting(text, "SchedulerParameters") or "").split(",")  # the last line is the one in force
            if conf.placement.prefer and "ignore_prefer_validation" not in params:
                problems.append(Problem("error", "placement.prefer", f"{path} has no SchedulerParameters="
                                        "ignore_prefer_validation: Slurm refuses a job that prefers a feature no "
                                        "node has yet, so jobs asking for a dataset that no node holds ready would "
                                        "be refused at submit; add it, or set placement.prefer: false"))
            problems += spank_problems(text, path, series)
            found["private_jobs"] = privatedata.hides_jobs_in(text)
            problems.append(Problem("note", "PrivateData", (
                f"{path} has PrivateData=jobs: dsstage hides other users' jobs too (demand.json readable by its "
                "writer only, published node reports without job ids or users, each user's status and bbstat "
                "show their own jobs and counts of the rest)") if found["private_jobs"] else (
                f"{path} has no PrivateData=jobs: every user sees every queued job's id, user, datasets and "
                "nodes in dsstage status and bbstat, as in squeue")))
            found["largest_job"] = largest_job(text)
            problems += hooks_problems(text, os.path.dirname(path), path)
            problems += shm_problems(conf, text, path)
            if node:
                problems += scratch_problems(conf, text, path, node)
    if conf.peers.enabled:
        from dsstage.transfer.peerd import read_secret
        ports = [conf.peers.port] + [int(h.rsplit(":", 1)[1]) for h in conf.peers.hosts.values() if ":" in h]
        if max(ports) >= 1024:
            problems.append(Problem("note", "peers.port", f"port {max(ports)} is not below 1024: while a node's daemon "
                                    "is not running, any user there can listen on it and be asked by the other nodes' "
                                    "root for data; use a port below 1024 outside a test cluster"))
        try:
            read_secret(conf.peers.secret_file)
        except ConfigError as exc:
            problems.append(Problem("error", "peers.secret_file", f"{exc}; until it is, this node stages from the "
                                    "source alone and its daemon (dsstage peers serve) does not start"))
    scontrol = conf.slurm_command("scontrol")
    if not os.access(scontrol, os.X_OK):
        problems.append(Problem("note", "slurm_bin", f"{scontrol} is not an executable on this host; on the "
                                "compute nodes it must be: set slurm_bin to the directory of Slurm's commands"))
    return found, problems
