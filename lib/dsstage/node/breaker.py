"""A breaker per source: once a source stops answering, the cluster's next Prologs decide at once.

A hung source (an NFS server gone, a failing OST, an rsync daemon that accepts and never
answers) costs the job whose stage meets it its whole ``prolog_budget``: the hook leaves its
work behind and decides without it (dsstage.hooks.abandoned). Without a breaker every later
job on every node pays the same, one after another. So the hook that left its work behind
while that work was reading a source *trips* the source's breaker: it writes
``<state_dir>/sources/<key>.json`` (who, when, why). Every later stage of a dataset from that
source, on any node, reads the record first (one bounded read of the state directory it
reads anyway) and, while the breaker is open, decides at once: the dataset's ``on_failure``
(its source where that is mounted and allowed, else a hold), with the reason.

While the breaker is open, the next Prolog that needs the source *probes* it, unless another
probe is under way: it claims the probe (``probe_after`` moves ``PROBE_TIMEOUT`` on, so that the
cluster's other Prologs meanwhile decide at once), then asks the source for its top directory,
bounded by ``PROBE_TIMEOUT`` (a child it leaves behind if the source does not answer). If the
source answers, the record goes and the stage goes on as usual; if not, the dataset gets its
``on_failure`` at once, and no node probes again for a cooldown (``COOLDOWN``, doubling with
each failed probe up to ``COOLDOWN_MAX``): the Prologs meanwhile decide at once. So no Prolog
spends more than ``PROBE_TIMEOUT`` on a source known to hang, at most one probes it at a time,
most spend nothing on it, and the first stage after a cooldown in which it answered again uses
it (measured with bench/scale's hanging source: docs/benchmarks.md).

A breaker's key is the source as the admins declared it (``sources.<name>``, the prefix its
datasets' sources begin with: one NFS server, one rsync daemon), else the dataset alone. A
stage that fails at once (an error, not a hang) trips nothing: it cost no budget.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsstage.config.model import Config, Dataset, Source
from dsstage.fs import formats, safe, untrusted

log = logging.getLogger(__name__)

DIR = "sources"
#: seconds a probe waits for the source's answer (and the others wait for the probe)
PROBE_TIMEOUT = 5.0
#: seconds without a probe after the first failed one, doubling with each, up to COOLDOWN_MAX
COOLDOWN = 15.0
COOLDOWN_MAX = 120.0


def key_of(conf: Config, ds: Dataset) -> str:
    """The breaker a dataset's stage goes through: its declared source's (``source.<name>``,
    the longest matching prefix), else its own (``dataset.<name>``)."""
    budget = conf.budget_of(ds.source)
    return f"source.{budget.name}" if budget is not None else f"dataset.{ds.name}"


def path(state_dir: str, key: str) -> str:
    return os.path.join(state_dir, DIR, key + ".json")


@dataclass(frozen=True)
class State:
    """A breaker as a stage sees it: ``closed`` (go on), ``open`` (decide at once: ``reason``)
    or ``probe`` (ask the source first)."""

    kind: str
    reason: str = ""
    since: float = 0.0


def state(record: Mapping[str, Any] | None, now: float) -> State:
    """What a stage does with the breaker ``record`` (None or {}: no breaker) at ``now`` (pure)."""
    if not record:
        return State("closed")
    since = _number(record.get("since"))
    after = _number(record.get("probe_after"))
    reason = (f"its source stopped answering (found by node {record.get('by') or '?'} "
              f"{max(0, int(now - since))} s ago: {record.get('reason') or 'no reason given'})")
    if now >= after:
        return State("probe", reason, since)
    if not record.get("probe_by") and record.get("probed_by"):  # cooling down after a failed probe
        return State("open", f"{reason}; node {record.get('probed_by')} probed it "
                             f"{max(0, int(now - _number(record.get('probed_at'))))} s ago, the next probe in "
                             f"{max(1, int(after - now))} s", since)
    return State("open", f"{reason}; node {record.get('probe_by') or '?'} is probing it now", since)


def after_failed_probe(record: Mapping[str, Any], node: str, now: float) -> dict[str, Any]:
    """The breaker once ``node``'s probe at ``now`` found the source still not answering: no
    probe for COOLDOWN seconds (doubling with each failed probe, up to COOLDOWN_MAX), so
    that the Prologs meanwhile decide at once instead of each spending PROBE_TIMEOUT on it;
    a source that answers again is used from the first probe after its cooldown (pure)."""
    probes = int(_number(record.get("failed_probes"))) + 1
    cool = min(COOLDOWN_MAX, COOLDOWN * 2 ** (probes - 1))
    return {**record, "probe_after": now + cool, "probe_by": "", "probed_by": node, "probed_at": now,
            "failed_probes": probes}


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def read(state_dir: str, key: str) -> dict[str, Any] | None:
    """The breaker record of ``key``, None if there is none (or it is not one: a damaged or
    foreign file is no breaker)."""
    record = untrusted.read_json(path(state_dir, key))
    if not record or formats.problem("breaker", record, path(state_dir, key)):
        return None
    return record


def write(state_dir: str, key: str, record: Mapping[str, Any]) -> None:
    os.makedirs(os.path.join(state_dir, DIR), exist_ok=True)
    safe.write_json(path(state_dir, key), formats.stamp("breaker", record), fsync=False)


def trip(state_dir: str, key: str, node: str, reason: str, now: float) -> None:
    """Open ``key``'s breaker: the cluster's next stages from it decide at once."""
    write(state_dir, key, {"source": key, "by": node, "since": now, "reason": " ".join(reason.split()),
                           "probe_after": now})


def claim_probe(state_dir: str, key: str, record: Mapping[str, Any], node: str, now: float) -> None:
    """Say this node probes the source now: the others decide at once until ``PROBE_TIMEOUT``
    has passed (a race of two nodes costs two probes, no more)."""
    write(state_dir, key, {**record, "probe_after": now + PROBE_TIMEOUT, "probe_by": node})


def reset(state_dir: str, key: str) -> bool:
    """Close ``key``'s breaker; False if it was not open."""
    try:
        os.unlink(path(state_dir, key))
    except FileNotFoundError:
        return False
    return True


