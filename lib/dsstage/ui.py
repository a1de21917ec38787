"""Terminal output: one rich console, and a progress bar only on a terminal."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from functools import lru_cache

from rich.console import Console


@lru_cache(maxsize=1)
def console() -> Console:
    return Console()


@lru_cache(maxsize=1)
def err_console() -> Console:
    return Console(stderr=True)


@contextlib.contextmanager
def progress_bar(what: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """Yield ``advance(done_delta, total)``; draws a bar on a terminal, nothing elsewhere."""
    if not (enabled and sys.stderr.isatty()):
        yield lambda _n, _total: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )
    lock = threading.Lock()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err_console(), transient=True) as prog:
        task = prog.add_task(what, total=None)

        def advance(n: int, total: int) -> None:
            with lock:
                prog.update(task, advance=n, total=total)
        yield advance
