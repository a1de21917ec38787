"""The ``cpu`` scenario of bench/run (issue 30): what a stage costs in CPU, and whether it
scales with cores, against the least a verifying copy must do, in the same run.

Sources are in the page cache (a cold disk would hide the CPU). For 5,000 (20,000 full)
files of 110 KB and for 2 x 512 MiB (4 x 1 GiB full):

- CPU seconds (user + system, children included) per GiB of ``dsstage stage``, against
  ``cp -a`` plus ``b3sum`` of the same files: the bytes copied and hashed once each.
- The bare verified copy (read, BLAKE3, write a new file, compare with the manifest's hash;
  no temporary name, no mtime, no fsync) in Python threads, the faster of 4 and 16, and
  dsstage's throughput against it.
- Throughput on 1 core and on 2 (``taskset -c 0`` and ``-c 0,1``; the bare copy pins its own
  threads) of the stage, the bare verified copy, ``dsstage verify --full`` and ``b3sum``.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench import Bench

#: threads of the bare verified copy: the faster of these counts is the reference
THREADS = (4, 16)
ONE, TWO = "0", "0,1"


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and its reaped children so far."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def measure(b: Bench, fn: Callable[[], object], setup: Callable[[], object]) -> tuple[float, float]:
    """Medians of the wall time and of the CPU time of ``fn`` (setup not counted)."""
    walls, cpus = [], []
    for _ in range(b.runs):
        setup()
        c, t = cpu_seconds(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(cpu_seconds() - c)
    return statistics.median(walls), statistics.median(cpus)


def pinned(cpus: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with this thread (and the threads it starts) on ``cpus`` only."""
    def run() -> object:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        try:
            return fn()
        finally:
            os.sched_setaffinity(0, before)
    return run


def scenario(b: Bench) -> None:
    from dsstage.config import manifest as config_manifest
    small_n = 5_000 if b.quick else 20_000
    large_n, large_size = (2, 512 << 20) if b.quick else (4, 1 << 30)
    two = len(os.sched_getaffinity(0)) >= 2 and shutil.which("taskset") is not None
    if not two:
        b.say("cpu: fewer than 2 CPUs (or no taskset): the 1-core/2-core rows are left out")
    for what, root in ((f"{small_n} x 110 KB", b.make_files("small", small_n, 110_000)),
                       (f"{large_n} x {large_size >> 20} MiB", b.make_large("large", large_n, large_size))):
        name = root.name
        b.build_manifest(name, root)
        entries = config_manifest.Catalog(str(b.dir / "state")).load(name).entries
        total = sum(e.size for e in entries)
        gib = total / 2**30
        sources = [str(root / e.path) for e in entries]
        dest = b.dir / "baseline-dest"
        b.touch = total + (256 << 20)
        label = f"cpu and cores, {what}, page cache"

        fresh_dest, fresh_store = b.fresh_dest(dest, "warm", sources), b.fresh_store(name, "warm", sources)
        hashes = {e.path: e.hash for e in entries}

        def vcopy(k: int) -> None:
            b.verified_copy(root, dest, hashes, k)

        def stage(*pin: str) -> Callable[[], object]:
            return lambda: b.sh(*pin, *b.dsstage, "stage", name, "--job-id", "1", env=b.env())

        t_ds, c_ds = measure(b, stage(), fresh_store)
        t_cp, c_cp = measure(b, lambda: b.sh("cp", "-a", str(root), str(dest)), fresh_dest)
        t_b3, c_b3 = measure(b, lambda: b.sh("b3sum", *sources), fresh_dest)
        t_v = {k: measure(b, lambda k=k: vcopy(k), fresh_dest)[0] for k in THREADS}  # type: ignore[misc]
        best = min(t_v, key=lambda k: t_v[k])
        per, base = c_ds / gib, (c_cp + c_b3) / gib
        b.add(label, "dsstage stage, CPU seconds per GiB (user+system, children included)", per, "s/GiB",
              "cp -a + b3sum, CPU s/GiB", base, per / base, "<= 1.3x", per / base <= 1.3)
        b.add(label, "dsstage stage", t_ds, "s")
        for k, t in t_v.items():
            b.add(label, f"bare verified copy, {k} threads", t, "s")
        b.add(label, "dsstage throughput / bare verified copy throughput", t_v[best] / t_ds, "x",
              f"bare verified copy, {best} threads, GiB/s", gib / t_v[best], t_v[best] / t_ds, ">= 0.9x",
              t_v[best] / t_ds >= 0.9)
        if not two:
            continue
        s1 = b.time_median(stage("taskset", "-c", ONE), fresh_store)
        s2 = b.time_median(stage("taskset", "-c", TWO), fresh_store)
        v1 = b.time_median(pinned(ONE, lambda: vcopy(best)), fresh_dest)
        v2 = b.time_median(pinned(TWO, lambda: vcopy(best)), fresh_dest)
        b.add(label, "dsstage stage, 2 cores / 1 core throughput", s1 / s2, "x",
              "bare verified copy, 2 cores / 1 core", v1 / v2, (s1 / s2) / (v1 / v2),
              ">= 1.8x, and >= the bare copy's", s1 / s2 >= 1.8 and s1 / s2 >= v1 / v2)
        b.add(label, "dsstage stage on 1 core", s1, "s")
        b.add(label, "bare verified copy on 1 core", v1, "s")
        staged_dir = Path(b.dir / "nvme" / "bench" / "datasets" / name)
        b.sh(*b.dsstage, "stage", name, "--job-id", "1", env=b.env())
        staged = [str(p) for p in staged_dir.rglob("*.bin")]

        def hot() -> None:
            b.settle("warm", staged)

        def verify(pin: str) -> Callable[[], object]:
            return lambda: b.sh("taskset", "-c", pin, *b.dsstage, "verify", name, "--full", env=b.env())

        def b3(pin: str) -> Callable[[], object]:
            return lambda: b.sh("taskset", "-c", pin, "b3sum", *staged)
        f1, f2 = b.time_median(verify(ONE), hot), b.time_median(verify(TWO), hot)
        h1, h2 = b.time_median(b3(ONE), hot), b.time_median(b3(TWO), hot)
        b.add(label, "dsstage verify --full, 2 cores / 1 core throughput", f1 / f2, "x",
              "b3sum, 2 cores / 1 core", h1 / h2, (f1 / f2) / (h1 / h2), ">= 1.8x, and >= b3sum's",
              f1 / f2 >= 1.8 and f1 / f2 >= h1 / h2)
        b.add(label, "dsstage verify --full on 1 core", gib / f1, "GiB/s", "b3sum on 1 core", gib / h1, h1 / f1)
