"""The README's install line, run verbatim in a fresh virtual environment from a copy of the repository, gives a
package whose commands all run: `--help`, `env`, `build` + `run`, `validate` (its report's plots included) and `serve`
answering the OpenAI API. The CPU torch comes first, as the README says; from this machine's own wheel (the CPU index
the README names is not reachable from the test machines), everything else from the README's line as written."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.server]


def readme_install_line() -> str:
    """The README's `pip install -e ".[all]" ...` line."""
    found = re.findall(r"^(pip install -e \"\.\[all\]\".*)$", (ROOT / "README.md").read_text(), re.M)
    assert len(found) == 1, found
    return found[0].strip()


def _copy_repository(to: Path) -> None:
    """The tracked files (what a fresh clone holds), else the tree without environments and build outputs."""
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if r.returncode == 0 and r.stdout:
        for rel in r.stdout.decode().split("\0"):
            if rel and (ROOT / rel).is_file():
                (to / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, to / rel)
        return
    shutil.copytree(ROOT, to, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
        ".venv", "engines", "reports", "*.egg-info", "__pycache__", ".pytest_cache", ".git"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_install_line_gives_every_command(tmp_path):
    src, venv = tmp_path / "src", tmp_path / "venv"
    src.mkdir()
    _copy_repository(src)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(venv), OMP_NUM_THREADS="1")

    def sh(cmd: str, cwd: Path = tmp_path, timeout: float = 1800):
        r = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{cmd!r} exited {r.returncode}: {r.stdout[-1500:]} {r.stderr[-3000:]}"
        return r

    sh('pip install -q "torch==2.13.0"')
    sh(readme_install_line(), cwd=src)
    exe = venv / "bin" / "dflash-export"
    assert exe.is_file()

    top = sh(f"{exe} --help").stdout
    for name in ("inspect", "build", "run", "validate", "serve", "deploy", "demo", "recipes", "env"):
        assert f"\n  {name} " in top, name
    report = json.loads(sh(f"{exe} env --json").stdout)
    assert report["backends"]["onnxruntime"] == "yes", report["backends"]
    missing = [d for d, lib in report["libraries"].items() if lib["version"] is None
               and d not in ("triton", "tensorrt", "tensorrt-llm")]  # the GPU backends' libraries: not in [all]
    assert missing == [], missing

    engines = tmp_path / "engines"
    sh(f"{exe} build --recipe tiny-qwen3 --out {engines}")
    engine = engines / "tiny-qwen3" / "onnxruntime"
    run = sh(f"{exe} run --engine {engine} --max-new-tokens 8 'hello'")
    assert "tokens per target pass" in run.stderr

    sh(f"{exe} validate --help")
    rep = tmp_path / "rep"
    sh(f"{exe} validate --recipe tiny-qwen3 --engine {engine} --num-prompts 1 --max-new-tokens 8 --dist-samples 5 "
       f"--report {rep}")
    assert (rep / "report.md").is_file() and (rep / "speedup_per_prompt.png").is_file()

    sh(f"{exe} serve --help")
    port = _free_port()
    args = [str(exe), "serve", "--engine", str(engine), "--port", str(port)]
    if "--metrics-port" in sh(f"{exe} serve --help").stdout:  # tritonserver's own ports, where serve takes them
        args += ["--metrics-port", str(_free_port())]
    server = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        deadline, line = time.monotonic() + 300, ""
        while time.monotonic() < deadline and not line.startswith("ready:"):
            line = server.stdout.readline()
            assert line or server.poll() is None, f"serve exited before it was ready: {server.stderr.read()[-3000:]}"
        assert line.startswith("ready:"), line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == "tiny-qwen3"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(timeout=180) == 0
