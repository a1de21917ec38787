"""bench/scale: the cluster's load on its shared filesystem, on a devcluster of N nodes.

Each scenario runs twice in the same run, on the same devcluster: with peers on (any node's
copy serves the others, the first node to read a version claims it) and the baseline with
peers off (every node reads the source), each time on a dataset name no node holds yet.
The source is a latencyfs mount of generated files, uncached (the nodes share no read
through this machine's page cache, as separate NFS clients do not), with one bandwidth for
all readers (--rate) and a budget of requests in flight (sources.<name>.max_in_flight).

Figures, per scenario and mode: bytes the source served / dataset size; the time from
submission until the last job ended; the highest number of requests in flight the source
saw (against max_in_flight); Slurm RPCs during the scenario (sdiag's per-type counts, reset
before); the shared state directory's operations per job start (the devcluster's
``state_dir`` is served by a second latencyfs, writable, root not squashed, 200 µs per
request: what an NFS server would see of dsstage, every FUSE request counted, by kind and
by area, the top-level entry it went to: nodes, budget, staging, demand, ...; and the same
without the background: the requests per second of 10 s with no job, before each mode,
times the scenario's duration, taken out); and for the N-node job, the slowest node's stage
against one node alone.

The hanging source (``hang``, last): the source stops answering (latencyfs ``hang``: every
request blocks, as a hard NFS mount whose server is gone) and one-node jobs run one after
another, one per node, under a short ``prolog_budget`` (--hang-budget) and the shipped
``on_failure: fallback``. Per job: from submission to its end, and Slurm RPCs. The first job
pays the budget (what every job paid before the source's breaker, dsstage.node.breaker); the
figure is what the later ones pay, on other nodes.

    bench/scale [--nodes 16] [--files 120] [--size 262144] [--rate 40] [--budget 16] [--json FILE]
                [--scenarios job,array,after,pairs,hang] [--hang-budget 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

TOP = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TOP / "tests"))
from latencyfs import LatencyFS  # noqa: E402

PORT = 38817
STAGED = re.compile(r"job (\d+)(?:_\d+)?: (\S+) (staged|cached) at \S+/nvme/(n\d+)/\S+ in ([\d.]+)s")


@contextlib.contextmanager
def devcluster(nodes: int) -> Iterator[tuple[Path, dict[str, str]]]:
    """packaging/devcluster up of ``nodes`` nodes (no services: nothing runs behind the
    scenarios' backs), down and removed afterwards."""
    cdir = Path(f"/var/tmp/dsstage-scale-{os.getpid()}")
    dc_env = dict(os.environ, DEVCLUSTER_DIR=str(cdir), DEVCLUSTER_PORT=str(PORT), DEVCLUSTER_NODES=str(nodes),
                  DEVCLUSTER_SAMPLE_FILES="10", DEVCLUSTER_SERVICES="0")
    env = dict(os.environ, SLURM_CONF=str(cdir / "etc" / "slurm.conf"),
               DSSTAGE_CONFIG=str(cdir / "etc" / "dsstage.yaml"), DSSTAGE_RUN_DIR=str(cdir / "dsstage-run"))
    script = str(TOP / "packaging" / "devcluster")
    t = time.monotonic()
    up = subprocess.run([script, "up"], env=dc_env, text=True, capture_output=True, timeout=3600)
    try:
        if up.returncode != 0:
            raise SystemExit(f"bench/scale: devcluster up failed: {up.stderr[-2000:]}")
        print(f"devcluster of {nodes} nodes up in {time.monotonic() - t:.1f} s", flush=True)
        yield cdir, env
    finally:
        subprocess.run([script, "down"], env=dc_env, timeout=600, capture_output=True)
        shutil.rmtree(cdir, ignore_errors=True)


def make_files(root: Path, files: int, size: int) -> int:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        p = root / f"part{i % 8}" / f"f{i:05d}.bin"
        p.parent.mkdir(exist_ok=True)
        if not p.exists() or p.stat().st_size != size:
            p.write_bytes(os.urandom(size))
    return files * size


@contextlib.contextmanager
def served_state_dir(cdir: Path) -> Iterator[LatencyFS]:
    """The devcluster's state directory behind a latencyfs that counts its requests: the
    directory moves to a backing directory and the mount takes its place (writable, each
    request as its caller, root served as root: an export without root_squash)."""
    state = cdir / "dsstage-state"
    backing = cdir / "dsstage-state.backing"
    state.rename(backing)
    state.mkdir()
    try:
        with LatencyFS(backing, state, delay_us=200, squash=True, extra_options="squash_uid=0,squash_gid=0") as fs:
            yield fs
    finally:
        state.rmdir()
        backing.rename(state)


def state_ops(stats: dict) -> dict[str, int]:
    """The state directory's requests by kind, without the zeros."""
    return {k: v for k, v in stats["ops"].items() if v}


def state_areas(stats: dict) -> dict[str, dict[str, int]]:
    """The state directory's requests by area (its top-level entry: nodes, budget, staging,
    demand, ...) and kind, without the areas that saw none."""
    return {a: kinds for a, kinds in stats.get("by_area", {}).items() if kinds}


def idle_rates(state: LatencyFS, seconds: float) -> dict[str, dict[str, float]]:
    """The state directory's requests per second by area and kind while no job runs: the
    devcluster's background (each node's report refresh every few seconds, where a site's
    timer runs every 5 minutes; the poller's rounds), taken out of a scenario's figures."""
    state.reset()
    time.sleep(seconds)
    return {a: {k: v / seconds for k, v in kinds.items()} for a, kinds in state_areas(state.stats()).items()}


def without_background(areas: dict[str, dict[str, int]], rates: dict[str, dict[str, float]],
                       seconds: float) -> dict[str, dict[str, float]]:
    """``areas`` less what the background (``rates``) would have done in ``seconds``."""
    net = {a: {k: max(0.0, v - rates.get(a, {}).get(k, 0.0) * seconds) for k, v in kinds.items()}
           for a, kinds in areas.items()}
    return {a: {k: v for k, v in kinds.items() if v >= 0.05} for a, kinds in net.items()
            if sum(kinds.values()) >= 0.05}


class Cluster:
    def __init__(self, cdir: Path, env: dict[str, str], fs: LatencyFS, source: Path,
                 state: LatencyFS | None = None) -> None:
        self.cdir, self.env, self.fs, self.source, self.state = cdir, env, fs, source, state
        self.conf_path = cdir / "etc" / "dsstage.yaml"
        self.log_path = cdir / "log" / "dsstage-hooks.log"
        self.dsstage = str(TOP / ".venv" / "bin" / "dsstage")
        self.count = 0

    def run(self, *argv: str, check: bool = True) -> str:
        res = subprocess.run(list(argv), env=self.env, text=True, capture_output=True, timeout=1800,
                             cwd=str(self.cdir / "jobs"))
        if check and res.returncode != 0:
            raise SystemExit(f"bench/scale: {' '.join(argv[:4])} failed ({res.returncode}): {res.stderr[-800:]}")
        return res.stdout

    def dataset(self, peers: bool, budget: int, rsync: bool = False, prolog_budget: int = 600) -> str:
        """A fresh dataset name on the source (nothing of it on any node), peers on or off."""
        self.count += 1
        name = f"s{self.count}"
        conf = yaml.safe_load(self.conf_path.read_text())
        conf["datasets"][name] = {"source": str(self.source)}
        conf["peers"]["enabled"] = peers
        conf["sources"] = {"lfs": {"prefix": str(self.fs.mountpoint), "max_in_flight": budget}}
        conf["prolog_budget"] = prolog_budget
        self.conf_path.write_text(yaml.safe_dump(conf))
        self.conf_path.chmod(0o644)
        self.run(self.dsstage, "manifest", "build", name)
        self.run(self.dsstage, "export-catalog", "-o", str(self.cdir / "etc" / "dsstage_catalog.lua"))
        return name

    def submit(self, name: str, *opts: str) -> str:
        script = self.cdir / "jobs" / f"scale-{time.monotonic_ns()}.sh"
        script.write_text(f"#!/bin/bash\n#SBATCH --dataset={name}\ntrue\n")
        script.chmod(0o755)
        return self.run("sbatch", "--parsable", "-o", "/dev/null", *opts, str(script)).strip().split(";")[0]

    def wait(self, jobs: list[str], seconds: float = 1800) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-j", ",".join(jobs), "-o", "%i", check=False).strip():
                return
            time.sleep(0.5)
        raise SystemExit(f"bench/scale: jobs {jobs} did not end within {seconds} s")

    def rpcs(self) -> int:
        """Slurm RPCs since the last ``sdiag --reset`` (the per-type counts, summed)."""
        text = self.run("sdiag")
        part = text.split("Remote Procedure Call statistics by message type", 1)[-1]
        part = part.split("Remote Procedure Call statistics by user", 1)[0]
        return sum(int(m) for m in re.findall(r"count:(\d+)", part))

    def stages(self, name: str) -> list[tuple[str, float]]:
        """(node, seconds) of each stage of ``name`` in the hooks' log."""
        return [(m.group(4), float(m.group(5))) for m in STAGED.finditer(self.log_path.read_text())
                if m.group(2) == name]


def scenario(c: Cluster, what: str, total: int, budget: int, start: Callable[[str], list[str]],
             idle: float = 10.0) -> list[dict]:
    rows = []
    for peers in (True, False):
        name = c.dataset(peers, budget)
        rates = idle_rates(c.state, idle) if c.state else {}
        c.fs.reset()
        if c.state:
            c.state.reset()
        c.run("sdiag", "--reset")
        t = time.monotonic()
        jobs = start(name)
        c.wait(jobs)
        took = time.monotonic() - t
        stats = c.fs.stats()
        state = c.state.stats() if c.state else {}
        ops = state_ops(state) if state else {}
        areas = state_areas(state) if state else {}
        net = without_background(areas, rates, took)
        stages = c.stages(name)
        row = {"scenario": what, "peers": peers, "served_over_dataset": stats["bytes_read"] / total,
               "seconds": took, "peak_in_flight": stats["peak_in_flight"],
               "peak_opens_in_flight": stats["peak_opens_in_flight"], "max_in_flight": budget,
               "rpcs": c.rpcs(), "jobs": len(jobs), "stages": len(stages),
               "slowest_stage_s": max((s for _n, s in stages), default=0.0),
               "starts": len(stages), "state_ops": ops, "state_ops_by_area": areas,
               "state_ops_per_start": sum(ops.values()) / max(len(stages), 1),
               "state_background_per_s": rates, "state_ops_by_area_net": net,
               "state_ops_per_start_net": sum(sum(k.values()) for k in net.values()) / max(len(stages), 1)}
        rows.append(row)
        print(f"{what:44} peers {'on ' if peers else 'off'}: source served {row['served_over_dataset']:5.2f}x, "
              f"{took:6.1f} s, peak in flight {row['peak_in_flight']:3d} (budget {budget}), "
              f"{row['rpcs']:5d} RPCs, {len(stages)} stages, slowest {row['slowest_stage_s']:.1f} s, "
              f"state dir {row['state_ops_per_start']:.0f} ops per node start, "
              f"{row['state_ops_per_start_net']:.0f} without the background", flush=True)
        if ops:
            print(f"{'':44}              state dir by kind: "
                  + ", ".join(f"{k} {v / max(len(stages), 1):.1f}" for k, v in sorted(ops.items())), flush=True)
            print(f"{'':44}              state dir by area, without the background: "
                  + ", ".join(f"{a} {sum(kinds.values()) / max(len(stages), 1):.1f} ("
                              + ", ".join(f"{k} {v / max(len(stages), 1):.1f}" for k, v in sorted(kinds.items()))
                              + ")" for a, kinds in sorted(net.items(), key=lambda kv: -sum(kv[1].values()))),
                  flush=True)
    return rows


def hanging(c: Cluster, nodes: int, budget: int, prolog_budget: int) -> list[dict]:
    """One-node jobs one after another on n1..nN while the source hangs (see the module doc)."""
    name = c.dataset(True, budget, prolog_budget=prolog_budget)
    c.fs.hang()
    rows = []
    try:
        for i in range(1, nodes + 1):
            c.run("sdiag", "--reset")
            t = time.monotonic()
            job = c.submit(name, "-N", "1", "-w", f"n{i}")
            c.wait([job], seconds=prolog_budget * 4 + 120)
            took = time.monotonic() - t
            row = {"scenario": "a hanging source, one-node jobs one after another", "job": i, "node": f"n{i}",
                   "seconds": took, "rpcs": c.rpcs(), "prolog_budget": prolog_budget}
            rows.append(row)
            print(f"hanging source, job {i} on n{i}: submitted to ended {took:6.1f} s "
                  f"(prolog_budget {prolog_budget} s), {row['rpcs']:4d} RPCs", flush=True)
    finally:
        c.fs.answer()
    later = [r["seconds"] for r in rows[1:]]
    if later:
        print(f"hanging source: the first job {rows[0]['seconds']:.1f} s, the {len(later)} later ones "
              f"{min(later):.1f}-{max(later):.1f} s (mean {sum(later) / len(later):.1f})", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--files", type=int, default=120)
    ap.add_argument("--size", type=int, default=256 * 1024, help="bytes per file")
    ap.add_argument("--rate", type=int, default=40, help="the source's bandwidth for all readers, MiB/s")
    ap.add_argument("--budget", type=int, default=16, help="sources.<name>.max_in_flight")
    ap.add_argument("--dir", default="/var/tmp/dsstage-bench-scale", help="where the generated files are kept")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--scenarios", default="job,array,after,pairs,hang",
                    help="which to run, of job, array, after, pairs, hang")
    ap.add_argument("--hang-budget", type=int, default=20, help="prolog_budget of the hanging-source scenario, s")
    args = ap.parse_args()
    chosen = set(args.scenarios.split(","))
    if chosen - {"job", "array", "after", "pairs", "hang"}:
        raise SystemExit(f"bench/scale: --scenarios: {args.scenarios}: of job, array, after, pairs, hang")
    if os.geteuid() != 0:
        raise SystemExit("bench/scale: run as root (the devcluster's daemons are root's)")
    n = args.nodes
    backing = Path(args.dir) / "backing"
    total = make_files(backing / "data", args.files, args.size)
    mnt = Path(args.dir) / "mnt"
    rows: list[dict] = []
    with LatencyFS(backing, mnt, delay_us=200, rate=args.rate << 20, extra_options="uncached") as fs, \
            devcluster(n) as (cdir, env), served_state_dir(cdir) as state:
        c = Cluster(cdir, env, fs, Path(fs.mountpoint) / "data", state)
        # one node alone: what "ready" costs without any sharing (the N-node job's baseline)
        name = c.dataset(False, args.budget)
        fs.reset()
        c.wait([c.submit(name, "-N", "1", "-w", "n1")])
        alone = max((s for _n, s in c.stages(name)), default=0.0)
        print(f"one node alone: its stage {alone:.1f} s, source served {fs.stats()['bytes_read'] / total:.2f}x",
              flush=True)
        if "job" in chosen:
            rows += scenario(c, f"one {n}-node job", total, args.budget,
                             lambda name: [c.submit(name, "-N", str(n), "--exclusive")])
        if "array" in chosen:
            rows += scenario(c, f"an array of {n} one-node jobs, at once", total, args.budget,
                             lambda name: [c.submit(name, f"--array=1-{n}", "-N", "1", "--exclusive")])

        def one_after_another(name: str) -> list[str]:
            jobs = []
            for i in range(1, n + 1):
                jobs.append(c.submit(name, "-N", "1", "-w", f"n{i}"))
                c.wait(jobs[-1:])
            return jobs
        if "after" in chosen:
            rows += scenario(c, f"{n} one-node jobs, one after another", total, args.budget, one_after_another)
        if "pairs" in chosen:
            rows += scenario(c, f"{n // 2} jobs of 2 nodes, at once", total, args.budget,
                             lambda name: [c.submit(name, "-N", "2", "--exclusive") for _ in range(n // 2)])
        for r in rows:
            r["one_node_alone_s"] = alone
        if "hang" in chosen:  # last: the source's breaker stays open behind it
            rows += hanging(c, n, args.budget, args.hang_budget)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
