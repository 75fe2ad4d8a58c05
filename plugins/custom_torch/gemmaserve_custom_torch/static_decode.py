"""`StaticDecoder`: batched decode over fixed buffers (`BatchedDecodeState`), replayed as CUDA graphs.

A step of ``B`` rows runs at the smallest bucket ``b >= B`` (``graph_buckets``): rows ``B..b-1`` are padding
(see ``kv/decode_state.py``). The forward of a bucket reads only the state's fixed buffers and the pools, so
it is captured once per bucket (``graphs.py``) and replayed; ``use_graphs=False`` runs the identical
forward eagerly (the parity reference). The forward also takes the greedy argmax on the device, which
:meth:`greedy_tokens` hands to the sampler when every row is greedy.

Per-step host work: the block bookkeeping of rows that cross a block boundary (the others pass
``PagedKVCache.decode_needs_nothing``), one H2D copy of ids + positions (+ sources), and H2D copies of the table
rows that changed; none of it waits for the device. Asynchronous decode passes ``previous`` (the device tokens
of the step before) and per row the index it feeds on, gathered on the device before the forward. Logits
returned by :meth:`decode` live in a buffer the next step overwrites.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .graphs import StepGraphs, explain_report, maybe_compile
from .kv.batched import BatchedPagedKVCache, DecodeState, PagedDecodeContext
from .kv.decode_state import BatchedDecodeState, count_fed, graph_buckets, pick_bucket
from .kv.paged_cache import prepare_decode_rows
from .kv.pools import KVPools
from .models.fusion import moe_is_fused
from .models.gemma import GemmaForCausalLM
from .settings import CustomTorchSettings

__all__ = ["StaticDecoder", "make_decoder"]

logger = logging.getLogger(__name__)


class StaticDecoder:
    """Decode steps of a `BatchedPagedKVCache` through fixed buffers. Not thread-safe (backend lock).

    ``kernel``: paged decode attention with ``paged_decode_attention``'s signature. ``compile_model``:
    run the forward through ``torch.compile(dynamic=False)`` (one compilation per bucket). ``explain``:
    log ``torch._dynamo.explain`` counts for the first bucket run (kept in :attr:`explain`)."""

    def __init__(
        self,
        model: GemmaForCausalLM,
        pools: KVPools,
        *,
        buckets: Sequence[int],
        width: int,
        kernel: Callable[..., Tensor],
        use_graphs: bool,
        compile_model: bool = False,
        explain: bool = False,
    ) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive sizes, got {buckets}")
        self.model = model
        self.pools = pools
        self.buckets = tuple(buckets)
        self.kernel = kernel
        self.state = BatchedDecodeState(pools, self.buckets[-1], width)
        self._forward = maybe_compile(self._forward_eager, compile_model)
        self.graphs = StepGraphs(self._run_forward, "decode") if use_graphs else None
        self._explain_pending = explain
        self.explain: dict[str, Any] | None = None
        self._last: tuple[Tensor, Tensor] | None = None
        self.steps = 0
        self.slow_rows = 0  # rows that needed block bookkeeping (for stats)
        self.fed_rows = 0  # rows that consumed the previous step's device token (asynchronous decode)

    @torch.inference_mode()
    def decode(self, batch: BatchedPagedKVCache, input_ids: Sequence[int], sources: Sequence[int] | None = None,
               previous: Tensor | None = None) -> Tensor:
        """Row ``i`` consumes ``input_ids[i]``, or ``previous[sources[i]]`` when ``sources[i] >= 0`` (device
        tokens of the step before); returns logits [B, vocab] (valid until the next call). Raises
        KVCapacityError before changing any row's length if a pool cannot supply the new blocks."""
        rows = batch.rows
        if len(input_ids) != len(rows) or not rows:
            raise ValueError(f"got {len(input_ids)} input ids for a batch of {len(rows)} rows")
        fed = count_fed(sources, previous, len(rows))
        bucket = pick_bucket(self.buckets, len(rows))
        slow = prepare_decode_rows(self.pools, rows)
        self.state.load(rows, input_ids, bucket, sources if fed else None)
        if fed:
            self.state.feed_previous(previous, bucket)
            self.fed_rows += fed
        if self._explain_pending:
            self.run_explain(bucket)
        logits, tokens = self.graphs.run(bucket) if self.graphs is not None else self._run_forward(bucket)
        for row in rows:
            row.commit_append(1)
        self.steps += 1
        self.slow_rows += slow
        self._last = (logits[: len(rows)], tokens[: len(rows)])
        return self._last[0]

    def greedy_tokens(self, logits: Tensor) -> Tensor | None:
        """The device argmax of ``logits`` if it is the tensor the last :meth:`decode` returned, else None."""
        if self._last is not None and logits is self._last[0]:
            return self._last[1]
        return None

    def run_explain(self, bucket: int) -> dict[str, Any]:
        """``torch._dynamo.explain`` of the ``bucket`` forward now (runs it once: the state must hold a valid
        step, e.g. all padding); also kept in :attr:`explain`."""
        self._explain_pending = False
        self.explain = explain_report(self._forward_eager, bucket)
        return self.explain

    def capture_all(self) -> dict[int, float]:
        """Capture every bucket's graph now (all rows padding, so only scratch blocks are written);
        returns seconds per bucket. No-op without graphs."""
        if self.graphs is None:
            return {}
        with torch.inference_mode():
            for bucket in self.buckets:
                if not self.graphs.has(bucket):
                    self.state.load([], [], bucket)
                    self.graphs.capture(bucket)
        return dict(self.graphs.capture_seconds)

    def _run_forward(self, bucket: int) -> tuple[Tensor, Tensor]:
        return self._forward(bucket)

    def _forward_eager(self, bucket: int) -> tuple[Tensor, Tensor]:
        """The whole decode forward of ``bucket`` rows from the state buffers: (logits [b, V], argmax [b])."""
        positions, seq_lens, tables, slots = self.state.step_tensors(bucket)
        step = DecodeState(positions, seq_lens, tables, slots, {}, {})
        context = PagedDecodeContext(self.model.config, self.pools, step, "triton", self.kernel)
        ids = self.state.ids[:bucket, None]
        hidden = self.model.forward_hidden(ids, positions[:, None], context)
        logits = self.model.compute_logits(hidden[:, -1])
        return logits, logits.argmax(dim=-1)


