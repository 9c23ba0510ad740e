"""DFlash drafter training (the paper's recipe, made to fit a CPU budget).

What is trained and on what:
- The target is frozen. Training data are the target's own greedy responses to prompts, generated in batches once and
  cached in shards together with the target's taps (the drafter's context features) and its top-k next-token
  log-probabilities (soft targets), keyed by the target's path, config and a digest of its weight and tokenizer
  files. A trainer re-scans the shards, so data generation can run alongside training.
- Each sequence contributes many blocks: a random anchor position `a` in the response opens a block `[x_a, mask, ...,
  mask]` (block_size tokens) at positions a .. a+bs-1. One drafter forward serves all blocks of a batch through an
  attention mask: a block's queries see the context features at positions < a and their own block's keys
  (bidirectionally), never another block's. This is exactly what inference does at an anchor `a`, because greedy
  speculative decoding follows the target's own greedy trajectory -- so held-out block accuracy predicts τ.
- Loss at block slot k (1 .. bs-1) is weighted exp(-(k-1)/γ): early slots decide acceptance. It is computed over the
  vocabulary the cached responses actually use (+ the soft targets' ids) instead of the full LM head, mixing the hard
  greedy label with the target's renormalized top-k distribution.
- Only layers, fc, hidden_norm and norm train; embedding and LM head are the target's. The drafter starts from the
  target: its layers are copies of the target's last layers, `fc` passes the deepest tap through, norms come from the
  target -- so it starts from "what the target's top does" instead of noise.
Checkpoints hold the drafter in the z-lab format plus the optimizer state, that digest of the target and the seed,
written atomically; a step's batch and anchors come from a generator seeded by (seed, step), so a resumed run draws
what an uninterrupted one would (and a resume with another seed is refused).

Where each part lives (imports point down this list, never up):
- cli.py           the click command: parsing only
- stage.py         the stage: recipe + options checked, data made or found, the loop run, the best drafter written
- loop.py          schedule, batches, held-out evaluation, atomic checkpoints, resumption
- init_drafter.py  the drafter to start from (the target's top layers; a trained drafter grown by identity layers)
- blocks.py        blocks, the training attention mask, the one-pass forward over every block, the loss
- own_answers.py   the target's own long answers: a slot-cache batched greedy decoder and its resumable shards
- data.py          TrainSequence, generated / teacher-forced data, shards, prompt sources
"""
