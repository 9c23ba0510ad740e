"""`dflash-export`: one thin click command per stage. Commands parse and call; the logic lives in the stage modules.

Exit codes, the same for every command (errors.py): 0 done, 1 a check failed (CheckFailed), 2 usage or input error
(every DFlashError, click's usage errors as `error: <option>: <message>`, unreadable or unwritable paths as
`error: <file>: <reason>`, a missing optional library as the line that installs it), 3 internal error (a bug: one
line, the traceback in a file, or on the terminal with DFLASH_EXPORT_TRACEBACK=1). Never a traceback otherwise.
"""

from __future__ import annotations

import codecs
import os
import signal
import sys
import threading
from contextlib import contextmanager


def _interrupted_while_loading(signum, frame):
    """Ctrl-C while the commands load: nothing was done yet, so one line and exit 130, not an import's traceback."""
    sys.stderr.write("interrupted\n")
    raise SystemExit(130)


_loading = threading.current_thread() is threading.main_thread() and \
    signal.getsignal(signal.SIGINT) is signal.default_int_handler
if _loading:
    signal.signal(signal.SIGINT, _interrupted_while_loading)

import click

from dflash_export import __version__
from dflash_export.clitypes import recipe_options
from dflash_export.environment import install_hint
from dflash_export.errors import (
    EXIT_CODES_HELP,
    EXIT_INPUT,
    EXIT_INTERNAL,
    STOP_SIGNALS,
    DFlashError,
    Terminated,
)


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


def _stop(signum, frame):
    """SIGINT / SIGTERM / SIGHUP during a command: KeyboardInterrupt (Terminated) where the command is. Not inside a
    finalizer (`__del__`): an exception there is printed as "Exception ignored" and dropped, and the command would
    carry on to exit 0; the signal is delivered again once the finalizer has returned."""
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__":
            import _thread

            again = threading.Timer(0.05, _thread.interrupt_main, (signum,))
            again.daemon = True
            again.start()
            return
        f = f.f_back
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


_DEFAULT_HANDLERS = (signal.default_int_handler, signal.SIG_DFL, None, _interrupted_while_loading)


@contextmanager
def _stop_signals_raise():
    """While a command runs (main thread only), the stop signals raise instead of killing the process; handlers set
    by someone else (a test harness, an ignored SIGHUP under nohup) are left alone, and all are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, h in previous.items():
        if h in _DEFAULT_HANDLERS:
            signal.signal(s, _stop)
    try:
        yield
    finally:
        for s, h in previous.items():
            if h in _DEFAULT_HANDLERS:
                signal.signal(s, signal.default_int_handler if h is _interrupted_while_loading else h)


# The options that name a file or directory (or a recipe or suite that may be one).
PATH_OPTIONS = frozenset({"--out", "--engine", "--recipe", "--target", "--drafter", "--repo", "--log-file",
                          "--report", "--work-dir", "--init-from", "--llmapi-model-py", "--suite"})


def expand_tilde_options(args: list[str]) -> list[str]:
    """`--out=~/x` as the shell expands `--out ~/x`: a path option's value joined to it by `=` gets no tilde
    expansion from the shell (the word is no assignment), so its leading `~` or `~user` is expanded here; a value
    that names no home directory, and everything after `--`, stay as they are."""
    out = []
    for i, a in enumerate(args):
        if a == "--":
            return out + args[i:]
        if not isinstance(a, str):  # click's API takes any object as an argument (argv holds strings only)
            out.append(a)
            continue
        opt, eq, value = a.partition("=")
        if eq and opt in PATH_OPTIONS and value.startswith("~"):
            a = f"{opt}={os.path.expanduser(value)}"
        out.append(a)
    return out


class _StdoutClosed(Exception):
    """stdout's reader went away (a closed pipe: `| head -1`). Not an OSError, so that no writer on the way (rich
    turns a BrokenPipeError into exit 1) takes it for its own."""


def _escape_unencodable(e: UnicodeError):
    """The stdout/stderr error handler: surrogate escapes (the undecodable bytes of an argument or path) go out as the
    bytes they were, any other character the stream's encoding cannot hold (an ASCII locale) as a backslash escape."""
    if not isinstance(e, UnicodeEncodeError):
        raise e
    try:
        return codecs.lookup_error("surrogateescape")(e)
    except UnicodeError:
        return codecs.backslashreplace_errors(e)


