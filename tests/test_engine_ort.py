"""The ONNX Runtime engine driven by the runtime: lossless against the PyTorch reference, same behaviour as
TorchEngine step by step, no torch at serving time, and refusal of engines that do not match their manifest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from target_support import assert_as_plain

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.manifest import read_manifest
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError
from dflash_export.runtime.single import DFlashRuntime

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 41)), [7], [200, 13, 13, 13, 99, 5, 64, 65],
           [3 + (i * 7) % 200 for i in range(250)]]  # the last one runs past 256 tokens


@pytest.fixture(scope="module")
def built(ort_pair):
    return ort_pair


def test_engine_dir_has_manifest_and_one_shared_weight_file(built):
    recipe, out, eng, _ = built
    m = read_manifest(out)
    assert m.backend == "onnxruntime" and m.recipe == recipe.name
    for key in ("recipe_path", "inputs", "block_size", "target_layer_ids", "mask_token_id", "max_seq_len",
                "stop_token_ids", "vocab_size", "dtypes", "flags"):
        assert key in m.raw, key
    names = {p.name for p in out.iterdir()}
    assert {"target.onnx", "drafter.onnx", "lm_head.onnx", "shared_weights.bin", "codec.json", "manifest.json"} <= names
    assert not any(n.startswith("target_verify") for n in names)  # the export's portable graph is not shipped
    assert eng.info.block_size == m.block_size and eng.info.max_seq_len == recipe.max_seq_len
    import onnx

    shared_users = {}
    for fname in ("target.onnx", "drafter.onnx", "lm_head.onnx"):  # optimized graphs point at the one shared file
        model = onnx.load(str(out / fname), load_external_data=False)
        locs = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in model.graph.initializer}
        assert all((v == "shared_weights.bin") == k.startswith("shared.") for k, v in locs.items() if v)
        shared_users[fname] = sorted(k for k in locs if k.startswith("shared."))
    # only the LM head session holds a vocabulary-sized matrix; embedding rows are read from the file on demand
    assert shared_users["target.onnx"] == shared_users["drafter.onnx"] == [] and len(shared_users["lm_head.onnx"]) == 1


def test_greedy_dflash_and_ar_equal_reference_ar(built):
    """Plain decoding on the engine gives the reference's tokens; DFlash gives plain decoding's, as the engine's
    numerics probe states for this CPU (target_support.assert_as_plain)."""
    from dflash_export.runtime.reference import ar_generate

    _, _, eng, torch_eng = built
    rt = DFlashRuntime(eng)
    for prompt in PROMPTS:
        ref = ar_generate(torch_eng.target, prompt, 48)
        sp = SamplingParams(max_new_tokens=48)
        assert rt.generate(prompt, sp, "ar").tokens == ref.tokens, prompt
        assert_as_plain(eng, prompt, rt.generate(prompt, sp, "dflash").tokens, ref.tokens)


def test_steps_match_torch_engine_with_accepting_blocks(built):
    """The tiny drafter is random (it rarely gets accepted), so blocks here come from the reference continuation with
    one token corrupted at a random slot: accept lengths 0..bs-1 and every commit/crop path get exercised."""
    from dflash_export.runtime.reference import ar_generate

    _, _, eng, torch_eng = built
    bs = eng.info.block_size
    rng = np.random.default_rng(0)
    prompt = list(range(30, 49))
    cont = ar_generate(torch_eng.target, prompt, 200).tokens
    sp = SamplingParams()
    seqs = [e.new_sequence() for e in (eng, torch_eng)]
    first = [e.prefill(s, np.array(prompt)) for e, s in zip((eng, torch_eng), seqs)]
    np.testing.assert_allclose(first[0], first[1], atol=1e-4)
    done, accepts = 0, set()
    while done + bs < len(cont) - 1:
        # pending context features: the engine's fused ctx == the reference drafter's fc + hidden_norm of the taps
        import torch

        with torch.inference_mode():
            ref_ctx = torch_eng.drafter.project_context(seqs[1].taps).numpy()
        np.testing.assert_allclose(seqs[0].ctx, ref_ctx, atol=1e-4, rtol=0)
        anchor = cont[done]
        drafts = [e.draft(s, anchor, sp, None)[0] for e, s in zip((eng, torch_eng), seqs)]
        np.testing.assert_array_equal(drafts[0], drafts[1])
        block = np.array(cont[done: done + bs], np.int64)
        k = int(rng.integers(1, bs + 1))
        if k < bs:
            block[k] = (block[k] + 1) % (eng.info.vocab_size - 2)
        results = [e.verify(s, block, None, sp, None) for e, s in zip((eng, torch_eng), seqs)]
        assert results[0] == results[1]
        accept, emitted = results[0]
        assert emitted == cont[done + 1: done + 2 + accept]
        accepts.add(accept)
        done += accept + 1
        assert seqs[0].length == seqs[1].length == len(prompt) + done
    assert accepts == set(range(bs))


def test_drafting_after_skipped_drafts_reads_every_pending_feature(built):
    """One-token verifies with no draft between them (the runtime's draft back-off) leave their context features
    pending; the next draft must see exactly what a draft after prefilling the whole prefix sees."""
    from dflash_export.runtime.reference import ar_generate

    _, _, eng, torch_eng = built
    prompt = PROMPTS[1]
    cont = ar_generate(torch_eng.target, prompt, 6).tokens
    sp = SamplingParams(temperature=0.8)  # returns draft distributions, so whole rows can be compared
    u = np.full(eng.info.block_size - 1, 0.5)
    got = {}
    for name, e in (("ort", eng), ("torch", torch_eng)):
        seq = e.new_sequence()
        e.prefill(seq, np.array(prompt))
        e.draft(seq, cont[0], sp, u)  # consumes the prompt's features
        for i in range(4):
            assert e.verify(seq, np.array([cont[i]]), None, SamplingParams(), None) == (0, [cont[i + 1]])
        got[name] = e.draft(seq, cont[4], sp, u)[1]
    fresh = torch_eng.new_sequence()
    torch_eng.prefill(fresh, np.array(prompt + cont[:4]))
    want = torch_eng.draft(fresh, cont[4], sp, u)[1]
    np.testing.assert_allclose(got["torch"], want, atol=1e-6)
    np.testing.assert_allclose(got["ort"], want, atol=1e-4)


def test_sampling_equals_torch_engine_given_the_seed(built):
    from dflash_export.engines.torch_ref import TorchEngine

    _, _, eng, torch_eng = built
    assert isinstance(torch_eng, TorchEngine)
    for seed, (t, k, p) in enumerate([(0.8, 0, 1.0), (1.0, 20, 1.0), (0.6, 0, 0.9)]):
        sp = SamplingParams(max_new_tokens=32, temperature=t, top_k=k, top_p=p, seed=seed)
        for prompt in PROMPTS[:2]:
            a = DFlashRuntime(eng).generate(prompt, sp).tokens
            b = DFlashRuntime(torch_eng).generate(prompt, sp).tokens
            assert a == b, (sp, prompt)


def test_serving_imports_no_torch(built):
    _, out, _, _ = built
    code = ("import sys; from dflash_export.engines.base import SamplingParams;"
            "from dflash_export.engines.registry import load_engine;"
            "from dflash_export.runtime.single import DFlashRuntime;"
            f"e = load_engine({str(out)!r}, threads=1);"
            "print(DFlashRuntime(e).generate([1, 2, 3], SamplingParams(max_new_tokens=4)).tokens);"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _copy(out, tmp_path):
    import shutil

    dst = tmp_path / "eng"
    shutil.copytree(out, dst)
    return dst


def test_draft_vocabulary_restriction_stays_lossless(tmp_path):
    """A drafter limited to the first 100 ids proposes nothing above them, and the output is still the target's."""
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.models import load_target
    from dflash_export.recipes import load_recipe
    from dflash_export.runtime.reference import ar_generate

    recipe = load_recipe("tiny-llama")
    out = build_onnxruntime(recipe, tmp_path / "eng", threads=1, draft_vocab=100)
    eng = load_engine(out, threads=1)
    assert eng.draft_vocab == 100 and (out / "draft_head.onnx").is_file()
    target = load_target(recipe.target_path)
    rt = DFlashRuntime(eng)
    for prompt in PROMPTS[:3]:
        want = ar_generate(target, prompt, 40).tokens
        assert rt.generate(prompt, SamplingParams(max_new_tokens=40), "ar").tokens == want
        assert_as_plain(eng, prompt, rt.generate(prompt, SamplingParams(max_new_tokens=40)).tokens, want)
    seq = eng.new_sequence()
    eng.prefill(seq, np.array(PROMPTS[1]))
    toks, probs = eng.draft(seq, 5, SamplingParams(temperature=1.0), np.full(eng.info.block_size - 1, 0.999))
    assert (toks < 100).all() and probs.shape == (eng.info.block_size - 1, eng.info.vocab_size)
    assert np.allclose(probs.sum(-1), 1) and not probs[:, 100:].any()
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, seed=3)
    assert len(rt.generate(PROMPTS[0], sp).tokens) == 24


