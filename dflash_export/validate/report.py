"""Report files of a validation: report.json (every figure), report.md (the ten-second summary) and three PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_export.errors import DFlashError
from dflash_export.files import check_output_dir, removing_new_dirs
from dflash_export.validate.runner import ValidationReport

PLOTS = {"tau_histogram": "tau_histogram.png", "speedup_per_prompt": "speedup_per_prompt.png",
         "tokens_per_s": "tokens_per_s.png"}
# Every file of a report, by name: report.json, report.md and the plots.
REPORT_FILES = {"json": "report.json", "md": "report.md", **PLOTS}


def check_report_dir(report_dir) -> None:
    """A report directory that can take the report, refused before any work when it cannot: besides being a writable
    directory (files.check_output_dir), none of the report's file names may be taken there by something a file
    cannot replace (a directory), which would fail the report's last step with some of its files already moved."""
    check_output_dir(report_dir, "--report")
    _check_report_files_free(Path(report_dir))


def _check_report_files_free(out: Path) -> None:
    """Refuse a report directory where one of the report's file names is a directory (no file can replace it)."""
    taken = next((out / n for n in REPORT_FILES.values() if (out / n).is_dir()), None)
    if taken is not None:
        raise DFlashError("is a directory where the report writes a file; move it or choose another --report",
                          path=taken, field="--report")


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e-2 and v != 0 else f"{v:.2f}"


def _cell(text) -> str:
    """Text made safe for one markdown table cell: no line break, no unescaped column bar."""
    return str(text).replace("\r", "⏎").replace("\n", "⏎").replace("|", "\\|")


def _quote(text: str) -> str:
    """A decoded snippet as code in one markdown table cell."""
    if not text:
        return ""
    return " `" + _cell(text).replace("`", "'") + "`"


def summary_rows(report: ValidationReport) -> list[tuple[str, str, str, str]]:
    """(check, value, threshold, status) rows shared by report.md and the terminal summary."""
    rows = []
    for t in report.thresholds:
        status = "PASS" if t["passed"] else "FAIL"
        threshold = f"{t['op']} {_fmt(t['threshold'])}"
        if t["name"] == "speedup_vs_ar" and t["value"] < 1.0:  # said even when a recipe's lower floor lets it pass
            threshold += "  (DFlash slower than plain decoding on this engine)"
        rows.append((t["name"], _fmt(t["value"]), threshold, status))
    return rows


