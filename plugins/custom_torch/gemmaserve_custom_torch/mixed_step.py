"""`MixedStep`: one scheduler tick (decode rows + prefill chunks, or decode rows alone) as ONE forward over a
`ForwardBatch`: the only forward path of the backend (apart from the one-row prefill fallback).

Order of work in :meth:`MixedStep.run`:

1. Decode rows get the block of their new position (as a decode step does: release out-of-window blocks,
   check every pool can supply the step, allocate). A shortage raises ``KVCapacityError`` before any chunk
   is touched and before any row's length moves.
2. Each chunk's row gets blocks for its tokens with ``prepare_append(n, release=False)`` (its first queries
   still read the old window; released after the forward). A chunk whose pool is short is halved until it
   fits (the scheduler takes the rest next tick; a one-token chunk frees its out-of-window blocks first, as
   a decode row does); one that cannot take a single token is left out (the backend then runs it on the
   one-row path, which gathers its old window before freeing it).
3. One batch (:func:`~.kv.forward_batch.pack_tick`), one forward (:class:`~.kv.forward_batch.RaggedPagedContext`):
   on CUDA the batch is staged into fixed buffers padded to a token bucket and the forward replays that
   bucket's CUDA graph (captured on first use); elsewhere (CPU, MoE models on the eager expert loop, ticks
   larger than the buffers) it runs eagerly on fresh tensors. With fast prefill, the KV-shared layers at the end of the stack run only
   for the last token of the sequences whose logits are needed (decode rows and chunks that complete their
   prompt): they store nothing, so every other token's work there is dead. Stored K/V and the kept logits
   are those of the full computation.
4. Lengths move only after the forward: if it raises, every row holds the tokens it held (blocks prepared
   for the tick stay and are reused by the next append).

A decode-only tick (no chunk) is the same path with a decode-only batch (``decode_only``: the model runs it as
``[rows, 1]`` and the attention is the paged decode kernel, `DecodeBatchContext`). With fixed buffers its
rows are staged by `DecodeStaging` (one H2D copy of ids / positions / sources plus the table entries that
changed) padded to a row bucket of ``graph_buckets(max_seqs)``, and the graph of ``(bucket, True, bucket)``
replays; that forward also takes the greedy argmax on the device (:meth:`MixedStep.greedy_tokens`). Graph keys
are ``(bucket, decode_only, logits rows)``: the kernel choice is static per captured graph, and a tick with
prompt tokens computes its logits rows (and, with fast prefill, its KV-shared layers) padded to
``ForwardBuffers.logit_rows_for`` only, not to the bucket's sequence count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from gemmaserve.errors import KVCapacityError

from .graphs import StepGraphs, explain_report, maybe_compile
from .kv.decode_state import count_fed, feed_previous
from .kv.forward_batch import (
    ForwardBatch,
    ForwardBuffers,
    PackedTick,
    RaggedAttention,
    build_forward_batch,
    pack_tick,
    paged_context,
)
from .kv.paged_cache import PagedKVCache, prepare_decode_rows
from .kv.pools import KVPools
from .models.gemma import GemmaForCausalLM
from .sampling import to_device

__all__ = ["MixedStep", "TickMirror", "shared_tail_start"]

logger = logging.getLogger(__name__)
GraphKey = tuple[int, bool, int]  # (token bucket, decode_only, logits rows)


class TickMirror(Protocol):
    """Other ranks that run every tick's forward with this process (tensor parallel: `TensorParallelWorkers`)."""

    def send_forward(self, tick: PackedTick) -> None:
        """Start ``tick``'s forward on the other ranks (called right before this rank runs it)."""

    def forward_failed(self, error: BaseException) -> None:
        """This rank's forward of the tick just sent raised: the ranks' collectives may be out of step."""


def shared_tail_start(model: GemmaForCausalLM) -> int | None:
    """First layer of the trailing run of KV-shared layers (None if the last layer stores K/V)."""
    config = model.config
    start = config.num_hidden_layers
    while start > 0 and not config.stores_kv(start - 1):
        start -= 1
    return start if start < config.num_hidden_layers else None