def test_draft_without_new_context_is_a_clear_error(built):
    _, _, eng, _ = built
    seq = eng.new_sequence()
    with pytest.raises(DFlashError, match="prefill"):
        eng.draft(seq, 1, SamplingParams(), None)


def test_failed_build_leaves_nothing_that_loads(tmp_path, monkeypatch):
    from dflash_export.engines import ort_build
    from dflash_export.recipes import load_recipe

    def boom(*a, **k):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(ort_build, "copy_tokenizer", boom)  # after export + optimization, before the manifest
    with pytest.raises(RuntimeError, match="mid-build"):
        ort_build.build_onnxruntime(load_recipe("tiny-llama"), tmp_path / "eng", threads=1)
    assert list(tmp_path.iterdir()) == []  # neither the engine dir nor its temporary sibling
    with pytest.raises(DFlashError):
        load_engine(tmp_path / "eng")


def test_sequence_past_max_seq_len_is_a_clear_error(built):
    _, _, eng, _ = built
    seq = eng.new_sequence()
    eng.prefill(seq, np.arange(eng.info.max_seq_len - 2) % 200)
    with pytest.raises(DFlashError, match="max_seq_len"):
        eng.verify(seq, np.arange(eng.info.block_size), None, SamplingParams(), None)


def test_kv_buffers_sized_by_the_hint_and_grown_past_it_give_the_same_logits(built):
    _, _, eng, _ = built
    ids = PROMPTS[4]
    small, sized = eng.new_sequence(max_tokens=4), eng.new_sequence(max_tokens=len(ids))
    # one allocation of exactly the request's length (+ the rows a one-token step is padded with: numerics.py)
    pad = eng.row_floor - 1
    assert (small.capacity, sized.capacity) == (4 + pad, len(ids) + pad)
    for a, b in zip(*(eng.prefill(s, np.array(ids[:100])) for s in (small, sized))):
        assert a == b
    for t in ids[100:]:  # the small sequence's buffers grow (and are rebound) on the way
        np.testing.assert_array_equal(eng.decode(small, t), eng.decode(sized, t))
    assert small.capacity >= len(ids) and sized.capacity == len(ids) + pad


