"""benchmarks/llamacpp_peer/run.py against fake llama.cpp binaries (no llama.cpp build needed): the argument lists of
its three decodings -- plain, DFlash with the drafter GGUF, prompt lookup (`--spec-type ngram-simple`, no draft model)
-- and the figures read back from what llama.cpp prints (its log lines' formats, from llama.cpp's source: `llama_perf`'s
"eval time = X ms / N runs", speculative-simple's "decoded N tokens in S seconds" and "n_predict" / "n_accept")."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from script_support import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "llamacpp_peer" / "run.py"

# Echoes the prompt and a fixed answer on stdout like llama-speculative-simple (which prints the prompt first), logs
# its argv, and prints the summary lines the benchmark parses; exits 3 when told to fail.
FAKE = """#!{python}
import json, sys
argv = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps([sys.argv[0].rsplit("/", 1)[-1], *argv]) + "\\n")
prompt = argv[argv.index("-p") + 1]
if "FAIL" in prompt:
    sys.stderr.write("error: something llama.cpp says\\n")
    sys.exit(3)
if sys.argv[0].endswith("llama-completion"):
    sys.stdout.write(" the answer")
    sys.stderr.write("llama_perf_context_print:        eval time =     500.00 ms /    20 runs   "
                     "(   25.00 ms per token)\\n")
else:
    sys.stdout.write(prompt + " the answer and more")
    sys.stderr.write("encoded   12 tokens in    0.100 seconds, speed:  120.000 t/s\\n"
                     "decoded   24 tokens in    0.800 seconds, speed:   30.000 t/s\\n\\n"
                     "n_draft   = 7\\nn_predict = 24\\nn_drafted = 35\\nn_accept  = 16\\naccept    = 45.714%\\n")
"""


@pytest.fixture(scope="module")
def peer():
    return load_script(SCRIPT, "llamacpp_peer_run")


@pytest.fixture()
def fake_bin(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "argv.jsonl"
    for name in ("llama-completion", "llama-speculative-simple"):
        path = bindir / name
        path.write_text(FAKE.format(python=sys.executable, log=str(log)))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bindir, log


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_ngram_is_llamacpp_prompt_lookup_without_a_draft_model(peer, fake_bin, tmp_path):
    bindir, log = fake_bin
    res = peer.llama_ngram(bindir, tmp_path / "t.gguf", "PROMPT", 24, 2, 512, 3, 7)
    (argv,) = _calls(log)
    assert argv[0] == "llama-speculative-simple"
    assert _opt(argv, "--spec-type") == "ngram-simple"
    assert (_opt(argv, "--spec-ngram-simple-size-n"), _opt(argv, "--spec-ngram-simple-size-m")) == ("3", "7")
    assert "-md" not in argv and "-td" not in argv
    assert (_opt(argv, "-m"), _opt(argv, "-n"), _opt(argv, "-t"), _opt(argv, "--temp"), _opt(argv, "-c")) == (
        str(tmp_path / "t.gguf"), "24", "2", "0", "512")
    assert "--no-repack" in argv
    # 24 tokens in 0.8 s; 24 committed in 24 - 16 target steps; the text after the echoed prompt
    assert res["tok_s"] == pytest.approx(30.0) and res["tau"] == pytest.approx(3.0)
    assert res["text"] == " the answer and more"
    assert res["peak_rss_mb"] > 0


def test_dflash_passes_the_drafter_and_its_draft_length(peer, fake_bin, tmp_path):
    bindir, log = fake_bin
    res = peer.llama_dflash(bindir, tmp_path / "t.gguf", tmp_path / "d.gguf", "PROMPT", 24, 2, 512, 15)
    (argv,) = _calls(log)
    assert (_opt(argv, "--spec-type"), _opt(argv, "-md"), _opt(argv, "--spec-draft-n-max"), _opt(argv, "-td")) == (
        "draft-dflash", str(tmp_path / "d.gguf"), "15", "2")
    assert res["tok_s"] == pytest.approx(30.0) and res["tau"] == pytest.approx(3.0)


def test_plain_reads_llama_perf_eval_time(peer, fake_bin, tmp_path):
    bindir, log = fake_bin
    res = peer.llama_plain(bindir, tmp_path / "t.gguf", "PROMPT", 24, 2, 512)
    (argv,) = _calls(log)
    assert argv[0] == "llama-completion" and "--spec-type" not in argv
    assert res["tok_s"] == pytest.approx(40.0) and res["tau"] == 1.0 and res["text"] == " the answer"


def test_a_failing_llamacpp_run_is_one_error_with_its_message(peer, fake_bin, tmp_path):
    bindir, _ = fake_bin
    with pytest.raises(RuntimeError, match="llama-speculative-simple failed: .*something llama.cpp says"):
        peer.llama_ngram(bindir, tmp_path / "t.gguf", "FAIL", 24, 2, 512, 3, 7)


@pytest.mark.parametrize("spec, want", [("3", (3, None)), ("4:15", (4, 15))])
def test_ngram_setting_parses(peer, spec, want):
    assert peer.parse_ngram(spec) == want


@pytest.mark.parametrize("spec", ["", "0", "a", "3:0", "3:2000", "1:2:3"])
def test_bad_ngram_setting_is_one_clear_error(peer, spec):
    with pytest.raises(SystemExit, match="--llama-ngram: expected N or N:M"):
        peer.parse_ngram(spec)