def _block_ms(model: GemmaForCausalLM, attention: RaggedAttention) -> list[int]:
    """The ragged kernel's query-tile sizes this model's layers use (Triton only)."""
    if attention != "triton":
        return []
    from .kernels.ragged_attention import ragged_block_m

    config = model.config
    return sorted({ragged_block_m(config.head_dims[i], config.num_attention_heads // config.num_kv_heads[i])
                   for i in range(config.num_hidden_layers)})


class MixedStep:
    """Runs ticks of ``model`` over ``pools``. ``fast_prefill``: narrow the KV-shared tail (see above).
    ``graphs``: replay CUDA graphs per token bucket for ticks of at most ``max_tokens`` tokens and
    ``max_seqs`` sequences (rows at most ``width`` blocks), and per row bucket for decode-only ticks;
    ``fixed_buffers`` (default: with ``graphs``) runs the same padded forwards of the fixed buffers without
    graphs (the replay-parity reference, CPU tests). ``compile``: the decode-only forward of the fixed buffers
    through ``torch.compile(dynamic=False)`` (one compilation per bucket); ``explain``: log
    ``torch._dynamo.explain`` of the first decode-only bucket run (kept in :attr:`explain`); both need the
    fixed buffers (ValueError otherwise). ``decode_kernel``: the decode-only batches' attention kernel in place of
    the default (``paged_decode_attention`` / the gather reference), e.g. ``paged_decode_attention_reference``
    in CPU tests. Not thread-safe (backend lock).

    Counters of ticks with prompt tokens: ``steps``, ``tokens``, ``shrunk`` (halvings of a chunk whose pool
    was short), ``deferred`` (chunks left out: not even one token fitted), ``eager_steps`` (those ticks run
    without the fixed buffers). Of decode-only ticks: ``decode_steps``, ``slow_rows`` (rows that needed block
    bookkeeping), ``fed_rows`` (rows that consumed the previous step's device token), ``decode_eager_steps``.

    ``mirror``: told of every tick's `PackedTick` right before its forward (tensor parallel: rank 0 sends it to
    the worker ranks, which run :meth:`forward_tick` on it) and of that forward's exception; ticks fed from
    previous device tokens are refused then (the workers could not see those tokens)."""

    def __init__(self, model: GemmaForCausalLM, pools: KVPools, attention: RaggedAttention, *,
                 fast_prefill: bool = True, graphs: bool = False, fixed_buffers: bool | None = None,
                 max_tokens: int = 8192, max_seqs: int = 256, width: int = 1,
                 mirror: TickMirror | None = None, compile: bool = False, explain: bool = False,
                 decode_kernel: Callable[..., Tensor] | None = None) -> None:
        self.model = model
        self.mirror = mirror
        self.pools = pools
        self.attention: RaggedAttention = attention
        self.decode_kernel = decode_kernel
        self.narrow_layer = shared_tail_start(model) if fast_prefill else None
        self.device = next(iter(pools.k.values())).device
        self.block_ms = _block_ms(model, attention)
        self.buffers: ForwardBuffers | None = None
        self.graphs: StepGraphs | None = None
        if graphs or fixed_buffers:
            self.buffers = ForwardBuffers(pools, max_tokens=max_tokens, max_seqs=max_seqs, width=width,
                                          block_ms=self.block_ms, device=self.device)
        if (compile or explain) and self.buffers is None:
            raise ValueError("compile / explain run the decode forward of the fixed buffers: pass graphs or "
                             "fixed_buffers")
        self._decode_forward = maybe_compile(self._decode_forward_eager, compile)
        if graphs:
            self.graphs = StepGraphs(self._bucket_forward, "tick")
        self._explain_pending = explain
        self.explain: dict[str, Any] | None = None
        self._last: tuple[Tensor, Tensor | None] | None = None  # the last decode-only tick's (logits, argmax)
        self.steps = 0
        self.tokens = 0
        self.shrunk = 0
        self.deferred = 0
        self.eager_steps = 0
        self.decode_steps = 0
        self.slow_rows = 0
        self.fed_rows = 0
        self.decode_eager_steps = 0

    @torch.inference_mode()
    def run(self, decode_rows: Sequence[PagedKVCache], decode_ids: Sequence[int],
            chunks: Sequence[tuple[PagedKVCache, Sequence[int], bool]], sources: Sequence[int] | None = None,
            previous: Tensor | None = None) -> tuple[Tensor | None, list[Tensor | None], list[int]]:
        """Decode ``decode_ids[i]`` on ``decode_rows[i]`` and append ``chunks[j] = (row, tokens, want_logits)``.
        With ``sources``, decode row ``i`` consumes ``previous[sources[i]]`` instead where ``sources[i] >= 0``
        (asynchronous decode: the previous step's device tokens, gathered on the device before the forward).

        Returns (decode logits [B, vocab] or None, valid until the next call; per chunk its last position's
        logits [1, vocab] (a copy) where wanted and the chunk ran whole; per chunk the tokens it ran: all of
        them, or fewer when its pool was short, 0 = left out, row unchanged). Raises KVCapacityError before
        changing anything if the decode rows' blocks cannot be supplied."""
        if len(decode_ids) != len(decode_rows):
            raise ValueError(f"got {len(decode_ids)} input ids for {len(decode_rows)} decode rows")
        if not chunks:
            return (self._decode(decode_rows, decode_ids, sources, previous) if decode_rows else None), [], []
        fed = count_fed(sources, previous, len(decode_rows))
        prepare_decode_rows(self.pools, decode_rows)
        taken: list[int] = []
        sizes = [len(tokens) for _, tokens, _ in chunks]
        for index, (row, _, _) in enumerate(chunks):
            while sizes[index] > 0:  # a short pool takes a shorter chunk (its old window needs fewer blocks)
                try:
                    # a one-token chunk reads only its own window, like a decode row: free what it leaves first
                    row.prepare_append(sizes[index], release=sizes[index] == 1)
                    break
                except KVCapacityError:
                    sizes[index] //= 2
                    self.shrunk += 1
            if sizes[index]:
                taken.append(index)
            else:
                self.deferred += 1
        out: list[Tensor | None] = [None] * len(chunks)
        rows = [*decode_rows, *(chunks[i][0] for i in taken)]
        if not rows:
            return None, out, sizes
        num_decode = len(decode_rows)
        tokens = [*([t] for t in decode_ids), *(chunks[i][1][: sizes[i]] for i in taken)]
        wanted = [i for i in taken if chunks[i][2] and sizes[i] == len(chunks[i][1])]
        seq_of = {i: num_decode + j for j, i in enumerate(taken)}
        tick = pack_tick(self.pools, rows, tokens, [*range(num_decode), *(seq_of[i] for i in wanted)])
        logits = self._forward(tick, (sources, previous) if fed else None)
        for row in decode_rows:
            row.commit_append(1)
        for i in taken:
            row = chunks[i][0]
            row.commit_append(sizes[i])
            row.release_out_of_window(0)
        for k, i in enumerate(wanted, start=num_decode):
            out[i] = logits[k : k + 1].clone()
        self.steps += 1
        self.tokens += tick.num_tokens
        return (logits[:num_decode] if num_decode else None), out, sizes

    def _decode(self, rows: Sequence[PagedKVCache], ids: Sequence[int], sources: Sequence[int] | None,
                previous: Tensor | None) -> Tensor:
        """The decode-only tick of :meth:`run`: block bookkeeping, then the padded bucket of the fixed buffers
        (graph replay on CUDA) or an eager decode-only batch (no buffers, tensor parallel). Logits [B, vocab]
        valid until the next call; with the fixed buffers the argmax taken in the same forward is kept for
        :meth:`greedy_tokens`."""
        fed = count_fed(sources, previous, len(rows))
        slow = prepare_decode_rows(self.pools, rows)
        buffers, count = self.buffers, len(rows)
        tokens: Tensor | None = None
        if buffers is not None and self.mirror is None:
            bucket = buffers.load_decode(rows, ids, sources if fed else None)
            if fed:
                assert previous is not None
                buffers.decode.feed_previous(previous, bucket)
            if self._explain_pending:
                self.run_explain(bucket)
            key = (bucket, True, bucket)
            logits, tokens = self.graphs.run(key) if self.graphs is not None else self._bucket_forward(key)
            logits, tokens = logits[:count], tokens[:count]
        else:
            tick = pack_tick(self.pools, rows, [[token] for token in ids], range(count), decode_only=True)
            logits = self._forward(tick, (sources, previous) if fed else None)  # type: ignore[arg-type]
            self.decode_eager_steps += 1
        for row in rows:
            row.commit_append(1)
        self.decode_steps += 1
        self.slow_rows += slow
        self.fed_rows += fed
        self._last = (logits, tokens)
        return logits

    def greedy_tokens(self, logits: Tensor) -> Tensor | None:
        """The device argmax the last decode-only tick's forward took, if ``logits`` is the tensor it returned
        and it ran on the fixed buffers; else None (the caller samples)."""
        if self._last is not None and logits is self._last[0]:
            return self._last[1]
        return None

    def run_explain(self, bucket: int) -> dict[str, Any]:
        """``torch._dynamo.explain`` of the decode-only ``bucket`` forward now (runs it once: the buffers must
        hold a valid decode step, e.g. all padding); also kept in :attr:`explain`."""
        self._explain_pending = False
        self.explain = explain_report(self._decode_forward_eager, bucket)
        return self.explain

    def capture_all(self) -> dict[GraphKey, float]:
        """Capture every decode-only row bucket's graph and every token bucket's at each of its logits-row counts
        (``ForwardBuffers.logit_rows``) now (all padding: only scratch blocks are written); returns seconds per graph
        key. No-op without graphs."""
        if self.graphs is None or self.buffers is None:
            return {}
        buffers = self.buffers
        with torch.inference_mode():
            for bucket in buffers.decode_buckets:
                if not self.graphs.has((bucket, True, bucket)):
                    buffers.decode.load([], [], bucket)
                    self.graphs.capture((bucket, True, bucket))
            for bucket in buffers.buckets:
                keys = [(bucket, False, rows) for rows in buffers.logit_rows[bucket]]
                missing = [key for key in keys if not self.graphs.has(key)]
                if missing:
                    buffers.load_padding(bucket)  # one staging serves every logits-row count of the bucket
                for key in missing:
                    self.graphs.capture(key)
        return dict(self.graphs.capture_seconds)

    def _forward(self, tick: PackedTick, feed: tuple[Sequence[int], Tensor] | None = None) -> Tensor:
        """Logits [R, vocab] of ``tick.logit_seqs`` (a graph replay's rows beyond R are padding). ``feed``:
        (sources, previous tokens) of the decode rows, the first sequences of the batch."""
        if self.mirror is None:
            return self.forward_tick(tick, feed)
        if feed is not None:
            raise RuntimeError("a tick fed from the previous step's device tokens cannot be mirrored to other "
                               "ranks (tensor parallel runs synchronous ticks)")
        self.mirror.send_forward(tick)
        try:
            return self.forward_tick(tick)
        except BaseException as exc:
            self.mirror.forward_failed(exc)
            raise

    def forward_tick(self, tick: PackedTick, feed: tuple[Sequence[int], Tensor] | None = None) -> Tensor:
        """The forward of a packed tick over the pools as they are (no block bookkeeping): logits [R, vocab].
        Rank 0 reaches it through :meth:`run`; tensor-parallel workers call it with rank 0's tick. A
        decode-only tick runs here eagerly (the fixed buffers stage decode-only ticks in :meth:`run`)."""
        buffers = self.buffers
        if (buffers is not None and not tick.decode_only
                and buffers.bucket_for(tick.num_tokens, len(tick.query_lens)) is not None):
            bucket = buffers.load(tick, feed[0] if feed is not None else None)
            if feed is not None:
                buffers.feed_previous(feed[1])
            key = (bucket, False, buffers.logit_rows_for(bucket, len(tick.logit_seqs)))
            run = self.graphs.run if self.graphs is not None else self._bucket_forward
            return run(key)[0][: len(tick.logit_seqs)]
        if not tick.decode_only:
            self.eager_steps += 1
        batch = build_forward_batch(self.pools, tick, self.device, self.block_ms)
        if feed is not None:
            sources = to_device(list(feed[0]), torch.int64, self.device)
            feed_previous(batch.ids[: len(sources)], sources, feed[1])
        return self.forward_batch(batch)

    def _bucket_forward(self, key: GraphKey) -> tuple[Tensor, ...]:
        bucket, decode_only, rows = key
        if decode_only:
            return self._decode_forward(bucket)
        assert self.buffers is not None
        return (self.forward_batch(self.buffers.view(bucket, rows)),)

    def _decode_forward_eager(self, bucket: int) -> tuple[Tensor, Tensor]:
        """The decode-only forward of ``bucket`` rows of the fixed buffers: (logits [b, V], argmax [b])."""
        assert self.buffers is not None
        logits = self.forward_batch(self.buffers.decode_view(bucket))
        return logits, logits.argmax(dim=-1)

    def forward_batch(self, batch: ForwardBatch) -> Tensor:
        """The whole forward of ``batch``: logits [len(logit_seqs), vocab]. Reads only ``batch`` and the pools
        (graph-capturable for a padded batch of fixed buffers). A decode-only batch runs as ``[S, 1]`` with the
        paged decode kernel, any other as ``[1, T]`` with the ragged kernel (:func:`paged_context`)."""
        context = paged_context(self.model.config, self.pools, batch, self.attention, self.narrow_layer,
                                self.decode_kernel)
        if batch.decode_only:
            hidden = self.model.forward_hidden(batch.ids[:, None], batch.positions[:, None], context)
            return self.model.compute_logits(hidden[:, -1])
        logit_tokens = batch.logit_tokens()
        narrow = None if self.narrow_layer is None else (self.narrow_layer, logit_tokens)
        hidden = self.model.forward_hidden(batch.ids[None], batch.positions[None], context, narrow)
        picked = hidden[0] if narrow is not None else hidden[0, logit_tokens]
        if picked.shape[0] == 0:  # no logits wanted (an unpadded batch of mid-prompt chunks)
            return picked.new_empty((0, self.model.config.vocab_size))
        return self.model.compute_logits(picked)
