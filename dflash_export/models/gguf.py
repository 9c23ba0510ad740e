"""GGUF targets: converted once to an HF-format directory (fp32, dequantized) and cached by the file's hash.

transformers' GGUF loader does the dequantization; this module adds what it does not promise: the conversion is cached
atomically (a half-written copy is never taken for a finished one) and the fields that silently change generation --
rope_theta, rms_norm_eps, tied embeddings, eos / stop ids, the chat template -- are checked against the GGUF metadata
itself, read with the `gguf` package.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

from dflash_export.errors import DFlashError
from dflash_export.files import atomic_dir, cache_dir, sha256_file
from dflash_export.models.arch import ARCHS
from dflash_export.models.hfutil import quiet_transformers, stop_token_ids_of
from dflash_export.models.rope import rope_parameters_of

# Bump when the conversion changes so cached copies are rebuilt. 4: the tokenizer files carry the GGUF's special tokens
# (SmolLM2: eos <|im_end|>, no BOS added), no GGUF byte copy posing as tokenizer.model, and the transformers-5 config
# carries a top-level rope_theta too.
_CONVERSION_VERSION = 4


def read_gguf_metadata(path: Path) -> dict:
    """The GGUF key/values this module checks, plus `tensor_names`. Token lists are skipped (large, not needed)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise DFlashError("GGUF targets need the `gguf` package (pip install 'dflash-export[gguf]')",
                          path=path) from None
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises plain ValueError / struct errors on truncated or foreign files
        raise DFlashError(f"not a readable GGUF file ({type(e).__name__}: {e})", path=path) from None
    meta: dict = {}
    for key, fld in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                   "tokenizer.ggml.scores"):
            continue
        try:
            meta[key] = fld.contents()
        except Exception:  # an exotic field type this gguf version cannot decode is not one we check
            continue
    meta["tensor_names"] = [t.name for t in reader.tensors]
    return meta


def hf_dir_from_gguf(path) -> Path:
    """An HF model directory (config, fp32 safetensors, tokenizer with chat template) for GGUF file `path`.

    Built on first use under `cache_dir()/targets/<sha256 of the file>/`, then reused. Raises DFlashError naming the
    field when a generation-relevant setting does not survive the conversion.
    """
    path = Path(path)
    if not path.is_file():
        raise DFlashError("GGUF file not found", path=path)
    digest = sha256_file(path)
    out = cache_dir() / "targets" / f"{digest[:24]}-v{_CONVERSION_VERSION}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    known = sorted(a.gguf_arch for a in ARCHS.values() if a.gguf_arch)
    if arch not in known:
        raise DFlashError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(known)})", path=path,
                          field="general.architecture")
    try:
        with atomic_dir(out) as tmp, _no_progress_bars():
            _convert(path, tmp)
            check_conversion(tmp, meta, path)
    except OSError as e:  # full disk, permissions: one line, and atomic_dir has removed the partial copy
        raise DFlashError(f"cannot write the converted target ({e.strerror or e})", path=out) from None
    return out


