"""What the measuring scripts (benchmarks/, recipes/*/measure_tau.py) share on their command lines: bounds on the
numbers they take, checked before any work, and one `error:` line with exit code 2 (as every `dflash-export` command
gives) instead of a traceback for bad input found later: a missing engine directory, a value the runtime refuses."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from dflash_export.errors import EXIT_INPUT, DFlashError


def refuse(option: str, message: str) -> NoReturn:
    """`error: OPTION: MESSAGE` on stderr and exit code 2."""
    print(f"error: {option}: {message}", file=sys.stderr)
    sys.exit(EXIT_INPUT)


def at_least(args, minimum: int, *options: str) -> None:
    """Refuse the first of `options` (spelled as on the command line: `--max-new-tokens`) whose value in `args` is
    below `minimum`; one left at None (the engine's or the machine's choice) passes. A count of 0 or less is never
    what a run means: the suites read `--prompts 0` as every prompt and `-1` as all but the last, and a loop of no
    rounds ends in an empty median after the work."""
    for option in options:
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if value is not None and value < minimum:
            refuse(option, f"must be >= {minimum}, got {value}")


def counts(text: str, option: str) -> list[int]:
    """A comma list of positive integers (`--concurrency 1,8`, `--batches 1,4,8`), each checked."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        refuse(option, f"expected a comma list of integers, got {text!r}")
    if not values or min(values) < 1:
        refuse(option, f"expected a comma list of integers >= 1, got {text!r}")
    return values


def run(main: Callable[[], int | None]) -> NoReturn:
    """Run a script's `main` and exit with its code; the package's input errors (DFlashError: a missing engine
    directory, a suite that does not parse, a sampling value out of range) end as one `error:` line, exit code 2."""
    try:
        code = main()
    except DFlashError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(e.exit_code)
    sys.exit(code)
