"""`dflash-export`: one thin click command per stage. Commands parse and call; the logic lives in the stage modules.

Every DFlashError becomes one `error: <file>: <field>: <message>` line and its exit code (2 for bad input, 1 for a
failed check), never a traceback; so do click's usage errors (`error: <option>: <message>`) and unreadable or
unwritable paths (OSError: `error: <file>: <reason>`). Anything else is a bug: one line, exit 1, the traceback in a
file (or on the terminal with DFLASH_EXPORT_TRACEBACK=1).
"""

from __future__ import annotations

import os
import sys

import click

from dflash_export import __version__
from dflash_export.errors import DFlashError


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _usage_error_line(e: click.ClickException) -> str:
    """click's own errors (bad or missing options, unknown commands) as `error: <option>: <message>`, not click's
    three-line usage block: the same shape as every other bad input."""
    if isinstance(e, click.BadParameter) and e.param is not None and e.message:
        hint = e.param_hint or " / ".join(getattr(e.param, "opts", None) or [e.param.name or ""])
        if isinstance(hint, (list, tuple)):
            hint = " / ".join(hint)
        return f"{hint.strip(chr(39))}: {_one_line(e.message)}"
    return _one_line(e.format_message())


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DFlashError as e:
            click.echo(f"error: {_one_line(e)}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"error: {_usage_error_line(e)}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except OSError as e:
            # A path the user gave that cannot be read or written (no such directory, a file where a directory must
            # be, no permission, a full disk): name the file, no traceback.
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"error: {where}{_one_line(e.strerror or e)}", err=True)
            sys.exit(2)
        except (click.exceptions.Exit, click.Abort):
            raise  # click's own control flow (--help, ctx.exit, EOF at a prompt)
        except Exception as e:  # noqa: BLE001 -- the last resort: a bug, not bad input
            if os.environ.get("DFLASH_EXPORT_TRACEBACK"):
                raise
            import tempfile
            import traceback

            fd, log = tempfile.mkstemp(prefix="dflash-export-", suffix=".traceback.txt")
            with os.fdopen(fd, "w") as f:
                traceback.print_exc(file=f)
            click.echo(f"error: internal error, {type(e).__name__}: {_one_line(e)[:300]} (traceback in {log}; "
                       "DFLASH_EXPORT_TRACEBACK=1 shows it here)", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dflash-export")
def main():
    """Export, compile, validate and deploy DFlash speculative decoding engines."""


def _register_optional(name: str, module: str, attr: str) -> None:
    """Stage commands live in their own modules; a stage whose module is absent is simply not listed."""
    import importlib

    try:
        cmd = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("dflash_export"):
            return
        raise
    main.add_command(cmd, name)


for _name, _module, _attr in [
    ("inspect", "dflash_export.models.cli", "inspect"),
    ("reference", "dflash_export.runtime.cli", "reference"),
    ("demo", "dflash_export.runtime.cli", "demo"),
    ("train", "dflash_export.train.cli", "train"),
    ("export", "dflash_export.export.cli", "export"),
    ("build", "dflash_export.engines.cli", "build"),
    ("run", "dflash_export.runtime.cli", "run"),
    ("bench", "dflash_export.bench.cli", "bench"),
    ("validate", "dflash_export.validate.cli", "validate"),
    ("deploy", "dflash_export.deploy.cli", "deploy"),
    ("serve", "dflash_export.deploy.cli", "serve"),
]:
    _register_optional(_name, _module, _attr)


if __name__ == "__main__":
    main()
