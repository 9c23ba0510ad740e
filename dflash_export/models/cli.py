"""`dflash-export inspect`'s report: lint a drafter against its target and print a summary table. The click command
is in dflash_export/cli.py: it names the pair by recipe, which sits a floor above the models."""

from __future__ import annotations

import json


def run_inspect(drafter: str, target: str, as_json: bool = False) -> int:
    """Print findings + summary; return 2 when any error was found, else 0."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from dflash_export.models.checkpoint import lint_pair

    findings, summary = lint_pair(drafter, target)
    errors = [f for f in findings if f.level == "error"]
    if as_json:
        print(json.dumps({"ok": not errors, "findings": [f.__dict__ for f in findings], "summary": summary},
                         indent=2, default=str))
        return 2 if errors else 0
    console = Console(stderr=False, highlight=False)
    if summary:
        # Values fold onto more lines, never cut to "…" (a path cut short names no file), and are plain text, never
        # rich markup (a directory named "[red]" is shown as it is).
        table = Table(title="DFlash pair", show_header=False)
        table.add_column(overflow="fold")
        table.add_column(overflow="fold")
        for k, v in summary.items():
            table.add_row(Text(k), Text(str(v)))
        console.print(table)
    err_console = Console(stderr=True, highlight=False, soft_wrap=True)
    for f in findings:
        err_console.print(f.line(), markup=False)
    console.print("OK: the pair satisfies the DFlash contract" if not errors else f"{len(errors)} error(s)",
                  markup=False)
    return 2 if errors else 0
