"""What the guides' tests share (tests/unit/test_user_guide.py, test_admin_guide.py): a
guide's code blocks and inline commands, and the check that the place named for a command
(a test function, or a whole script) still runs it."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dsstage.cli.main import build_parser

TOP = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.S | re.M)


@dataclass(frozen=True)
class Runs:
    """``path`` (a test function ``test`` in it, or the whole file for a script) contains
    every piece of ``pieces``: it runs the command."""

    path: str
    test: str | None
    pieces: tuple[str, ...]
    note: str = ""


def fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, indented ones (in list items) included."""
    return [(m.group(2), re.sub(rf"^{m.group(1)}", "", m.group(3), flags=re.M)) for m in _FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text without its fenced blocks."""
    return _FENCE.sub("", text)


def inline_commands(text: str, commands: Iterable[str]) -> list[str]:
    """Inline code in the prose that starts with one of ``commands`` and has arguments."""
    return [span for span in re.findall(r"`([^`\n]+)`", prose(text))
            if " " in span and span.split(" ", 1)[0] in commands]


def source_of(path: Path, name: str) -> str:
    """The source of function (with its decorators) or module-level assignment ``name`` in ``path``."""
    text = path.read_text()
    lines = text.splitlines()
    for node in ast.parse(text).body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
        if name in names:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            return "\n".join(lines[first - 1:node.end_lineno])
    raise AssertionError(f"{path.relative_to(TOP)} has no {name}")


def check_coverage(guide: str, shown: list[str], coverage: dict[str, list[Runs]]) -> None:
    """Every command ``guide`` shows has a place in ``coverage``, and ``coverage`` names no other."""
    missing = sorted({c for c in shown if c not in coverage})
    assert not missing, f"{guide} shows commands no test is named for (add them to COVERAGE): {missing}"
    unused = sorted(set(coverage) - set(shown))
    assert not unused, f"COVERAGE names commands {guide} no longer shows: {unused}"


def check_runs(command: str, places: list[Runs]) -> None:
    """Each named place exists and still has every piece of ``command``."""
    assert places, f"{command}: no place named"
    for runs in places:
        path = TOP / runs.path
        assert path.is_file(), f"{command}: {runs.path} is gone"
        text = source_of(path, runs.test) if runs.test else path.read_text()
        for piece in runs.pieces:
            assert piece in text, f"{command}: {runs.path} {runs.test or ''} no longer has {piece!r}"


def check_parses(command: str) -> None:
    """``dsstage ...`` is a verb and options the real command line accepts."""
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert getattr(args, "handler", None) is not None, command
