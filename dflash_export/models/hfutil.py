"""What every reader of an HF model directory shares: transformers kept quiet, and the stop tokens a config declares."""

from __future__ import annotations

import json
from pathlib import Path


def stop_token_ids_of(model_dir: Path, cfg: dict) -> list[int]:
    ids: list[int] = []
    for src in (cfg, _maybe_json(model_dir / "generation_config.json")):
        eos = src.get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        for i in eos or []:
            if i not in ids:
                ids.append(i)
    return ids


def _maybe_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def quiet_transformers() -> None:
    """transformers 5 draws tqdm bars for every load and save ("Loading weights", "Writing model shards") on stderr:
    they would break the one-line error contract of every command, and say nothing a user needs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # its config warnings too: what matters is checked and reported by name here