codecs.register_error("dflash-escape", _escape_unencodable)


def _to_devnull(stream) -> None:
    """Point a stream whose reader is gone at /dev/null, so its buffered text and later writes (the interpreter
    flushes stdout at exit) are dropped instead of failing again."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


class _Output:
    """sys.stdout or sys.stderr while a command runs. A write to a closed pipe points the stream at /dev/null; on
    stdout it then ends the command (_StdoutClosed: what it prints is what it is for, and a build's temporary files
    are removed on the way out), on stderr -- progress and diagnostics only -- the command carries on without them."""

    def __init__(self, stream, is_stdout: bool):
        self._stream = stream
        self._is_stdout = is_stdout

    def _closed(self):
        _to_devnull(self._stream)
        if self._is_stdout:
            raise _StdoutClosed

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _devnull_in_place_of_closed(fd: int) -> None:
    """A closed descriptor 1 or 2 becomes /dev/null, so that no file opened later takes its number and receives what
    a library writes there."""
    try:
        os.fstat(fd)
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)


@contextmanager
def _outputs():
    """While a command runs: a closed stdout or stderr (`>&-`) is /dev/null, not None; text the locale's encoding
    cannot hold is escaped (_escape_unencodable) instead of failing the command half-way; writes to a closed pipe
    are handled as _Output says."""
    saved = {name: getattr(sys, name) for name in ("stdout", "stderr")}
    errors = {}
    for name, stream in saved.items():
        if stream is None:
            _devnull_in_place_of_closed(1 if name == "stdout" else 2)
            stream = open(os.devnull, "w", encoding="utf-8")
        elif getattr(stream, "errors", None) in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
            errors[name] = stream.errors
            stream.reconfigure(errors="dflash-escape")
        setattr(sys, name, _Output(stream, name == "stdout"))
    try:
        yield
    finally:
        for name, stream in saved.items():
            setattr(sys, name, stream)
            if name in errors:
                try:
                    stream.reconfigure(errors=errors[name])
                except (OSError, ValueError):  # a closed pipe with text still buffered: dropped at exit anyway
                    pass


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on its write end)."""
    import select

    try:
        poll = select.poll()
        poll.register(1, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _stdout_gone() -> None:
    """stdout's reader went away: nothing more is written there, and the exit status is a shell's for a process that
    SIGPIPE ended (128 + 13), quietly, as for any filter cut short by `| head`."""
    _to_devnull(sys.__stdout__ or sys.stdout)
    sys.exit(128 + getattr(signal, "SIGPIPE", 13))


class _Group(click.Group):
    def resolve_command(self, ctx, args):
        name, cmd, args = super().resolve_command(ctx, args)
        return name, cmd, expand_tilde_options(args)

    def invoke(self, ctx):
        try:
            with _stop_signals_raise():
                return super().invoke(ctx)
        except DFlashError as e:
            click.echo(f"error: {_one_line(e)}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"error: {_usage_error_line(e)}", err=True)
            sys.exit(EXIT_INPUT)
        except Terminated as e:
            click.echo("terminated", err=True)
            sys.exit(128 + e.args[0])
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except _StdoutClosed:
            _stdout_gone()
        except OSError as e:
            if isinstance(e, BrokenPipeError) and _stdout_reader_gone():
                _stdout_gone()  # a writer that bypasses sys.stdout (click re-encodes an ASCII stdout as UTF-8)
            # A path the user gave that cannot be read or written (no such directory, a file where a directory must
            # be, no permission, a full disk): name the file, no traceback.
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"error: {where}{_one_line(e.strerror or e)}", err=True)
            sys.exit(EXIT_INPUT)
        except (click.exceptions.Exit, click.Abort):
            raise  # click's own control flow (--help, ctx.exit, EOF at a prompt)
        except Exception as e:  # noqa: BLE001 -- the last resort: a bug, not bad input
            hint = install_hint(e.name) if isinstance(e, ModuleNotFoundError) else None
            if hint:  # an optional library this command needs (environment.LIBRARIES): how to install it
                click.echo(f"error: {e.name}: not installed; this command needs it: {hint}", err=True)
                sys.exit(EXIT_INPUT)
            if os.environ.get("DFLASH_EXPORT_TRACEBACK"):
                raise
            import tempfile
            import traceback

            fd, log = tempfile.mkstemp(prefix="dflash-export-", suffix=".traceback.txt")
            with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
                traceback.print_exc(file=f)
            click.echo(f"error: internal error, {type(e).__name__}: {_one_line(e)[:300]} (traceback in {log}; "
                       "DFLASH_EXPORT_TRACEBACK=1 shows it here)", err=True)
            sys.exit(EXIT_INTERNAL)


# The command list: each command's summary (what `dflash-export --help` lists, never cut) and one example (the end of
# its own --help). tests/test_cli.py parses every example with the command it belongs to.
COMMANDS = {
    "inspect": ("Lint a drafter against its target (exit 2 on any error).",
                "dflash-export inspect --recipe smollm2-135m"),
    "build": ("Build an engine directory (reused when its inputs are unchanged).",
              "dflash-export build --recipe smollm2-135m --precision int4"),
    "run": ("Generate for one prompt with a built engine, streaming.",
            "dflash-export run --recipe smollm2-135m 'Name three primes.'"),
    "validate": ("Prove an engine lossless and fast; write a report and plots.",
                 "dflash-export validate --recipe smollm2-135m --num-prompts 5"),
    "serve": ("Serve an engine behind an OpenAI-compatible HTTP port.",
              "dflash-export serve --engine engines/smollm2-135m/onnxruntime --port 8000"),
    "deploy": ("Write a Triton model repository for an engine.",
               "dflash-export deploy --engine engines/smollm2-135m/onnxruntime --repo triton_repo"),
    "demo": ("Lint, build and generate with the embedded default pair.",
             "dflash-export demo --prompt 'Name three primes.'"),
    "bench": ("Benchmark DFlash against plain decoding and the references.",
              "dflash-export bench --recipe smollm2-135m --num-prompts 5 --modes dflash,ar"),
    "reference": ("Run the PyTorch reference (DFlash and plain) on a pair.",
                  "dflash-export reference --recipe tiny-qwen3 --prompt 'Hello'"),
    "export": ("Write a pair's two ONNX graphs (no engine).",
               "dflash-export export --recipe tiny-qwen3 --out exported/tiny-qwen3"),
    "train": ("Train a recipe's drafter on its target's own answers.",
              "dflash-export train --recipe smollm2-135m --data-only --threads 1"),
    "recipes": ("List the shipped recipes, one line each.", "dflash-export recipes"),
    "env": ("Report the backends installed, the CPU's ISA and the GPU.", "dflash-export env"),
}


def _with_summary_and_example(cmd: click.Command, name: str) -> click.Command:
    summary, example = COMMANDS[name]
    cmd.short_help = summary
    cmd.epilog = f"\b\nExample:\n  {example}"
    return cmd


class _Main(_Group):
    def main(self, *args, **kwargs):
        """Every command (and --help, --version, a usage error) under _outputs; a closed stdout ends it as
        _stdout_gone says, here as well as in a command (click writes --help before any command runs)."""
        try:
            with _outputs():
                return super().main(*args, **kwargs)
        except _StdoutClosed:
            _stdout_gone()

    def list_commands(self, ctx):  # the user's path first (COMMANDS' order), not the alphabet
        order = list(COMMANDS)
        return sorted(super().list_commands(ctx), key=lambda n: order.index(n) if n in order else len(order))


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=f"\b\nExample (the embedded default pair, CPU):\n  dflash-export build --recipe smollm2-135m\n"
                    f"  dflash-export validate --recipe smollm2-135m\n"
                    f"  dflash-export serve --engine engines/smollm2-135m/onnxruntime\n\n{EXIT_CODES_HELP}")
