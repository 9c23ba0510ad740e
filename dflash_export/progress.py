"""Progress on stderr for the steps that take more than a couple of seconds (export, graph optimization, quantization,
warm-up, the checks of `validate`): rich bars with elapsed time and, where the step counts its items, the time left.

A command opens one display (`progress_display`); the stage modules open steps (`step`) without knowing whether a
display is open: with none (tests, pipes, library use) a step costs nothing and prints nothing.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar

_current: ContextVar = ContextVar("dflash_progress", default=None)


class Step:
    """One bar of the open display (or nothing when none is open)."""

    def __init__(self, bar=None, task=None, total: float | None = None):
        self.bar, self.task, self.total = bar, task, total

    def advance(self, n: float = 1, description: str | None = None) -> None:
        if self.bar is not None:
            kw = {"description": description} if description else {}
            self.bar.update(self.task, advance=n, **kw)

    def set_total(self, total: float) -> None:
        """Give a step that started without one its count of items (its ETA column then fills in)."""
        self.total = total
        if self.bar is not None:
            self.bar.update(self.task, total=total)


def _columns():
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())


@contextmanager
def progress_display(enabled: bool | None = None, transient: bool = False):
    """Open the display for the `step`s run inside (default: when stderr is a terminal). Nested calls share the
    outer display."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or _current.get() is not None:
        yield _current.get()
        return
    from rich.console import Console
    from rich.progress import Progress

    bar = Progress(*_columns(), console=Console(stderr=True), transient=transient)
    token = _current.set(bar)
    try:
        with bar:
            yield bar
    finally:
        _current.reset(token)


@contextmanager
def step(description: str, total: float | None = None):
    """A bar for one step: `total` items (elapsed and ETA) or, when None, a spinner with the elapsed time. Marked
    complete when the block ends normally."""
    bar = _current.get()
    if bar is None:
        yield Step()
        return
    task = bar.add_task(description, total=total)
    s = Step(bar, task, total)
    yield s
    done = s.total if s.total is not None else 1
    bar.update(task, total=done, completed=done)
