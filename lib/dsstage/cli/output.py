"""The command line's JSON output, standard library only: the fast path (dsstage.cli.fast)
writes it before anything else is imported, every other verb through dsstage.cli.common.emit."""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing's: the warm paths do not import typing (tests/unit/test_warm_imports.py)
if TYPE_CHECKING:
    from typing import Any


def write_json(data: Any) -> None:
    """``data`` on stdout: indented for a person at a terminal; compact for a script, which
    Python's C encoder writes several times faster (status --json of 1,000 nodes is megabytes)."""
    import json  # a command with --json; the fast path's plain output needs no json (dsstage.fs.jsontext)
    pretty = sys.stdout.isatty()
    sys.stdout.write(json.dumps(data, sort_keys=True, indent=2 if pretty else None,
                                separators=None if pretty else (",", ":")) + "\n")