def test_plain_steps_between_other_calls_give_the_reference_logits(built):
    """Plain steps run through buffers bound once per sequence (OrtEngine._plain_hidden); every other target call
    (verify blocks, one-token verifies, drafts) binds its own. Interleaved in every order, each plain step's logits are
    the PyTorch engine's for the same prefix, and each is a fresh array that later steps leave alone."""
    from dflash_export.runtime.reference import ar_generate

    _, _, eng, torch_eng = built
    prompt = PROMPTS[1]
    cont = ar_generate(torch_eng.target, prompt, 40).tokens
    seqs = [e.new_sequence() for e in (eng, torch_eng)]
    for e, s in zip((eng, torch_eng), seqs):
        e.prefill(s, np.array(prompt))
    kept, done = [], 0
    for op in ("decode", "decode", "verify", "decode", "one", "decode", "draft", "decode", "verify", "decode",
               "decode"):
        if op == "decode":
            got = [e.decode(s, cont[done]) for e, s in zip((eng, torch_eng), seqs)]
            np.testing.assert_allclose(got[0], got[1], atol=1e-4, rtol=0)
            kept.append((got[0], got[0].copy()))
            done += 1
        elif op == "draft":
            for e, s in zip((eng, torch_eng), seqs):
                e.draft(s, cont[done], SamplingParams(), None)
        else:  # a block of the reference's own tokens (all accepted), or a one-token verify
            block = np.array(cont[done: done + (4 if op == "verify" else 1)], np.int64)
            results = [e.verify(s, block, None, SamplingParams(), None) for e, s in zip((eng, torch_eng), seqs)]
            assert results[0] == results[1] == (len(block) - 1, cont[done + 1: done + 1 + len(block)])
            done += len(block)
        assert seqs[0].length == seqs[1].length == len(prompt) + done
    assert all(np.array_equal(a, b) for a, b in kept)


