"""Which command lines the fast ``dsstage stage`` answers (dsstage.cli.fast.parse): the plain
form only; anything else is left to the full command."""

from __future__ import annotations

import pytest
from dsstage.cli.fast import parse


@pytest.mark.parametrize(("argv", "want"), [
    (["stage", "coco"], {"names": "coco"}),
    (["stage", "a,b", "--job-id", "7", "--json"], {"names": "a,b", "job_id": "7", "json": True}),
    (["--config", "/c.yaml", "--node=n2", "stage", "--job-id=9", "coco"],
     {"config": "/c.yaml", "node": "n2", "job_id": "9", "names": "coco"}),
    (["verify", "coco", "--json"], {"verb": "verify", "names": "coco", "json": True}),
    (["--node", "n3", "verify", "coco"], {"verb": "verify", "node": "n3", "names": "coco"}),
    (["verify", "--full", "coco", "--json"], {"verb": "verify", "names": "coco", "full": True, "json": True}),
])
def test_the_plain_form_is_parsed(argv, want):
    opts = parse(argv)
    assert opts == {"verb": "stage", "config": None, "node": None, "job_id": None, "json": False, "full": False,
                    "names": None, **want}


@pytest.mark.parametrize("argv", [
    ["stage"],  # no name: argparse explains
    ["release", "coco"],
    ["stage", "coco", "--user", "alice"],  # on behalf of a user: the full path checks groups
    ["stage", "coco", "--full"],
    ["stage", "coco", "--with", "n[1-2]"],
    ["-v", "stage", "coco"],
    ["--debug", "stage", "coco"],
    ["stage", "coco", "--config", "/c.yaml"],  # a global option after the verb: argparse refuses it
    ["--job-id", "7", "stage", "coco"],
    ["stage", "coco", "other"],
    ["stage", "coco", "--job-id"],
    ["stage", "coco", "--job"],  # an abbreviation argparse would take
    ["status", "stage"],
    ["stage", "coco", "--json=1"],
    ["verify", "coco", "--full=1"],
    ["verify", "coco", "--full", "--nodes", "n1"],
    ["verify", "--nodes", "n[1-2]", "coco"],
    ["verify", "coco", "--job-id", "3"],
    ["verify"],
    ["stage", "verify", "coco"],
])
def test_anything_else_is_left_to_the_full_command(argv):
    assert parse(argv) is None


def test_ctrl_c_in_the_fast_path_reads_as_in_the_full_command(monkeypatch, capsys):
    """A long fast ``verify --full`` interrupted: one line and 130, as the full command says it."""
    from dsstage.cli import fast, main

    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(fast, "answer", interrupted)
    assert main.main(["verify", "coco", "--full"]) == 130
    assert capsys.readouterr().err == "dsstage: interrupted\n"
