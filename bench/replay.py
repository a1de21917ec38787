"""Replay a slice of a real job trace on the development cluster, pre-staging and placement
off and on, and measure what the Prologs did.

Run through ``bench/replay`` (as root; see docs/benchmarks.md, "Pre-staging and placement:
replayed workload"). What it does:

1. Starts its own ``packaging/devcluster`` (n1 n2 n3, 2 CPUs each) in ``--dir`` on
   ``--port``, and wraps the cluster's installed Prolog (``$DIR/hooks/dsstage-prolog``, not
   the checkout's) in a script that logs each run's start and end (``date +%s.%N``), so the
   Prolog's time is measured inside slurmd's own run of it.
2. Generates ``--datasets`` random datasets (40-120 MB, a few hundred files each), adds them
   to the cluster's dsstage.yaml (``manifest build``, ``export-catalog``), with a node tier
   that holds about two of them and the source throttled to ``--source-rate`` (the copier's
   ``transfer.bwlimit``: the sources sit in the page cache here, and a shared filesystem is
   slower than that). A cold ``dsstage warm`` of each on a scratch node gives its stage time.
3. Takes ``--jobs`` consecutive jobs (with a run time) of the SWF trace from ``--offset``:
   their order, relative submit times compressed into ``--submit-span`` seconds, and run
   times mapped (log scale) into ``--runtime LO:HI`` seconds. Each job is one whole node
   (``--exclusive -N1 -t 1``) and gets a dataset by a seeded skewed draw: each trace user has
   a home dataset (Zipf), used by 3 of 4 of its jobs, the others drawn from the Zipf law.
4. Replays it once per mode (same jobs, same datasets): ``off``: the demand poller only,
   ``placement.features`` and ``prefer`` false; ``on``: the poller syncing node features,
   job_submit's ``--prefer``, and one ``dsstage --node nX prefetch`` loop per node. Between
   modes the nodes' copies are evicted and the demand history removed.
5. Reports per mode: jobs, the fraction whose Prolog took the warm path, the fraction that
   started warm (warm path, or the full Prolog finding the copy ready), the same among jobs
   that waited in the queue longer than their dataset's stage time (the goal: >= 90 % with
   pre-staging on), total and 95th-percentile Prolog time, bytes pre-staged and bytes
   pre-staged that no job then used. Raw per-job records go to a JSON file under /tmp, with
   the logs next to it.

The cluster is stopped (by pid, ``devcluster down``) and its directory removed at the end,
also on failure or interrupt.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

TOP = Path(__file__).resolve().parent.parent
VENV_BIN = TOP / ".venv" / "bin"
NODES = ("n1", "n2", "n3")
TRACE = Path("/work/shared/traces/HPC2N-2002-2.2-cln.swf.gz")
#: the line the Prolog wrapper appends per run: job node start end rc
TIMES = "prolog-times.log"
#: a line of the hooks' log: its time (since 93cce4e), the process, the level, the job, the text
_HOOK_LINE = re.compile(r"^(?:\S+ )?dsstage-\d+: (\w+): job (\d+): (.*)$")
#: "NAME cached at PATH (warm path)", "NAME cached at PATH in 0.01s", "NAME staged at PATH in 3.00s (N files, ...)"
_DONE = re.compile(r"^(\S+) (staged|cached) at (\S+)(?: \([^)]*\))?(?: \(warm path\)| in ([\d.]+)s(?: \(.*\))?)$")
_FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE")


def say(text: str) -> None:
    print(f"replay: {text}", file=sys.stderr, flush=True)


# -- the workload ----------------------------------------------------------------------------

@dataclass
class TraceJob:
    index: int  # position in the replay
    trace_id: int
    trace_submit: int
    trace_runtime: int
    trace_user: int
    submit: float  # seconds after the replay's start
    runtime: int  # seconds the job sleeps
    dataset: str = ""


def read_window(path: Path, offset: int, count: int) -> list[tuple[int, int, int, int]]:
    """(job id, submit, run time, user) of ``count`` consecutive trace jobs with a run time
    (> 0 s), starting at the ``offset``-th such job."""
    out: list[tuple[int, int, int, int]] = []
    seen = 0
    with gzip.open(path, "rt") as fh:
        for line in fh:
            if line.startswith(";") or not line.strip():
                continue
            f = line.split()
            runtime = int(float(f[3]))
            if runtime <= 0:
                continue
            if seen >= offset:
                out.append((int(f[0]), int(float(f[1])), runtime, int(f[11])))
                if len(out) == count:
                    break
            seen += 1
    if len(out) < count:
        raise SystemExit(f"replay: the trace has only {len(out)} jobs with a run time after offset {offset}")
    return out


def workload(args: argparse.Namespace, names: list[str]) -> list[TraceJob]:
    rows = read_window(Path(args.trace), args.offset, args.jobs)
    lo, hi = (float(x) for x in args.runtime.split(":"))
    t0, t1 = rows[0][1], rows[-1][1]
    scale = args.submit_span / (t1 - t0) if t1 > t0 else 0.0
    logs = [math.log(max(r[2], 1)) for r in rows]
    lmin, lmax = min(logs), max(logs)
    jobs = []
    for i, (jid, submit, runtime, user) in enumerate(rows):
        frac = (math.log(max(runtime, 1)) - lmin) / (lmax - lmin) if lmax > lmin else 0.5
        jobs.append(TraceJob(i, jid, submit, runtime, user,
                             submit=(submit - t0) * scale if scale else i * args.submit_span / max(1, len(rows) - 1),
                             runtime=int(round(lo + frac * (hi - lo)))))
    # datasets: Zipf popularity; each user a home dataset (3 of 4 of its jobs), the rest drawn
    rng = random.Random(args.seed)
    weights = [1.0 / (k + 1) ** args.zipf for k in range(len(names))]
    home: dict[int, str] = {}
    for j in jobs:
        if j.trace_user not in home:
            home[j.trace_user] = rng.choices(names, weights)[0]
        j.dataset = home[j.trace_user] if rng.random() < 0.75 else rng.choices(names, weights)[0]
    return jobs


# -- the cluster -----------------------------------------------------------------------------

def parse_records(text: str) -> dict[str, dict[str, str]]:
    """``scontrol show job -o`` of this benchmark's own jobs (names and comments it chose):
    job id -> Key=Value pairs."""
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("JobId="):
            continue
        rec: dict[str, str] = {}
        matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            rec.setdefault(m.group(1), line[m.end():end].strip())
        out[rec["JobId"]] = rec
    return out


def slurm_time(text: str | None) -> float | None:
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


class Replay:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(args.dir)
        self.etc = self.dir / "etc"
        self.state = self.dir / "dsstage-state"
        self.logdir = self.dir / "log"
        self.env = dict(os.environ, SLURM_CONF=str(self.etc / "slurm.conf"),
                        DSSTAGE_CONFIG=str(self.etc / "dsstage.yaml"), DSSTAGE_RUN_DIR=str(self.dir / "dsstage-run"),
                        PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
        for var in ("SLURM_JOB_ID", "SLURMD_NODENAME", "SQUEUE_USERS", "SLURM_CLUSTERS"):
            self.env.pop(var, None)
        # DEVCLUSTER_SERVICES=0: the cluster's own poller and prefetches (c5b6a72) would make
        # mode off pre-stage too, and double mode on's; each mode starts what it measures
        self.dc_env = dict(os.environ, DEVCLUSTER_DIR=str(self.dir), DEVCLUSTER_PORT=str(args.port),
                           DEVCLUSTER_SAMPLE_FILES="10", DEVCLUSTER_SERVICES="0")
        self.daemons: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.sizes: dict[str, int] = {}
        self.stage_time: dict[str, float] = {}
        self.capacity = 0
        self.min_keep = 600.0
        self.wait_for_data = 1800.0

    # -- plumbing --------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(list(argv), env=self.env, text=True, capture_output=True, timeout=timeout,
                             cwd=str(self.dir / "jobs") if (self.dir / "jobs").is_dir() else "/")
        if check and res.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} -> {res.returncode}: {res.stderr.strip()[-1500:]}")
        return res

    def ds(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(str(VENV_BIN / "dsstage"), *args, check=check)

    def up(self) -> None:
        say(f"devcluster up in {self.dir} (slurmctld port {self.args.port})")
        res = subprocess.run([str(TOP / "packaging" / "devcluster"), "up"], env=self.dc_env, text=True,
                             capture_output=True, timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(f"devcluster up failed:\n{res.stdout}\n{res.stderr[-3000:]}")
        self.wrap_prolog()

    def down(self) -> None:
        self.stop_daemons()
        subprocess.run([str(TOP / "packaging" / "devcluster"), "down"], env=self.dc_env, timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)

    def wrap_prolog(self) -> None:
        """The cluster's Prolog, timed: the installed script moves aside and a wrapper logs
        ``job node start end rc`` for each run (two ``date`` starts, about 2 ms, included)."""
        hook = self.dir / "hooks" / "dsstage-prolog"
        real = hook.with_name("dsstage-prolog.untimed")
        if not real.exists():
            hook.rename(real)
        hook.write_text(f"""#!/bin/sh