def test_embedding_rows_are_read_not_mapped(built):
    """Rows come from shared_weights.bin by pread: the table is never mapped (a mapping became resident by 64 KiB
    per token through the kernel's fault-around), and a bad id is a clear error."""
    _, out, eng, _ = built
    m = read_manifest(out).shared_tensors["shared.embed_tokens"]
    table = np.memmap(out / "shared_weights.bin", np.float32, "r", m.offset, m.shape)
    ids = [0, 5, 5, table.shape[0] - 1]
    np.testing.assert_array_equal(eng._embed.rows(ids), table[ids])
    del table
    DFlashRuntime(eng).generate([1, 2, 3], SamplingParams(max_new_tokens=8))
    maps = Path("/proc/self/maps")
    if maps.is_file():
        assert str(out / "shared_weights.bin") not in maps.read_text()
    with pytest.raises(DFlashError, match="outside the embedding"):
        eng._embed.rows([eng._embed.shape[0]])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input in an engine directory: one line naming the file and the field


def _rehash(d: Path) -> None:
    """Update the manifest's file hashes after a deliberate edit (so the content check, not the hash, must catch it)."""
    from dflash_export.files import sha256_file

    m = json.loads((d / "manifest.json").read_text())
    m["files"] = {p.name: sha256_file(p) for p in d.iterdir() if p.is_file() and p.name != "manifest.json"}
    (d / "manifest.json").write_text(json.dumps(m))


def _with_tokenizer(out, tmp_path, files: dict[str, str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    dst = _copy(out, tmp_path)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dst / "tokenizer.json"))
    for name, text in files.items():
        (dst / name).write_text(text)
    _rehash(dst)
    return dst


