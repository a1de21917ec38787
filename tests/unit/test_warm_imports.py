"""The warm paths (the warm Prolog, dsstage.hooks.warm; the fast ``dsstage stage``/``verify``,
dsstage.cli.fast) start in a few tens of milliseconds, most of it the interpreter's own: the
modules they import must not bring in what costs more than their work. Measured on the
development machine, 2026-11-28 (CPU of ``python -c 'import ...'`` beside the modules the
warm path needs, median of 30, two runs): typing 5-9 ms, dataclasses (with inspect, ast, dis,
tokenize) 15-23 ms, logging 18 ms; the warm Prolog's whole run is about 85 ms. And, 2026-11-29
(``python -X importtime``, compiled): collections 3 ms (``from collections.abc import ...`` at
run time brings it, so the warm modules import those names under TYPE_CHECKING), contextlib
with functools 2 ms; without them the warm Prolog's imports went from 17 to 9 ms."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import WARM_HEAVY as HEAVY

#: what the warm Prolog of a sharded dataset imports besides (its job record, plan and view);
#: logging comes with ClusterShell, which expands the job's hostlist
SHARDED = ("dsstage.hostlist", "dsstage.node.jobrecord", "dsstage.shards.indexfile", "dsstage.shards.assign",
           "dsstage.shards.told", "dsstage.shards.views", "dsstage.privatedata")


@pytest.mark.parametrize("modules,allowed", [
    (("dsstage.hooks.__main__", "dsstage.hooks.warm"), ()),
    (("dsstage.cli.main", "dsstage.cli.fast"), ()),
    (("dsstage.hooks.__main__", "dsstage.hooks.warm", *SHARDED),
     ("logging", "re", "enum", "collections", "contextlib", "functools")),
])
def test_the_warm_paths_modules_import_nothing_heavy(modules, allowed):
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import " + ", ".join(modules)],
                         capture_output=True, text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert set(modules) <= imported  # the probe saw the imports
    heavy = imported & (set(HEAVY) - set(allowed))
    assert not heavy, sorted(heavy)
