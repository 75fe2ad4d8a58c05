"""Tensor parallel for the custom_torch backend over torch.distributed (docs/scaling.md).

- `collectives`: `TensorParallel`, one rank's group and the all-reduce / all-gather the model calls (no-ops at
  world size 1);
- `shards`: which slice of every checkpoint tensor a rank holds, and the shard's geometry;
- `workers`: ranks 1..N-1 as worker processes that replay rank 0's ticks and block copies.

Nothing is imported here: `models` imports `collectives` and `shards` without pulling in the workers.
"""
