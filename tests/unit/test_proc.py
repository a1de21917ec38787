"""The one way dsstage runs a command: its locale, its timeout, its errors."""

from __future__ import annotations

import os

import pytest
from dsstage import proc
from dsstage.errors import CommandError


@pytest.mark.parametrize("env", [None, {"PATH": os.defpath, "LC_ALL": "de_DE.UTF-8", "LANG": "fr_FR.UTF-8"}])
def test_every_command_runs_in_the_c_locale(env, monkeypatch):
    monkeypatch.setenv("LC_ALL", "sv_SE.UTF-8")  # what a site's or a user's shell may set
    res = proc.run(["sh", "-c", 'printf "%s" "$LC_ALL"'], env=env, timeout=10)
    assert res.stdout == "C"


def test_the_caller_environment_is_kept_but_the_locale():
    res = proc.run(["sh", "-c", 'printf "%s" "$DSSTAGE_X"'], env={"PATH": os.defpath, "DSSTAGE_X": "y"}, timeout=10)
    assert res.stdout == "y"
    assert proc.c_locale({"A": "b"}) == {"A": "b", "LC_ALL": "C"}


def test_a_failing_command_carries_its_exit_code_and_output():
    with pytest.raises(CommandError) as err:
        proc.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)
    assert (err.value.returncode, err.value.stdout.strip(), err.value.stderr.strip()) == (3, "out", "err")
