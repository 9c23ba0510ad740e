"""The README's commands run verbatim: every ```bash line and ```python block of README.md, in order, from the
repository root (`./dev test` excepted: it is this suite). A `dflash-export serve` line starts the server in the
background (the README says to run the client in another terminal); it is stopped at the end. Every command line of
README.md, docs/*.md and recipes/*/README.md parses: its command and options exist, its values are accepted, the
scripts it names exist."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

def readme_steps() -> list[tuple[str, str]]:
    steps = []
    for lang, code in re.findall(r"```(bash|python)\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        if lang == "python":
            steps.append(("python", code))
            continue
        for cmd in re.sub(r"\\\n\s*", " ", code).splitlines():
            cmd = cmd.strip()
            if cmd and not cmd.startswith("#"):
                steps.append(("bash", cmd))
    return steps


def test_readme_has_the_two_commands_and_a_served_example():
    cmds = [c for kind, c in readme_steps() if kind == "bash"]
    assert cmds[:2] == ["./dev demo", "./dev test"]
    assert any(" serve " in c for c in cmds) and any(c.startswith("curl ") for c in cmds)


def test_readme_published_pair_and_install_lines_parse():
    """The ```sh blocks (the published pair, which needs its weights; the install lines) are not run here, but every
    `dflash-export` line in them must parse with the command it names, and the pair's engine path must be the one
    its build writes."""
    from dflash_export.cli import main

    lines = [ln.strip() for block in re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
             for ln in block.splitlines() if ln.strip().startswith("dflash-export ")]
    assert [ln.split()[1] for ln in lines] == ["inspect", "build", "validate", "serve"]
    for ln in lines:
        words = shlex.split(ln)
        main.commands[words[1]].make_context(words[1], words[2:])
    assert "--engine engines/qwen3-8b/onnxruntime" in lines[-1]


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").glob("*/README.md"))]
# A command at the start of a line or code span: `dflash-export COMMAND` or a script of the repository run by python,
# after environment assignments or `nice` if any.
_COMMAND = re.compile(r"(?:[A-Z_]+=\S+\s+|nice -n \d+\s+)*(?:\./|\.venv/bin/)?"
                      r"(?:dflash-export\s+[a-z]|python3?\s+(?:benchmarks|scripts|recipes|tests)/)")


def doc_commands() -> list[tuple[str, bool, list[str]]]:
    """Every command of README.md, docs/*.md and recipes/*/README.md as (where, whole, words): the lines of fenced
    blocks (continuations joined, the shell variables the file's blocks set expanded, a trailing `&` dropped; whole
    commands) and the inline code spans that start with one (these may name an option without what the command
    requires). `...` elides options, `[x]` marks x optional and `a|b` lists alternatives: one word list per
    alternative."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        fences = list(re.finditer(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M))
        shell_vars = {}
        for block in fences:
            for line in block.group(1).splitlines():
                if re.match(r"[A-Z]+=", line):  # E=...; S="..."
                    for word in shlex.split(line):
                        name, _, value = word.rstrip(";").partition("=")
                        shell_vars[name] = value

        def expand(s: str) -> str:
            return re.sub(r"\$([A-Z]+)\b", lambda m: shell_vars.get(m.group(1), m.group(0)), s)

        spans = []
        for block in fences:
            first = text.count("\n", 0, block.start(1)) + 1
            lines = block.group(1).splitlines()
            i = 0
            while i < len(lines):
                where, line = first + i, lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                i += 1
                line = re.sub(r"\s+&$", "", expand(re.split(r"\s+#\s", line.strip())[0]))  # `cmd &`: cmd
                if _COMMAND.match(line):
                    spans.append((where, True, line))
        prose = re.sub(r"^```[a-z]*\n.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for m in re.finditer(r"`([^`]+)`", prose):
            span = expand(" ".join(m.group(1).replace("\\|", "|").split()))
            if _COMMAND.match(span):
                spans.append((prose.count("\n", 0, m.start()) + 1, False, span))
        for line_no, whole, span in spans:
            words = [w.replace("[", "").replace("]", "") for w in shlex.split(span) if w != "..."]
            words = words[words.index(next(w for w in words if w.endswith("dflash-export") or w.startswith("python"))):]
            for k in range(max(len(w.split("|")) for w in words)):
                found.append((f"{doc.relative_to(ROOT)}:{line_no}", whole,
                              [w.split("|")[min(k, len(w.split("|")) - 1)] for w in words]))
    return found


def test_every_command_line_of_the_docs_parses():
    """A `dflash-export` line parses with its command (options, values; a whole line lacks nothing required) and
    `bench --modes` names known modes; a script line names a file of the repository and options that script takes."""
    import click

    from dflash_export.bench.suite import MODES as BENCH_MODES
    from dflash_export.cli import main

    commands = doc_commands()
    assert len(commands) > 100, len(commands)
    wrong = []
    for where, whole, words in commands:
        if words[0].endswith("dflash-export"):
            name, args = words[1], words[2:]
            if name not in main.commands:
                wrong.append(f"{where}: no command {name!r}")
                continue
            try:
                ctx = main.commands[name].make_context(name, list(args))
            except click.MissingParameter as e:
                if whole:
                    wrong.append(f"{where}: {e.format_message()}")
                continue
            except click.ClickException as e:
                wrong.append(f"{where}: {name}: {e.format_message()}")
                continue
            if name == "bench" and "--modes" in args:
                wrong += [f"{where}: bench --modes {m}: no such mode" for m in ctx.params["modes"].split(",")
                          if m not in BENCH_MODES]
        else:
            script = ROOT / words[1]
            if not script.is_file():
                wrong.append(f"{where}: {words[1]}: no such file")
                continue
            source = script.read_text()
            wrong += [f"{where}: {words[1]} takes no {opt}" for opt in (w.split("=")[0] for w in words[2:])
                      if opt.startswith("--") and f'"{opt}"' not in source]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.smollm2
def test_readme_commands_run_verbatim():
    """The README's commands as written, on a machine where tritonserver's usual ports (8001, 8002) are taken:
    `serve` keeps tritonserver's own ports internal and picks them free."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.skip("port 8000 (the README's) is in use on this machine")
    held = []
    for port in (8001, 8002):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        except OSError:  # taken already: taken either way
            s.close()
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    server = None
    try:
        for kind, step in readme_steps():
            if step.startswith("./dev test"):
                continue  # this suite
            if kind == "python":
                r = subprocess.run([sys.executable, "-c", step], cwd=ROOT, env=env, capture_output=True, text=True,
                                   timeout=300)
                assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
            elif " serve " in step:
                server = subprocess.Popen(step, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, start_new_session=True)
                deadline, line = time.monotonic() + 300, ""
                while time.monotonic() < deadline and not line.startswith("ready:"):
                    line = server.stdout.readline()
                    assert line or server.poll() is None, f"{step!r} exited before it was ready"
                assert line.startswith("ready:"), line
            else:
                r = subprocess.run(step, shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                                   timeout=1200)
                assert r.returncode == 0, f"{step!r}: {r.stderr[-2000:]}"
                if step.startswith("curl"):
                    assert r.stdout.rstrip().endswith("data: [DONE]"), r.stdout[-500:]
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)
        for s in held:
            s.close()