def render_markdown(report: ValidationReport) -> str:
    d = report.to_dict()
    g, a, s, dist = d["greedy"], d["acceptance"], d["speed"], d["distribution"]
    cm = s["cost_model"]
    lines = [
        f"# dflash-export validate: {report.recipe} ({report.engine.get('name') or report.engine.get('backend')}) — "
        f"**{'PASS' if report.passed else 'FAIL'}**",
        "",
        f"Suite `{report.suite.get('name', '?')}`, {g['prompts']} prompts, {report.options['max_new_tokens']} new "
        f"tokens, block size {a['block_size']}; timings are medians over prompts of {report.options['repeats']} "
        "run(s) each, after warm-up.",
        "",
        "| check | value | threshold | status |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c} | {v} | {t} | {st} |" for c, v, t, st in summary_rows(report)]
    lines += [
        "",
        "| figure | engine DFlash | engine AR | reference spec | reference AR |",
        "|---|---|---|---|---|",
        f"| tokens/s (median) | {s['engine_dflash_tok_s']:.1f} | {s['engine_ar_tok_s']:.1f} | "
        f"{s['reference_spec_tok_s']:.1f} | {s['reference_ar_tok_s']:.1f} |",
        f"| ms per output token (median) | {s['engine_dflash_tpot_ms']:.2f} | {s['engine_ar_tpot_ms']:.2f} | "
        f"{s['reference_spec_tpot_ms']:.2f} | {s['reference_ar_tpot_ms']:.2f} |",
        f"| identical to reference AR | {g['identical_fraction']:.0%} | {g['engine_ar_identical_fraction']:.0%} | "
        f"{g['reference_spec_identical_fraction']:.0%} | 100% |",
        "",
        f"τ {a['tau']:.2f} tokens per target pass ({g.get('tau_counts', '?')}; greedy; online {a['tau_online']:.2f}: "
        f"judged against the reference's own next tokens) over {a['steps']} steps of {g['prompts']} prompts; "
        "prompt lookup would reach τ "
        f"{a.get('tau_prompt_lookup', 1.0):.2f} on the same output tokens (yardstick, full blocks). "
        "A DFlash step costs "
        f"{cm['draft_ms']:.2f} ms draft ({cm.get('drafts_per_step', 1.0):.2f} drafts per step) + "
        f"{cm['verify_ms']:.2f} ms verify + {cm['dflash_overhead_ms']:.2f} ms loop = "
        f"{cm['step_ms']:.2f} ms and commits τ tokens ({cm['ms_per_token_dflash']:.2f} ms/token); an AR step costs "
        f"{cm['ar_decode_ms']:.2f} ms decode + {cm['ar_overhead_ms']:.2f} ms loop = {cm['ar_step_ms']:.2f} ms/token. "
        f"τ × AR step / DFlash step = {cm['predicted_speedup_vs_ar']:.2f}× (engine calls alone: "
        f"{cm['engine_calls_only_speedup_vs_ar']:.2f}×); measured {cm['measured_decode_speedup_vs_ar']:.2f}× per "
        "decoded token.",
        "",
    ]
    agree = g.get("reference_agreement")
    precision = (report.engine.get("manifest") or {}).get("precision")
    if agree and precision:
        margins = [f"{m:.2f}" for m in agree["logit_margins"] if m is not None]
        divs = [d for d in agree["first_divergences"] if d is not None]
        lines += [f"Weights {', '.join(f'{k} {v}' for k, v in precision.items())}; greedy output judged against "
                  f"{g.get('judged_against', 'the reference')}. Engine plain decoding vs the fp32 reference: "
                  f"{agree['engine_ar_identical']}/{agree['prompts']} prompts identical"
                  + (f"; first divergences at tokens {divs}, reference logit margins there {margins}" if divs else "")
                  + ".", ""]
    machine = report.environment.get("machine", {})
    cpu = machine.get("cpu") or {}
    lines += [f"Machine: {cpu.get('model', machine.get('processor', '?'))}, {machine.get('cpu_count')} CPUs, ISA "
              f"{' '.join(cpu.get('isa', [])) or '?'}."
              + (f" Kernel numerics: {g['numerics']['statement']}." if g.get("numerics") else ""), ""]
    if dist.get("ran"):
        lines.append(f"T={dist['temperature']} losslessness: {dist['test']}; {dist['tested_tokens']} tokens from "
                     f"{dist['samples_per_prompt']} seeds × {len(dist['prompts'])} prompts (top-k {dist['top_k']}, "
                     f"top-p {dist['top_p']}), G = {dist['g']:.1f} over {dist['prefixes']} prefixes "
                     f"(null {dist['null_mean']:.1f} ± {dist['null_sd']:.1f}), p = {dist['p_value']:.3g}.")
    else:
        lines.append(f"T>0 check not run ({dist.get('reason', '')}).")
    bad = [r for r in g["per_prompt"] if not r["identical"]]
    if bad:
        lines += ["", "| prompt | first divergence | diagnosis | engine tokens | reference tokens |",
                  "|---|---|---|---|---|"]
        for r in bad[:10]:
            w = r["around_divergence"]
            lines.append(f"| {_cell(r['id'])} | {r['first_divergence']} | {r['diagnosis']} | {w['engine']}"
                         f"{_quote(w['engine_text'])} | {w['reference']}{_quote(w['reference_text'])} |")
    lines += ["", "Plots: " + ", ".join(f"[{k}]({v})" for k, v in PLOTS.items()), ""]
    return "\n".join(lines)


