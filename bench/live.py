"""bench/live: starting at once on a live view (``start: at-once``) against waiting for the stage.

One node's Prolog (the hook as slurmd runs it, python -I -c CODE) on a cold dataset whose
mounted source is a latencyfs limited to --rate MiB/s for all readers (uncached: every open
reads through the limit), the dataset several times what the source delivers in
``start_budget``. Each figure beside its baseline from the same run:

- time from the Prolog's start to the job's first read: at once (the live view) against
  waiting for the whole stage (``start: wait``, the Prolog's budget large enough);
- the first epoch's read throughput on the live view, while the stage runs, against reading
  the source directly (no stage running);
- the second epoch's on the view (all local by then) against the ordinary local copy (the
  median of --repeat alternated reads of each);
- how long until the view is all local, against the stage alone.

    bench/live [--files 64] [--size 4194304] [--rate 16] [--start-budget 1] [--repeat 9] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

TOP = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TOP / "tests"))
from helpers import Env, run_hook, wait_flushed  # noqa: E402
from latencyfs import LatencyFS  # noqa: E402


def read_all(root: str, rels: list[str]) -> tuple[int, float]:
    """Read every file below ``root`` in order, 1 MiB at a time: (bytes, seconds)."""
    t = time.monotonic()
    total = 0
    for rel in rels:
        with open(os.path.join(root, rel), "rb", buffering=0) as fh:
            while chunk := fh.read(1 << 20):
                total += len(chunk)
    return total, time.monotonic() - t


def task_dir(lines: list[str]) -> str:
    return next(line.split("=", 1)[1] for line in lines if line.startswith("export DSSTAGE_DATASET_DIR="))


def wait_whole(view: str, timeout: float = 3600) -> float:
    record = Path(view + ".json")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if json.loads(record.read_text()).get("state") in ("whole", "failed"):
            return time.monotonic()
        time.sleep(0.05)
    raise SystemExit(f"bench/live: the live view {view} was not whole within {timeout}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--size", type=int, default=4 << 20, help="bytes per file")
    ap.add_argument("--rate", type=float, default=16, help="the source's MiB/s, all readers together")
    ap.add_argument("--start-budget", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=9, help="reads of each local tree for the second epoch")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/live: run as root (the node store is root's)")
    with tempfile.TemporaryDirectory(prefix="dsstage-live-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        backing = root / "backing"
        rels = [f"part{i % 8}/f{i:05d}.bin" for i in range(args.files)]
        for rel in rels:
            (backing / rel).parent.mkdir(parents=True, exist_ok=True)
            (backing / rel).write_bytes(os.urandom(args.size))
        total = args.files * args.size
        rate = int(args.rate * (1 << 20))
        with LatencyFS(backing, root / "mnt", delay_us=0, rate=rate) as fs:
            env = Env(root)
            env.extra.update(prolog_budget=3600, start_budget=args.start_budget)
            env.add("live", None, source=fs.mountpoint, start="at-once")
            env.add("wait", None, source=fs.mountpoint)
            env.cli("manifest", "build", "live")
            env.cli("manifest", "build", "wait")
            print(f"dataset {total / (1 << 20):.0f} MiB in {args.files} files; source {args.rate:g} MiB/s "
                  f"({total / rate:.1f} s for the dataset, {args.start_budget:g} s of start budget delivers "
                  f"{args.start_budget * args.rate:.0f} MiB)", flush=True)
            # the baseline reads first: the source alone, no stage running
            _n, direct_s = read_all(fs.mountpoint, rels)
            # waiting: the Prolog returns when the copy is whole
            rc, wait_first, lines = run_hook(env, "prolog", "1", "wait", timeout=3600)
            assert rc == 0, lines
            copy = task_dir(lines)
            # at once: the live view
            t0 = time.monotonic()
            rc, at_once_first, lines = run_hook(env, "prolog", "2", "live", timeout=3600)
            assert rc == 0, lines
            view = task_dir(lines)
            assert "/live/" in view, lines
            _n, epoch1_s = read_all(view, rels)
            whole_at = wait_whole(view) - t0
            # the second epoch: both local, in the page cache; the median of alternated reads (a read
            # of the whole dataset takes some ten milliseconds here: one read alone is noise)
            wait_flushed(env)  # the background flush of both copies is not read against
            view_s, local_s = [], []
            for _ in range(args.repeat):
                view_s.append(read_all(view, rels)[1])
                local_s.append(read_all(copy, rels)[1])
            epoch2_s, copy_s = sorted(view_s)[len(view_s) // 2], sorted(local_s)[len(local_s) // 2]
            for job, name in (("1", "wait"), ("2", "live")):
                run_hook(env, "epilog", job, name)
    mib = total / (1 << 20)
    figures = {
        "dataset_mib": mib, "rate_mib_s": args.rate, "start_budget_s": args.start_budget,
        "first_read_s": {"at_once": at_once_first, "wait": wait_first},
        "epoch1_mib_s": {"live_view": mib / epoch1_s, "source_direct": mib / direct_s},
        "epoch2_mib_s": {"live_view": mib / epoch2_s, "local_copy": mib / copy_s},
        "all_local_s": {"live_view": whole_at, "stage_alone": wait_first},
    }
    print(f"time to the job's first read: at once {at_once_first:.2f} s, waiting {wait_first:.2f} s "
          f"({wait_first / at_once_first:.1f}x)")
    print(f"first epoch: live view {mib / epoch1_s:.1f} MiB/s, the source directly {mib / direct_s:.1f} MiB/s "
          f"({direct_s / epoch1_s:.2f}x)")
    print(f"second epoch: live view {mib / epoch2_s:.0f} MiB/s, the ordinary local copy {mib / copy_s:.0f} MiB/s "
          f"({copy_s / epoch2_s:.2f}x)")
    print(f"all local after {whole_at:.2f} s (from the Prolog's start), the stage alone {wait_first:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
