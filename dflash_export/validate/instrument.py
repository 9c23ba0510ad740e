"""A recording proxy around an `Engine`: the runtime's own loop stays the system under test, while validate sees every
draft, every accept length and the time each engine call took (draft, verify, decode: the τ-weighted cost model)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dflash_export.engines.base import Engine, SamplingParams, Sequence


@dataclass
class StepRecord:
    """One DFlash step: the anchor's output index (tokens emitted before it), its drafts and what was accepted."""

    out_index: int
    drafts: list[int]
    accept_len: int


@dataclass
class CallLog:
    steps: list[StepRecord] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)


class InstrumentedEngine(Engine):
    """Delegates to `inner`; `log` collects per-call records until `reset()`."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.info = inner.info
        self.codec = inner.codec
        self.accumulates_context = inner.accumulates_context
        self.tree_verify = getattr(inner, "tree_verify", False)
        self.host_accept = getattr(inner, "host_accept", False)  # sampled walks pass through (accept=)
        self.numerics = getattr(inner, "numerics", None)  # the rows and trees the runtime may verify
        self.quantized_activations = getattr(inner, "quantized_activations", False)
        self.log = CallLog()
        self._emitted = 0          # tokens emitted so far in the current request

    def reset(self) -> CallLog:
        log, self.log = self.log, CallLog()
        return log

    def new_sequence(self, max_tokens: int | None = None) -> Sequence:
        self._emitted = 0
        return self.inner.new_sequence(max_tokens)

    def prefill(self, seq, input_ids: np.ndarray) -> np.ndarray:
        t = time.perf_counter()
        out = self.inner.prefill(seq, input_ids)
        self.log.prefill_s.append(time.perf_counter() - t)
        self._emitted = 1  # the runtime picks the first token from these logits
        return out

    def decode(self, seq, token: int, greedy: bool = False) -> np.ndarray:
        t = time.perf_counter()
        out = self.inner.decode(seq, token, greedy=greedy)
        self.log.decode_s.append(time.perf_counter() - t)
        return out

    def draft(self, seq, anchor: int, sp: SamplingParams, uniforms, block_len: int | None = None):
        t = time.perf_counter()
        tokens, probs = self.inner.draft(seq, anchor, sp, uniforms, block_len=block_len)
        self.log.draft_s.append(time.perf_counter() - t)
        return tokens, probs

    def verify(self, seq, block: np.ndarray, draft_probs, sp: SamplingParams, uniforms, **accept):
        t = time.perf_counter()
        accept, emitted = self.inner.verify(seq, block, draft_probs, sp, uniforms, **accept)
        self.log.verify_s.append(time.perf_counter() - t)
        # Drafts in the block (not those returned by draft) are what the target judged.
        self.log.steps.append(StepRecord(self._emitted, [int(x) for x in block[1:]], int(accept)))
        self._emitted += len(emitted)
        return accept, emitted

    def verify_tree(self, seq, tree, **accept):
        t = time.perf_counter()
        accept, emitted, path = self.inner.verify_tree(seq, tree, **accept)
        self.log.verify_s.append(time.perf_counter() - t)
        # A tree's judged drafts: its accepted path (the other branches were judged as well, in the same pass).
        self.log.steps.append(StepRecord(self._emitted, [tree.tokens[i] for i in path[1:]], int(accept)))
        self._emitted += len(emitted)
        return accept, emitted, path

    def close(self) -> None:
        self.inner.close()
