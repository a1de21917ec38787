"""The shape of lib/dsstage, checked by tools rather than by review: the import-linter contracts
in pyproject.toml (layers, and the warm Prolog's light imports), no import cycle anywhere
(imports inside functions count), ruff with its complexity rules (no function past one idea:
C901, PLR0912, PLR0913 at the limits pyproject.toml gives and justifies) and mypy (strict on
the decisions and the formats: policy, shards, fs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp

TOP = Path(__file__).resolve().parents[2]
LIB = TOP / "lib" / "dsstage"


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on.add(m)
        for n in sorted(graph.find_modules_directly_imported_by(m)):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            comp = []
            while True:
                n = stack.pop()
                on.discard(n)
                comp.append(n)
                if n == m:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycle():
    graph = grimp.build_graph("dsstage", cache_dir=None)
    assert cycles(graph) == []


def test_cycle_finder_finds_one():
    graph = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(m)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert cycles(graph) == [["a.x", "a.y"]]


def test_import_contracts_hold():
    """lint-imports reads the contracts from pyproject.toml; a broken one fails here."""
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--no-cache"], cwd=TOP, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(TOP / "lib")})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def _tool(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name(name)
    assert exe.exists(), f"{exe} is missing: packaging/run-tests installs the test extras (pyproject.toml)"
    return subprocess.run([str(exe), *args], cwd=TOP, capture_output=True, text=True, timeout=timeout)


def test_ruff_passes_with_the_complexity_rules(tmp_path):
    res = _tool("ruff", "check", "--no-cache", "lib", "tests", "bench", "packaging/make-man")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_passes(tmp_path):
    res = _tool("mypy", "--cache-dir", str(tmp_path / "mypy"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_no_function_of_lib_takes_more_than_eight_parameters():
    """ruff's complexity rules (C901, PLR0912, PLR0913 at max-args 8: pyproject.toml) hold
    everywhere in lib/: none is waived with a noqa."""
    marked = [f"{p.relative_to(LIB)}:{i}" for p in sorted(LIB.rglob("*.py"))
              for i, line in enumerate(p.read_text().splitlines(), 1)
              if "noqa" in line and ("PLR09" in line or "C901" in line)]
    assert not marked, f"waived complexity rules: give the function a request object instead: {marked}"


def test_each_package_docstring_names_each_of_its_modules():
    """A package's ``__init__`` says what it holds: every module of it named as ``module``, so a
    module added or moved shows in the docstring a reader starts from."""
    import ast
    missing = {}
    for init in sorted(LIB.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        mods = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"] + \
            [p.name for p in init.parent.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
        if absent := [m for m in sorted(mods) if f"``{m}``" not in doc]:
            missing[init.parent.name] = absent
    assert not missing, f"named in no package docstring: {missing}"
