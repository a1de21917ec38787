"""bench/compare: what this checkout's commands cost against another revision's, in one run.

A change meant to make a command start faster measures a few milliseconds against noise of
tens on a shared machine; two separate bench/run runs cannot tell them apart. Here each
command runs under both trees in turn (the other revision checked out in a git worktree;
the order swapped every round), both with their modules compiled (as the packages install
them), against the store bench/run leaves in its ``--dir`` (run ``bench/run --quick --only
warm,verify`` first: it makes the ready copies used here). Per command: the median wall time
and CPU (user + system, from the child's rusage) under each tree, and their ratio.

Commands, page cache warm:
- the warm Prolog of the cached 10k-file dataset (``python -c CODE prolog``, the
  environment slurmd gives it; prolog/dsstage-prolog runs the same with ``-I``, which would
  ignore the PYTHONPATH that picks the tree), and of a new 3-node job on the same files as
  a dataset of 96 shards, this node's third ready (as bench/run's sharded warm Prolog);
- ``dsstage verify NAME`` (the fast path) and ``dsstage stage NAME`` of a ready copy;
- ``dsstage verify NAME --full`` of the large-file and the small-file sets;
- the Epilog of a job whose warm Prolog leased the cached 10k-file dataset (release, retention,
  the node report);
- ``dsstage release`` and ``dsstage report`` (configuration loaded, no copying);
- ``dsstage stage`` of the large-file set into an empty store (the copy and its fixed cost).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TOP = Path(__file__).resolve().parent.parent


def hook_code() -> str:
    """How the hook scripts start the hooks (dsstage.hooks.__main__.CODE, this checkout's; an
    older tree's ``__main__`` has the same ``main``)."""
    from dsstage.hooks.__main__ import CODE
    return CODE


def tree_of(rev: str, where: Path) -> Path:
    """``lib`` of revision ``rev`` checked out below ``where`` (a detached git worktree)."""
    subprocess.run(["git", "-C", str(TOP), "worktree", "add", "-q", "--detach", str(where), rev], check=True)
    return where / "lib"


def compile_tree(lib: Path) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(lib)], check=True,
                   stdout=subprocess.DEVNULL)