@contextmanager
def _no_progress_bars():
    """No progress bars on stderr while converting, so that a failed conversion is the one error line. Besides the
    bars quiet_transformers turns off, transformers' GGUF reader draws one of its own ("Converting and de-quantizing
    GGUF tensors") with tqdm directly: its module's `tqdm` is a silent one for the duration."""
    quiet_transformers()
    try:
        from transformers import modeling_gguf_pytorch_utils as reader
    except ImportError:  # _convert names the missing library
        reader = None
    bar = getattr(reader, "tqdm", None)
    if not isinstance(bar, type):
        yield
        return

    class Silent(bar):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    reader.tqdm = Silent
    try:
        yield
    finally:
        reader.tqdm = bar


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize through transformers' GGUF reader into a model built from the GGUF's own config.

    `from_pretrained(gguf_file=...)` would do the same but insists on `accelerate` for this one path; the pieces it
    calls (config parsing, `load_gguf_checkpoint`'s name mapping + dequantization) do not need it.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    quiet_transformers()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    except (ValueError, OSError, KeyError, ImportError) as e:
        raise DFlashError(f"transformers cannot load this GGUF ({str(e).splitlines()[0]})", path=gguf_path) from None
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        bad = sorted(set(missing) - allowed_missing) or sorted(unexpected)
        raise DFlashError(f"GGUF tensors do not map onto {type(model).__name__} ({len(bad)} off, e.g. {bad[0]})",
                          path=gguf_path, field="tensors")
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _write_special_tokens(out, read_gguf_metadata(gguf_path), tokenizer)
    # transformers 5 writes the RoPE base inside `rope_parameters`; add the top-level `rope_theta` transformers 4
    # reads too, so the copy means the same thing to either (models/rope.py reads both).
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params and "rope_theta" not in cfg:
        cfg["rope_theta"] = params["rope_theta"]
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


_SPECIAL = (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id"))


def _write_special_tokens(out: Path, meta: dict, tokenizer) -> None:
    """Make the saved tokenizer say what the GGUF says, so transformers and llama.cpp's convert_hf_to_gguf.py read the
    same tokenizer as the engine: bos / eos / unk / pad from the GGUF ids (transformers' GGUF reader sets eos = bos
    for SmolLM2), add_bos_token / add_eos_token from the GGUF flags, and no `tokenizer.model` -- transformers saves
    the GGUF file itself under that name for a BPE vocabulary, which SentencePiece readers then fail on."""
    (out / "tokenizer.model").unlink(missing_ok=True)
    tokens = {name: tokenizer.convert_ids_to_tokens(int(meta[key])) for name, key in _SPECIAL if key in meta}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    for name, key in _SPECIAL:
        if name in tokens:
            cfg[name] = tokens[name]
            cfg[name + "_id"] = int(meta[key])
    cfg.update(add_bos_token=add_bos, add_eos_token=add_eos)
    if meta.get("tokenizer.ggml.model") == "gpt2":  # a byte-level BPE: served by tokenizer.json alone
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("vocab_file", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2, ensure_ascii=False) + "\n")
    tok_path = out / "tokenizer.json"
    if tok_path.is_file() and meta.get("tokenizer.ggml.model") == "gpt2":
        # transformers' GGUF reader writes a byte-level BPE with SentencePiece-style decoding (byte fallback, a
        # decoder sequence) and a post-processor that prepends bos. The GGUF's vocabulary is plain byte-level BPE:
        # say so, so that llama.cpp's converter takes it as one (tokenizer model gpt2, not llama).
        tj = json.loads(tok_path.read_text(encoding="utf-8"))
        tj["model"]["byte_fallback"] = False
        tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        if not (add_bos or add_eos) and (tj.get("post_processor") or {}).get("type") == "TemplateProcessing":
            tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                                    "use_regex": True}
        tok_path.write_text(json.dumps(tj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    gen_path = out / "generation_config.json"
    if gen_path.is_file() and "eos_token" in tokens:
        gen = json.loads(gen_path.read_text())
        gen["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
        gen_path.write_text(json.dumps(gen, indent=2) + "\n")


def _chat_template_of(model_dir: Path) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def check_conversion(model_dir: Path, meta: dict, gguf_path: Path) -> None:
    """Compare the converted config / tokenizer against GGUF metadata; DFlashError names the first field that
    differs."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = meta["general.architecture"]

    def fail(field: str, want, got):
        raise DFlashError(f"conversion changed {field}: GGUF has {want!r}, converted config has {got!r}",
                          path=gguf_path, field=field)

    theta = meta.get(f"{arch}.rope.freq_base")
    if theta is not None:
        got = rope_parameters_of(cfg, model_dir / "config.json", cfg.get("model_type", arch)).get("rope_theta")
        if not math.isclose(float(got or 0.0), float(theta), rel_tol=1e-6):
            fail("rope_theta", float(theta), got)
    eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon")
    # GGUF stores eps as float32: 1e-5 reads back as 9.99999975e-06, so compare at float32 precision.
    if eps is not None and not math.isclose(float(cfg.get("rms_norm_eps", 0.0)), float(eps), rel_tol=1e-6):
        fail("rms_norm_eps", float(eps), cfg.get("rms_norm_eps"))
    for key, field in ((f"{arch}.block_count", "num_hidden_layers"), (f"{arch}.embedding_length", "hidden_size"),
                       (f"{arch}.attention.head_count", "num_attention_heads"),
                       (f"{arch}.attention.head_count_kv", "num_key_value_heads")):
        if key in meta and int(meta[key]) != int(cfg.get(field, -1)):
            fail(field, int(meta[key]), cfg.get(field))
    tied = "output.weight" not in meta["tensor_names"]
    if bool(cfg.get("tie_word_embeddings", False)) != tied:
        fail("tie_word_embeddings", tied, cfg.get("tie_word_embeddings"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None and int(eos) not in stop_token_ids_of(model_dir, cfg):
        fail("eos_token_id", int(eos), stop_token_ids_of(model_dir, cfg))
    tcfg_path = model_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    for name, key in _SPECIAL:
        if key in meta and name in tcfg and tcfg.get(name + "_id", int(meta[key])) != int(meta[key]):
            fail(f"tokenizer_config.{name}", int(meta[key]), tcfg.get(name + "_id"))
    if "tokenizer.ggml.add_bos_token" in meta and bool(tcfg.get("add_bos_token")) != bool(
            meta["tokenizer.ggml.add_bos_token"]):
        fail("add_bos_token", bool(meta["tokenizer.ggml.add_bos_token"]), tcfg.get("add_bos_token"))
    if (model_dir / "tokenizer.model").is_file():
        fail("tokenizer.model", "no SentencePiece model (a BPE vocabulary)", "a tokenizer.model file")
    template = meta.get("tokenizer.chat_template")
    if template is not None and _chat_template_of(model_dir) != template:
        fail("chat_template", "the GGUF's template", "a different or missing template")