def _plots(report: ValidationReport, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, s = report.acceptance, report.speed
    ks = [int(k) for k in a["histogram"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    ax.bar([k - width / 2 for k in ks], list(a["histogram"].values()), width, label=f"engine (τ {a['tau']:.2f})")
    ax.bar([k + width / 2 for k in ks], list(a["histogram_online"].values()), width,
           label=f"online (τ {a['tau_online']:.2f})")
    ax.set_xlabel("tokens committed per step (accepted + bonus)")
    ax.set_ylabel("steps")
    ax.set_xticks(ks)
    ax.set_title(f"{report.recipe}: acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / PLOTS["tau_histogram"], dpi=100)
    plt.close(fig)

    per = s["per_prompt"]
    ids = [str(p["id"])[:12] for p in per]
    # First panel: what matters, DFlash against plain decoding on the same engine; the PyTorch reference (often
    # 10-30x slower) gets its own axis so it cannot flatten the first.
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.35 * len(per) + 2), 6), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})
    x = list(range(len(per)))
    vs_ar = [p["speedup_vs_ar"] for p in per]
    ax.bar(x, vs_ar, 0.6, color=["tab:blue" if v >= 1 else "tab:red" for v in vs_ar])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("DFlash / plain decoding\n(same engine, tok/s)")
    # Two short lines: one line of this length is cut at the narrowest figure width (6 in, up to 11 prompts).
    ax.set_title(f"{report.recipe}: DFlash speedup per prompt\nover plain decoding (median {s['speedup_vs_ar']:.2f}x)",
                 fontsize=11)
    ax2.bar(x, [p["speedup_vs_reference"] for p in per], 0.6, color="tab:cyan")
    ax2.set_ylabel("vs PyTorch\nreference spec")
    ax2.set_xticks(x)
    # Prompt ids are the suite's text: shown as written, never parsed as mathtext (an unmatched `$` or an unknown
    # `\command` there would fail the plot after the whole run).
    ax2.set_xticklabels(ids, rotation=60, ha="right", fontsize=7, parse_math=False)
    fig.tight_layout()
    fig.savefig(out / PLOTS["speedup_per_prompt"], dpi=100)
    plt.close(fig)

    labels = ["engine\nDFlash", "engine\nAR", "reference\nspec", "reference\nAR"]
    vals = [s["engine_dflash_tok_s"], s["engine_ar_tok_s"], s["reference_spec_tok_s"], s["reference_ar_tok_s"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, vals, color=["tab:blue", "tab:orange", "tab:cyan", "tab:red"])
    ax.set_ylabel("tokens/s (median over prompts)")
    ax.set_title(f"{report.recipe}: throughput, DFlash vs AR")
    fig.tight_layout()
    fig.savefig(out / PLOTS["tokens_per_s"], dpi=100)
    plt.close(fig)


def write_report(report: ValidationReport, out_dir) -> dict[str, Path]:
    """Write report.json, report.md and the plots into `out_dir` (created); returns their paths by name.

    All of them are written into a temporary directory inside `out_dir` first and moved into place only once every one
    is whole: an interrupted or failed write (a full disk) leaves the earlier report as it was, or no directory, never
    a new report.json beside older or missing plots."""
    import os
    import shutil
    import tempfile

    out = Path(out_dir)
    names = REPORT_FILES
    try:
        with removing_new_dirs(out):
            out.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".report.tmp-{os.getpid()}-", dir=out))
            try:
                (staging / names["json"]).write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n",
                                                     encoding="utf-8")
                # UTF-8 whatever the locale; a path's undecodable bytes (the suite's) written as they were
                (staging / names["md"]).write_text(render_markdown(report), encoding="utf-8", errors="surrogateescape")
                _plots(report, staging)
                _check_report_files_free(out)  # again before the first move: a report is replaced whole or not at all
                for name in names.values():  # created by open(): the umask's modes, as written in place
                    os.replace(staging / name, out / name)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        raise DFlashError(f"cannot write the report ({e.strerror or e})", path=out, field="--report") from None
    return {k: out / v for k, v in names.items()}
