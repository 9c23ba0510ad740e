"""What every reader of an HF model directory shares: transformers kept quiet, the stop tokens a config declares, and
the dtype it declares."""

from __future__ import annotations

from pathlib import Path

from dflash_export.decoding.request import is_int
from dflash_export.errors import DFlashError
from dflash_export.files import read_json_object


def stop_token_ids_of(model_dir: Path, cfg: dict) -> list[int]:
    """The `eos_token_id`s of config.json (`cfg`, already read) and generation_config.json (when present); a corrupt
    generation config, an id that is not a token id or one outside the vocabulary (`cfg`'s vocab_size, when an
    integer) is a DFlashError naming the file."""
    gen_path = model_dir / "generation_config.json"
    vocab = cfg.get("vocab_size")
    ids: list[int] = []
    for path, src in ((model_dir / "config.json", cfg),
                      (gen_path, read_json_object(gen_path) if gen_path.is_file() else {})):
        eos = src.get("eos_token_id")
        if isinstance(eos, int) and not isinstance(eos, bool):
            eos = [eos]
        if eos is not None and (not isinstance(eos, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos)):
            raise DFlashError(f"expected a token id or a list of them, got {eos!r}", path=path,
                              field="eos_token_id")
        for i in eos or []:
            if is_int(vocab) and i >= vocab:
                raise DFlashError(f"{i} is outside the vocabulary (vocab_size {vocab})", path=path,
                                  field="eos_token_id")
            if i not in ids:
                ids.append(i)
    return ids


# The dtypes a config.json may declare: the float dtypes the stages load and build (a recipe's `dtype` too).
CONFIG_DTYPES = ("float32", "float16", "bfloat16")


def config_dtype(cfg: dict, path: Path, prefix: str = "") -> str | None:
    """The dtype a config.json (`cfg`, already read) declares, as transformers reads it: `dtype`, else the older
    `torch_dtype`; None when neither is given. A value outside CONFIG_DTYPES under either key is a DFlashError naming
    the file and the key (`prefix` + key: "text_config." for a composite checkpoint's decoder settings)."""
    for key in ("dtype", "torch_dtype"):
        value = cfg.get(key)
        if value is not None and not (isinstance(value, str) and value in CONFIG_DTYPES):
            raise DFlashError(f"{value!r} is not a dtype this project loads ({', '.join(CONFIG_DTYPES)})", path=path,
                              field=prefix + key)
    return cfg.get("dtype") or cfg.get("torch_dtype")


def quiet_transformers() -> None:
    """transformers 5 draws tqdm bars for every load and save ("Loading weights", "Writing model shards") on stderr:
    they would break the one-line error contract of every command, and say nothing a user needs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # its config warnings too: what matters is checked and reported by name here
