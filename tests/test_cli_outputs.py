"""The CLI in the output environments scripts and CI give it: a closed pipe, a closed descriptor, an ASCII locale."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, stdout=None, stderr=None, env=None, cwd=None):
    """`python -m dflash_export ARGS` in a subprocess; stdout / stderr: "closed-pipe" (a pipe whose reader is gone),
    "closed" (the descriptor closed) or None (captured)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    streams = {}
    for name, how in (("stdout", stdout), ("stderr", stderr)):
        streams[name] = w_fd if how == "closed-pipe" else subprocess.PIPE
    argv = [sys.executable, "-m", "dflash_export", *[os.fsencode(a) if isinstance(a, bytes) else str(a) for a in args]]
    if "closed" in (stdout, stderr):  # a shell's `>&-` / `2>&-`: the child starts without the descriptor
        closes = "; ".join(f"os.close({fd})" for fd, how in ((1, stdout), (2, stderr)) if how == "closed")
        argv = [sys.executable, "-c", f"import os, sys; {closes}; os.execv(sys.executable, sys.argv[1:])", *argv]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, env=full_env, cwd=cwd, timeout=300, **streams)
    finally:
        os.close(w_fd)
    return r.returncode, (r.stdout or b"").decode(errors="replace"), (r.stderr or b"").decode(errors="replace")


def test_a_closed_stdout_pipe_ends_every_kind_of_output_quietly_with_sigpipes_status():
    # --help (written by click before any command), a plain echo, rich's table and --json: one status, no message
    for args in (["--help"], ["env"], ["env", "--json"], ["recipes"]):
        rc, _, err = _cli(*args, stdout="closed-pipe")
        assert rc == 141 and err == "", (args, rc, err)


def test_a_closed_stderr_pipe_never_stops_a_command_that_reports_progress_there(tmp_path):
    # train --data-only reports each shard on stderr: with no reader there it still writes all of its data
    recipe = tmp_path / "tiny-train.yaml"
    recipe.write_text("name: tiny-train\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n"
                      "chat_template: false\ntrain:\n  prompts: synthetic\n  num_prompts: 4\n  heldout_prompts: 1\n"
                      "  max_new_tokens: 6\n  block_size: 4\n  draft_layers: 2\n  steps: 2\n  warmup_steps: 2\n"
                      "  batch_size: 2\n  blocks_per_seq: 2\n")
    rc, out, _ = _cli("train", "--recipe", recipe, "--work-dir", tmp_path / "w", "--data-only", "--threads", "1",
                      stderr="closed-pipe", env={"DFLASH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    assert rc == 0, out
    shards = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file())
    rc, _, err = _cli("train", "--recipe", recipe, "--work-dir", tmp_path / "w2", "--data-only", "--threads", "1",
                      env={"DFLASH_CACHE": str(tmp_path / "cache2"), "OMP_NUM_THREADS": "1"})
    assert rc == 0, err
    assert shards == sorted(p.name for p in (tmp_path / "cache2").rglob("*") if p.is_file())


def test_a_closed_stdout_descriptor_discards_the_output_of_run(tmp_path):
    # run streams its text with sys.stdout.write: with no stdout at all the text is dropped, the run completes
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.recipes import load_recipe

    engine = build_onnxruntime(load_recipe("tiny-qwen3"), tmp_path / "engine", threads=1)
    rc, _, err = _cli("run", "--engine", engine, "--max-new-tokens", "4", "hello", stdout="closed",
                      env={"OMP_NUM_THREADS": "1"})
    assert rc == 0 and "internal error" not in err and "tokens" in err, err


def test_output_the_locale_cannot_encode_is_escaped_and_a_utf8_argument_is_read_under_an_ascii_locale():
    # rich's table draws '…' when a description is cut; an ASCII stdout gets an escape, not a UnicodeEncodeError
    rc, out, err = _cli("recipes", env={"PYTHONIOENCODING": "ascii", "COLUMNS": "60"})
    assert rc == 0 and "Error" not in err, err
    rc, out, err = _cli("inspect", "--recipe", "tiny-qwen3", env={"PYTHONIOENCODING": "ascii", "COLUMNS": "60"})
    assert rc == 0 and "internal error" not in err, err
    # LC_ALL=C without UTF-8 mode: a UTF-8 prompt reaches Python as escaped bytes, and is still UTF-8
    ascii_locale = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    rc, _, err = _cli("run", "--engine", "/nonexistent-engine", "h\u00e9llo \U0001f642".encode(), env=ascii_locale)
    assert rc == 2 and "not valid UTF-8" not in err and "nonexistent-engine" in err, err
    rc, _, err = _cli("run", "--engine", "/nonexistent-engine", b"caf\xe9", env=ascii_locale)
    assert rc == 2 and "prompt: not valid UTF-8 (byte 0xe9 at character 3)" in err, err



def test_build_and_run_in_a_directory_the_ascii_locale_cannot_decode(tmp_path):
    # LC_ALL=C without UTF-8 mode: a directory named with a Latin-1 byte and a UTF-8 'é' reaches Python as surrogate
    # escapes, which onnx's checker and external-data files, ONNX Runtime's sessions and its optimizer's output path
    # (C++ bindings taking UTF-8 strings) cannot take; they get the same files through a descriptor on the directory.
    # The build runs inside it on relative paths (which those bindings make absolute) and quantizes its graphs there
    # (int8); the run names the engine by its absolute path.
    odd = os.fsencode(tmp_path) + b"/caf\xe9 \xc3\xa9"
    os.mkdir(odd)
    with open(odd + b"/tiny-qwen3.yaml", "wb") as f:
        f.write((ROOT / "recipes" / "tiny-qwen3.yaml").read_bytes())
    env = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "OMP_NUM_THREADS": "1",
           "DFLASH_CACHE": str(tmp_path / "cache")}
    rc, out, err = _cli("build", "--recipe", "tiny-qwen3.yaml", "--out", "engines", "--precision", "int8", env=env,
                        cwd=odd)
    assert rc == 0 and "Traceback" not in err and "built engines/tiny-qwen3/onnxruntime-int8" in out + err, (out, err)
    engine = odd + b"/engines/tiny-qwen3/onnxruntime-int8"
    rc, out, err = _cli("run", "--engine", engine, "--max-new-tokens", "4", "hello", env=env)
    assert rc == 0 and "4 tokens" in err and "Traceback" not in err, err