def measure(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run of ``argv``."""
    t = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _pid, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
    if p.stderr:
        p.stderr.close()
    if status != 0:
        raise SystemExit(f"compare: {' '.join(argv)} failed ({status}): {err[-500:]}")
    return wall, ru.ru_utime + ru.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(prog="bench/compare", description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the revision to compare this checkout against (e.g. HEAD~3, a commit)")
    ap.add_argument("--runs", type=int, default=15, help="rounds; each runs every command under both trees")
    ap.add_argument("--dir", default="/var/tmp/dsstage-bench", help="bench/run's --dir")
    ap.add_argument("--only", default="", help="comma-separated command names (default: all)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("compare: run it as root (the store is root-owned)")
    d = Path(args.dir)
    conf, py = d / "dsstage.yaml", sys.executable
    ready = d / "nvme" / "bench" / "ready"
    for need in (conf, ready / "warm10k", ready / "warm10k-sharded", ready / "small"):
        if not need.exists():
            raise SystemExit(f"compare: {need} is missing: run bench/run --quick --only warm,verify first")

    def store_clear(name: str) -> Callable[[], None]:
        def clear() -> None:
            for sub in ("datasets", "ready", "staging", "leases"):
                shutil.rmtree(d / "nvme" / "bench" / sub / name, ignore_errors=True)
            os.sync()  # the previous run's dirty pages (and its background flush) are not this run's cost
        return clear

    def ds(*a: str) -> list[str]:
        return [py, "-m", "dsstage", *a]

    hook = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_JOB_ID": "4343", "SLURM_JOB_UID": "0",
            "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root", "SLURMD_NODENAME": "bench",
            "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "warm10k",
            "DSSTAGE_CONFIG": str(conf), "DSSTAGE_RUN_DIR": str(d / "run"), "DSSTAGE_LOG": str(d / "hooks.log")}
    cli = {**os.environ, "DSSTAGE_CONFIG": str(conf), "SLURMD_NODENAME": "bench"}
    cli.pop("SLURM_JOB_ID", None)
    epilog_env = {**hook, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}
    # a new 3-node job each run: the warm path records its versions and plan, as a job's first node does
    sharded_env = {**hook, "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": "warm10k-sharded",
                   "SLURM_JOB_NODELIST": "bench,bench2,bench3"}
    jobs = iter(range(700_000, 10**7))

    def new_job() -> None:
        sharded_env["SLURM_JOB_ID"] = str(next(jobs))

    def job_started() -> None:  # the Epilog's job: its Prolog ran (warm path), it holds a lease
        subprocess.run([py, "-c", hook_code(), "prolog"], env=hook, check=True)

    # name: (argv, environment, what to do before each run)
    commands: dict[str, tuple[list[str], dict[str, str], Callable[[], None] | None]] = {
        "warm prolog, 10k files": ([py, "-c", hook_code(), "prolog"], hook, None),
        "warm prolog, sharded, this node's third of 10k files in 96 shards":
            ([py, "-c", hook_code(), "prolog"], sharded_env, new_job),
        "verify (fast path)": (ds("verify", "warm10k"), cli, None),
        "stage of a ready copy (fast path)": (ds("stage", "warm10k", "--job-id", "compare"), cli, None),
        "verify --full, large files": (ds("verify", "large", "--full"), cli, None),
        "verify --full, small files": (ds("verify", "small", "--full"), cli, None),
        "epilog, releasing a cached dataset's lease": ([py, "-c", hook_code(), "epilog"], epilog_env,
                                                       job_started),
        "release": (ds("release", "warm10k", "--job-id", "compare"), cli, None),
        "report": (ds("report"), cli, None),
        "stage of the large files, empty store": (ds("stage", "large", "--job-id", "compare"), cli,
                                                  store_clear("large")),
    }
    only = [o for o in args.only.split(",") if o]
    chosen = {k: v for k, v in commands.items() if not only or any(o in k for o in only)}
    with tempfile.TemporaryDirectory(prefix="dsstage-compare-") as tmp:
        before = tree_of(args.rev, Path(tmp) / "before")
        try:
            trees = {"before": before, "this checkout": TOP / "lib"}
            for lib in trees.values():
                compile_tree(lib)
            subprocess.run(ds("stage", "large", "--job-id", "compare"), env=cli, check=True,
                           stdout=subprocess.DEVNULL)  # the large set ready, and in the page cache
            rows = []
            for name, (argv, env, setup) in chosen.items():
                got: dict[str, list[tuple[float, float]]] = {t: [] for t in trees}
                for i in range(args.runs):
                    for t in (list(trees) if i % 2 else list(reversed(list(trees)))):
                        if setup:
                            setup()
                        got[t].append(measure(argv, {**env, "PYTHONPATH": str(trees[t])}))
                med = {t: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                       for t, v in got.items()}
                (bw, bc), (aw, ac) = med["before"], med["this checkout"]
                rows.append((name, bw, aw, bc, ac))
                print(f"compare: {name}: wall {bw * 1000:.1f} -> {aw * 1000:.1f} ms ({aw / bw:.2f}x), "
                      f"CPU {bc * 1000:.1f} -> {ac * 1000:.1f} ms ({ac / bc:.2f}x)", flush=True)
        finally:
            subprocess.run(["git", "-C", str(TOP), "worktree", "remove", "--force", str(Path(tmp) / "before")],
                           check=False)
            store_clear("large")()
    print(f"\n| command | wall, {args.rev} | wall, this checkout | ratio "
          f"| CPU, {args.rev} | CPU, this checkout | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, bw, aw, bc, ac in rows:
        print(f"| {name} | {bw * 1000:.1f} ms | {aw * 1000:.1f} ms | {aw / bw:.2f} | {bc * 1000:.1f} ms | "
              f"{ac * 1000:.1f} ms | {ac / bc:.2f} |")
    print(f"\nmedians of {args.runs} runs each, alternated; both trees compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