# bench/replay: the Prolog, timed
s=$(date +%s.%N)
{real}
rc=$?
e=$(date +%s.%N)
echo "${{SLURM_JOB_ID:-?}} ${{SLURMD_NODENAME:-?}} $s $e $rc" >> {self.logdir / TIMES}
exit $rc
""")
        hook.chmod(0o755)

    def start_daemon(self, name: str, *argv: str) -> None:
        log = open(self.logdir / f"{name}.log", "ab")
        proc = subprocess.Popen(list(argv), env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd="/")
        log.close()
        self.daemons.append((name, proc))

    def stop_daemons(self) -> None:
        """Stop the poller and the prefetch loops this benchmark started, by pid; a prefetch's
        child (in a session of its own) first, by its process group."""
        for name, proc in reversed(self.daemons):
            if proc.poll() is None:
                for child in children(proc.pid):
                    try:
                        os.killpg(child, signal.SIGTERM)
                    except (ProcessLookupError, PermissionError):
                        pass
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            say(f"stopped {name} (pid {proc.pid})")
        self.daemons.clear()

    # -- datasets --------------------------------------------------------------------------

    def config(self, *, placement: bool) -> None:
        path = self.etc / "dsstage.yaml"
        conf = yaml.safe_load(path.read_text())
        conf["datasets"] = {name: {"source": str(self.dir / "data" / name)} for name in self.sizes}
        conf["tiers"]["nvme"]["capacity"] = self.capacity
        conf["transfer"] = {"bwlimit": max(1, int(self.args.source_rate * 1024 / 4)), "streams": 4}
        conf["prefetch"] = {"interval": "2s", "horizon": "10m"}
        conf["retention"] = {**(conf.get("retention") or {}), "min_keep": round(self.min_keep, 1)}
        conf["placement"] = {"features": placement, "prefer": placement,
                             "wait_for_data": round(self.wait_for_data, 1) if placement else 0}
        path.write_text(yaml.safe_dump(conf, sort_keys=False))
        path.chmod(0o644)
        self.ds("export-catalog", "-o", str(self.etc / "dsstage_catalog.lua"))

    def make_datasets(self, names: list[str], rng: random.Random) -> None:
        mb = [int(40 + (120 - 40) * k / max(1, len(names) - 1)) for k in range(len(names))]
        rng.shuffle(mb)
        block = os.urandom(1 << 20)
        for name, size_mb in zip(names, mb):
            root = self.dir / "data" / name
            root.mkdir(parents=True, exist_ok=True)
            files = 200 + size_mb  # 240 - 320 files of about 0.2 - 0.4 MB
            each = size_mb * 10**6 // files
            for i in range(files):
                off = (i * 7919 + len(name) * 131) % (len(block) - each - 16)
                (root / f"part{i:04d}.bin").write_bytes(block[off:off + each] + name.encode()[:8].ljust(8, b".")
                                                        + i.to_bytes(8, "little"))
            self.sizes[name] = sum(p.stat().st_size for p in root.iterdir())
        top2 = sorted(self.sizes.values())[-2:]
        # the two largest and about a seventh more (the size of every run since 2026-11-22)
        self.capacity = int(sum(top2) / 0.9 * 1.02)
        self.config(placement=False)
        for name in names:
            self.ds("manifest", "build", name)
        self.ds("export-catalog", "-o", str(self.etc / "dsstage_catalog.lua"))
        say("datasets: " + ", ".join(f"{n} {self.sizes[n] / 1e6:.0f} MB" for n in names)
            + f"; node tier {self.capacity / 1e6:.0f} MB; source {self.args.source_rate:g} MiB/s")

    def measure_stage_times(self) -> None:
        """A cold ``dsstage warm`` of each dataset on a scratch node (not a Slurm node)."""
        for name in self.sizes:
            t = time.monotonic()
            self.ds("--node", "scratch", "warm", name)
            self.stage_time[name] = time.monotonic() - t
        shutil.rmtree(self.dir / "nvme" / "scratch", ignore_errors=True)
        (self.state / "nodes" / "scratch.json").unlink(missing_ok=True)
        say("cold stage times: " + ", ".join(f"{n} {s:.2f}s" for n, s in self.stage_time.items()))

    # -- modes -----------------------------------------------------------------------------

    def reset(self) -> None:
        """No jobs, no daemons, no copies on the nodes, no demand history."""
        self.stop_daemons()
        leftover = [j for j, r in parse_records(self.run("scontrol", "show", "job", "-o").stdout).items()
                    if r.get("JobState") not in _FINAL]
        if leftover:
            self.run("scancel", *leftover, check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(
                    r.get("JobState") not in _FINAL
                    for r in parse_records(self.run("scontrol", "show", "job", "-o").stdout).values()):
                time.sleep(1)
        for node in NODES:
            for name in self.sizes:
                res = self.ds("--node", node, "evict", name, "--force", "--reason", "bench reset", check=False)
                if res.returncode != 0:
                    say(f"evict {name} on {node}: {res.stderr.strip()}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(any((self.dir / "nvme" / n / "trash").glob("*")) for n in NODES
                                                   if (self.dir / "nvme" / n / "trash").is_dir()):
            time.sleep(0.5)
        for node in NODES:
            left = list((self.dir / "nvme" / node / "datasets").glob("*/*"))
            if left:
                raise RuntimeError(f"copies left on {node} after the reset: {left}")
            self.ds("--node", node, "report", check=False)
        (self.state / "demand.json").unlink(missing_ok=True)

    def replay(self, mode: str, jobs: list[TraceJob]) -> dict[str, Any]:
        on = mode == "on"
        say(f"mode {mode}: reset")
        self.reset()
        self.config(placement=on)
        self.start_daemon(f"poller-{mode}", str(VENV_BIN / "dsstage"), "demand-poller", "--interval", "3")
        if on:
            for node in NODES:
                self.start_daemon(f"prefetch-{node}", str(VENV_BIN / "dsstage"), "--node", node, "prefetch")
        deadline = time.monotonic() + 30
        while not (self.state / "demand.json").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the demand poller wrote no snapshot in 30 s: see " + str(self.logdir))
            time.sleep(0.3)
        script = self.dir / "jobs" / "replay-job.sh"
        script.write_text('#!/bin/bash\necho "start $(date +%s.%N) $SLURMD_NODENAME"\n'
                          'f=$(ls "$DSSTAGE_DATASET_DIR" | head -1)\n'
                          'head -c 65536 "$DSSTAGE_DATASET_DIR/$f" > /dev/null && echo "read $DSSTAGE_DATASET_DIR/$f"\n'
                          'sleep "$1"\n')
        script.chmod(0o755)
        load0 = os.getloadavg()
        say(f"mode {mode}: replaying {len(jobs)} jobs over {jobs[-1].submit:.0f}s of submissions")
        started = time.time()
        t0 = time.monotonic()
        submitted: dict[str, tuple[TraceJob, float]] = {}
        records: dict[str, dict[str, str]] = {}
        plans: dict[str, list[str]] = {}  # job -> its SchedNodeList while pending, each change
        events: dict[tuple[Any, ...], dict[str, Any]] = {}
        todo = list(jobs)
        last_poll = 0.0
        limit = jobs[-1].submit + self.args.timeout
        while True:
            now = time.monotonic() - t0
            while todo and todo[0].submit <= now:
                j = todo.pop(0)
                at = time.time()
                res = self.run("sbatch", "--parsable", f"--dataset={j.dataset}", "--exclusive", "-N1", "-t", "1",
                               "-J", f"replay-{mode}-{j.index:02d}", "-o", str(self.dir / "jobs" / "%j.out"),
                               str(script), str(j.runtime))
                submitted[res.stdout.strip().split(";")[0]] = (j, at)
            if now - last_poll >= 2 or not todo:
                last_poll = now
                recs = parse_records(self.run("scontrol", "show", "job", "-o").stdout)
                for jid, r in recs.items():
                    if jid in submitted:
                        records[jid] = r
                        plan = r.get("SchedNodeList", "")
                        seq = plans.setdefault(jid, [])
                        if r.get("JobState") == "PENDING" and plan and (not seq or seq[-1] != plan):
                            seq.append(plan)
                self.collect_events(events, started)
                if not todo and all(records.get(jid, {}).get("JobState") in _FINAL for jid in submitted):
                    break
                if now > limit:
                    say(f"mode {mode}: timed out after {now:.0f}s; cancelling what is left")
                    break
            time.sleep(0.2)
        wall = time.monotonic() - t0
        time.sleep(3)  # the last Epilogs and prefetch records
        self.collect_events(events, started)
        load1 = os.getloadavg()
        self.stop_daemons()
        reports = {n: read_json(self.state / "nodes" / f"{n}.json") for n in NODES}
        rows = self.job_rows(submitted, records, plans)
        summary = summarise(mode, rows, list(events.values()), self.sizes, self.args.source_rate * 2**20)
        summary.update(wall=round(wall, 1), load_before=load0, load_after=load1)
        say(f"mode {mode}: done in {wall:.0f}s; " + one_line(summary))
        return {"summary": summary, "jobs": rows, "prefetch_events": sorted(events.values(), key=lambda e: e["time"]),
                "copies_at_end": {n: (r or {}).get("copies") for n, r in reports.items()}}

    def collect_events(self, events: dict[tuple[Any, ...], dict[str, Any]], since: float) -> None:
        """The prefetch events of the node reports (a report keeps only its last 20)."""
        for node in NODES:
            rep = read_json(self.state / "nodes" / f"{node}.json") or {}
            for e in rep.get("prefetch") or []:
                if isinstance(e, dict) and float(e.get("time") or 0) >= since:
                    events[(node, e.get("time"), e.get("dataset"), e.get("job_id"), e.get("action"))] = {"node": node,
                                                                                                           **e}

    def job_rows(self, submitted: dict[str, tuple[TraceJob, float]], records: dict[str, dict[str, str]],
                 plans: dict[str, list[str]]) -> list[dict[str, Any]]:
        times: dict[str, tuple[str, float, float, int]] = {}
        for line in (self.logdir / TIMES).read_text().splitlines() if (self.logdir / TIMES).exists() else []:
            f = line.split()
            if len(f) == 5:
                times[f[0]] = (f[1], float(f[2]), float(f[3]), int(f[4]))  # the last run of a requeued job
        hooks: dict[str, list[tuple[str, str]]] = {}
        hook_log = self.logdir / "dsstage-hooks.log"
        for line in hook_log.read_text(errors="replace").splitlines() if hook_log.exists() else []:
            m = _HOOK_LINE.match(line)
            if m:
                hooks.setdefault(m.group(2), []).append((m.group(1), m.group(3)))
        started_by: dict[str, str] = {}
        ctld = self.logdir / "slurmctld.log"
        for line in ctld.read_text(errors="replace").splitlines() if ctld.exists() else []:
            m = re.search(r"sched/backfill: _start_job: Started JobId=(\d+)|sched: Allocate JobId=(\d+)", line)
            if m:
                started_by[m.group(1) or m.group(2)] = "backfill" if m.group(1) else "main"
        rows = []
        for jid, (j, submit_at) in sorted(submitted.items(), key=lambda kv: int(kv[0])):
            output = self.dir / "jobs" / f"{jid}.out"
            out_lines = output.read_text(errors="replace").splitlines() if output.exists() else []
            read = next((x.split(" ", 1)[1] for x in out_lines if x.startswith("read ")), "")
            read_from = ("node" if read.startswith(str(self.dir / "nvme")) else
                         "source" if read.startswith(str(self.dir / "data")) else "?")
            r = records.get(jid, {})
            node, p_start, p_end, rc = times.get(jid, (r.get("NodeList", ""), None, None, None))
            path, staged_s, notes = "unknown", None, []
            for level, text in hooks.get(jid, []):
                m = _DONE.match(text)
                if m and m.group(1) == j.dataset:
                    if text.endswith("(warm path)"):
                        path = "warm"
                    else:
                        path = "cached" if m.group(2) == "cached" else "staged"
                        staged_s = float(m.group(4))
                elif level in ("WARNING", "ERROR"):
                    notes.append(text)
            if path == "unknown" and notes:
                path = "fallback" if read_from == "source" else "failed"
            start = p_start if p_start is not None else slurm_time(r.get("StartTime"))
            wait = start - submit_at if start is not None else None
            rows.append({
                "job_id": jid, "index": j.index, "trace_id": j.trace_id, "trace_user": j.trace_user,
                "dataset": j.dataset, "runtime": j.runtime, "state": r.get("JobState", "?"), "node": node,
                "prefer": (r.get("Prefer") or "").replace("(null)", ""), "plans": plans.get(jid, []),
                "started_by": started_by.get(jid, "?"), "read_from": read_from,
                "job_output": [x for x in out_lines if x.startswith(("read ", "dsstage"))],
                "started_on_last_plan": bool(plans.get(jid)) and plans[jid][-1] == node,
                "submitted": submit_at, "prolog_start": p_start, "prolog_end": p_end, "prolog_rc": rc,
                "prolog_seconds": round(p_end - p_start, 4) if p_start is not None and p_end is not None else None,
                "wait": round(wait, 3) if wait is not None else None, "path": path, "staged_seconds": staged_s,
                "stage_time": round(self.stage_time[j.dataset], 3),
                "waited_longer": wait is not None and wait > self.stage_time[j.dataset],
                "slurm": {k: r.get(k) for k in ("SubmitTime", "StartTime", "EndTime", "Reason", "ExitCode")},
                "hook_notes": notes})
        return rows


def processes(name: str) -> Iterator[tuple[int, bytes]]:
    """(pid, content of /proc/<pid>/<name>) of every process that is still there to read."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                yield int(d.name), (d / name).read_bytes()
            except OSError:
                continue


