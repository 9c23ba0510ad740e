"""How much K/V a served instance's shared batch may hold (runtime/batching.py `max_kv_tokens`): bytes a token, the
memory available, the bound chosen from it. Imports nothing beyond the engine manifest, so the model stub can.

A token's bytes are what the batch holds for it between steps, the drafter's share included (its context K/V and the
context features waiting for it); not the weights, nor a step's activations (a drafter call's copies of its
sequences' context K/V among them, at most twice the drafter's K/V of the sequences drafting)."""

from __future__ import annotations

from dflash_export.engines.manifest import Manifest

# Of the memory available when an instance loads: what the shared batches of every instance of the deployment (all
# its models') may hold together by default, each bounded to its share.
KV_MEMORY_FRACTION = 0.5


def kv_bytes_per_token(manifest: Manifest) -> int | None:
    """Bytes one token of one sequence takes in a shared batch (runtime/batching's buffers; a hybrid target's
    linear-attention layers hold less): the target's K/V, the drafter's context K/V (as many rows as the target's at
    most: engines/ort_batch.py) and the context features waiting for the drafter (float32 rows, `context_width`
    wide), which a sequence holds for every token it has committed since it last drafted. None for an engine whose
    manifest records no shapes."""
    sh = manifest.shapes
    if sh is None:
        return None
    itemsize = 2 if (manifest.raw.get("dtypes") or {}).get("kv_cache") in ("float16", "bfloat16") else 4
    kv = 2 * itemsize * (sh.target_layers * sh.target_kv_heads * sh.target_head_dim
                         + sh.drafter_layers * sh.drafter_kv_heads * sh.drafter_head_dim)
    return kv + 4 * context_width(manifest)


def context_width(manifest: Manifest) -> int:
    """The width of a context feature row: the drafter's hidden size, which is the target embedding's width
    (models/drafter.py `check_drafter_fits`); 0 where the manifest records no embedding."""
    embed = manifest.shared_tensors.get("shared.embed_tokens")
    return int(embed.shape[-1]) if embed is not None and embed.shape else 0


def kv_reservation_bytes(manifest: Manifest, max_batch: int) -> int | None:
    """About the most K/V one instance's shared batch reserves when nothing bounds it: `max_batch` slots, each as
    long as the engine's max_seq_len. None for an engine whose manifest records no shapes."""
    per_token = kv_bytes_per_token(manifest)
    if per_token is None or not manifest.max_seq_len:
        return None
    return max_batch * manifest.max_seq_len * per_token


def default_kv_tokens(manifest: Manifest, instances: int, max_batch: int, available: int | None) -> int | None:
    """The K/V bound (token cells: slots x rows) of each instance's shared batch when none is given: the tokens
    whose K/V fits in KV_MEMORY_FRACTION of `available` bytes shared by `instances`, every instance of the
    deployment that holds a shared batch, whichever model it serves (a repository's `dflash` and `dflash_stream`
    each run their own); at most what `max_batch` full-length sequences take; None (unbounded) when either figure is
    unknown, and for engines whose batch keeps its K/V on the device (tensorrt: the memory available here says
    nothing about it)."""
    per_token = kv_bytes_per_token(manifest)
    if per_token is None or available is None or not manifest.max_seq_len or manifest.backend != "onnxruntime":
        return None
    fits = int(KV_MEMORY_FRACTION * available) // (instances * per_token)
    return max(1, min(fits, max_batch * manifest.max_seq_len))