def make_decoder(
    model: GemmaForCausalLM, pools: KVPools, custom: CustomTorchSettings, attention: str, max_batch_size: int,
    *, width: int,
) -> StaticDecoder | None:
    """The backend's fixed-buffer decoder for triton attention (CUDA graphs on CUDA unless the model has MoE
    layers on the eager expert loop, whose host sync cannot be captured); None for the gather path. ``width``: blocks
    of the longest row. Captures every bucket now with ``CUSTOM_BACKEND_GRAPH_CAPTURE=startup``."""
    on_cuda = next(iter(pools.k.values())).device.type == "cuda"
    if attention != "triton":
        if custom.compile or custom.explain or (custom.cuda_graph and on_cuda):
            logger.warning("custom_torch: CUDA graphs / COMPILE / EXPLAIN need CUSTOM_BACKEND_ATTENTION=triton "
                           "(auto on CUDA); decode runs eagerly on the gather path")
        return None
    from .kernels.paged_attention import paged_decode_attention

    use_graphs = custom.cuda_graph and on_cuda
    if use_graphs and not moe_is_fused(model):
        logger.warning("custom_torch: MoE models decode without CUDA graphs unless their experts are fused "
                       "(CUSTOM_BACKEND_FUSE): the eager expert loop syncs the host")
        use_graphs = False
    decoder = StaticDecoder(
        model, pools, buckets=graph_buckets(max_batch_size), width=width, kernel=paged_decode_attention,
        use_graphs=use_graphs, compile_model=custom.compile, explain=custom.explain,
    )
    if custom.graph_capture == "startup":
        seconds = decoder.capture_all()
        logger.info("custom_torch: captured %d decode graphs in %.1f s", len(seconds), sum(seconds.values()))
    return decoder
