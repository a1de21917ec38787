"""The shape of lib/dsstage, checked by tools rather than by review: the import-linter contracts
in pyproject.toml (layers, and the warm Prolog's light imports), no import cycle anywhere
(imports inside functions count), and no module that has grown past one idea."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp

TOP = Path(__file__).resolve().parents[2]
LIB = TOP / "lib" / "dsstage"
MAX_LINES = 450


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


def test_no_module_over_the_limit():
    sizes = {str(p.relative_to(LIB)): len(p.read_text().splitlines()) for p in LIB.rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}
