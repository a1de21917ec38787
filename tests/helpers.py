"""Test helpers: a dsstage installation on tmp_path, dataset trees, and the CLI as users run it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from dsstage.config import load

ROOT = Path(__file__).resolve().parent.parent
#: what the warm paths must not import (tests/unit/test_warm_imports.py)
WARM_HEAVY = ("typing", "dataclasses", "inspect", "logging", "yaml", "argparse", "json", "re", "enum",
              "collections", "contextlib", "functools")


def python_copier(monkeypatch) -> None:
    """The verifying copier works in Python in this test (DSSTAGE_NATIVE_COPY=0): for tests
    that fail its Python calls on purpose."""
    from dsstage.transfer import native
    monkeypatch.setenv("DSSTAGE_NATIVE_COPY", "0")
    native.forget()


def native_copier():
    """The native copier (dsstage.transfer.native.Helper); the test fails (never skips) if
    it is not built."""
    from dsstage.transfer import native
    native.forget()
    program = native.helper()
    assert program, "native/dsstage-copy is not built: packaging/run-tests builds it (make -C native)"
    return program


def copy_verified(src, dest, entries, **kw):
    """dsstage.transfer.copier.copy_verified from directory ``src`` into directory ``dest``;
    ``kw`` are Tuning's fields and copy_verified's keywords alike."""
    import dataclasses

    from dsstage.transfer import copier
    fields = {f.name for f in dataclasses.fields(copier.Tuning)}
    tuning = copier.Tuning(**{k: v for k, v in kw.items() if k in fields})
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return copier.copy_verified(str(src), fd, entries, tuning, **{k: v for k, v in kw.items() if k not in fields})
    finally:
        os.close(fd)


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    root.mkdir(parents=True, exist_ok=True)
    return root


def random_tree(root: Path, count: int, size: int, seed: int = 1, fanout: int = 100) -> Path:
    """``count`` files of about ``size`` bytes in ``count/fanout`` directories."""
    import random
    rnd = random.Random(seed)
    blob = os.urandom(size * 2 + 1)
    for i in range(count):
        d = root / f"d{i // fanout:04d}"
        d.mkdir(parents=True, exist_ok=True)
        off = rnd.randrange(size)
        (d / f"f{i:07d}.bin").write_bytes(blob[off:off + size] + i.to_bytes(8, "little"))
    return root


def wait_flushed(env: Env, node: str | None = None) -> None:
    """Wait for the detached flushes of new copies on ``node`` (dsstage.node.background): each
    takes its dataset's lock for a moment (an Epilog keeps a copy whose lock is busy for now)
    and rewrites the copy's ready mark, durable (one a test removed meanwhile comes back)."""
    deadline = time.monotonic() + 30
    marks = list((env.tier_root(node) / "ready").glob("*/*.json"))
    while time.monotonic() < deadline and not all('"durable": true' in m.read_text() for m in marks):
        time.sleep(0.05)


class Env:
    """A dsstage installation on tmp_path: state dir, tiers, sources, configuration."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.state = tmp_path / "state"
        self.nvme = tmp_path / "nvme"
        self.config_path = tmp_path / "dsstage.yaml"
        self.run = tmp_path / "run"  # the node-local run directory (reports, metrics)
        self.datasets: dict[str, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}
        self.node = "n1"

    def source(self, name: str) -> Path:
        return self.tmp / "src" / name

    def add(self, name: str, files: dict[str, bytes] | None = None, **spec: Any) -> Path:
        src = self.source(name)
        if files is not None:
            write_tree(src, files)
        src.mkdir(parents=True, exist_ok=True)
        spec.setdefault("source", str(src))
        self.datasets[name] = spec
        self.write()
        return src

    def write(self) -> Path:
        data = {"state_dir": str(self.state),
                "tiers": {"nvme": {"path": str(self.nvme) + "/{node}", "capacity": "100GiB", "root_filesystem": True}},
                "datasets": self.datasets, **self.extra}
        self.config_path.write_text(yaml.safe_dump(data))
        os.chmod(self.config_path, 0o644)
        return self.config_path

    def tier_root(self, node: str | None = None) -> Path:
        return self.nvme / (node or self.node)

    def config(self) -> Any:
        return load.load(str(self.config_path))

    def store(self, **kw: Any) -> Any:
        from dsstage.node.store import Store
        kw.setdefault("run_dir", str(self.run))
        return Store(self.config(), kw.pop("node", self.node), **kw)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["DSSTAGE_CONFIG"] = str(self.config_path)
        env["SLURMD_NODENAME"] = self.node
        env["DSSTAGE_RUN_DIR"] = str(self.run)
        env.pop("SLURM_JOB_ID", None)
        return env

    def cli(self, *args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([sys.executable, "-m", "dsstage", *args], env=self.env(), text=True,
                             capture_output=True, **kw)
        if check and res.returncode != 0:
            raise AssertionError(f"dsstage {' '.join(args)} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    def cli_json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json").stdout)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "dsstage", *args], env=self.env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run_hook(env: Env, which: str, job: str, request: str = "coco",
             timeout: float = 120) -> tuple[int, float, list[str]]:
    """The hook ``which`` as its script runs it (``python -I -c CODE which``): its exit code, its seconds and
    the job's TaskProlog lines (if any)."""
    run = Path(env.run)
    proc_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DSSTAGE_CONFIG": str(env.config_path),
                "DSSTAGE_RUN_DIR": str(run), "DSSTAGE_LOG": str(env.tmp / "hooks.log"),
                "SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root",
                "SLURMD_NODENAME": env.node, "SLURM_JOB_NODELIST": env.node,
                "SPANK__SLURM_SPANK_OPTION_dsstage_dataset": request}
    t = time.monotonic()
    from dsstage.hooks.__main__ import CODE
    res = subprocess.run([sys.executable, "-I", "-c", CODE, which], env=proc_env, cwd="/",
                         capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - t
    task = run / env.node / "jobs" / f"{job}.task"
    return res.returncode, took, task.read_text().splitlines() if task.exists() else []


@contextlib.contextmanager
def reachable_above(path: Path) -> Iterator[None]:
    """The directories above ``path`` under /tmp or /var/tmp may be entered by anyone, as
    above a real state directory (pytest's temporary directory is root's alone), for a test
    that acts as another user there; their modes put back afterwards."""
    above = [p for p in Path(path).parents if str(p).startswith(("/tmp/", "/var/tmp/"))]
    modes = {p: p.stat().st_mode & 0o7777 for p in above}
    for p, m in modes.items():
        p.chmod(m | 0o011)
    try:
        yield
    finally:
        for p, m in modes.items():
            p.chmod(m)


def releases(top: Path | None = None) -> list[tuple[str, str, str]]:
    """packaging/releases of checkout ``top`` (this one by default), oldest first: (version,
    commit, day) of each release packaging/release cut."""
    top = top or Path(__file__).resolve().parents[1]
    out = []
    for line in (top / "packaging" / "releases").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            version, commit, day = line.split()
            out.append((version, commit, day))
    return out
