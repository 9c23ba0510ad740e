"""benchmarks/ortgenai_peer/run.py's pure parts, without ONNX Runtime GenAI installed: the n-gram grid, decode rates,
identical counts, the summary's medians and within-round ratios (checked against figures worked out by hand), the
table, the targets' verdicts, the venv's pins; and that the script imports nothing outside the standard library (its
worker runs in ORT GenAI's own venv, where this package and numpy are absent)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from script_support import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "ortgenai_peer" / "run.py"


@pytest.fixture(scope="module")
def peer():
    return load_script(SCRIPT, "ortgenai_peer_run")


def test_grid_parses_settings_in_order_without_repeats(peer):
    assert peer.parse_grid("3:7, 2:4,3:7,") == [{"ngram_size": 3, "max_draft_tokens": 7},
                                                 {"ngram_size": 2, "max_draft_tokens": 4}]
    assert peer.grid_key({"ngram_size": 4, "max_draft_tokens": 16}) == "ngram:4:16"


@pytest.mark.parametrize("spec, says", [("3", "NGRAM_SIZE:MAX_DRAFT_TOKENS"), ("a:7", "NGRAM_SIZE"),
                                        ("1:7", "ngram_size must be >= 2"), ("3:17", "1..16"), ("3:0", "1..16"),
                                        (" , ", "no setting")])
def test_bad_grid_is_one_clear_error(peer, spec, says):
    with pytest.raises(SystemExit, match=says) as e:
        peer.parse_grid(spec)
    assert "--ngram-grid" in str(e.value)


def test_decode_rate_counts_tokens_after_the_first_call(peer):
    assert peer.decode_rate(128, 1, 2.54) == pytest.approx(127 / 2.54)
    assert peer.decode_rate(1, 1, 0.5) == 0.0 and peer.decode_rate(5, 1, 0.0) == 0.0


def _run(tokens, tok_s, tau=1.0):
    return {"tokens": tokens, "tok_s": tok_s, "tau": tau}


def _rounds():
    """Two rounds, fp32 only, two prompts; ORT GenAI's n-gram 3:7 beats 2:7 in both rounds."""
    a, b = [1, 2, 3], [4, 5]

    def one(ours_plain, ours_dfl, og_plain, og37, og27):
        return {("ours", "fp32", "plain"): [_run(a, ours_plain[0]), _run(b, ours_plain[1])],
                ("ours", "fp32", "dflash"): [_run(a, ours_dfl[0], 2.0), _run([4, 6], ours_dfl[1], 3.0)],
                ("ortgenai", "fp32", "plain"): [_run(a, og_plain[0]), _run(b, og_plain[1])],
                ("ortgenai", "fp32", "ngram:3:7"): [_run(a, og37[0], 1.5), _run(b, og37[1], 1.7)],
                ("ortgenai", "fp32", "ngram:2:7"): [_run([9], og27[0]), _run(b, og27[1])]}

    return [one((10, 12), (20, 22), (10, 10), (14, 16), (11, 11)),
            one((8, 10), (18, 18), (9, 9), (12, 12), (10, 10))]


def test_summary_medians_ratios_and_identical_counts(peer):
    rows = peer.summarize(_rounds(), ["fp32"], ["ngram:3:7", "ngram:2:7"], {("ours", "fp32"): 700.0,
                          ("ortgenai", "fp32"): 780.0}, {("ours", "fp32"): 594.0, ("ortgenai", "fp32"): 515.0})
    by = {(r["system"], r["mode"]): r for r in rows}
    assert [k for k in by] == [("ours", "plain"), ("ours", "dflash"), ("ortgenai", "plain"),
                               ("ortgenai", "ngram:3:7"), ("ortgenai", "ngram:2:7")]
    # per-round medians: ours plain 11 / 9, ORT GenAI plain 10 / 9, its n-gram 3:7 15 / 12 (best), 2:7 11 / 10
    assert by[("ours", "plain")]["tok_s"] == pytest.approx(10.0)
    assert by[("ours", "plain")]["vs_ortgenai_plain"] == pytest.approx((11 / 10 + 9 / 9) / 2)
    assert by[("ours", "dflash")]["vs_ortgenai_ngram"] == pytest.approx((21 / 15 + 18 / 12) / 2)
    assert by[("ortgenai", "ngram:3:7")]["best"] and not by[("ortgenai", "ngram:2:7")]["best"]
    assert by[("ortgenai", "ngram:3:7")]["vs_ortgenai_ngram"] == pytest.approx(1.0)
    # identical to own plain, from the first round: DFlash's second prompt differs, n-gram 2:7's first
    assert by[("ours", "dflash")]["identical_to_own_plain"] == 1
    assert by[("ortgenai", "ngram:3:7")]["identical_to_own_plain"] == 2
    assert by[("ortgenai", "ngram:2:7")]["identical_to_own_plain"] == 1
    assert by[("ours", "plain")]["identical_to_own_plain"] is None
    assert by[("ours", "dflash")]["tau"] == pytest.approx(2.5) and by[("ours", "dflash")]["peak_rss_mb"] == 700.0

    table = peer.render_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[3].startswith("| this project | fp32 | DFlash | 19.5 |") and "| 1/2 |" in table[3]
    assert "ngram:3:7 (best)" in table[5] and "780 (515)" in table[5]

    lines = peer.verdicts(rows, {"fp32": 78.0})
    assert "fp32: plain / ORT GenAI plain 1.050x (target >= 1.05x): met" in lines
    assert any(ln.startswith("fp32: DFlash / ORT GenAI n-gram 1.450x") and ln.endswith("met") for ln in lines)
    assert any(ln.startswith("fp32: DFlash / ORT GenAI plain") and ln.endswith("met") for ln in lines)
    assert "fp32: DFlash identical to own plain 1/2: MISSED" in lines
    assert any("peak RSS 700 MiB" in ln and "= 858)" in ln and ln.endswith("met") for ln in lines)


