"""dsstage benchmarks, each measurement next to a baseline measured in the same run.

Run through ``bench/run [--quick] [--json FILE] [--runs N] [--dir DIR]``. Data is generated
under --dir (kept between runs; regenerated when the scenario's shape changes). Every
figure is the median of several runs; before each run of a cold measurement the page
cache is dropped (where the kernel allows it), so sources are read from disk by dsstage and
baselines alike, and each tool is then run once on a one-file dataset, so that its own code
is not (Bench.load_tools; --cold-code leaves that out). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import yaml

TOP = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TOP / "tests"))
import cpu  # noqa: E402  (bench/cpu.py)
from dsstage.cluster import reports as cluster_reports  # noqa: E402
from dsstage.cluster import status as cluster_status  # noqa: E402
from dsstage.cluster import status_view as cluster_status_view  # noqa: E402
from dsstage.config import load as config_load  # noqa: E402
from dsstage.config import manifest as config_manifest  # noqa: E402
from dsstage.node import publish  # noqa: E402
from dsstage.policy import demand  # noqa: E402
from dsstage.transfer.check import check_tree  # noqa: E402
from latencyfs import LatencyFS  # noqa: E402
from servers import RsyncDaemon  # noqa: E402

CHUNK = 1 << 20


def in_parallel(items: Sequence[object], fn: Callable[[object, bytearray], object], threads: int) -> None:
    """``fn(item, buffer)`` for every item, ``threads`` at once, each thread pulling the next
    item and reusing its own 1 MiB buffer (no pool's per-item cost, no allocation per read)."""
    it = iter(items)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        buf = bytearray(CHUNK)
        while not errors:
            with lock:
                item = next(it, None)
            if item is None:
                return
            try:
                fn(item, buf)
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(e)
    workers = [threading.Thread(target=worker) for _ in range(max(1, min(threads, len(items))))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def read_file(path: object, buf: bytearray) -> None:
    """open, read to the end, close: what any copy must do with a source file, and no more."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)


def write_all(fd: int, view: memoryview, n: int) -> None:
    """The first ``n`` bytes of ``view`` to ``fd``, however short the writes."""
    done = 0
    while done < n:
        done += os.write(fd, view[done:n])


def stream_file(src: str, dst: str, buf: bytearray, flags: int, mode: int, h: blake3.blake3 | None = None) -> None:
    """``src`` read chunk by chunk into ``buf``, each chunk written as it is read to ``dst``
    (opened with ``flags`` and ``mode``) and hashed into ``h`` if given."""
    fin = os.open(src, os.O_RDONLY)
    try:
        fout = os.open(dst, flags, mode)
        try:
            view = memoryview(buf)
            while n := os.readv(fin, [buf]):
                if h is not None:
                    h.update(view[:n])
                write_all(fout, view, n)
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def copy_file(pair: object, buf: bytearray) -> None:
    """read_file, each chunk written as it is read to a new file (no hashing, no fsync: dsstage
    does not fsync either before the copy is usable; its syncfs runs in the background)."""
    src, dst = pair  # type: ignore[misc]
    stream_file(src, dst, buf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def verified_copy_file(item: object, buf: bytearray) -> None:
    """copy_file of a file read whole into the buffer, its BLAKE3 compared with the hash
    it should have before it is written (a file no larger than the buffer, as the
    latency scenario's 100 KB): the least any verifying copy must do (no
    temporary name, no mtime, no checks on what the source is)."""
    src, dst, want = item  # type: ignore[misc]
    fin = os.open(src, os.O_RDONLY)
    try:
        view = memoryview(buf)
        n = 0
        while k := os.readv(fin, [view[n:]]):
            n += k
    finally:
        os.close(fin)
    if blake3.blake3(view[:n]).hexdigest() != want:
        raise RuntimeError(f"{src}: BLAKE3 differs from the manifest's")
    fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    try:
        write_all(fout, view, n)
    finally:
        os.close(fout)


def verified_copy_any(item: object, buf: bytearray) -> None:
    """A verified copy of a file of any size: each chunk read, hashed and written; the hash
    compared with the manifest's at the end (read, BLAKE3, write: no temporary name, no
    mtime, no fsync)."""
    src, dst, want = item  # type: ignore[misc]
    h = blake3.blake3()
    stream_file(src, dst, buf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444, h)
    if h.hexdigest() != want:
        raise RuntimeError(f"{src}: BLAKE3 differs from the manifest's")


@dataclass
class Row:
    scenario: str
    measure: str
    value: float
    unit: str
    baseline: str = ""
    baseline_value: float | None = None
    ratio: float | None = None  # value relative to the baseline, as the target states it
    target: str = ""
    met: bool | None = None


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.quick = args.quick
        self.runs = args.runs or (3 if args.quick else 5)
        self.dir = Path(args.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[Row] = []
        self.can_drop = self._try_drop()
        self.py = sys.executable
        self.dsstage = [self.py, "-m", "dsstage"]
        self.conf = self.dir / "dsstage.yaml"
        self.datasets: dict[str, dict[str, object]] = {}
        self.tiers: dict[str, dict[str, object]] = {}
        self.only = set(args.only.split(",")) if args.only else None
        #: "cold": page cache dropped before each run; "warm": sources read once beforehand
        self.caches = ["cold", "warm"] if args.cache == "both" else [args.cache]
        self.delays = [int(d) for d in args.delays.split(",")]
        self.pretouch = not args.no_pretouch
        #: after a drop, each tool's own code read back (load_tools); --cold-code: not
        self.warm_code = not args.cold_code
        #: bytes of fresh memory a run of the current measurement takes (pages it reads and writes)
        self.touch = 1 << 30

    def wants(self, scenario: str) -> bool:
        if scenario in ("single", "tiny"):  # single: the large-file scenario's shape; tiny: long. On request
            return self.only is not None and scenario in self.only
        return self.only is None or scenario in self.only

    # -- plumbing --------------------------------------------------------------------

    def _try_drop(self) -> bool:
        try:
            subprocess.run(["sync"], check=True)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return True
        except OSError:
            return False

    def drop_caches(self) -> None:
        if self.can_drop:
            self._try_drop()

    def back_memory(self) -> None:
        """Touch ``self.touch`` bytes of fresh memory and free them again, so that the pages
        the next run takes for what it reads and writes are ones the host has just backed
        (docs/benchmarks.md, "Fresh memory on a virtual machine"); --no-pretouch skips it."""
        if not self.pretouch:
            return
        chunk = b"\1" * (64 << 20)
        n = max(1, -(-min(self.touch, self.TOUCH_MAX) // len(chunk)))
        with mmap.mmap(-1, n * len(chunk)) as m:
            for _ in range(n):
                m.write(chunk)

    TOUCH_MAX = 8 << 30

    def say(self, text: str) -> None:
        print(f"bench: {text}", file=sys.stderr, flush=True)

    def time_median(self, fn: Callable[[], object], setup: Callable[[], object] | None = None,
                    runs: int | None = None) -> float:
        times = []
        for _ in range(runs or self.runs):
            if setup:
                setup()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def sh(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(list(argv), text=True, capture_output=True, env=env)
        if res.returncode != 0:
            raise SystemExit(f"bench: {' '.join(argv[:4])}... failed ({res.returncode}): {res.stderr[-800:]}")
        return res

    def env(self, **extra: str) -> dict[str, str]:
        e = dict(os.environ, DSSTAGE_CONFIG=str(self.conf), SLURMD_NODENAME="bench")
        e.pop("SLURM_JOB_ID", None)
        e.update(extra)
        return e

    def configure(self, name: str, source: str, **spec: object) -> None:
        self.datasets[name] = {"source": source, "tier": "nvme", **spec}
        self.conf.write_text(yaml.safe_dump({
            "state_dir": str(self.dir / "state"),
            "tiers": {"nvme": {"path": str(self.dir / "nvme" / "{node}"), "capacity": "95%", "root_filesystem": True},
                      **self.tiers},
            "datasets": self.datasets, "retention": {"min_keep": 0}}))
        os.chmod(self.conf, 0o644)

    def hook_env(self, defaults: Path | str, request: str | None, job: str) -> dict[str, str]:
        """The environment slurmd gives a Prolog/Epilog: built from scratch, not inherited."""
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DSSTAGE_DEFAULTS": str(defaults), "SLURM_JOB_ID": job,
               "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root", "SLURMD_NODENAME": "bench",
               "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
        if request:
            env["SPANK__SLURM_SPANK_OPTION_dsstage_dataset"] = request
        return env

    def ds(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return self.sh(*self.dsstage, *args, env=self.env(**env))

    def clear_store(self, name: str) -> None:
        for sub in ("datasets", "ready", "staging", "leases"):
            shutil.rmtree(self.dir / "nvme" / "bench" / sub / name, ignore_errors=True)
        for p in (self.dir / "nvme" / "bench" / "staging").glob(f"{name}.*"):
            shutil.rmtree(p, ignore_errors=True)

    def fresh_dest(self, dest: Path, cache: str, sources: list[str]) -> Callable[[], None]:
        """Before a baseline's run: ``dest`` removed, the page cache settled (self.settle)."""
        def setup() -> None:
            shutil.rmtree(dest, ignore_errors=True)
            self.settle(cache, sources)
        return setup

    def fresh_store(self, name: str, cache: str, sources: list[str]) -> Callable[[], None]:
        """Before a stage's run: ``name`` cleared from the store, the page cache settled."""
        def setup() -> None:
            self.clear_store(name)
            self.settle(cache, sources)
        return setup

    def verified_copy(self, root: Path, dest: Path, hashes: dict[str, str], threads: int,
                      copy: Callable[[object, bytearray], None] = verified_copy_any) -> None:
        """The bare verified copy of ``root`` (the files ``hashes`` names, with their hashes)
        into ``dest``: its directories made, then ``copy`` of each file, ``threads`` at once."""
        for d in sorted({os.path.dirname(r) for r in hashes}):
            os.makedirs(dest / d, exist_ok=True)
        in_parallel([(str(root / r), str(dest / r), h) for r, h in hashes.items()], copy, min(threads, len(hashes)))

    def _data(self, name: str, shape: str) -> tuple[Path, bool]:
        """The data directory of a scenario, and whether it already holds ``shape``
        (otherwise it is emptied for the caller to generate)."""
        root = self.dir / "data" / name
        stamp = root / ".shape"
        if stamp.exists() and stamp.read_text() == shape:
            return root, True
        shutil.rmtree(root, ignore_errors=True)
        return root, False

    def make_files(self, name: str, count: int, size: int, fanout: int = 1000) -> Path:
        shape = f"{count}x{size}"
        root, ready = self._data(name, shape)
        if ready:
            return root
        self.say(f"generating {name}: {count} files of {size} bytes")
        blob = os.urandom(max(size, 1) * 2)
        for i in range(count):
            d = root / f"c{i // fanout:05d}"
            if i % fanout == 0:
                d.mkdir(parents=True, exist_ok=True)
            off = (i * 7919) % max(size, 1)
            (d / f"f{i:07d}.bin").write_bytes(blob[off:off + size - 8] + i.to_bytes(8, "little") if size >= 8 else b"")
        (root / ".shape").write_text(shape)
        return root

    def make_large(self, name: str, count: int, size: int) -> Path:
        shape = f"{count}x{size}"
        root, ready = self._data(name, shape)
        if ready:
            return root
        root.mkdir(parents=True)
        self.say(f"generating {name}: {count} files of {size >> 20} MiB")
        block = os.urandom(1 << 20)
        for i in range(count):
            with open(root / f"shard{i:03d}.bin", "wb") as fh:
                for j in range(size >> 20):
                    fh.write(block[:-16] + i.to_bytes(8, "little") + j.to_bytes(8, "little"))
        (root / ".shape").write_text(shape)
        return root

    def build_manifest(self, name: str, root: Path) -> None:
        self.configure(name, str(root))
        self.ds("manifest", "build", name)

    def add(self, *args: object, **kw: object) -> Row:
        row = Row(*args, **kw)  # type: ignore[arg-type]
        self.rows.append(row)
        base = f"  vs {row.baseline} {row.baseline_value:.3f}" if row.baseline_value is not None else ""
        ratio = f"  ratio {row.ratio:.2f}" if row.ratio is not None else ""
        self.say(f"{row.scenario}: {row.measure} = {row.value:.3f} {row.unit}{base}{ratio}")
        return row

    # -- scenarios -------------------------------------------------------------------

    def warm_up(self, paths: list[str]) -> None:
        """Read ``paths`` into the page cache (the cache is not dropped in a warm run)."""
        for p in paths:
            with open(p, "rb") as fh:
                while fh.read(1 << 24):
                    pass

    def settle(self, cache: str, paths: list[str]) -> None:
        """Before one run: drop the page cache (cold) or make sure ``paths`` are in it (warm)."""
        if cache == "cold":
            self.back_memory()
            self.drop_caches()
            if self.warm_code:
                self.load_tools()
        else:
            subprocess.run(["sync"], check=True)  # the previous run's dirty pages are not this run's cost
            self.warm_up(paths)
            self.back_memory()

    #: the one-file dataset each tool is run on after a drop (load_tools)
    TOOLS_SET = "toolwarm"

    def load_tools(self) -> None:
        """After a drop: each tool run once on a one-file dataset of its own, so that what
        the tools run from (their binaries and libraries, the interpreter's and dsstage's
        modules, the native helper, dsstage's configuration) is in the page cache, as on a
        node where they run all day, while the data, its manifest and its directories stay
        on disk. Without it a cold dsstage paid for loading Python and some 250 modules
        from disk, which cp, rsync and b3sum (small binaries) and the bare copies (run in
        this process) do not. --cold-code leaves it out."""
        root = self.dir / "data" / self.TOOLS_SET
        if self.TOOLS_SET not in self.datasets:
            root = self.make_files(self.TOOLS_SET, 1, 4096)
            self.build_manifest(self.TOOLS_SET, root)
        files = [str(p) for p in root.rglob("*.bin")]
        out = self.dir / "toolwarm-dest"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        self.sh("cp", "-a", str(root), str(out / "cp"))
        self.sh("rsync", "-a", f"{root}/", f"{out}/rsync/")
        self.sh("b3sum", *files)
        if shutil.which("fpsync"):
            self.sh("fpsync", "-n", "4", "-t", str(self.dir / "fpsync-tmp"), f"{root}/", f"{out}/fpsync/")
        self.clear_store(self.TOOLS_SET)
        self.ds("stage", self.TOOLS_SET, "--job-id", "1")
        self.ds("verify", self.TOOLS_SET, "--full")
        self.ds("verify", self.TOOLS_SET)
        self.clear_store(self.TOOLS_SET)
        shutil.rmtree(out)

    def cold_stage(self, label: str, name: str, root: Path, target_ratio: float, compare: str,
                   cache: str = "cold") -> None:
        """dsstage stage (verification included) against rsync -a, cp -a and fpsync; the
        source read from disk (cold) or from the page cache (warm)."""
        self.build_manifest(name, root)
        sources = [str(p) for p in root.rglob("*") if p.is_file() and p.name != ".shape"]
        total = sum(os.path.getsize(p) for p in sources)
        self.touch = (2 if cache == "cold" else 1) * total + (256 << 20)  # read (cold) and written
        dest = self.dir / "baseline-dest"
        if cache == "warm":
            label = label.replace("cold stage", "page-cache stage")

        fresh_dest, fresh_store = self.fresh_dest(dest, cache, sources), self.fresh_store(name, cache, sources)
        t_ds = self.time_median(lambda: self.ds("stage", name, "--job-id", "1"), fresh_store)
        t_ds_code = None
        if cache == "cold" and self.warm_code:
            # the same stage as the first run after boot: the drop takes its code too
            self.warm_code = False
            try:
                t_ds_code = self.time_median(lambda: self.ds("stage", name, "--job-id", "1"), fresh_store)
            finally:
                self.warm_code = True
        t_rsync = self.time_median(lambda: self.sh("rsync", "-a", f"{root}/", f"{dest}/"), fresh_dest)
        t_cp = self.time_median(lambda: self.sh("cp", "-a", str(root), str(dest)), fresh_dest)
        t_read = self.time_median(lambda: in_parallel(sources, read_file, self.CEILING_THREADS), fresh_dest)
        rels = [os.path.relpath(p, root) for p in sources]

        def bare_copy() -> None:
            for d in sorted({os.path.dirname(r) for r in rels}):
                os.makedirs(dest / d, exist_ok=True)
            in_parallel([(str(root / r), str(dest / r)) for r in rels], copy_file, self.CEILING_THREADS)
        t_ceil = self.time_median(bare_copy, fresh_dest)
        hashes = {e.path: e.hash for e in config_manifest.Catalog(str(self.dir / "state")).load(name).entries}
        t_vcopy = self.time_median(lambda: self.verified_copy(root, dest, hashes, self.CEILING_THREADS), fresh_dest)
        gib = total / 2**30
        self.add(label, "dsstage stage (incl. BLAKE3 verify)", t_ds, "s")
        if t_ds_code is not None:
            self.add(label, "dsstage stage, its code cold too (as --cold-code; against code in memory)", t_ds_code,
                     "s", "code in memory", t_ds, t_ds_code / t_ds)
        self.add(label, "rsync -a", t_rsync, "s")
        self.add(label, "cp -a", t_cp, "s")
        if shutil.which("fpsync"):
            fp_tmp = self.dir / "fpsync-tmp"
            t_fp = self.time_median(lambda: self.sh("fpsync", "-n", "4", "-t", str(fp_tmp), f"{root}/", f"{dest}/"),
                                    fresh_dest)
            self.add(label, "fpsync -n 4", t_fp, "s")
        self.add(label, f"bare parallel read of the source ({self.CEILING_THREADS} threads, nothing written)",
                 t_read, "s")
        self.add(label, f"ceiling: bare parallel copy ({self.CEILING_THREADS} threads read each file and write "
                 "its bytes to a new file; no hashing, no fsync)", t_ceil, "s")
        if compare == "rsync":
            self.add(label, "speed-up of dsstage over rsync -a", t_rsync / t_ds, "x", "rsync -a", t_rsync,
                     t_rsync / t_ds, f">= {target_ratio}x", t_rsync / t_ds >= target_ratio)
        else:
            self.add(label, "dsstage throughput / cp -a throughput", (gib / t_ds) / (gib / t_cp), "x", "cp -a",
                     gib / t_cp, t_cp / t_ds, f">= {target_ratio}x", t_cp / t_ds >= target_ratio)
        self.add(label, "dsstage throughput", gib / t_ds, "GiB/s")
        self.add(label, "dsstage throughput / ceiling throughput", t_ceil / t_ds, "x", "bare parallel copy",
                 gib / t_ceil, t_ceil / t_ds)
        self.add(label, f"bare verified copy ({self.CEILING_THREADS} threads: read, BLAKE3, write a new file, "
                 "compare with the manifest)", t_vcopy, "s")
        self.add(label, "dsstage throughput / bare verified copy throughput", t_vcopy / t_ds, "x",
                 "bare verified copy, GiB/s", gib / t_vcopy, t_vcopy / t_ds, ">= 0.9x", t_vcopy / t_ds >= 0.9)

    # -- latency-bound sources: latencyfs (tests/latencyfs.c) --------------------------

    CEILING_THREADS = 16  # the local-disk ceiling's copy threads
    LATENCY_CEILING_THREADS = (64, 256)  # the latency ceiling: the faster of these
    LATENCY_VERIFIED_THREADS = (32, 64)  # the bare verified copy: the faster of these
    LATENCY_PARALLEL_RSYNC = 16  # rsync processes of the plain parallel rsync, one per top directory
    LATENCY_FPSYNC_JOBS = 16

    def latency(self, delays_us: Sequence[int]) -> None:
        """A source where each metadata operation, open and read costs one round trip:
        dsstage stage and manifest build against rsync -a, cp -a, fpsync, a plain parallel
        rsync and a bare parallel read of the same files, each run with cold caches (the
        page cache dropped and latencyfs mounted again, so no dentry or attribute is cached)."""
        n = 2000 if self.quick else 5000
        root = self.make_files(f"latency{n}", n, 100_000, fanout=100)
        rels = sorted(str(p.relative_to(root)) for p in root.rglob("*.bin"))
        total = sum((root / r).stat().st_size for r in rels)
        self.touch = 3 * total + (256 << 20)  # the backing files, the mount's pages, the copy
        mnt = self.dir / "mnt-latency"
        dest = self.dir / "baseline-dest"
        fp_tmp = self.dir / "fpsync-tmp"
        name = "latency"
        for delay in delays_us:
            label = f"latency {delay / 1000:g} ms, {n} x 100 KB"
            with LatencyFS(root, mnt, delay_us=delay) as fs:
                self.say(f"{label}: latencyfs on {mnt} (pid {fs.pid})")
                paths = [str(mnt / r) for r in rels]

                def cold() -> None:
                    fs.remount()  # no dentry, attribute or page cached for the mount
                    self.back_memory()
                    self.drop_caches()  # nor for the backing files

                def fresh_dest() -> None:
                    shutil.rmtree(dest, ignore_errors=True)
                    cold()

                def fresh_store() -> None:
                    self.clear_store(name)
                    cold()
                requests: dict[str, dict[str, object]] = {}

                def timed(tool: str, fn: Callable[[], object], setup: Callable[[], object]) -> float:
                    t = self.time_median(fn, setup)
                    requests[tool] = fs.stats()  # the counters of its last run (since the remount)
                    return t

                def parallel_rsync() -> None:
                    dest.mkdir(parents=True, exist_ok=True)
                    tops = sorted(os.listdir(mnt))
                    with ThreadPoolExecutor(self.LATENCY_PARALLEL_RSYNC) as pool:
                        list(pool.map(lambda d: self.sh("rsync", "-a", str(mnt / d), f"{dest}/"), tops))

                def rebuild() -> None:
                    catalog = config_manifest.Catalog(str(self.dir / "state"))
                    (Path(catalog.dir(name)) / config_manifest.CURRENT).unlink(missing_ok=True)
                    self.ds("manifest", "build", name)

                cold()
                self.build_manifest(name, mnt)
                t_ds = timed("dsstage", lambda: self.ds("stage", name, "--job-id", "1"), fresh_store)
                t_build = timed("manifest", rebuild, cold)
                t_rsync = timed("rsync", lambda: self.sh("rsync", "-a", f"{mnt}/", f"{dest}/"), fresh_dest)
                t_cp = timed("cp", lambda: self.sh("cp", "-a", str(mnt), str(dest)), fresh_dest)
                t_par = timed("parallel rsync", parallel_rsync, fresh_dest)
                t_fp = None
                fp_chunk = max(1, n // 64)
                if shutil.which("fpsync"):
                    t_fp = timed("fpsync", lambda: self.sh(
                        "fpsync", "-n", str(self.LATENCY_FPSYNC_JOBS), "-f", str(fp_chunk), "-t", str(fp_tmp),
                        f"{mnt}/", f"{dest}/"), fresh_dest)
                t_reads = {k: timed(f"read{k}", lambda k=k: in_parallel(paths, read_file, k), cold)  # type: ignore[misc]
                           for k in self.LATENCY_CEILING_THREADS}
                hashes = {e.path: e.hash for e in config_manifest.Catalog(str(self.dir / "state")).load(name).entries}
                copies = [(str(mnt / r), str(dest / r), hashes[r]) for r in rels]

                def verified_copy(k: int) -> None:
                    for d in sorted({os.path.dirname(r) for r in rels}):
                        os.makedirs(dest / d, exist_ok=True)
                    in_parallel(copies, verified_copy_file, k)
                t_vcopy = {k: timed(f"vcopy{k}", lambda k=k: verified_copy(k), fresh_dest)  # type: ignore[misc]
                           for k in self.LATENCY_VERIFIED_THREADS}
            best = min(t_reads, key=lambda k: t_reads[k])
            best_v = min(t_vcopy, key=lambda k: t_vcopy[k])
            t_ceil = t_reads[best]
            mib = total / 2**20
            self.add(label, "dsstage stage (incl. BLAKE3 verify)", t_ds, "s")
            self.add(label, "rsync -a", t_rsync, "s")
            self.add(label, "cp -a", t_cp, "s")
            if t_fp is not None:
                self.add(label, f"fpsync -n {self.LATENCY_FPSYNC_JOBS} -f {fp_chunk}", t_fp, "s")
            self.add(label, f"parallel rsync ({self.LATENCY_PARALLEL_RSYNC} rsync -a at once, one per top "
                     "directory)", t_par, "s")
            for k, t in t_reads.items():
                self.add(label, f"bare parallel read, {k} threads (open, read, close)", t, "s")
            for k, t in t_vcopy.items():
                self.add(label, f"bare parallel verified copy, {k} threads (read, BLAKE3, write a new file)", t, "s")
            speedup = t_rsync / t_ds
            self.add(label, "speed-up of dsstage over rsync -a", speedup, "x", "rsync -a", t_rsync, speedup,
                     *((">= 3x", speedup >= 3) if delay == 1000 else ()))
            self.add(label, "dsstage throughput / ceiling throughput", t_ceil / t_ds, "x",
                     f"bare parallel read, {best} threads, MiB/s", mib / t_ceil, t_ceil / t_ds, ">= 0.85x",
                     t_ceil / t_ds >= 0.85)
            self.add(label, "bare verified copy throughput / ceiling throughput (the most any verifying copy "
                     "reached)", t_ceil / t_vcopy[best_v], "x", f"bare parallel read, {best} threads, MiB/s",
                     mib / t_ceil, t_ceil / t_vcopy[best_v])
            self.add(label, "dsstage throughput / bare verified copy throughput", t_vcopy[best_v] / t_ds, "x",
                     f"bare verified copy, {best_v} threads, MiB/s", mib / t_vcopy[best_v], t_vcopy[best_v] / t_ds)
            self.add(label, "dsstage manifest build throughput / ceiling throughput", t_ceil / t_build, "x",
                     "ceiling, MiB/s", mib / t_ceil, t_ceil / t_build)
            self.add(label, "dsstage manifest build", t_build, "s")
            for tool, st in requests.items():
                ops = st["ops"]
                assert isinstance(ops, dict)
                self.say(f"{label}: {tool}: {sum(ops.values()) / n:.2f} requests per file "
                         f"({', '.join(f'{k} {v}' for k, v in ops.items() if v)}), "
                         f"peak {st['peak_in_flight']} in flight, {st['peak_opens_in_flight']} opens")
            for tool in ("dsstage", "manifest"):
                self.add(label, f"{'dsstage stage' if tool == 'dsstage' else 'manifest build'}: peak requests "
                         "in flight (opens)", float(requests[tool]["peak_in_flight"]),  # type: ignore[arg-type]
                         f"requests ({requests[tool]['peak_opens_in_flight']} opens)")

    def warm_prolog(self, files: int) -> float:
        name = f"warm{files // 1000}k"
        root = self.make_files(name, files, 64)
        self.build_manifest(name, root)
        self.ds("stage", name, "--job-id", "warmup")
        defaults = self.dir / "defaults"
        defaults.write_text(f"DSSTAGE_CONFIG={self.conf}\nDSSTAGE_PYTHON={self.py}\n"
                            f"DSSTAGE_RUN_DIR={self.dir / 'run'}\nDSSTAGE_LOG={self.dir / 'hooks.log'}\n")
        env = self.hook_env(defaults, name, "4242")
        prolog = str(TOP / "prolog" / "dsstage-prolog")
        self.sh(prolog, env=env)
        return self.time_median(lambda: self.sh(prolog, env=env), runs=max(self.runs, 10))

    #: the sharded warm Prolog's dataset: shards, and the 3-node job whose third this node holds
    WARM_SHARDS, WARM_JOB_NODES = 96, "bench,bench2,bench3"

    def warm_prolog_sharded(self, files: int) -> float:
        """The warm Prolog of a 3-node job on the same files as a dataset of WARM_SHARDS shards:
        this node's part (a third) and its view are ready; each run is a new job, so the warm
        path also records the job's versions and makes its plan, as a job's first node does."""
        name = f"warm{files // 1000}k-sharded"
        self.configure(name, str(self.dir / "data" / f"warm{files // 1000}k"), shards=self.WARM_SHARDS)
        self.ds("manifest", "build", name)
        defaults = self.dir / "defaults"
        prolog = str(TOP / "prolog" / "dsstage-prolog")
        jobs = iter(range(5000 + files, 10**7))  # job ids of their own: a job's records are its own

        def one() -> str:
            job = str(next(jobs))
            self.sh(prolog, env={**self.hook_env(defaults, name, job), "SLURM_JOB_NODELIST": self.WARM_JOB_NODES})
            return job
        first = one()  # the full Prolog stages this node's part and makes its view
        t = self.time_median(one, runs=max(self.runs, 10))
        log = (self.dir / "hooks.log").read_text()
        last = str(int(first) + max(self.runs, 10))
        if f"job {last}: {name} cached at " not in log or "(warm path)" not in log.split(f"job {last}: ")[-1]:
            raise SystemExit(f"bench: the warm Prolog did not answer job {last} of {name}: see {self.dir}/hooks.log")
        return t

    def warm(self) -> None:
        t10 = self.warm_prolog(10_000)
        t100 = self.warm_prolog(100_000)
        s10 = self.warm_prolog_sharded(10_000)
        s100 = self.warm_prolog_sharded(100_000)
        part = f"{self.WARM_SHARDS} shards, this node's third of a 3-node job (its view)"
        self.add("warm prolog, sharded", f"10k files in {part}", s10 * 1000, "ms", "cached dataset, 10k files",
                 t10 * 1000, s10 / t10, "<= 150 ms", s10 <= 0.150)
        self.add("warm prolog, sharded", f"100k files in {part}", s100 * 1000, "ms", "cached dataset, 100k files",
                 t100 * 1000, s100 / t100, "<= 150 ms", s100 <= 0.150)
        t_cli = self.time_median(lambda: self.ds("stage", "warm100k", "--job-id", "cli"), runs=max(self.runs, 10))
        self.add("warm stage", "`dsstage stage` of a cached 100k-file dataset (CLI)", t_cli * 1000, "ms")
        self.add("warm prolog", "cached dataset, 10k files", t10 * 1000, "ms", target="<= 150 ms", met=t10 <= 0.150)
        self.add("warm prolog", "cached dataset, 100k files", t100 * 1000, "ms", "10k files", t10 * 1000,
                 t100 / t10, "<= 150 ms and <= 1.5x the 10k time", t100 <= 0.150 and t100 / t10 <= 1.5)
        env = self.hook_env("/nonexistent", None, "4244")
        prolog = str(TOP / "prolog" / "dsstage-prolog")
        t_none = self.time_median(lambda: self.sh(prolog, env=env), runs=50)
        t_true = self.time_median(lambda: self.sh("/bin/true", env=env), runs=50)
        self.add("no-dataset prolog", "prolog for a job without --dataset", t_none * 1000, "ms", "/bin/true",
                 t_true * 1000, t_none / t_true, "<= 20 ms", t_none <= 0.020)

    def verification(self, what: str, name: str, root: Path, cache: str = "cold") -> None:
        self.build_manifest(name, root)
        self.ds("stage", name, "--job-id", "1")
        files = [str(p) for p in root.rglob("*.bin")]
        total = sum(os.path.getsize(f) for f in files) / 2**30
        staged = json.loads(self.ds("verify", name, "--json").stdout)["path"]
        staged_files = [str(p) for p in Path(staged).rglob("*.bin")]
        entries = config_manifest.Catalog(str(self.dir / "state")).load(name).entries
        label = f"full verification, {what}" + (", page cache" if cache == "warm" else "")
        self.touch = sum(os.path.getsize(f) for f in staged_files) + (256 << 20)  # what a cold run reads

        def settle() -> None:
            self.settle(cache, staged_files)
        t_ds = self.time_median(lambda: self.ds("verify", name, "--full"), settle)
        t_py = self.time_median(lambda: self.ds("verify", name, "--full", DSSTAGE_NATIVE_COPY="0"), settle)
        t_b3 = self.time_median(lambda: self.sh("b3sum", *staged_files), settle)

        def hash_path() -> None:  # what verify --full does past the CLI's start
            fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if check_tree(fd, entries):
                    raise SystemExit(f"bench: the staged copy of {name} does not match its manifest")
            finally:
                os.close(fd)
        t_in = self.time_median(hash_path, settle)
        t_quick = self.time_median(lambda: self.ds("verify", name), settle)
        # the same as the packages run it: /usr/bin/dsstage is packaging/launcher.py behind the venv's Python
        launcher = str(TOP / "packaging" / "launcher.py")
        t_launched = self.time_median(lambda: self.sh(self.py, launcher, "verify", name, env=self.env()), settle)
        self.add(label, "dsstage verify --full", total / t_ds, "GiB/s", "b3sum", total / t_b3,
                 t_b3 / t_ds, ">= 0.9x b3sum", t_b3 / t_ds >= 0.9)
        self.add(label, "dsstage verify --full, hashing in Python (DSSTAGE_NATIVE_COPY=0)", total / t_py, "GiB/s",
                 "b3sum", total / t_b3, t_b3 / t_py)
        self.add(label, "its hashing alone (check_tree, in process)", total / t_in, "GiB/s", "b3sum",
                 total / t_b3, t_b3 / t_in)
        self.add(label, "its fixed cost: verify --full's time beyond its hashing", t_ds - t_in, "s")
        self.add(label, "dsstage verify (quick, of the ready copy: the fast path)", t_quick, "s")
        self.add(label, "the same through the packages' launcher (packaging/launcher.py)", t_launched, "s")

    def sharing(self, tmp: Path, count: int) -> None:
        module = self.dir / "data"
        root = self.make_files("shared", count, 110_000)
        daemon_dir = tmp / "rsyncd"
        daemon_dir.mkdir(parents=True, exist_ok=True)
        daemon = RsyncDaemon(daemon_dir, module)
        try:
            self.configure("shared", daemon.url("shared"))
            total = json.loads(self.ds("manifest", "build", "shared", "--from", str(root), "--json").stdout)["bytes"]

            def one() -> None:
                self.ds("stage", "shared", "--job-id", "1")

            def eight() -> None:
                procs = [subprocess.Popen([*self.dsstage, "stage", "shared", "--job-id", str(100 + i)],
                                          env=self.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                         for i in range(8)]
                for p in procs:
                    if p.wait() != 0:
                        why = p.stderr.read().decode() if p.stderr else ""
                        raise SystemExit(f"bench: concurrent stage failed: {why}")

            def fresh() -> None:
                self.clear_store("shared")
                daemon.log.write_text("")
                self.drop_caches()
            t1 = self.time_median(one, fresh)
            fresh()
            t8_start = time.perf_counter()
            eight()
            t8 = time.perf_counter() - t8_start
            read8 = daemon.bytes_sent()
        finally:
            daemon.stop()
        self.add("8-way sharing", "wall time, 8 concurrent stages", t8, "s", "1 stage", t1, t8 / t1)
        self.add("8-way sharing", "bytes read from the source / dataset size", read8 / total, "x",
                 target="source read once (1.0x)", met=read8 == total)

    def manifests(self, root: Path, entries: int) -> None:
        cat = config_manifest.Catalog(str(self.dir / "state"))
        name = "small"
        nbytes = sum(p.stat().st_size for p in root.rglob("*.bin"))
        nfiles = sum(1 for _ in root.rglob("*.bin"))

        def rebuild() -> None:
            (Path(cat.dir(name)) / config_manifest.CURRENT).unlink(missing_ok=True)  # hash everything again
            self.ds("manifest", "build", name)
        t_build = self.time_median(rebuild, self.drop_caches)
        files = [str(p) for p in root.rglob("*.bin")]
        t_b3 = self.time_median(lambda: self.sh("b3sum", *files), self.drop_caches)
        self.add("manifest", "build throughput (files)", nfiles / t_build, "files/s")
        self.add("manifest", "build throughput", nbytes / t_build / 2**20, "MiB/s", "b3sum on the same files",
                 nbytes / t_b3 / 2**20, t_b3 / t_build)
        big = self.dir / "manifest-1m.manifest"
        if not big.exists() or config_manifest.read_header(str(big)).get("files") != entries:
            self.say(f"writing a manifest of {entries} entries")
            es = [config_manifest.Entry(f"train/n{i % 1000:08d}/img_{i:08d}.JPEG", 110_000, 1_700_000_000_000_000_000,
                           blake3.blake3(i.to_bytes(8, "little")).hexdigest()) for i in range(entries)]
            digest = config_manifest.compute_digest(es)
            config_manifest.write(config_manifest.Manifest("big", digest, es, 0, 0.0), str(big))
        t_load = self.time_median(lambda: config_manifest.read(str(big)))

        def plain() -> None:
            with open(big) as fh:
                for line in fh:
                    line.split("\t")
        t_plain = self.time_median(plain)
        self.add("manifest", f"load with checks, {entries} entries", t_load, "s",
                 "reading and splitting its lines", t_plain, t_load / t_plain)

    def epilog(self) -> None:
        name = "warm10k"
        defaults = self.dir / "defaults"
        env = self.hook_env(defaults, name, "4343")
        prolog = str(TOP / "prolog" / "dsstage-prolog")
        epilog = str(TOP / "epilog" / "dsstage-epilog")
        t = self.time_median(lambda: self.sh(epilog, env=env), setup=lambda: self.sh(prolog, env=env),
                             runs=max(self.runs, 10))
        self.add("epilog", "release a cached dataset's lease", t * 1000, "ms", target="<= 1000 ms", met=t <= 1.0)
        self.retention_epilog(t)

    def retention_epilog(self, t_release: float) -> None:
        """The Epilog itself (the hook script, as slurmd runs it) when its retention plan
        evicts a large copy: the tier is over its high watermark once the job's lease is
        released, so the copy goes to the trash and a detached process deletes it."""
        files = 100_000 if self.quick else 1_000_000
        name = f"evict{files // 1000}k"
        root = self.make_files(name, files, 64)
        total = sum(p.stat().st_size for p in root.rglob("*.bin"))
        self.tiers["small"] = {"path": str(self.dir / "small" / "{node}"), "capacity": int(total * 1.05),
                               "high_watermark": "90%", "low_watermark": "50%", "root_filesystem": True}
        self.configure(name, str(root), tier="small")
        self.ds("manifest", "build", name)
        defaults = self.dir / "defaults"
        env = self.hook_env(defaults, name, "5151")
        prolog = str(TOP / "prolog" / "dsstage-prolog")
        epilog = str(TOP / "epilog" / "dsstage-epilog")
        tier = self.dir / "small" / "bench"
        purges: list[float] = []

        def stage() -> None:
            self.wait_trash(tier, purges)
            demand.write(str(self.dir / "state"), demand.build([], time.time()))  # fresh, and nobody wants it
            self.say(f"staging {name} for the Epilog to evict")
            self.sh(prolog, env=env)

        def end() -> None:
            self.sh(epilog, env=env)
            if any((tier / "datasets" / name).iterdir()):
                raise SystemExit(f"bench: the Epilog did not evict {name}")
        runs = 1 if files >= 1_000_000 else 3
        t = self.time_median(end, setup=stage, runs=runs)
        self.wait_trash(tier, purges)
        self.add("epilog", f"release + retention evicting a {files // 1000}k-file copy (median of {runs})",
                 t * 1000, "ms", "release only", t_release * 1000, t / t_release, "<= 1000 ms", t <= 1.0)
        self.add("epilog", f"background deletion of the evicted {files // 1000}k files (idle I/O priority)",
                 statistics.median(purges), "s")

    def wait_trash(self, tier: Path, purges: list[float]) -> None:
        """Wait for the detached purge to empty the tier's trash; note how long it took."""
        trash = tier / "trash"
        if not trash.exists() or not any(trash.iterdir()):
            return
        t = time.perf_counter()
        while any(trash.iterdir()):
            time.sleep(0.1)
        purges.append(time.perf_counter() - t)

    # -- status: 1,000 generated node reports ----------------------------------------

    STATUS_NODES, STATUS_DATASETS, STATUS_JOBS = 1000, 50, 2000
    STATUS_FRESH = 300.0  # generated reports are reused this long: they are 0-4 min old when written

    def make_status(self) -> tuple[Path, int]:
        """Node reports (FORMAT 2, see dsstage/report.py) of STATUS_NODES nodes, a config
        that names their datasets and tiers, a fake ``sinfo`` (five nodes down) and a fresh
        demand snapshot; the number of copies. The reports are reused while they are fresh."""
        import random
        root = self.dir / "status"
        state_dir = root / "state"
        nodes_dir = state_dir / "nodes"
        shape = f"v1 {self.STATUS_NODES} nodes x {self.STATUS_DATASETS} datasets x {self.STATUS_JOBS} jobs"
        stamp = root / ".shape"
        now = time.time()
        rng = random.Random(20261122)
        names = [f"set{i:02d}" for i in range(self.STATUS_DATASETS)]
        nodes = [f"n{i:04d}" for i in range(1, self.STATUS_NODES + 1)]
        users = [f"user{i:03d}" for i in range(80)]
        versions = {d: [f"{rng.getrandbits(64):016x}" for _ in range(3)] for d in names}  # current first
        sizes = {d: (int(rng.lognormvariate(25, 1.2)), rng.randint(1_000, 5_000_000)) for d in names}
        weights = [1 / (i + 1) ** 0.8 for i in range(len(names))]  # a few popular datasets
        down = set(rng.sample(nodes, 5))
        (root / "slurm-bin").mkdir(parents=True, exist_ok=True)
        sinfo = root / "slurm-bin" / "sinfo"
        sinfo.write_text("#!/bin/sh\ncat <<'EOF'\n" + "".join(
            f"{n}|{n}|{'down*' if n in down else rng.choice(['idle', 'mixed', 'allocated'])}\n" for n in nodes)
            + "EOF\n")
        squeue = root / "slurm-bin" / "squeue"
        squeue.write_text("#!/bin/sh\necho 'squeue: bench: no Slurm here' >&2\nexit 1\n")
        for f in (sinfo, squeue):
            f.chmod(0o755)
        conf = root / "dsstage.yaml"
        conf.write_text(yaml.safe_dump({
            "state_dir": str(state_dir), "slurm_bin": str(root / "slurm-bin"),
            "tiers": {"nvme": {"path": "/local/nvme/dsstage", "capacity": "90%"},
                      "ssd": {"path": "/local/ssd/dsstage", "capacity": "90%"}},
            "datasets": {d: {"source": f"/shared/datasets/{d}", "tier": "nvme" if i % 5 else "ssd"}
                         for i, d in enumerate(names)}}))
        os.chmod(conf, 0o644)
        fresh = stamp.exists() and stamp.read_text().split("\n")[0] == shape \
            and now - float(stamp.read_text().split("\n")[1]) < self.STATUS_FRESH
        job = iter(range(700_000, 800_000))
        if not fresh:
            self.say(f"generating {shape}")
            shutil.rmtree(nodes_dir, ignore_errors=True)
            nodes_dir.mkdir(parents=True)
        copies = 0
        for node in nodes:
            tiers = ["nvme", "ssd"] if rng.random() < 0.3 else ["nvme"]
            caps = {"nvme": 7_680_000_000_000, "ssd": 3_840_000_000_000}
            rows: list[dict[str, object]] = []
            used = dict.fromkeys(tiers, 0)
            held = rng.choices(names, weights, k=40)
            for d in list(dict.fromkeys(held))[:rng.randint(10, 30)]:
                tier = rng.choice(tiers)
                nbytes, nfiles = sizes[d]
                r = rng.random()
                state, current, version = "ready", True, versions[d][0]
                if r < 0.08:
                    version, current = versions[d][rng.randint(1, 2)], False
                elif r < 0.11:
                    state = "staging"
                elif r < 0.12:
                    state = "verifying"
                elif r < 0.14:
                    state, version, current = "evicting", versions[d][rng.randint(1, 2)], False
                elif r < 0.145:
                    state = "interrupted"
                leases = [{"job_id": str(next(job)), "user": rng.choice(users), "since": now - rng.uniform(60, 86400)}
                          for _ in range(rng.choice([0, 0, 0, 1, 1, 2]))] if state == "ready" and current else []
                progress = None
                if state in ("staging", "verifying"):
                    total = nbytes if state == "staging" else nfiles
                    done = int(total * rng.random())
                    since = now - rng.uniform(30, 3600)
                    rate = done / (now - since)
                    progress = {"phase": "copying" if state == "staging" else "verifying",
                                "unit": "bytes" if state == "staging" else "files", "done": done, "total": total,
                                "rate": rate, "eta": (total - done) / rate if rate else None, "since": since}
                if leases:
                    decision = {"action": "keep", "reason": f"leased by job {leases[-1]['job_id']}"}
                elif state == "ready" and not current:
                    decision = {"action": "evict", "reason": "superseded by the current version and not leased"}
                elif state == "ready":
                    decision = rng.choice([
                        {"action": "keep", "reason": f"wanted by pending job {rng.randint(700_000, 799_999)}"},
                        {"action": "keep", "reason": "used 4 min ago (retention.min_keep 10m)"},
                        {"action": "keep", "reason": "below the high watermark"},
                        {"action": "evict", "reason": "not wanted, idle 3 d: over the high watermark"}])
                else:
                    decision = None
                row: dict[str, object] = {
                    "tier": tier, "dataset": d, "version": version, "state": state, "current": current,
                    "bytes": nbytes, "files": nfiles if state == "ready" else 0, "leases": leases,
                    "last_used": now - rng.uniform(0, 7 * 86400) if state == "ready" else None,
                    "decision": decision, "progress": progress}
                if progress:
                    row["job_id"] = str(next(job))
                rows.append(row)
                used[tier] += nbytes
            copies += len(rows)
            stale = rng.random() < 0.015
            report = {"format": 2, "node": node,
                      "time": now - (rng.uniform(2, 48) * 3600 if stale else rng.uniform(0, 240)),
                      "demand": {"age": rng.uniform(0, 60), "stale": False},
                      "tiers": [{"tier": t, "path": f"/local/{t}/dsstage", "capacity": caps[t], "used": used[t],
                                 "reserved": 0, "free": max(caps[t] - used[t], 0), "high": 0.9 * caps[t],
                                 "low": 0.7 * caps[t]} for t in tiers],
                      "copies": rows}
            if not fresh:  # the same draws either way, so the count of copies holds for reused reports
                (nodes_dir / f"{node}.json").write_text(json.dumps(report))
        if not fresh:
            stamp.write_text(f"{shape}\n{now}\n")
        wants: dict[str, dict[str, list[dict[str, object]]]] = {}
        running: dict[str, str] = {}
        for i in range(self.STATUS_JOBS):
            job_id, user = str(900_000 + i), rng.choice(users)
            first = rng.randrange(1, self.STATUS_NODES - 7)
            width = rng.choice([1, 1, 2, 4, 8])
            hostlist = f"n{first:04d}" if width == 1 else f"n[{first:04d}-{first + width - 1:04d}]"
            pending = i % 10 < 7
            planned = rng.random() < 0.6
            for d in set(rng.choices(names, weights, k=rng.choice([1, 1, 2]))):
                w = wants.setdefault(d, {"pending": [], "running": []})
                if pending:
                    w["pending"].append({"job_id": job_id, "user": user, "partition": "gpu",
                                         "priority": rng.randint(1000, 9999),
                                         "start": now + rng.uniform(0, 86400) if planned else None,
                                         "nodes": hostlist if planned else ""})
                else:
                    w["running"].append({"job_id": job_id, "user": user, "partition": "gpu", "nodes": hostlist})
            if not pending:
                running[job_id] = hostlist
        (state_dir / "demand.json").write_text(json.dumps({
            "format": 1, "time": time.time(), "host": "bench", "backend": "bench", "datasets": wants,
            "running": running, "uses": {d: round(100 * w, 2) for d, w in zip(names, weights)}}))
        return conf, copies

    def status_view(self) -> None:
        """`dsstage status` over 1,000 node reports, against reading the same reports."""
        from dsstage.errors import DsstageError
        from dsstage.slurm.records import Job, Node
        t_gen = time.perf_counter()
        conf_path, copies = self.make_status()
        self.say(f"status data ready in {time.perf_counter() - t_gen:.1f} s")
        conf = config_load.load(str(conf_path))
        nodes_dir = Path(conf.state_dir) / "nodes"
        label = f"status, {self.STATUS_NODES} nodes"
        runs = max(self.runs, 5)
        env = self.env(DSSTAGE_CONFIG=str(conf_path), COLUMNS="80")
        read_all = f"from dsstage.cluster import reports; reports.read_all({conf.state_dir!r})"
        bare = (f"import json, os; d = {str(nodes_dir)!r}\n"
                "for n in sorted(os.listdir(d)):\n    json.load(open(os.path.join(d, n), 'rb'))")

        def status_cli(*args: str) -> subprocess.CompletedProcess[str]:
            return self.sh(*self.dsstage, "status", *args, env=env)
        t_py = self.time_median(lambda: self.sh(self.py, "-c", "pass", env=env), runs=runs)
        t_bare = self.time_median(lambda: self.sh(self.py, "-c", bare, env=env), runs=runs)
        t_read = self.time_median(lambda: self.sh(self.py, "-c", read_all, env=env), runs=runs)
        size = sum(p.stat().st_size for p in nodes_dir.iterdir())
        self.add(label, f"copies in the reports ({size / 2**20:.1f} MiB of JSON)", copies, "copies")
        self.add(label, "python -c pass (interpreter start)", t_py * 1000, "ms")
        self.add(label, "python -c: json.load of every report", t_bare * 1000, "ms")
        self.add(label, "python -c: reports.read_all (read-only baseline)", t_read * 1000, "ms")
        target = "< 1000 ms"
        for measure, args in (("dsstage status --no-queue (plain, piped)", ["--no-queue"]),
                              ("dsstage status --json --no-queue", ["--json", "--no-queue"]),
                              ("dsstage status --no-queue --node 'n[0001-0100]'", ["--no-queue", "--node",
                                                                                   "n[0001-0100]"]),
                              ("dsstage status (queue from the snapshot, fake sinfo; plain)", [])):
            out = status_cli(*args).stdout
            t = self.time_median(lambda a=args: status_cli(*a), runs=runs)  # type: ignore[misc]
            self.add(label, f"{measure}, output {len(out.encode()) / 1024:.0f} KiB", t * 1000, "ms",
                     "read_all", t_read * 1000, t / t_read, target, t < 1.0)

        class Stub:  # the demand snapshot is fresh, so status never asks for the queue
            def nodes(self) -> dict[str, Node]:
                return {}

            def queue(self) -> list[Job]:
                raise DsstageError("bench: the demand snapshot should be fresh")

            def job_alive(self, job_id: str) -> bool:
                return True

            def hold(self, job_id: str, reason: str) -> str:
                return ""

        def view() -> str:
            s = cluster_status.collect(conf, Stub())
            if s.demand_source != "snapshot":
                raise SystemExit(f"bench: status did not use the demand snapshot: {s.queue_error}")
            return cluster_status_view.render_plain(s, cluster_status_view.sections(s, show_queue=True, plain=True))
        out = view()
        t_in_read = self.time_median(lambda: cluster_reports.read_all(conf.state_dir), runs=runs)
        t_view = self.time_median(view, runs=runs)
        s = cluster_status.collect(conf, Stub())
        t_collect = self.time_median(lambda: cluster_status.collect(conf, Stub()), runs=runs)
        t_secs = self.time_median(lambda: cluster_status_view.sections(s, show_queue=True, plain=True), runs=runs)
        t_json = self.time_median(lambda: json.dumps(cluster_status.to_json(s)), runs=runs)
        self.add(label, "in-process cluster_reports.read_all", t_in_read * 1000, "ms")
        self.add(label, f"in-process collect + sections + render_plain, queue of {len(s.queue)} jobs, output "
                 f"{len(out.encode()) / 1024:.0f} KiB", t_view * 1000, "ms", "in-process read_all",
                 t_in_read * 1000, t_view / t_in_read, target, t_view < 1.0)
        self.add(label, "collect alone (reports + demand snapshot)", t_collect * 1000, "ms")
        self.add(label, "sections alone (with the queue)", t_secs * 1000, "ms")
        self.add(label, "in-process to_json + json.dumps", t_json * 1000, "ms")

    def run(self) -> None:
        self.say(f"{'quick' if self.quick else 'full'} run, median of {self.runs}; page cache "
                 f"{'dropped before each cold run' if self.can_drop else 'NOT dropped (not permitted here)'}"
                 f"{', each tool then run once on one file' if self.can_drop and self.warm_code else ''}")
        small_n = 5_000 if self.quick else 20_000
        small = self.make_files("small", small_n, 110_000) \
            if self.wants("cold") or self.wants("manifest") or self.wants("verify") else Path("/nonexistent")
        large_n, large_size = (2, 512 << 20) if self.quick else (4, 1 << 30)
        large = self.make_large("large", large_n, large_size) if self.wants("cold") or self.wants("verify") \
            else Path("/nonexistent")
        for cache in self.caches:
            if self.wants("cold"):
                self.cold_stage(f"cold stage, {small_n} x 110 KB", "small", small, 1.5, "rsync", cache)
                self.cold_stage(f"cold stage, {large_n} x {large_size >> 20} MiB", "large", large, 0.95, "cp", cache)
            if self.wants("single"):
                single = self.make_large("single", 1, 2048 << 20)
                self.cold_stage("cold stage, 1 x 2048 MiB", "single", single, 0.95, "cp", cache)
        if self.wants("warm"):
            self.warm()
            self.epilog()
        if self.wants("verify"):
            for cache in self.caches:
                self.verification(f"{large_n} x {large_size >> 20} MiB", "large", large, cache)
                self.verification(f"{small_n} x 110 KB", "small", small, cache)
        if self.wants("sharing"):
            self.sharing(self.dir / "tmp", 1000 if self.quick else 4000)
        if self.wants("manifest"):
            self.build_manifest("small", small)
            self.manifests(small, 1_000_000)
        if self.wants("status"):
            self.status_view()
        if self.wants("latency"):
            self.latency(self.delays)
        if self.wants("fanout"):
            self.fanout()
        if self.wants("sharded"):
            self.sharded()
        if self.wants("tiny"):
            self.tiny()
        if self.wants("cpu"):
            cpu.scenario(self)

    #: the fan-out scenario's devcluster: its own directory and ports (bench/replay uses 46917)
    FANOUT_PORT = 36817
    #: the shared source's bandwidth for all nodes together, MiB/s (a filesystem busy with a job start)
    FANOUT_RATE = 40

    def fanout(self) -> None:
        """Many nodes, one read of the shared filesystem: a 3-node job on the devcluster
        (packaging/devcluster: real Slurm, the Prolog on each node) whose source is a
        latencyfs mount with a bandwidth shared by all readers (FANOUT_RATE). The time is
        the slowest node's stage in its Prolog (the hooks' log), the source bytes what
        latencyfs served; baselines in the same run: a one-node job, and the 3-node job with
        peers off (three independent stages)."""
        n = 240 if self.quick else 480
        root = self.make_files(f"fanout{n}", n, 1 << 20, fanout=60)
        with self.devcluster("fanout") as (cdir, env), \
                LatencyFS(root, self.dir / "mnt-fanout", delay_us=200, rate=self.FANOUT_RATE << 20,
                          extra_options="uncached") as fs:
            self._fanout_runs(n, root, fs, cdir, env)

    @staticmethod
    def runner(cdir: Path, env: dict[str, str]) -> Callable[..., str]:
        """A command on the devcluster (its Slurm and dsstage configuration): its output."""
        def run(*argv: str, check: bool = True) -> str:
            res = subprocess.run(list(argv), env=env, text=True, capture_output=True, timeout=900,
                                 cwd=str(cdir / "jobs"))
            if check and res.returncode != 0:
                raise SystemExit(f"bench: {' '.join(argv[:3])}... failed ({res.returncode}): {res.stderr[-800:]}")
            return res.stdout
        return run

    @staticmethod
    def wait_for_job(run: Callable[..., str], job_id: str, seconds: float = 900) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and run("squeue", "-h", "-j", job_id, "-o", "%T").strip():
            time.sleep(0.5)

    #: threads of the bare verified copy in the tiny-files scenario (the same as the other scenarios' ceiling)
    TINY_THREADS = (1, 4)

    def tiny(self) -> None:
        """Many tiny files (1 KB, and empty), local and in the page cache: per-file cost alone.
        dsstage stage (and again with its copier in Python, as without native/dsstage-copy)
        against cp -a, rsync -a and the bare verified copy (read, BLAKE3, compare, write a
        new file; no temporary name, no mtime, no fsync) in Python threads."""
        n = 100_000 if self.quick else 300_000
        for size, what in ((1024, "1 KB"), (0, "empty")):
            name = f"tiny{n // 1000}k-{size}"
            root = self.make_files(name, n, size)
            self.build_manifest(name, root)
            sources = [str(p) for p in root.rglob("*") if p.is_file() and p.name != ".shape"]
            hashes = {e.path: e.hash for e in config_manifest.Catalog(str(self.dir / "state")).load(name).entries}
            dest = self.dir / "baseline-dest"
            self.touch = 256 << 20

            fresh_dest, fresh_store = self.fresh_dest(dest, "warm", sources), self.fresh_store(name, "warm", sources)

            def vcopy(k: int) -> None:
                self.verified_copy(root, dest, hashes, k, verified_copy_file)
            label = f"tiny files, {n:,} x {what}, page cache"
            t_ds = self.time_median(lambda: self.ds("stage", name, "--job-id", "1"), fresh_store)
            t_py = self.time_median(lambda: self.ds("stage", name, "--job-id", "1", DSSTAGE_NATIVE_COPY="0"),
                                    fresh_store)
            t_cp = self.time_median(lambda: self.sh("cp", "-a", str(root), str(dest)), fresh_dest)
            t_rsync = self.time_median(lambda: self.sh("rsync", "-a", f"{root}/", f"{dest}/"), fresh_dest)
            t_v = {k: self.time_median(lambda k=k: vcopy(k), fresh_dest) for k in self.TINY_THREADS}  # type: ignore[misc]
            best = min(t_v, key=lambda k: t_v[k])
            # the last step of a stage alone, on the ready copy (sealed already: it changes nothing)
            self.ds("stage", name, "--job-id", "1")
            staged = json.loads(self.ds("verify", name, "--json").stdout)["path"]
            wanted = set(hashes)
            t_seal_made = self.time_median(lambda: self.seal(staged, wanted, wanted))
            t_seal_all = self.time_median(lambda: self.seal(staged, wanted, frozenset()))
            self.add(label, "dsstage stage (incl. BLAKE3 verify)", t_ds, "s")
            self.add(label, "dsstage stage, the copier in Python (DSSTAGE_NATIVE_COPY=0)", t_py, "s")
            self.add(label, "cp -a", t_cp, "s")
            self.add(label, "rsync -a", t_rsync, "s")
            for k, t in t_v.items():
                self.add(label, f"bare verified copy, {k} threads", t, "s")
            self.add(label, "dsstage throughput / cp -a throughput", t_cp / t_ds, "x", "cp -a, files/s", n / t_cp,
                     t_cp / t_ds, ">= 0.9x", t_cp / t_ds >= 0.9)
            self.add(label, "dsstage throughput / rsync -a throughput", t_rsync / t_ds, "x", "rsync -a, files/s",
                     n / t_rsync, t_rsync / t_ds, ">= 2x", t_rsync / t_ds >= 2)
            self.add(label, "dsstage throughput / bare verified copy throughput", t_v[best] / t_ds, "x",
                     f"bare verified copy, {best} threads, files/s", n / t_v[best], t_v[best] / t_ds, ">= 0.9x",
                     t_v[best] / t_ds >= 0.9)
            self.add(label, "dsstage files per second", n / t_ds, "files/s")
            self.add(label, "its seal alone, in process, the copier's files named as made (publish.seal)",
                     t_seal_made, "s", "every file checked (as after rsync)", t_seal_all, t_seal_made / t_seal_all)

    @staticmethod
    def seal(staged: str, wanted: set[str], made: Collection[str]) -> None:
        """dsstage.node.publish.seal of the copy at ``staged``, as a stage ends with it."""
        fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
        try:
            publish.seal(fd, 0, wanted=wanted, made=made)
        finally:
            os.close(fd)

    #: the sharded scenario's dataset: shards, and what the source serves (MiB/s, all nodes)
    SHARDED_SHARDS = 24

    def sharded(self) -> None:
        """A dataset larger than a node's share, spread over a 3-node job on the devcluster:
        what the source (a latencyfs mount) served for the job, and what each node holds,
        against the dataset and a third of it; each run starts from nodes that hold nothing."""
        n = 240 if self.quick else 480
        root = self.make_files(f"fanout{n}", n, 1 << 20, fanout=60)
        total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        with self.devcluster("sharded") as (cdir, env), \
                LatencyFS(root, self.dir / "mnt-sharded", delay_us=200, rate=self.FANOUT_RATE << 20,
                          extra_options="uncached") as fs:
            run = self.runner(cdir, env)
            conf_path = cdir / "etc" / "dsstage.yaml"
            conf = yaml.safe_load(conf_path.read_text())
            conf["datasets"]["big"] = {"source": str(fs.mountpoint), "shards": self.SHARDED_SHARDS}
            conf_path.write_text(yaml.safe_dump(conf))
            conf_path.chmod(0o644)
            dsstage = str(TOP / ".venv" / "bin" / "dsstage")
            run(dsstage, "manifest", "build", "big")
            run(dsstage, "export-catalog", "-o", str(cdir / "etc" / "dsstage_catalog.lua"))
            tier = str(conf["tiers"]["nvme"]["path"])
            served, held = [], []
            for i in range(self.runs):
                self.say(f"sharded: run {i + 1} of {self.runs}")
                for node in ("n1", "n2", "n3"):
                    run(dsstage, "--node", node, "evict", "big", "--force", check=False)
                fs.remount()
                fs.reset()
                job_id = run("sbatch", "--parsable", "-N", "3", "-w", "n[1-3]", "--dataset=big", "-o", "/dev/null",
                             "--wrap", "true").strip().split(";")[0]
                self.wait_for_job(run, job_id)
                log = (cdir / "log" / "dsstage-hooks.log").read_text()
                if log.count(f"job {job_id}: big shards ") != 3:
                    raise SystemExit(f"bench: sharded job {job_id}: not every node staged its part; see "
                                     f"{cdir}/log/dsstage-hooks.log")
                served.append(int(fs.stats()["bytes_read"]))
                held.append([sum(p.stat().st_size for p in Path(tier.replace("{node}", node), "datasets", "big")
                                 .rglob("*") if p.is_file()) for node in ("n1", "n2", "n3")])
        b_src = statistics.median(served) / total
        b_node = statistics.median(max(h) for h in held) / (total / 3)
        label = f"sharded, 3-node job, {n} x 1 MiB in {self.SHARDED_SHARDS} shards"
        self.add(label, "source bytes / dataset", b_src, "x", "dataset, MiB", total / 2**20, b_src, "<= 1.05",
                 b_src <= 1.05)
        self.add(label, "bytes the fullest node holds / (dataset / 3)", b_node, "x", "dataset / 3, MiB",
                 total / 3 / 2**20, b_node, "<= 1.1", b_node <= 1.1)

    @contextlib.contextmanager
    def devcluster(self, what: str) -> Iterator[tuple[Path, dict[str, str]]]:
        """A devcluster of its own for a scenario (packaging/devcluster: real Slurm, the
        Prolog on each of n1-n3), stopped afterwards: its directory and the environment its
        commands run in."""
        cdir = Path(f"/var/tmp/dsstage-bench-{what}-{os.getpid()}")
        dc_env = dict(os.environ, DEVCLUSTER_DIR=str(cdir), DEVCLUSTER_PORT=str(self.FANOUT_PORT),
                      DEVCLUSTER_SAMPLE_FILES="10")
        env = dict(os.environ, SLURM_CONF=str(cdir / "etc" / "slurm.conf"),
                   DSSTAGE_CONFIG=str(cdir / "etc" / "dsstage.yaml"), DSSTAGE_RUN_DIR=str(cdir / "dsstage-run"))
        for var in ("SLURM_JOB_ID", "SLURMD_NODENAME"):
            env.pop(var, None)
        script = str(TOP / "packaging" / "devcluster")
        self.say(f"{what}: devcluster up in {cdir} (slurmctld port {self.FANOUT_PORT})")
        up = subprocess.run([script, "up"], env=dc_env, text=True, capture_output=True, timeout=1800)
        try:
            if up.returncode != 0:
                raise SystemExit(f"bench: devcluster up failed: {up.stderr[-2000:]}")
            yield cdir, env
        finally:
            subprocess.run([script, "down"], env=dc_env, timeout=300)
            shutil.rmtree(cdir, ignore_errors=True)

    def _fanout_runs(self, n: int, root: Path, fs: LatencyFS, cdir: Path, env: dict[str, str]) -> None:
        import re
        conf_path = cdir / "etc" / "dsstage.yaml"
        log_path = cdir / "log" / "dsstage-hooks.log"
        dsstage = str(TOP / ".venv" / "bin" / "dsstage")

        run = self.runner(cdir, env)

        def configure(peers: bool) -> None:
            conf = yaml.safe_load(conf_path.read_text())
            conf["datasets"]["fan"] = {"source": str(fs.mountpoint)}
            conf["peers"]["enabled"] = peers
            conf_path.write_text(yaml.safe_dump(conf))
            conf_path.chmod(0o644)

        configure(True)
        run(dsstage, "manifest", "build", "fan")
        run(dsstage, "export-catalog", "-o", str(cdir / "etc" / "dsstage_catalog.lua"))
        total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())

        def job(nodes: str, count: int) -> tuple[float, int]:
            """The slowest node's stage in seconds, and the bytes the source served."""
            for node in ("n1", "n2", "n3"):
                run(dsstage, "--node", node, "evict", "fan", "--force", check=False)  # not there: nothing to do
            fs.remount()
            self.drop_caches()
            fs.reset()
            out = run("sbatch", "--parsable", "-N", str(count), "-w", nodes, "--dataset=fan",
                      "-o", "/dev/null", "--wrap", "true")
            job_id = out.strip().split(";")[0]
            self.wait_for_job(run, job_id)
            served = int(fs.stats()["bytes_read"])
            times = [float(t) for t in re.findall(rf"job {job_id}: fan staged at \S+ in ([0-9.]+)s",
                                                   log_path.read_text())]
            if len(times) != count:
                raise SystemExit(f"bench: fanout job {job_id}: {len(times)} of {count} nodes staged; see {log_path}")
            return max(times), served

        results: dict[str, list[tuple[float, int]]] = {"one": [], "independent": [], "fanout": []}
        for i in range(self.runs):
            self.say(f"fanout: run {i + 1} of {self.runs}")
            configure(True)
            results["one"].append(job("n1", 1))
            results["fanout"].append(job("n[1-3]", 3))
            configure(False)
            results["independent"].append(job("n[1-3]", 3))
        configure(True)
        t = {k: statistics.median(x for x, _ in v) for k, v in results.items()}
        b = {k: statistics.median(y for _, y in v) / total for k, v in results.items()}
        label = f"fanout 3 nodes, {n} x 1 MiB, source {self.FANOUT_RATE} MiB/s shared"
        self.add(label, "source bytes / dataset, 3-node job with peers", b["fanout"], "x",
                 "3 independent stages", b["independent"], b["fanout"], "<= 1.1", b["fanout"] <= 1.1)
        self.add(label, "slowest node's stage, 3-node job with peers", t["fanout"], "s",
                 "one node's stage", t["one"], t["fanout"] / t["one"], "<= 1.3x", t["fanout"] / t["one"] <= 1.3)
        self.add(label, "slowest node's stage, 3 independent stages", t["independent"], "s",
                 "one node's stage", t["one"], t["independent"] / t["one"])


def table(rows: list[Row]) -> str:
    out = ["| scenario | measure | value | baseline | ratio | target | met |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = f"{r.baseline} {r.baseline_value:.3f}" if r.baseline_value is not None else ""
        out.append(f"| {r.scenario} | {r.measure} | {r.value:.3f} {r.unit} | {base} | "
                   f"{'' if r.ratio is None else f'{r.ratio:.2f}'} | {r.target} | "
                   f"{'' if r.met is None else ('yes' if r.met else 'NO')} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(prog="bench/run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller data: a few minutes on 2 cores")
    p.add_argument("--json", help="also write the rows as JSON to this file")
    p.add_argument("--runs", type=int, help="runs per measurement (default 3 quick, 5 full)")
    p.add_argument("--dir", default="/var/tmp/dsstage-bench", help="where data and stores go")
    p.add_argument("--only", help="comma-separated scenarios: cold, single, warm, verify, sharing, manifest, status, "
                   "latency, fanout, sharded, tiny, cpu (single, one 2 GiB file, and tiny, 300,000 tiny files, "
                   "run only when named)")
    p.add_argument("--cache", choices=("cold", "warm", "both"), default="cold",
                   help="cold, warm or both: page cache dropped before each run of cold, warm and single stages "
                   "and of verify (cold), or the data read into it beforehand (warm), to see the hashing "
                   "path without a slow disk hiding it")
    p.add_argument("--cold-code", action="store_true",
                   help="leave the tools' own code out of the page cache in cold runs too (a first run "
                        "after boot); by default each tool is run once on a one-file dataset after the "
                        "drop, so that only the data is read from disk")
    p.add_argument("--no-pretouch", action="store_true", help="do not touch fresh memory before each run "
                   "(on a virtual machine whose host reclaims free memory, a run's first use of a page can cost "
                   "a host fault: see docs/benchmarks.md)")
    p.add_argument("--delays", default="1000,200", help="the latency scenario's emulations: per-request delays of "
                   "latencyfs in microseconds (default 1000,200: 1 ms and 0.2 ms round trips)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench/run: run as root (the store is root-owned; the page cache is dropped)", file=sys.stderr)
        return 2
    b = Bench(args)
    started = time.time()
    b.run()
    print(table(b.rows))
    print(f"\n{len(b.rows)} figures in {time.time() - started:.0f} s; machine: {os.cpu_count()} CPUs, "
          f"page cache {'dropped' if b.can_drop else 'not dropped'} before cold runs")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in b.rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
