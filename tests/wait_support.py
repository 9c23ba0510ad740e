"""A bound on how long a call under test may block (a reader stuck on a FIFO, a lock never released): the test fails
with a line saying what waited instead of hanging the suite. Main thread only (SIGALRM)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class Stuck(Exception):
    """Raised into the blocked call: not an OSError, which the code under test may take for an unreadable file."""


@contextmanager
def fails_after(seconds: int, what: str) -> Iterator[None]:
    def stuck(signum, frame):
        raise Stuck(what)

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
