"""Tensor parallelism of the engine (config key `tensor_parallel_size`): one process per GPU.

- `shard`: which slice of every weight a rank holds (Megatron-style column/row-parallel
  linears, vocab-parallel embedding and LM head, whole KV heads per rank) and the check that a
  model splits at all;
- `comm`: a rank's groups and collectives (the model's all-reduces and logits gather, the step
  header from rank 0 with the step's host input arrays in shared memory, the inputs' device
  broadcast for a step too large for a ring slot);
- `ranktimes`: each worker rank's own launch of every step, which rank 0 gathers for replay;
- `workers`: rank 0 starts the other ranks (spawned processes on localhost) and each worker's
  loop, which builds the same `engine.Engine` and replays every step rank 0 sends it.

Rank 0 is the engine the product drives; it alone runs the scheduling policy and reads tokens.
Every rank samples the same tokens from the same gathered logits (the sampler's per-slot state
stays identical everywhere, so the next decode's input ids need no extra transfer).
"""
