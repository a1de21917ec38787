"""The manual pages in packaging/man are packaging/make-man's output for today's command line.

A verb, an option or a help text changed in dsstage.cli without running packaging/make-man
fails here; so does a page that groff (or mandoc, where installed) warns about.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from dsstage.cli.main import build_parser

TOP = Path(__file__).resolve().parents[2]
MAN = TOP / "packaging" / "man"
FIX = "run packaging/make-man and commit packaging/man"


def load_make_man() -> ModuleType:
    path = TOP / "packaging" / "make-man"
    loader = importlib.machinery.SourceFileLoader("make_man", str(path))
    spec = importlib.util.spec_from_loader("make_man", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_man() -> ModuleType:
    return load_make_man()


def cli_verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The verbs as argparse has them (not through make-man, which is what is checked)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p for s in subs for name, p in s.choices.items()}


def roff(text: str) -> str:
    return text.replace("-", "\\-")


def test_committed_pages_are_current(make_man, tmp_path):
    pages = make_man.render(previous=MAN)
    stale = make_man.differences(pages, MAN)
    assert not stale, f"packaging/man is not what the command line gives for {', '.join(stale)}: {FIX}"
    # and packaging/make-man --output writes the same files
    out = tmp_path / "man"
    shutil.copytree(MAN, out)
    assert make_man.main(["--output", str(out), "--check"]) == 0
    assert make_man.main(["--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in MAN.iterdir())


def test_every_verb_has_a_page_listed_on_the_main_page():
    verbs = cli_verbs(build_parser())
    assert len(verbs) >= 10
    main = (MAN / "dsstage.1").read_text()
    commands = main.split(".SH COMMANDS", 1)[1].split(".SH ", 1)[0]
    see_also = main.split(".SH SEE ALSO", 1)[1]
    for verb in verbs:
        assert (MAN / f"dsstage-{verb}.1").is_file(), f"no page for `dsstage {verb}`: {FIX}"
        assert f".BR {roff('dsstage-' + verb)} (1)" in commands, f"dsstage.1 does not list {verb}: {FIX}"
        assert f".BR {roff('dsstage-' + verb)} (1)," in see_also
    pages = {p.name for p in MAN.glob("*.1")}
    assert pages == {"dsstage.1"} | {f"dsstage-{v}.1" for v in verbs}, f"a page for a verb that is gone: {FIX}"


def test_every_option_and_action_of_a_verb_is_in_its_page(make_man):
    for verb, parser in cli_verbs(build_parser()).items():
        if verb in make_man.DELEGATED:  # `dsstage simulate --help` is that parser's
            import importlib
            parser = importlib.import_module(make_man.DELEGATED[verb]).build_parser()
        page = (MAN / f"dsstage-{verb}.1").read_text()
        assert page.startswith(f".TH {roff('DSSTAGE-' + verb.upper())} 1 ")
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for name in action.choices:
                    assert f'.SS "{roff(f"dsstage {verb} {name}")}"' in page, f"{verb} {name}: {FIX}"
                continue
            for opt in action.option_strings:
                assert f"\\fB{roff(opt)}\\fR" in page, f"dsstage {verb} {opt} is not in its page: {FIX}"


def test_main_page_has_the_sections_a_reader_looks_for():
    main = (MAN / "dsstage.1").read_text()
    sections = re.findall(r"^\.SH (.+)$", main, re.M)
    assert sections == ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "COMMANDS", "ENVIRONMENT", "FILES",
                        "EXIT STATUS", "SEE ALSO"]
    files = main.split(".SH FILES", 1)[1].split(".SH ", 1)[0]
    for path in ("/etc/dsstage/dsstage.yaml", "/etc/default/dsstage", "/run/dsstage"):
        assert f".I {roff(path)}\n" in files
    from dsstage import __version__
    assert re.match(rf'\.TH DSSTAGE 1 \d{{4}}-\d\d-\d\d "dsstage {re.escape(__version__)}" ', main)
    for code in (0, 2, 65, 69, 74, 75, 77, 78):  # the admin guide's table of exit codes
        assert f"\n.B {code}\n" in main.split(".SH EXIT STATUS", 1)[1]


def test_output_depends_on_neither_terminal_nor_clock(make_man, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "33")
    a = make_man.render(previous=MAN, today="2001-01-01")
    monkeypatch.setenv("COLUMNS", "250")
    b = make_man.render(previous=MAN, today="2099-12-31")
    assert a == b
    # a page whose text changed gets the day it changed; the others keep theirs
    changed = tmp_path / "man"
    shutil.copytree(MAN, changed)
    page = changed / "dsstage-ls.1"
    page.write_text(page.read_text().replace("List the datasets", "Show the datasets"))
    c = make_man.render(previous=changed, today="2099-12-31")
    assert c["dsstage-ls.1"].startswith(".TH DSSTAGE\\-LS 1 2099-12-31 ")
    assert c["dsstage.1"] == a["dsstage.1"]
    assert make_man.differences(c, changed) == ["dsstage-ls.1"]


def test_roff_text_is_escaped(make_man):
    assert make_man.fill(".hidden request and 'another") == ["\\&.hidden request and 'another"]
    assert make_man.esc("a-b\\c") == "a\\-b\\ec"
    assert all(len(line) <= 80 for line in make_man.fill("word " * 100))


def lint(argv: list[str], page: Path) -> str:
    res = subprocess.run([*argv, str(page)], capture_output=True, text=True, timeout=60)
    return (res.stdout + res.stderr).strip()


@pytest.mark.parametrize("tool", [["groff", "-ww", "-man", "-Tutf8", "-z"], ["mandoc", "-T", "lint"]],
                         ids=["groff", "mandoc"])
def test_pages_render_without_warnings(tool):
    if not shutil.which(tool[0]):
        # packaging/run-tests installs both: under CI a missing linter is a failure, not a pass
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{tool[0]} is not installed (packaging/run-tests installs it)", pytrace=False)
        pytest.skip(f"{tool[0]} is not installed")
    pages = sorted(MAN.glob("*.1"))
    assert pages
    problems = {p.name: out for p in pages if (out := lint(tool, p))}
    assert not problems, problems


def test_every_verb_is_in_the_readmes_command_table_and_every_row_is_a_verb():
    verbs = set(cli_verbs(build_parser()))
    readme = (MAN.parents[1] / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `dsstage ")]
    listed = {line.split("`dsstage ", 1)[1].split()[0].rstrip("`") for line in rows}
    assert verbs - listed == set(), f"README.md's command table leaves out {sorted(verbs - listed)}"
    assert listed - verbs == set(), f"README.md's command table names commands that are gone: {sorted(listed - verbs)}"