def test_bench_and_validate_read_and_write_in_a_directory_the_ascii_locale_cannot_decode(tmp_path):
    # LC_ALL=C without UTF-8 mode: the engine, the recipe, the suite, bench's --out and validate's --report all lie in
    # a directory whose name reaches Python as surrogate escapes. report.md (UTF-8, with its dashes and the suite's
    # path) is written whatever the locale, the path's bytes as they are on disk.
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.recipes import load_recipe

    odd = os.fsencode(tmp_path) + b"/caf\xe9 \xc3\xa9"
    os.mkdir(odd)
    engine = build_onnxruntime(load_recipe("tiny-qwen3"), Path(os.fsdecode(odd + b"/engine")), threads=1)
    for name, src in ((b"tiny-qwen3.yaml", ROOT / "recipes" / "tiny-qwen3.yaml"),
                      (b"s\xe9.jsonl", ROOT / "validate" / "tiny-random.jsonl")):
        with open(odd + b"/" + name, "wb") as f:
            f.write(src.read_bytes())
    env = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "OMP_NUM_THREADS": "1",
           "DFLASH_CACHE": str(tmp_path / "cache")}
    common = ["--recipe", odd + b"/tiny-qwen3.yaml", "--engine", os.fsencode(engine), "--suite", odd + b"/s\xe9.jsonl",
              "--num-prompts", "2", "--max-new-tokens", "4"]
    rc, out, err = _cli("bench", *common, "--modes", "dflash,ar", "--out", odd + b"/b\xe9.json", env=env)
    assert rc == 0 and "Traceback" not in err, (out, err)
    with open(odd + b"/b\xe9.json", "rb") as f:
        assert b'"summary"' in f.read()
    rc, out, err = _cli("validate", *common, "--dist-samples", "2", "--report", odd + b"/report", "--no-progress",
                        env=env)
    assert rc == 0 and "internal error" not in err and "report: " in out, (out, err)
    with open(odd + b"/report/report.md", "rb") as f:
        md = f.read()
    assert "\u2014".encode() in md and b"/caf\xe9 \xc3\xa9/s\xe9.jsonl" in md


def test_files_the_project_writes_are_utf8_under_an_ascii_locale(tmp_path):
    # LC_ALL=C without UTF-8 mode makes open()'s default encoding ASCII: a GGUF's tokenizer settings (token strings
    # are any text) and every atomic_file output (bench --out, validate reports, manifests) are written as UTF-8.
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from dflash_export.files import atomic_file\n"
        "from dflash_export.models.gguf import _write_special_tokens\n"
        "out = Path(sys.argv[1])\n"
        "class Tok:\n"
        "    def convert_ids_to_tokens(self, i):\n"
        "        return '\\u0120caf\\u00e9' if i == 5 else '<|\\u00fc|>'\n"
        "_write_special_tokens(out, {'tokenizer.ggml.bos_token_id': 5, 'tokenizer.ggml.eos_token_id': 6}, Tok())\n"
        "with atomic_file(out / 'a.txt') as f:\n"
        "    f.write('\\u00e9\\u2014\\n')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0",
           "PYTHONCOERCECLOCALE": "0"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    cfg = json.loads((tmp_path / "tokenizer_config.json").read_bytes().decode("utf-8"))
    assert cfg["bos_token"] == "\u0120caf\u00e9" and cfg["eos_token"] == "<|\u00fc|>"
    assert json.loads((tmp_path / "special_tokens_map.json").read_bytes())["bos_token"] == "\u0120caf\u00e9"
    assert (tmp_path / "a.txt").read_bytes() == "\u00e9\u2014\n".encode()
