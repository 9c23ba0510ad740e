"""`dflash-export reference`: the PyTorch yardstick on a recipe's pair (spec vs AR, greedy or sampled)."""

from __future__ import annotations

import click

from dflash_export.errors import DFlashError
from dflash_export.recipes import load_recipe


def encode_prompt(tokenizer, prompt: str | list[dict], chat_template: bool) -> list[int]:
    """Token ids for a prompt string or a message list, with the chat template when asked and available."""
    if isinstance(prompt, list) or (chat_template and getattr(tokenizer, "chat_template", None)):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() would be its keys
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return list(tokenizer(prompt)["input_ids"])


def byte_codec(target, drafter):
    """The byte codec a target without tokenizer.json is encoded with (a tiny random pair's): the one its engines
    carry (codec.json, one token per byte, the drafter's mask id reserved), so the reference decodes the same ids
    as `run` on them. None for a target with tokenizer.json. transformers would otherwise build an empty tokenizer
    from the config's model type, which encodes every prompt to no tokens."""
    from pathlib import Path

    from dflash_export.models.tokenization import ByteCodec

    if (Path(target.model_dir) / "tokenizer.json").is_file():
        return None
    return ByteCodec(target.vocab_size, {int(drafter.config.mask_token_id)})


def run_reference(recipe_name: str, prompt: str | None, max_new_tokens: int, temperature: float, seed: int) -> None:
    import torch

    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter, read_drafter_config
    from dflash_export.models.drafter import check_drafter_fits
    from dflash_export.runtime.reference import ar_generate, spec_generate

    if prompt is not None and not prompt:
        raise DFlashError("the prompt is empty", field="--prompt")
    recipe = load_recipe(recipe_name)
    # The options against the recipe and the drafter's config.json, before the weights load (minutes for a large pair)
    recipe.check_new_tokens(max_new_tokens, recipe.drafted_block(read_drafter_config(recipe.drafter_path).block_size))
    dtype = getattr(torch, recipe.dtype)
    target = load_target(recipe.target_path, dtype)
    drafter = load_drafter(recipe.drafter_path, dtype)
    check_drafter_fits(drafter, target, recipe.drafter_path)
    block = recipe.drafted_block(drafter.config.block_size)
    codec = byte_codec(target, drafter)
    if prompt is None:
        ids = list(range(3, 19))
        click.echo(f"[{recipe.name}] no --prompt: token ids {ids}")
    elif codec is not None:
        ids = codec.encode_prompt(prompt, recipe.chat_template)
        if not ids:
            raise DFlashError(f"the prompt encodes to no tokens under the byte codec of a target without "
                              f"tokenizer.json (one token per UTF-8 byte, modulo {min(codec.vocab_size, 256)}; the "
                              f"drafter's mask id {drafter.config.mask_token_id} dropped): give a prompt with other "
                              "characters, or put the checkpoint's tokenizer.json beside its config.json",
                              path=target.model_dir, field="--prompt")
        click.echo(f"[{recipe.name}] no tokenizer.json: byte-codec token prompt {ids}")
    else:
        ids = encode_prompt(target.tokenizer, prompt, recipe.chat_template)
        if not ids:
            raise DFlashError("the prompt encodes to no tokens with the target's tokenizer (its tokenizer files in "
                              "this directory): give a prompt with text its vocabulary covers", path=target.model_dir,
                              field="--prompt")
        bad = [t for t in ids if not 0 <= t < target.vocab_size]
        if bad:
            raise DFlashError(f"its tokenizer encodes the prompt to token id {bad[0]}, outside the target's "
                              f"vocabulary (vocab_size {target.vocab_size}): the tokenizer files do not belong to "
                              "this checkpoint", path=target.model_dir)
    if len(ids) + max_new_tokens + block > recipe.max_seq_len:
        raise DFlashError(f"prompt ({len(ids)} tokens) + {max_new_tokens} new tokens + block ({block}) exceeds the "
                          f"recipe's max_seq_len {recipe.max_seq_len}", field="--max-new-tokens")
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    ar = ar_generate(target, ids, **kw)
    sp = spec_generate(drafter, target, ids, block_size=recipe.block_size, **kw)
    if codec is not None:
        click.echo(f"AR  : {ar.tokens}")
        click.echo(f"DFL : {sp.tokens}")
    else:
        click.echo(target.tokenizer.decode(sp.tokens, skip_special_tokens=True))
    same = ar.tokens == sp.tokens
    # Sampled, the reference's drafter chain (min(1, p/q), the residual on rejection) draws from AR's distribution
    # but spends the seed's uniforms on drafts and acceptance tests too: its tokens are not AR's, draw for draw.
    verdict = (f"identical to AR: {same}" if temperature <= 0 else
               f"same tokens as AR: {same} (not expected when sampling: the drafter chain keeps AR's distribution, "
               "not its draws)")
    click.echo(f"{verdict} | τ {sp.tau:.2f} tokens per target pass (PyTorch reference: drafter chain, "
               f"every draft verified) | AR {ar.tokens_per_s:.1f} tok/s | "
               f"DFlash {sp.tokens_per_s:.1f} tok/s | speedup {sp.tokens_per_s / max(ar.tokens_per_s, 1e-9):.2f}x")
