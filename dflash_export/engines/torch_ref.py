"""The PyTorch reference wrapped as an `Engine`, so the runtime, validate and deploy stages can be exercised (and
compared) with the very models the compiled engines are measured against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash_export.decoding.sampling import probs_from_logits, sample_from, top_probability, verify_block
from dflash_export.engines.base import Engine, EngineInfo, SamplingParams, Sequence, load_codec
from dflash_export.models import load_target
from dflash_export.models.checkpoint import load_drafter
from dflash_export.models.tokenization import ByteCodec
from dflash_export.recipes import load_recipe


class _TorchSeq(Sequence):
    def __init__(self, t_cache, d_cache):
        super().__init__()
        self.t_cache, self.d_cache = t_cache, d_cache
        self.taps = None          # pending context taps [1, n, k*H]
        self.taps_pos = None      # their positions [1, n]


class TorchEngine(Engine):
    accumulates_context = True
    host_accept = True  # verify takes a sampled walk (`accept=`, decoding/acceptance.py)

    def __init__(self, target, drafter, recipe_name: str = "", max_seq_len: int = 2048, codec=None,
                 block_size: int | None = None):
        self.target, self.drafter = target, drafter
        spec = drafter.spec(block_size)
        self.info = EngineInfo(
            backend="pytorch", recipe=recipe_name, block_size=spec.block_size, mask_token_id=spec.mask_token_id,
            vocab_size=target.vocab_size, stop_token_ids=list(target.stop_token_ids), max_seq_len=max_seq_len,
            target_layer_ids=list(spec.target_layer_ids),
        )
        if codec is None:  # the target's tokenizer files, checked as an engine's are (load_codec)
            d = Path(target.model_dir)
            codec = load_codec(d) if (d / "tokenizer.json").is_file() else ByteCodec(
                target.vocab_size, {drafter.config.mask_token_id})
        self.codec = codec

    @classmethod
    def from_recipe(cls, recipe) -> TorchEngine:
        dtype = getattr(torch, recipe.dtype)
        return cls(load_target(recipe.target_path, dtype), load_drafter(recipe.drafter_path, dtype), recipe.name,
                   recipe.max_seq_len, block_size=recipe.block_size)

    @classmethod
    def from_manifest(cls, engine_dir: Path, manifest, **_) -> TorchEngine:
        return cls.from_recipe(load_recipe(manifest.recipe_path))

    def new_sequence(self, max_tokens: int | None = None) -> Sequence:
        return _TorchSeq(self.target.new_cache(), self.drafter.new_cache())

    @torch.inference_mode()
    def prefill(self, seq: _TorchSeq, input_ids: np.ndarray) -> np.ndarray:
        n = len(input_ids)
        self.info.check_room(seq.length + n)
        pos = torch.arange(n)[None]
        out = self.target.forward(torch.from_numpy(input_ids)[None], pos, seq.t_cache, self.info.target_layer_ids)
        seq.length = n
        seq.taps, seq.taps_pos = out.taps, pos
        return out.logits[0, -1].float().numpy()

    @torch.inference_mode()
    def decode(self, seq: _TorchSeq, token: int, greedy: bool = False) -> np.ndarray:
        self.info.check_room(seq.length + 1)
        out = self.target.forward(torch.tensor([[token]]), torch.tensor([[seq.length]]), seq.t_cache)
        seq.length += 1
        return out.logits[0, -1].float().numpy()

    @torch.inference_mode()
    def draft(self, seq: _TorchSeq, anchor: int, sp: SamplingParams, uniforms, block_len: int | None = None):
        bs = min(block_len or self.info.block_size, self.info.block_size)
        block = torch.full((1, bs), self.info.mask_token_id, dtype=torch.long)
        block[0, 0] = anchor
        block_pos = torch.arange(seq.length, seq.length + bs)[None]
        logits, hidden = self.drafter.draft_step(self.target, seq.taps, seq.taps_pos, block, block_pos, seq.d_cache)
        seq.taps = seq.taps_pos = None
        if self.drafter.config.is_dflash2:  # the candidate selector's walk (z-lab's DFlash2DraftModel.propose)
            return self.drafter.propose(logits[0].float(), hidden[0], anchor, sp.temperature, sp.top_k, sp.top_p,
                                        uniforms)
        logits = logits[0].double().numpy()
        if sp.greedy:
            seq.draft_confidence = top_probability(logits)
            seq.draft_logits = logits  # what a draft tree is grown from (decoding/tree.py)
            return np.argmax(logits, axis=-1).astype(np.int64), None
        probs = probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p)
        return np.array([sample_from(p, u) for p, u in zip(probs, uniforms)], dtype=np.int64), probs

    # The two steps of verification, apart so validate's planted faults (validate/faults.py) can replace one.
    def target_probs(self, logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
        return probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p)

    def walk(self, walk, logits: np.ndarray, sp: SamplingParams) -> tuple[list[int], list[int]]:
        """The sampled walk over a verified block's logits, each row's distribution from `target_probs`."""
        return walk(logits, lambda row: self.target_probs(row, sp))

    def accept_block(self, probs, logits, draft_tokens, draft_probs, uniforms, greedy: bool):
        return verify_block(probs, logits, draft_tokens, draft_probs, uniforms, greedy)

    @torch.inference_mode()
    def verify(self, seq: _TorchSeq, block: np.ndarray, draft_probs, sp: SamplingParams, uniforms, accept=None):
        """`Engine.verify`; `accept` (a decoding.acceptance.Walk): the sampled walk over the block instead."""
        bs = len(block)
        self.info.check_room(seq.length + bs)
        pos = torch.arange(seq.length, seq.length + bs)[None]
        snapshot = self.target.snapshot(seq.t_cache)
        out = self.target.forward(torch.from_numpy(block)[None], pos, seq.t_cache, self.info.target_layer_ids)
        logits = out.logits[0].double().numpy()
        if accept is not None:
            path, emitted = self.walk(accept, logits, sp)
            accept = len(path) - 1
        else:
            probs = None if sp.greedy else self.target_probs(logits, sp)
            accept, emitted = self.accept_block(probs, logits, block[1:], draft_probs, uniforms, sp.greedy)
        seq.length += accept + 1
        self.target.commit(seq.t_cache, seq.length, snapshot, torch.from_numpy(block[: accept + 1])[None],
                           pos[:, : accept + 1])
        taps, taps_pos = out.taps[:, : accept + 1], pos[:, : accept + 1]
        if seq.taps is not None:  # no draft consumed the previous step's taps: keep them, in order
            taps, taps_pos = torch.cat([seq.taps, taps], 1), torch.cat([seq.taps_pos, taps_pos], 1)
        seq.taps, seq.taps_pos = taps, taps_pos
        return accept, emitted