@click.version_option(__version__, prog_name="dflash-export")
def main():
    """Export, compile, validate and deploy DFlash speculative decoding engines.

    DFlash drafts a block of tokens in one pass of a small drafter conditioned on the target's hidden states; the
    target verifies the block in one pass. τ (tau) = tokens committed per target verify pass (plain decoding: 1)."""


@main.command()
@click.argument("drafter_arg", metavar="[DRAFTER]", required=False)
@recipe_options
@click.option("--json", "as_json", is_flag=True, help="Print the findings and summary as JSON.")
def inspect(drafter_arg, recipe, target, drafter, as_json):
    """Lint a drafter checkpoint against its target and print a summary (exit 2 on any error).

    The pair: --recipe NAME, or DRAFTER (a checkpoint directory) with --target, or --target and --drafter."""
    from dflash_export.models.cli import run_inspect
    from dflash_export.recipes import recipe_from_options

    if drafter_arg and drafter:
        raise DFlashError("give the drafter once: as DRAFTER or as --drafter", field="--drafter")
    if recipe is None and not (target and (drafter or drafter_arg)):
        raise DFlashError("give --recipe NAME, or DRAFTER and --target TARGET", field="--recipe")
    r = recipe_from_options(recipe, target, drafter or drafter_arg)
    sys.exit(run_inspect(r.drafter_path, r.target_path, as_json))


