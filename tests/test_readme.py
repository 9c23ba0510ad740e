"""The README's commands run verbatim: every ```bash line and ```python block of README.md, in order, from the
repository root (`./dev test` excepted: it is this suite). A `dflash-export serve` line starts the server in the
background (the README says to run the client in another terminal); it is stopped at the end."""

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
