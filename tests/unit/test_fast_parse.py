"""Which command lines the fast ``dsstage stage`` answers (dsstage.cli.fast.parse): the plain
form only; anything else is left to the full command."""

from __future__ import annotations

import pytest
from dsstage.cli.fast import parse
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.mark.parametrize(("argv", "want"), [
    (["stage", "coco"], {"names": "coco"}),
    (["stage", "a,b", "--job-id", "7", "--json"], {"names": "a,b", "job_id": "7", "json": True}),
    (["--config", "/c.yaml", "--node=n2", "stage", "--job-id=9", "coco"],
     {"config": "/c.yaml", "node": "n2", "job_id": "9", "names": "coco"}),
    (["verify", "coco", "--json"], {"verb": "verify", "names": "coco", "json": True}),
    (["--node", "n3", "verify", "coco"], {"verb": "verify", "node": "n3", "names": "coco"}),
    # the global options after the verb too, as the full command line takes them
    (["stage", "coco", "--config", "/c.yaml", "--node=n4"], {"config": "/c.yaml", "node": "n4", "names": "coco"}),
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


@pytest.mark.parametrize(("argv", "node", "config"), [
    (["prolog", "--dry-run", "--job", "5", "--node", "n1"], "n1", None),
    (["--node", "n2", "prolog", "--dry-run", "--job", "5"], "n2", None),
    (["--node", "n2", "stage", "coco", "--node", "n3"], "n3", None),  # after the verb wins
    (["manifest", "build", "coco", "--config", "/c.yaml"], None, "/c.yaml"),
    (["stage", "coco", "--config", "/c.yaml", "--node", "n4"], "n4", "/c.yaml"),
])
def test_the_full_command_line_takes_the_global_options_after_the_verb(argv, node, config):
    """As the README's table writes them: `dsstage prolog --dry-run --job 5 --node n1`."""
    from dsstage.cli.main import build_parser
    args = build_parser().parse_args(argv)
    assert (args.node, args.config) == (node, config)
    fast = parse(argv)
    if fast is not None:  # the fast path reads them the same way
        assert (fast["node"], fast["config"]) == (node, config)


def test_status_keeps_its_own_node_option_a_hostlist():
    from dsstage.cli.main import build_parser
    args = build_parser().parse_args(["status", "--node", "n[1-2]"])
    assert args.nodes == "n[1-2]" and args.node is None


TOKENS = ["stage", "verify", "coco", "a,b", "--job-id", "--job-id=9", "7", "--json", "--full", "--config", "/c.yaml",
          "--config=/d.yaml", "--node", "n2", "--node=n3", "--user", "alice", "-v", "--nodes", "n[1-2]"]


def full_parse(argv):
    """What the full command line (dsstage.cli.main.build_parser) makes of ``argv``, or None if
    it refuses it."""
    import contextlib
    import io

    from dsstage.cli.main import build_parser
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return build_parser().parse_args(argv)
    except SystemExit:
        return None


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=7))
def test_what_the_fast_path_parses_the_full_command_line_parses_alike(argv):
    """The fast path keeps its own small parser (argparse and the full parser cost about
    25 ms of a 50 ms fast stage: docs/benchmarks.md), so it is held to the full one: every
    command line it answers, the full parser takes with the same values."""
    fast = parse(argv)
    if fast is None:
        return
    full = full_parse(argv)
    assert full is not None, argv
    got = {"verb": full.handler.__name__.removeprefix("cmd_"), "config": full.config, "node": full.node,
           "job_id": getattr(full, "job_id", None), "json": full.json, "full": bool(getattr(full, "full", False)),
           "names": full.name}
    assert fast == got, argv