def all_open(state_dir: str) -> dict[str, dict[str, Any]]:
    """Every tripped breaker: key -> record (``dsstage status``, the metrics)."""
    try:
        names = sorted(os.listdir(os.path.join(state_dir, DIR)))
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            record = read(state_dir, name[:-len(".json")])
            if record is not None:
                out[name[:-len(".json")]] = record
    return out


def probe_argv(source: Source, rsh: str, timeout: float) -> list[str]:
    """The command that asks ``source`` for its top directory and nothing more."""
    if source.kind == "local":
        return [sys.executable, "-I", "-c", "import os, sys; os.stat(sys.argv[1]); os.listdir(sys.argv[1])",
                source.path]
    seconds = str(max(1, int(timeout)))
    argv = ["rsync", "--list-only", f"--timeout={seconds}"]
    if source.kind == "daemon":
        argv.append(f"--contimeout={seconds}")
    else:
        argv += ["-e", f"{rsh} -o ConnectTimeout={seconds}"]
    return [*argv, source.rsync_base().rstrip("/") + "/"]


def probe(source: Source, rsh: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None if ``source`` answers within ``timeout`` seconds (an error is an answer: the
    source is there), else why not. The asking child is killed, and left behind if the
    kill does not end it (a hard mount)."""
    try:
        child = subprocess.Popen(probe_argv(source, rsh, timeout), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        return f"cannot ask it ({exc.strerror or exc})"
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        try:
            child.wait(1.0)
        except subprocess.TimeoutExpired:
            pass  # blocked in the filesystem: the kernel ends it when the source answers
        return f"{source.raw} did not answer within {timeout:g} s"
    if source.kind != "local" and child.returncode in (10, 30, 35, 255):  # rsync: socket, timeout; ssh
        return f"{source.raw} cannot be reached (exit code {child.returncode})"
    return None


def look(conf: Config, ds: Dataset, now: float | None = None) -> tuple[dict[str, Any] | None, State]:
    """The breaker of ``ds``'s source as the state directory holds it (read as
    ``report.user``) and what a stage would do with it now; reads only (``gate`` acts on it,
    the dry run says it)."""
    from dsstage.fs.identity import writing_as
    with writing_as(conf.report.user):
        record = read(conf.state_dir, key_of(conf, ds))
    return record, state(record, time.time() if now is None else now)


def gate(conf: Config, ds: Dataset, node: str, now: float | None = None) -> str | None:
    """Before a stage of ``ds`` from its source: None to go on, else why the stage must not
    (the dataset then gets its ``on_failure`` at once). A due probe is made here, bounded by
    ``PROBE_TIMEOUT``, as root (ssh's keys are root's); the state directory is read and
    written as ``report.user``; one that cannot be read or written is no breaker."""
    from dsstage.fs.identity import writing_as
    key = key_of(conf, ds)
    now = time.time() if now is None else now
    record, st = look(conf, ds, now)
    if st.kind == "closed" or record is None:
        return None
    if st.kind == "open":
        return f"the breaker of {key} is open: {st.reason}"
    try:
        with writing_as(conf.report.user):
            claim_probe(conf.state_dir, key, record, node, now)
    except OSError as exc:
        log.warning("cannot claim the probe of %s: %s", key, exc)
    why = probe(ds.source, conf.transfer.rsh)
    if why is not None:
        log.warning("the source of %s still does not answer: %s", ds.name, why)
        try:
            with writing_as(conf.report.user):
                write(conf.state_dir, key, after_failed_probe(record, node, time.time()))
        except OSError as exc:
            log.warning("cannot record the failed probe of %s: %s", key, exc)
        return f"the breaker of {key} is open: {st.reason}; probed again now: {why}"
    log.info("the source of %s answers again: the breaker of %s is closed (probed on %s)", ds.name, key, node)
    try:
        with writing_as(conf.report.user):
            reset(conf.state_dir, key)
    except OSError as exc:
        log.warning("cannot close the breaker of %s: %s", key, exc)
    return None