@pytest.mark.parametrize("files, bad", [
    ({"chat_template.jinja": "{% for m in messages %}{{ m.content }\n"}, "chat_template.jinja"),
    ({"tokenizer_config.json": "[1]"}, "tokenizer_config.json"),
    ({"tokenizer_config.json": '{"chat_template": "{% if %}"}'}, "tokenizer_config.json: chat_template"),
    ({"tokenizer_config.json": '{"eos_token": 5}'}, "tokenizer_config.json: eos_token"),
    ({"chat_template.jinja": "{{ messages | no_such_filter }}"}, "chat_template.jinja: invalid chat template"),
    ({"tokenizer_config.json": '{"chat_template": ["one", "two"]}'}, "tokenizer_config.json: chat_template"),
])
def test_broken_tokenizer_files_are_one_line_naming_the_file(built, tmp_path, files, bad):
    """`run`, `deploy` and `serve --engine` each refuse the engine before any work, in one line naming the file (and
    field), and deploy writes no repository."""
    from click.testing import CliRunner

    from dflash_export.cli import main

    _, out, _, _ = built
    dst = _with_tokenizer(out, tmp_path, files)
    for args in (["run", "--engine", str(dst), "hi there", "--max-new-tokens", "2"],
                 ["deploy", "--engine", str(dst), "--repo", str(tmp_path / "repo")],
                 ["serve", "--engine", str(dst), "--port", "1"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, (args, r.output)
        assert f"{dst / bad}" in r.output, (args, r.output)
    assert not (tmp_path / "repo").exists()


def _drop_target_graph(dst: Path, m: dict) -> None:
    (dst / "target.onnx").unlink()
    del m["files"]["target.onnx"]


@pytest.mark.parametrize("edit, field, says", [
    # a manifest edited to draft among the first 100 ids, in an engine built without a draft head
    (lambda dst, m: m["flags"].update(draft_vocab=100), "flags.draft_vocab",
     "100: drafting among the first 100 ids needs draft_head.onnx, which the engine's files do not hold; rebuild"),
    (_drop_target_graph, "files", "target.onnx, a graph every ONNX Runtime engine loads, is not among them; rebuild"),
], ids=["draft-head", "target"])
def test_a_graph_the_manifest_needs_but_does_not_list_is_one_line_naming_the_field(built, tmp_path, edit, field,
                                                                                    says):
    from click.testing import CliRunner

    from dflash_export.cli import main

    _, out, _, _ = built
    dst = _copy(out, tmp_path)
    m = json.loads((dst / "manifest.json").read_text())
    assert m["flags"]["draft_vocab"] is None and "draft_head.onnx" not in m["files"]
    edit(dst, m)
    (dst / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["run", "--engine", str(dst), "1 2 3", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {dst / 'manifest.json'}: {field}: {says}"), r.output
    with pytest.raises(DFlashError, match=re.escape(f"{dst / 'manifest.json'}: {field}: {says}")):
        load_engine(dst, threads=1)


# transformers' named templates, as published checkpoints write them (NousResearch/Hermes-2-Pro-Llama-3-8B,
# CohereForAI/c4ai-command-r-v01): a list of {"name", "template"}, the "default" one rendering prompts
NAMED_TEMPLATES = [{"name": "default", "template": "{% for m in messages %}{{ m.content }} {% endfor %}"},
                   {"name": "tool_use", "template": "{{ raise_exception('the tool_use template rendered') }}"}]


def test_a_tokenizer_config_with_named_chat_templates_runs_with_its_default_one(built, tmp_path):
    """A list of named chat templates (transformers renders the one named "default" when no other is asked for)
    loads, and prompts render with the default template; a list naming no default template is one line naming the
    field, at load."""
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.engines.base import load_codec

    _, out, _, _ = built
    dst = _with_tokenizer(out, tmp_path / "named", {"tokenizer_config.json": json.dumps(
        {"eos_token": "[UNK]", "chat_template": NAMED_TEMPLATES})})
    assert load_codec(dst).render_chat([{"role": "user", "content": "hi there"}]) == "hi there "
    r = CliRunner().invoke(main, ["run", "--engine", str(dst), "hi there", "--max-new-tokens", "2"])
    assert r.exit_code == 0, r.output
    dst = _with_tokenizer(out, tmp_path / "no-default", {"tokenizer_config.json": json.dumps(
        {"chat_template": NAMED_TEMPLATES[1:]})})
    r = CliRunner().invoke(main, ["run", "--engine", str(dst), "hi there", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {dst / 'tokenizer_config.json'}: chat_template: no template named "
                               "'default'"), r.output


@pytest.mark.parametrize("files, says", [
    ({"chat_template.jinja": "{{ messages[0].content + 1 }}"},
     "chat_template.jinja: cannot render the chat template for these messages (TypeError"),
    ({"chat_template.jinja": "{% if messages %}{{ messages | no_such_filter }}{% endif %}"},
     "chat_template.jinja: cannot render the chat template for these messages (TemplateRuntimeError: No filter "
     "named 'no_such_filter'"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{{ raise_exception('roles must alternate') }}"})},
     "tokenizer_config.json: chat_template: the chat template refused these messages: roles must alternate"),
])
def test_chat_template_failing_at_render_is_one_line_naming_its_file(built, tmp_path, files, says):
    from click.testing import CliRunner

    from dflash_export.cli import main

    _, out, _, _ = built
    dst = _with_tokenizer(out, tmp_path, files)
    r = CliRunner().invoke(main, ["run", "--engine", str(dst), "hi there", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {dst}/{says}"), r.output


def test_chat_template_looping_without_end_is_one_line(built, tmp_path):
    """`run` over an engine whose template loops 10**10 times without writing: one error line naming the field, in
    seconds (a process of its own, killed at the timeout should the rendering never end)."""
    import os
    import time

    _, out, _, _ = built
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    dst = _with_tokenizer(out, tmp_path, {"chat_template.jinja": spin})
    root = Path(__file__).resolve().parent.parent
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dflash_export", "run", "--engine", str(dst), "hi there",
                        "--max-new-tokens", "2"], capture_output=True, text=True, timeout=180, cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)})
    seconds = time.monotonic() - start
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in lines[0], r.stdout + r.stderr
    assert f"{dst / 'chat_template.jinja'}: the chat template did more than" in lines[0], lines
    assert "steps of work" in lines[0], lines
    assert seconds < 60, seconds


def test_working_chat_template_still_loads(built, tmp_path):
    _, out, _, _ = built
    dst = _with_tokenizer(out, tmp_path, {"chat_template.jinja": "{% for m in messages %}{{ m.content }} {% endfor %}"})
    eng = load_engine(dst, threads=1)
    assert eng.codec.encode_prompt("hi there") == [1, 2]
    eng.close()


_READ_IN_ASCII_LOCALE = r"""
import json, mmap, sys
from pathlib import Path

from dflash_export.engines.onnxruntime import _release_weight_pages
from dflash_export.files import read_json_object
from dflash_export.models.tokenization import TextCodec

d, weights = Path(sys.argv[1]), Path(sys.argv[2])
cfg = read_json_object(d / "tokenizer_config.json")
codec = TextCodec.from_dir(d)
with open(weights / "w.data", "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    released = _release_weight_pages(weights)
    mapped.close()
print(json.dumps([cfg["eos_token"], codec.chat_template, released]))
"""


def test_an_engines_files_read_the_same_in_an_ascii_locale(tmp_path):
    """tritonserver's python backend stub runs its interpreter in an ASCII locale, whatever LANG says: an engine's
    UTF-8 tokenizer files and chat template, and a weights file's non-ASCII path among the process's mappings, read
    there as anywhere else."""
    from tokenizers import Tokenizer, models

    d = tmp_path / "engine"
    d.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "\u2026"}, ensure_ascii=False), "utf-8")
    template = "{% for m in messages %}« {{ m['content'] }} »{% endfor %}"
    (d / "chat_template.jinja").write_text(template, "utf-8")
    weights = tmp_path / "café ü"
    weights.mkdir()
    (weights / "w.data").write_bytes(b"\0" * 8192)
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, "-X", "utf8=0", "-c", _READ_IN_ASCII_LOCALE, str(d), str(weights)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    eos, chat_template, released = json.loads(r.stdout.splitlines()[-1])
    assert eos == "\u2026" and chat_template == template and released >= 0


