"""`MixedStep`: one scheduler tick (decode rows + prefill chunks) as ONE forward over a `ForwardBatch`.

Order of work in :meth:`MixedStep.run`:

1. Decode rows get the block of their new position (as a decode step does: release out-of-window blocks,
   check every pool can supply the step, allocate). A shortage raises ``KVCapacityError`` before any chunk
   is touched and before any row's length moves.
2. Each chunk's row gets blocks for its tokens with ``prepare_append(n, release=False)`` (its first queries
   still read the old window; released after the forward). A chunk whose pool is short is left out and
   reported (the backend runs it alone on the path that needs fewer blocks).
3. One batch, one forward (:class:`~.kv.forward_batch.RaggedPagedContext`). With fast prefill, the
   KV-shared layers at the end of the stack run only for the last token of the sequences whose logits are
   needed (decode rows and chunks that complete their prompt): they store nothing, so every other token's
   work there is dead. Stored K/V and the kept logits are those of the full computation.
4. Lengths move only after the forward: if it raises, every row holds the tokens it held (blocks prepared
   for the tick stay and are reused by the next append).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

from gemmaserve.errors import KVCapacityError

from .kv.forward_batch import RaggedAttention, RaggedPagedContext, build_forward_batch
from .kv.paged_cache import PagedKVCache
from .kv.pools import KVPools
from .models.gemma import GemmaForCausalLM

__all__ = ["MixedStep", "shared_tail_start"]


def shared_tail_start(model: GemmaForCausalLM) -> int | None:
    """First layer of the trailing run of KV-shared layers (None if the last layer stores K/V)."""
    config = model.config
    start = config.num_hidden_layers
    while start > 0 and not config.stores_kv(start - 1):
        start -= 1
    return start if start < config.num_hidden_layers else None


class MixedStep:
    """Runs ticks of ``model`` over ``pools``. ``fast_prefill``: narrow the KV-shared tail (see above).
    Not thread-safe (backend lock). Counters: ``steps``, ``tokens``, ``shrunk`` (halvings of a chunk whose
    pool was short), ``deferred`` (chunks left out: not even one token fitted)."""

    def __init__(self, model: GemmaForCausalLM, pools: KVPools, attention: RaggedAttention, *,
                 fast_prefill: bool = True) -> None:
        self.model = model
        self.pools = pools
        self.attention: RaggedAttention = attention
        self.narrow_layer = shared_tail_start(model) if fast_prefill else None
        self.device = next(iter(pools.k.values())).device
        self.steps = 0
        self.tokens = 0
        self.deferred = 0
        self.shrunk = 0

    @torch.inference_mode()
    def run(self, decode_rows: Sequence[PagedKVCache], decode_ids: Sequence[int],
            chunks: Sequence[tuple[PagedKVCache, Sequence[int], bool]]) -> tuple[Tensor | None, list[Tensor | None], list[int]]:
        """Decode ``decode_ids[i]`` on ``decode_rows[i]`` and append ``chunks[j] = (row, tokens, want_logits)``.

        Returns (decode logits [B, vocab] or None, per chunk its last position's logits [1, vocab] where wanted
        and the chunk ran whole, per chunk the tokens it ran: all of them, or fewer when its pool was short,
        0 = left out, row unchanged). Raises KVCapacityError before changing anything if the decode rows'
        blocks cannot be supplied."""
        if len(decode_ids) != len(decode_rows):
            raise ValueError(f"got {len(decode_ids)} input ids for {len(decode_rows)} decode rows")
        slow = [row for row in decode_rows if not row.decode_needs_nothing()]
        for row in slow:
            row.release_out_of_window(1)
        needs: Counter[str] = Counter()
        for row in slow:
            needs.update(row.append_needs(1))
        for group, num in needs.items():
            self.pools.ensure_free(group, num)
        for row in slow:
            row.prepare_append(1)
        taken: list[int] = []
        left_out: list[int] = []
        sizes = [len(tokens) for _, tokens, _ in chunks]
        for index, (row, _, _) in enumerate(chunks):
            while sizes[index] > 0:  # a short pool takes a shorter chunk (its old window needs fewer blocks)
                try:
                    row.prepare_append(sizes[index], release=False)
                    break
                except KVCapacityError:
                    sizes[index] //= 2
                    self.shrunk += 1
            (taken if sizes[index] else left_out).append(index)
        self.deferred += len(left_out)
        chunks = [(row, tokens[: sizes[i]], want and sizes[i] == len(tokens))
                  for i, (row, tokens, want) in enumerate(chunks)]
        rows = [*decode_rows, *(chunks[i][0] for i in taken)]
        out: list[Tensor | None] = [None] * len(chunks)
        if not rows:
            return None, out, sizes
        tokens = [*([t] for t in decode_ids), *(chunks[i][1] for i in taken)]
        batch = build_forward_batch(self.pools, rows, tokens, self.device)
        num_decode = len(decode_rows)
        wanted = list(range(num_decode)) + [num_decode + j for j, i in enumerate(taken) if chunks[i][2]]
        wanted_t = torch.tensor(wanted, dtype=torch.int64).to(self.device)
        narrow = None  # (first narrowed layer, kept token indices) for the model
        context = RaggedPagedContext(self.model.config, self.pools, batch, self.attention,
                                     None if self.narrow_layer is None else (self.narrow_layer, wanted_t))
        if self.narrow_layer is not None:
            narrow = (self.narrow_layer, batch.last_index[wanted_t])
        hidden = self.model.forward_hidden(batch.ids[None], batch.positions[None], context, narrow)
        logits = None
        if wanted:
            picked = hidden[0] if narrow is not None else hidden[0, batch.last_index[wanted_t]]
            logits = self.model.compute_logits(picked)
        for row in decode_rows:
            row.commit_append(1)
        for j, i in enumerate(taken):
            row = chunks[i][0]
            row.commit_append(len(chunks[i][1]))
            row.release_out_of_window(0)
        if logits is not None:
            for k, seq in enumerate(wanted[num_decode:], start=num_decode):
                out[taken[seq - num_decode]] = logits[k : k + 1]
        self.steps += 1
        self.tokens += batch.num_tokens
        return (logits[:num_decode] if num_decode and logits is not None else None), out, sizes
