"""The warm paths (the warm Prolog, dsstage.hooks.warm; the fast ``dsstage stage``/``verify``,
dsstage.cli.fast) start in a few tens of milliseconds, most of it the interpreter's own: the
modules they import must not bring in what costs more than their work. Measured on the
development machine, 2026-11-28 (CPU of ``python -c 'import ...'`` beside the modules the
warm path needs, median of 30, two runs): typing 5-9 ms, dataclasses (with inspect, ast, dis,
tokenize) 15-23 ms, logging 18 ms; the warm Prolog's whole run is about 85 ms."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import WARM_HEAVY as HEAVY


@pytest.mark.parametrize("modules", [
    ("dsstage.hooks.__main__", "dsstage.hooks.warm"),
    ("dsstage.cli.main", "dsstage.cli.fast"),
])
def test_the_warm_paths_modules_import_nothing_heavy(modules):
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import " + ", ".join(modules)],
                         capture_output=True, text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert set(modules) <= imported  # the probe saw the imports
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