def children(pid: int) -> list[int]:
    return [p for p, stat in processes("stat") if int(stat.rpartition(b")")[2].split()[1]) == pid]


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def other_clusters(mine: Path) -> list[str]:
    """Other slurmctld processes on this machine (another cluster's tests: noise)."""
    cmds = (raw.replace(b"\0", b" ").decode(errors="replace").strip() for _pid, raw in processes("cmdline"))
    return [cmd for cmd in cmds if cmd.startswith("slurmctld") and str(mine) not in cmd]


# -- figures ---------------------------------------------------------------------------------

def p95(values: list[float]) -> float | None:
    """Nearest-rank 95th percentile."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(0.95 * len(s)) - 1)]


def summarise(mode: str, rows: list[dict[str, Any]], events: list[dict[str, Any]], sizes: dict[str, int],
              rate: float) -> dict[str, Any]:
    """The figures of one mode. ``rate``: bytes/s of a stage from the source (bounds what an
    abandoned prefetch moved: dsstage records no bytes for it)."""
    ran = [r for r in rows if r["prolog_seconds"] is not None]
    warm = [r for r in ran if r["path"] == "warm"]
    ready = [r for r in ran if r["path"] in ("warm", "cached")]
    waited = [r for r in ran if r["waited_longer"]]
    waited_ready = [r for r in waited if r["path"] in ("warm", "cached")]
    prolog = [r["prolog_seconds"] for r in ran]
    planned = [r for r in ran if r["plans"]]
    staged = sorted((e for e in events if e.get("action") == "staged"), key=lambda e: e["time"])
    unused = 0
    for i, e in enumerate(staged):
        # used: the first job with this dataset whose Prolog ran on this node after the
        # prefetch, and before the prefetch staged it there again, found the copy ready (a
        # job that staged it itself, or a second prefetch, found it evicted)
        key = (e["node"], e["dataset"])
        again = next((float(x["time"]) for x in staged[i + 1:] if (x["node"], x["dataset"]) == key), math.inf)
        after = sorted((r for r in ran if r["node"] == e["node"] and r["dataset"] == e["dataset"]
                        and float(e["time"]) - 0.5 <= r["prolog_start"] < again), key=lambda r: r["prolog_start"])
        e["used_by"] = after[0]["job_id"] if after and after[0]["path"] in ("warm", "cached") else None
        if e["used_by"] is None:
            unused += int(e.get("bytes") or 0)
    # an abandoned prefetch whose staging area was removed wasted what had arrived: dsstage
    # records 0 bytes for it; bound it by its seconds at the source's rate
    dropped = [e for e in events if e.get("action") == "abandoned" and "was removed" in str(e.get("reason"))]
    dropped_bound = sum(min(sizes.get(str(e.get("dataset")), 0), int(float(e.get("seconds") or 0) * rate))
                        for e in dropped)
    misses: dict[str, int] = {}
    for r in waited:
        if r["path"] not in ("warm", "cached"):
            kind = miss_kind(r)
            misses[kind] = misses.get(kind, 0) + 1
    actions: dict[str, int] = {}
    for e in events:
        actions[str(e.get("action"))] = actions.get(str(e.get("action")), 0) + 1
    return {
        "mode": mode, "jobs": len(rows), "prolog_runs": len(ran),
        "warm_path": len(warm), "warm_path_fraction": frac(len(warm), len(ran)),
        "started_warm": len(ready), "started_warm_fraction": frac(len(ready), len(ran)),
        "waited_longer": len(waited), "waited_longer_warm": len(waited_ready),
        "waited_longer_warm_fraction": frac(len(waited_ready), len(waited)),
        "waited_longer_warm_path": sum(1 for r in waited if r["path"] == "warm"),
        "waited_longer_misses": misses,
        "staged": sum(1 for r in ran if r["path"] == "staged"),
        "fallback": sum(1 for r in rows if r["path"] == "fallback"),
        "failed": sum(1 for r in rows if r["path"] in ("failed", "unknown")),
        "started_by_backfill": sum(1 for r in rows if r["started_by"] == "backfill"),
        "prolog_total": round(sum(prolog), 3), "prolog_p95": p95(prolog),
        "prolog_median": sorted(prolog)[len(prolog) // 2] if prolog else None,
        "planned_jobs": len(planned), "started_on_last_plan": sum(1 for r in planned if r["started_on_last_plan"]),
        "prefetched_bytes": sum(int(e.get("bytes") or 0) for e in staged),
        "prefetched_unused_bytes": unused, "prefetch_actions": actions,
        "abandoned_removed": len(dropped), "abandoned_bytes_at_most": dropped_bound,
        "waits": {"median": median([r["wait"] for r in ran]), "max": max([r["wait"] for r in ran], default=None),
                  "mean": mean([r["wait"] for r in ran])},
    }


def miss_kind(row: dict[str, Any]) -> str:
    """Why a job that waited longer than its stage time did not start warm: it fell back to
    the source, it started on another node than the one Slurm last planned for it (the
    prefetch staged where the plan said), it started where planned but its copy was not
    ready (late), or Slurm never showed it a planned node."""
    if row["path"] in ("fallback", "failed", "unknown"):
        return "fell back"
    if not row["plans"]:
        return "never planned"
    return "late" if row["started_on_last_plan"] else "moved off the planned node"


def frac(a: int, b: int) -> float | None:
    return a / b if b else None


def mean(values: list[float]) -> float | None:
    s = [v for v in values if v is not None]
    return round(sum(s) / len(s), 3) if s else None


def median(values: list[float]) -> float | None:
    s = sorted(v for v in values if v is not None)
    return s[len(s) // 2] if s else None


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def one_line(s: dict[str, Any]) -> str:
    return (f"{s['jobs']} jobs, warm path {pct(s['warm_path_fraction'])}, "
            f"started warm {pct(s['started_warm_fraction'])}, "
            f"waited > stage time and warm {s['waited_longer_warm']}/{s['waited_longer']}, Prolog total "
            f"{s['prolog_total']:.1f}s p95 {s['prolog_p95'] or 0:.2f}s, pre-staged {mb(s['prefetched_bytes'])} "
            f"({mb(s['prefetched_unused_bytes'])} unused)")


def table(summaries: list[dict[str, Any]]) -> str:
    head = ("| mode | jobs | warm path | started warm | waited > stage time: started warm | Prolog total | "
            "Prolog p95 | Prolog median | fell back to the source | pre-staged | pre-staged unused | "
            "abandoned prefetches | started on planned node | queue wait mean | "
            "misses (waited > stage time, not warm) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        lines.append(
            f"| {s['mode']} | {s['jobs']} | {pct(s['warm_path_fraction'])} ({s['warm_path']}) | "
            f"{pct(s['started_warm_fraction'])} ({s['started_warm']}) | "
            f"{pct(s['waited_longer_warm_fraction'])} ({s['waited_longer_warm']}/{s['waited_longer']}) | "
            f"{s['prolog_total']:.1f} s | {s['prolog_p95'] or 0:.2f} s | {s['prolog_median'] or 0:.2f} s | "
            f"{s['fallback']} | "
            f"{mb(s['prefetched_bytes'])} | {mb(s['prefetched_unused_bytes'])} | "
            f"{s['abandoned_removed']} (<= {mb(s['abandoned_bytes_at_most'])}) | "
            f"{s['started_on_last_plan']}/{s['planned_jobs']} | {s['waits'].get('mean') or 0:.1f} s | "
            + (", ".join(f"{k} {v}" for k, v in sorted(s["waited_longer_misses"].items())) or "none") + " |")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/replay", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE), help="SWF trace (gzip)")
    p.add_argument("--offset", type=int, default=34000, help="first job of the window, counting jobs with a run time")
    p.add_argument("--jobs", type=int, default=36, help="jobs in the window")
    p.add_argument("--seed", type=int, default=2002, help="seed of the dataset draw and sizes")
    p.add_argument("--datasets", type=int, default=5, help="number of datasets")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of dataset popularity")
    p.add_argument("--submit-span", type=float, default=90.0, help="seconds the window's submissions span")
    p.add_argument("--runtime", default="8:28", help="LO:HI seconds the trace's run times map into (log scale)")
    p.add_argument("--source-rate", type=float, default=32.0, help="MiB/s of a stage from the source")
    p.add_argument("--min-keep", type=float, default=None,
                   help="retention.min_keep in seconds (default: dsstage's 600 s compressed like the submit times)")
    p.add_argument("--wait-for-data", type=float, default=None,
                   help="placement.wait_for_data in seconds with placement on (default: dsstage's 1800 s compressed "
                        "like the submit times; 0: --prefer alone)")
    p.add_argument("--modes", default="off,on", help="off, on, or both (comma-separated, in that order)")
    p.add_argument("--runs", type=int, default=1,
                   help="replay the modes this many times on the same cluster and datasets; the goal is read "
                        "from the median run (1)")
    p.add_argument("--timeout", type=float, default=360.0, help="seconds after the last submission before giving up")
    p.add_argument("--dir", default=f"/var/tmp/dsstage-replay-bench-{os.getpid()}", help="the devcluster's directory")
    p.add_argument("--port", type=int, default=46917,
                   help="slurmctld port (slurmd: +100..+103; 36917 is another cluster's slurmd port here)")
    p.add_argument("--out", default="", help="JSON of the raw records (default /tmp/dsstage-replay-<time>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("replay: run as root (the devcluster's daemons and the store are root's)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"/tmp/dsstage-replay-{stamp}.json")
    logs_out = out.with_suffix("").with_name(out.with_suffix("").name + "-logs")
    command = shlex.join(["bench/replay", *(sys.argv[1:] if argv is None else argv)])
    names = [f"ds{k}" for k in range(args.datasets)]
    jobs = workload(args, names)
    began = time.monotonic()
    head = subprocess.run(["git", "-C", str(TOP), "describe", "--always", "--dirty"], text=True, capture_output=True)
    commit = head.stdout.strip() or "?"
    others = other_clusters(Path(args.dir))
    say(f"window: trace jobs {jobs[0].trace_id}-{jobs[-1].trace_id} ({len(jobs)} jobs from offset {args.offset}), "
        f"seed {args.seed}; datasets " + ", ".join(f"{n}: {sum(j.dataset == n for j in jobs)}" for n in names))
    if others:
        say(f"note: {len(others)} other Slurm cluster(s) run on this machine (noise): {others}")
    rep = Replay(args)
    span = jobs[-1].trace_submit - jobs[0].trace_submit
    rep.min_keep = args.min_keep if args.min_keep is not None else max(10.0, 600.0 * args.submit_span / max(span, 1))
    rep.wait_for_data = (args.wait_for_data if args.wait_for_data is not None
                         else max(10.0, 1800.0 * args.submit_span / max(span, 1)))
    results: dict[str, Any] = {}
    try:
        rep.up()
        rep.make_datasets(names, random.Random(args.seed))
        rep.measure_stage_times()
        for run in range(1, args.runs + 1):
            for mode in args.modes.split(","):
                key = mode.strip() if args.runs == 1 else f"{mode.strip()} #{run}"
                results[key] = rep.replay(mode.strip(), jobs)
                results[key]["summary"]["mode"] = key
    finally:
        try:
            logs_out.mkdir(parents=True, exist_ok=True)
            for f in (rep.logdir.glob("*.log") if rep.logdir.is_dir() else []):
                shutil.copy(f, logs_out / f.name)
        except OSError as exc:
            say(f"could not keep the logs: {exc}")
        rep.down()
    summaries = [r["summary"] for r in results.values()]
    data = {"command": command, "seed": args.seed, "window": {"offset": args.offset, "jobs": args.jobs,
                                                              "trace_ids": [jobs[0].trace_id, jobs[-1].trace_id]},
            "args": vars(args), "datasets": {n: {"bytes": rep.sizes.get(n), "stage_time": rep.stage_time.get(n)}
                                             for n in names},
            "tier_capacity": rep.capacity, "min_keep": rep.min_keep, "wait_for_data": rep.wait_for_data,
            "workload": [asdict(j) for j in jobs],
            "other_clusters": others, "commit": commit,
            "cpus": os.cpu_count(), "wall": round(time.monotonic() - began, 1), "modes": results}
    out.write_text(json.dumps(data, indent=1))
    print()
    print(table(summaries))
    print()
    print(f"command: {command}  (checkout {commit})")
    print(f"window: trace {Path(args.trace).name}, jobs {jobs[0].trace_id}-{jobs[-1].trace_id} ({len(jobs)} with a "
          f"run time, from offset {args.offset}); submissions over {jobs[-1].submit:.0f}s, run times "
          f"{min(j.runtime for j in jobs)}-{max(j.runtime for j in jobs)}s; seed {args.seed}")
    print("datasets: " + ", ".join(f"{n} {rep.sizes[n] / 1e6:.0f} MB ({sum(j.dataset == n for j in jobs)} jobs, cold "
                                   f"stage {rep.stage_time[n]:.2f}s)" for n in names)
          + f"; node tier {rep.capacity / 1e6:.0f} MB; source {args.source_rate:g} MiB/s; "
            f"retention.min_keep {rep.min_keep:.0f}s; placement.wait_for_data (on) {rep.wait_for_data:.0f}s")
    if others:
        print(f"noise: {len(others)} other Slurm cluster(s) ran on this machine; load "
              + ", ".join(f"{s['mode']} {s['load_before'][0]:.1f}->{s['load_after'][0]:.1f}" for s in summaries))
    print(f"raw records: {out} (logs: {logs_out}); {data['wall']:.0f}s in all")
    ons = [s for s in summaries if s["mode"].split(" ")[0] == "on" and s["waited_longer_warm_fraction"] is not None]
    if ons:
        fs = sorted(s["waited_longer_warm_fraction"] for s in ons)
        f = fs[(len(fs) - 1) // 2]  # the median run (the lower one of an even count)
        met = f >= 0.9
        spread = f" (runs: {', '.join(pct(x) for x in fs)})" if len(fs) > 1 else ""
        misses: dict[str, int] = {}
        for s in ons:
            for k, v in s["waited_longer_misses"].items():
                misses[k] = misses.get(k, 0) + v
        print(f"goal (pre-staging on: >= 90 % of jobs that waited longer than their dataset's stage time start "
              f"warm, median of {len(fs)} run{'s' if len(fs) > 1 else ''}): {pct(f)}{spread}: "
              f"{'met' if met else 'NOT met'}; misses in all: "
              + (", ".join(f"{k} {v}" for k, v in sorted(misses.items())) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