def test_venv_pins_this_projects_runtime_and_builder_libraries(peer):
    reqs = peer.venv_requirements("0.18.0", {"onnxruntime": "1.32.0", "torch": "2.13.0+cpu", "transformers": "5.15.0",
                                             "onnx": None})
    assert reqs == ["onnxruntime-genai==0.18.0", "onnxruntime==1.32.0", "torch==2.13.0", "transformers==5.15.0"]


def test_script_imports_only_the_standard_library():
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('p', {str(SCRIPT)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "bad = [n for n in sys.modules if n.split('.')[0] in ('dflash_export', 'numpy', 'onnxruntime')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_per_round_lines_give_each_rounds_ratios_against_the_best_setting(peer):
    lines = peer.per_round(_rounds(), ["fp32"], ["ngram:3:7", "ngram:2:7"], [12.5, 14.0])
    # round 1: plain medians 11 / 10, DFlash 21 against n-gram 3:7's 15; round 2: 9 / 9, 18 / 12
    assert lines == ["fp32 round 1: plain 1.10x ORT GenAI plain, DFlash 1.40x its n-gram 3:7 (load average 12.5)",
                     "fp32 round 2: plain 1.00x ORT GenAI plain, DFlash 1.50x its n-gram 3:7 (load average 14.0)"]


def test_per_round_lines_add_cpu_time_per_token_where_both_sides_report_it(peer):
    rounds = _rounds()[:1]
    for key, cpu in ((("ours", "fp32", "plain"), (40.0, 50.0)), (("ortgenai", "fp32", "plain"), (60.0, 40.0)),
                     (("ours", "fp32", "dflash"), (20.0, 30.0)), (("ortgenai", "fp32", "ngram:3:7"), (50.0, 50.0))):
        for run, c in zip(rounds[0][key], cpu):
            run["cpu_ms_per_token"] = c
    # medians: ours plain 45, ORT GenAI plain 50 -> 1.11x; ours DFlash 25, n-gram 3:7 50 -> 2.00x
    (line,) = peer.per_round(rounds, ["fp32"], ["ngram:3:7", "ngram:2:7"], [3.0])
    assert line == ("fp32 round 1: plain 1.10x ORT GenAI plain, DFlash 1.40x its n-gram 3:7; in CPU ms per token "
                    "1.11x and 2.00x (load average 3.0)")


def test_the_lossless_subset_compares_only_prompts_where_the_ngram_decodes_its_plain_text(peer):
    rounds = _rounds()
    # n-gram 3:7 equals its plain on both prompts in both rounds: make the second prompt differ in round 2 only
    rounds[1][("ortgenai", "fp32", "ngram:3:7")][1]["tokens"] = [4, 7]
    (line,) = peer.lossless_subset(rounds, ["fp32"], ["ngram:3:7", "ngram:2:7"])
    # prompt 0 alone: round 1 DFlash 20 / n-gram 14, round 2 18 / 12; n-gram / plain 14 / 10, 12 / 9; tau 2.0, 1.5
    dfl, gain = (20 / 14 + 18 / 12) / 2, (14 / 10 + 12 / 9) / 2
    assert line == (f"fp32: on the 1/2 prompts where ORT GenAI's n-gram 3:7 decodes its plain text: DFlash "
                    f"{dfl:.2f}x its n-gram (its n-gram {gain:.2f}x its plain); τ 2.00 against its 1.50")
    for run in rounds[0][("ortgenai", "fp32", "ngram:3:7")]:
        run["tokens"] = [0]
    assert peer.lossless_subset(rounds, ["fp32"], ["ngram:3:7"]) == [
        "fp32: on the 0/2 prompts where ORT GenAI's n-gram 3:7 decodes its plain text: none"]