@main.command()
def recipes():
    """List the recipes in recipes/: name, then what the pair is (and the environment variables it still needs)."""
    from dflash_export.recipes import list_recipes, load_recipe

    names = list_recipes()
    width = max(len(n) for n in names)
    for name in names:
        try:
            r = load_recipe(name)
        except DFlashError as e:
            click.echo(f"{name:{width}}  (unreadable: {_one_line(e)})")
            continue
        missing = r.missing_environment()
        needs = f"  [set {', '.join('$' + var for var, _ in missing)}]" if missing else ""
        click.echo(f"{name:{width}}  {_one_line(r.description) or r.target}{needs}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def env(as_json):
    """What this environment can run: the engine backends installed, each optional library (and the line that
    installs it), the CPU and the instruction-set features its kernels dispatch on, the NVIDIA GPU or none, and
    where the cache is (converted targets, generated data, `serve --engine`'s model repositories, the serve stub's
    numpy; DFLASH_CACHE moves it)."""
    import json
    import platform

    from dflash_export.engines.numerics import cpu_features, isa_label
    from dflash_export.environment import LIBRARIES, backends_installed, gpus, installed_version
    from dflash_export.files import cache_root

    cpu = cpu_features()
    try:
        cache = str(cache_root())
    except DFlashError as e:
        cache = f"none ({_one_line(e)})"
    report = {"dflash_export": __version__, "python": f"{platform.python_version()} ({sys.executable})",
              "cache": cache,
              "cpu": {**cpu, "label": isa_label(cpu["isa"])}, "gpu": gpus(), "backends": backends_installed(),
              "libraries": {lib.dist: {"version": installed_version(lib), "needed_by": lib.needed_by,
                                       "install": lib.install} for lib in LIBRARIES}}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"dflash-export {__version__}, Python {report['python']}")
    click.echo(f"cache: {cache}" + ("" if cache.startswith("none (") else " (DFLASH_CACHE moves it)"))
    click.echo(f"CPU: {cpu['model']} ({cpu['machine']}), {report['cpu']['label']}: {' '.join(cpu['isa'])}")
    click.echo(f"GPU: {', '.join(report['gpu']) if report['gpu'] else 'none (no NVIDIA GPU seen by nvidia-smi)'}")
    click.echo("backends: " + "; ".join(f"{b} {state}" for b, state in report["backends"].items()))
    click.echo("libraries:")
    width = max(len(lib.dist) for lib in LIBRARIES)
    for lib in LIBRARIES:
        version = installed_version(lib)
        install = "" if version else f"; install: {lib.install}"
        click.echo(f"  {lib.dist:{width}}  {version or 'missing':12}  for {lib.needed_by}{install}")


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

for _name, _cmd in main.commands.items():
    if _name in COMMANDS:  # a command missing there fails tests/test_cli.py, not the CLI
        _with_summary_and_example(_cmd, _name)

if _loading and signal.getsignal(signal.SIGINT) is _interrupted_while_loading:
    signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    main()