@pytest.mark.parametrize("config_template", [
    "CONFIG {% for m in messages %}{{ m['content'] }}{% endfor %}",
    [{"name": "default", "template": "CONFIG {% for m in messages %}{{ m['content'] }}{% endfor %}"}],
])
def test_a_chat_template_file_beside_a_config_template_renders_as_transformers_renders(tmp_path, config_template):
    """A tokenizer directory with both a chat_template.jinja and a `chat_template` in tokenizer_config.json renders
    prompts with the template transformers' own tokenizer applies to it (the file, which it prefers)."""
    import shutil

    from deploy_support import smollm2_tokenizer_dir
    from transformers import AutoTokenizer

    from dflash_export.engines.base import load_codec

    d = tmp_path / "tok"
    shutil.copytree(smollm2_tokenizer_dir(), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": config_template}))
    (d / "chat_template.jinja").write_text("FILE {% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=False)
    assert load_codec(d).render_chat(messages) == expected == "FILE [hi][yo]"


@pytest.mark.parametrize("damage", ["a header declaring 10^11 rows", "truncated", "an object array", "not .npy"])
def test_a_damaged_dflash2_codebook_is_one_error_naming_it_before_numpy_allocates(tmp_path, damage):
    """DFlash 2's codebooks (.npy [V, R] float32 in the engine): a header declaring more than the file holds (numpy
    would allocate 745 GiB), a cut file, a pickled array or another format is one DFlashError naming the file."""
    import io
    from types import SimpleNamespace

    from numpy.lib import format as npy

    from dflash_export.engines.onnxruntime import SELECTOR_FILES, _selector_tables

    manifest = SimpleNamespace(selector=SimpleNamespace(top_k=2, rank=3))
    for name in SELECTOR_FILES:
        np.save(tmp_path / name, np.zeros((8, 3), np.float32))
    assert [t.shape for t in _selector_tables(tmp_path, manifest, 8)[1:]] == [(8, 3), (8, 3)]
    path = tmp_path / SELECTOR_FILES[1]
    raw = path.read_bytes()
    if damage == "a header declaring 10^11 rows":
        header = io.BytesIO()
        npy.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**11, 2)})
        path.write_bytes(header.getvalue() + raw[len(header.getvalue()):])
    elif damage == "truncated":
        path.write_bytes(raw[:-8])
    elif damage == "an object array":
        np.save(path, np.array([object()] * 3, dtype=object), allow_pickle=True)
    else:
        path.write_bytes(b"PK\x03\x04 not an array")
    with pytest.raises(DFlashError, match="unreadable DFlash 2 codebook") as e:
        _selector_tables(tmp_path, manifest, 8)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
