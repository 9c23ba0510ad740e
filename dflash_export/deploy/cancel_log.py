"""The model's cancellation lines in the server log, bounded however many clients go away.

Each cancelled request gives a `dflash-cancel:` line (deploy/triton_model.py; benchmarks/soak.py reads them): why,
how long after the cancel became visible the model saw it, the step it was in, and how many DFlash steps the runtime
ran for the request after the cancel became visible. A model instance writes its first `verbatim` lines as they come;
after those, cancels are counted, and one `dflash-cancel-summary:` line every `period_s` seconds (while there is
any to report, and at the instance's end) gives their number and the worst of each figure. An instance's cancel
lines are then at most `verbatim` + one per `period_s` of its life, whatever the rate of cancels.
"""

from __future__ import annotations

import os
import sys
import threading
import time

CANCEL_LINES_VERBATIM = 100
CANCEL_SUMMARY_S = 60.0


def cancel_line(why: str, late_ms: float | None, step_ms: float | None, steps: int) -> str:
    """One cancel's line. `late_ms`: from the cancel becoming visible to the model seeing it (None: unknown, e.g. a
    cancel of Triton's own); `step_ms`: the step it was seen after (None: seen before the request's first step)."""
    where = ("before it started (it was queued)" if step_ms is None else
             f"mid-generation, last step {step_ms:.0f} ms")
    late = -1 if late_ms is None else late_ms
    return (f"dflash-cancel: {why}; noticed {late:.0f} ms after it, {where}, "
            f"{steps} step{'' if steps == 1 else 's'} after it")


class CancelLog:
    """Writes cancel lines to `out` (default: stderr, which tritonserver's log takes): the first `verbatim` as they
    come, then a summary every `period_s` seconds. `clock`: seconds, monotonic. `timer`: a summary is also written
    `period_s` after the first cancel it counts when no later cancel comes to write it (a daemon thread); without
    it, only `record` and `flush` write summaries. Thread-safe."""

    def __init__(self, verbatim: int = CANCEL_LINES_VERBATIM, period_s: float = CANCEL_SUMMARY_S, out=None,
                 clock=time.monotonic, timer: bool = True):
        self.verbatim_left = verbatim
        self.period_s = period_s
        self.out = out
        self.clock = clock
        self.timer = timer
        self._lock = threading.Lock()
        self._pending: Counter | None = None
        self._since = 0.0
        self._thread: threading.Timer | None = None

    def record(self, why: str, late_ms: float | None, step_ms: float | None, steps: int) -> None:
        with self._lock:
            now = self.clock()
            if self._pending is not None and now - self._since >= self.period_s:
                self._write_summary(now)
            if self.verbatim_left > 0:
                self.verbatim_left -= 1
                self._write(cancel_line(why, late_ms, step_ms, steps))
                return
            if self._pending is None:
                self._pending, self._since = Counter(), now
                if self.timer:
                    self._thread = threading.Timer(self.period_s, self._on_timer)
                    self._thread.args = (self._thread,)
                    self._thread.daemon = True
                    self._thread.start()
            self._pending.add(late_ms, step_ms, steps)

    def flush(self) -> None:
        """Write the summary of the cancels counted so far, if any (at the instance's end)."""
        with self._lock:
            if self._pending is not None:
                self._write_summary(self.clock())

    def _on_timer(self, thread: threading.Timer) -> None:
        with self._lock:
            if self._pending is not None and self._thread is thread:  # not already written by `record` or `flush`
                self._write_summary(self.clock())

    def _write_summary(self, now: float) -> None:
        p = self._pending
        self._pending = None
        if self._thread is not None:
            self._thread.cancel()
            self._thread = None
        self._write(f"dflash-cancel-summary: pid {os.getpid()}: {p.count} more cancel{'' if p.count == 1 else 's'} "
                    f"in {now - self._since:.0f} s ({p.queued} before they started, {p.running} mid-generation); "
                    f"at most {p.steps} step{'' if p.steps == 1 else 's'} after it, noticed at most "
                    f"{p.late_ms:.0f} ms after it, last step at most {p.step_ms:.0f} ms")

    def _write(self, line: str) -> None:
        out = self.out if self.out is not None else sys.stderr
        try:
            print(line, file=out, flush=True)
        except (OSError, ValueError):  # the log is gone (the server is stopping): nothing to keep
            pass


class Counter:
    """What a summary reports: how many cancels, seen before their first step or mid-generation, and the worst
    figures of those seen mid-generation (-1 ms: none known)."""

    def __init__(self):
        self.count = self.queued = self.running = self.steps = 0
        self.late_ms = self.step_ms = -1.0

    def add(self, late_ms: float | None, step_ms: float | None, steps: int) -> None:
        self.count += 1
        if step_ms is None:
            self.queued += 1
            return
        self.running += 1
        self.steps = max(self.steps, steps)
        self.step_ms = max(self.step_ms, step_ms)
        if late_ms is not None:
            self.late_ms = max(self.late_ms, late_ms)
