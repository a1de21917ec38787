"""What an admin sees of a fleet operation: one summary line, a table of answers folded by
outcome, and a live progress view per node on a terminal (rich).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dsstage.hostlist import fold_nodes as fold
from dsstage.hostlist import natural_key

if TYPE_CHECKING:
    from rich.console import Console
from dsstage.cluster.fleet import Answer, DoneFn, ProgressFn, Row, exit_code, one_line

log = logging.getLogger(__name__)


def summary_rows(answers: Mapping[str, Answer], describe: Callable[[dict], str]) -> list[Row]:
    """``(node, "ok" | "failed", seconds, message)`` per node, in node order. The message of
    an ok node is ``describe(result)``, of a failed one its error."""
    rows = []
    for node in sorted(answers, key=natural_key):
        a = answers[node]
        if a.ok:
            try:
                message = describe(a.result) if isinstance(a.result, dict) else ""
            except Exception as exc:  # the node's JSON is not what describe expects
                message = f"(cannot describe the answer: {type(exc).__name__}: {exc})"
            rows.append((node, "ok", a.seconds, one_line(message)))
        else:
            rows.append((node, "failed", a.seconds, one_line(a.error)))
    return rows


def fold_rows(rows: Sequence[Row]) -> list[tuple[str, str, str, str]]:
    """Rows with the same result and message as one, their nodes folded (``n[1-2,4-8]``),
    the time as a range: a thousand nodes that did the same thing read as one line. The ok
    ones first, the failed last, next to the summary line."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row[1], row[3]), []).append(row)
    folded = []
    for (status, message), members in groups.items():
        times = [r[2] for r in members]
        lo, hi = min(times), max(times)
        span = f"{lo:.1f}s" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}s"
        folded.append((status != "ok", natural_key(members[0][0]), (fold([r[0] for r in members]), status, span,
                                                                  message)))
    folded.sort(key=lambda x: (x[0], x[1]))
    return [x[2] for x in folded]


def summary_line(answers: Mapping[str, Answer], max_reasons: int = 3) -> str:
    """``8 nodes: 7 ok, 1 failed (n3: unreachable: connection refused)``."""
    total = len(answers)
    failed = [a for a in answers.values() if not a.ok]
    line = f"{total} node{'' if total == 1 else 's'}: {total - len(failed)} ok, {len(failed)} failed"
    if not failed:
        return line
    by_error: dict[str, list[str]] = {}
    for a in sorted(failed, key=lambda a: natural_key(a.node)):
        by_error.setdefault(one_line(a.error, 200), []).append(a.node)
    reasons = [f"{fold(nodes)}: {error}" for error, nodes in by_error.items()]
    more = len(reasons) - max_reasons
    shown = "; ".join(reasons[:max_reasons]) + (f"; {more} more reason{'s' if more > 1 else ''} above"
                                                if more > 0 else "")
    return f"{line} ({shown})"


def print_summary(answers: Mapping[str, Answer], describe: Callable[[dict], str], *,
                  console: Console | None = None, title: str | None = None) -> None:
    """The table of what every node answered (folded, see fold_rows) and the summary line."""
    from rich.table import Table
    from rich.text import Text

    from dsstage.ui import console as default_console
    out = console or default_console()
    table = Table(title=title, title_justify="left")
    for column in ("node", "result", "time", "message"):
        table.add_column(column, justify="right" if column == "time" else "left")
    for nodes, status, span, message in fold_rows(summary_rows(answers, describe)):
        # Text, not markup: the message comes from the nodes
        table.add_row(Text(nodes), Text(status, style="green" if status == "ok" else "bold red"), Text(span),
                      Text(message))
    out.print(table)
    out.print(Text(summary_line(answers), style="bold" if exit_code(answers) == 0 else "bold red"))


def progress_state(progress: Mapping[str, Any]) -> tuple[str, int | None, int | None]:
    """``(phase, done, total)`` of a progress dict; done and total (bytes) only when they are
    sane counts. The phase is the remote's word, made one short line."""
    phase = one_line(str(progress.get("phase") or "running"), 40)
    done, total = progress.get("done"), progress.get("total")

    def count(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    done_n, total_n = count(done), count(total)
    if done_n is None or total_n is None:
        return phase, None, None
    return phase, min(done_n, total_n), total_n


@contextlib.contextmanager
def progress_view(nodes: Sequence[str], what: str, enabled: bool = True) -> Iterator[tuple[ProgressFn, DoneFn]]:
    """Yield ``(on_progress, on_done)`` for ``run`` that draw one bar per node on a terminal
    (stderr), nothing elsewhere: bytes done/total once the node sends progress, else a
    pulsing bar with its state (waiting, connecting, running); ok or failed at the end.

    A first line counts the answers. With more nodes than the terminal has lines, only the
    nodes at work and the failed ones are shown.
    """
    if not (enabled and sys.stderr.isatty()):
        yield (lambda _node, _progress: None), (lambda _answer: None)
        return
    from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from dsstage.ui import err_console
    from dsstage.units import human

    class StateColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(task.fields.get("state", ""), style=task.fields.get("style", ""))

    con = err_console()
    compact = len(nodes) > max(con.height - 5, 5)
    lock = threading.Lock()
    counts = {"ok": 0, "failed": 0}
    totals: dict[str, int] = {}
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), StateColumn(), TimeElapsedColumn(),
                  console=con, transient=True) as prog:
        overall = prog.add_task(one_line(what, 60), total=len(nodes), state=f"{len(nodes)} nodes")
        tasks = {node: prog.add_task(node, total=None, state="waiting", visible=not compact) for node in nodes}

        def on_progress(node: str, progress: dict) -> None:
            phase, done, total = progress_state(progress)
            with lock:
                if node not in tasks:
                    return
                if done is None or total is None:
                    prog.update(tasks[node], total=None, state=phase, visible=True)
                else:
                    totals[node] = max(total, 1)
                    prog.update(tasks[node], total=totals[node], completed=done, visible=True,
                                state=f"{phase} {human(done)} / {human(total)}")

        def on_done(answer: Answer) -> None:
            with lock:
                task = tasks.get(answer.node)
                if task is None:
                    return
                counts["ok" if answer.ok else "failed"] += 1
                if answer.ok:
                    total = totals.get(answer.node, 1)
                    prog.update(task, total=total, completed=total, state="ok", style="green",
                                visible=not compact)
                else:
                    prog.update(task, total=1, completed=0, state=f"failed: {one_line(answer.error, 80)}",
                                style="bold red", visible=True)
                prog.update(overall, advance=1, state=f"{counts['ok']} ok, {counts['failed']} failed")
        yield on_progress, on_done
