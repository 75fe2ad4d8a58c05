"""`CustomTorchBackend`: the InferenceBackend of custom-{cuda,mps,cpu} over the hand-written Gemma model.

In-flight KV is one `PagedKVCache` per row (``RowKV``) and a `BatchedPagedKVCache` for the decoding rows
(``BatchKV``). With triton attention (auto on CUDA) decode runs through a `StaticDecoder` (fixed buffers,
CUDA graphs per batch bucket on CUDA); the gather path runs `PagedRunner.decode`. On CUDA, prefill uses
SDPA and q/k/v + gate/up weights and RMSNorms are fused at load (``CUSTOM_BACKEND_PREFILL_ATTENTION`` /
``_FUSE``); cold prefill chunks replay CUDA graphs per padded length (`GraphPrefill`, ``_PREFILL_GRAPH``). It caches prefixes itself (`PrefixCache`, progressively after every prefill chunk), so
``set_cache_adapter`` is a no-op, and admits by window-aware block reservations (`KVAdmission`). All methods run under ``self.lock`` (the caller's job).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gemmaserve.backend import (
    BackendCapabilities,
    InferenceBackend,
    ModelInfo,
    PrefillState,
    SampledTokens,
    StepOutput,
)
from gemmaserve.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from gemmaserve.sampling_params import RowSampling
from gemmaserve.settings import CoreSettings

from .kernels import HAS_TRITON
from .batched_prefill import BatchedPrefill
from .kv import BatchedPagedKVCache, KVAdmission, KVPools, PagedKVCache, PrefixCache, kv_groups, plan_pool_sizes
from .models.fusion import fuse_elementwise, fuse_norms, fuse_projections
from .mixed_step import MixedStep
from .models.gemma import GemmaForCausalLM
from .prefill_graphs import make_graph_prefill
from .runner import PagedRunner
from .sampling import sample_tokens
from .settings import CustomTorchSettings, load_custom_settings, resolve_attention, resolve_fast_paths
from .static_decode import make_decoder
from .tokenizer import HFTokenizer

__all__ = ["CustomTorchBackend", "create_backend"]

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def create_backend(model_path: str, device: str, settings: CoreSettings) -> CustomTorchBackend:
    """Registry factory: load ``model_path`` on ``device`` with ``CUSTOM_BACKEND_*`` settings from the env."""
    return CustomTorchBackend.from_checkpoint(model_path, device, settings, load_custom_settings())


class CustomTorchBackend(InferenceBackend):
    """Paged-KV backend; see the module docstring. Build with :meth:`from_checkpoint`."""

    def __init__(
        self,
        model: GemmaForCausalLM,
        tokenizer: HFTokenizer,
        settings: CoreSettings,
        custom: CustomTorchSettings,
        *,
        name: str = "gemma",
    ) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.custom = custom
        config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = custom.block_size or settings.kv_block_size
        max_len = min(settings.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.attention = resolve_attention(custom.attention, self.device.type, HAS_TRITON)
        on_cuda = self.device.type == "cuda"
        batched_prefill = custom.batched_prefill == "on" or (custom.batched_prefill == "auto" and on_cuda)
        # chunks that read their old window from the pools keep it until their forward ends (mixed step too)
        fixed_buffer_prefill = custom.mixed_step or batched_prefill or (
            custom.prefill_graph and on_cuda and not config.moe_num_experts)
        windows = [g.window for g in kv_groups(config) if g.window is not None]
        num_blocks = plan_pool_sizes(
            kv_groups(config), self.block_size, param.element_size(), _budget_bytes(config, settings, custom, param),
            sliding_blocks=custom.sliding_blocks, max_rows=settings.max_batch_size,
            # a fixed-buffer prefill chunk keeps its first queries' sliding blocks until its forward ends
            sliding_headroom_tokens=min([settings.prefill_chunk_tokens, *windows]) if fixed_buffer_prefill else 0,
        )
        self.pools = KVPools(config, num_blocks, self.block_size, self.dtype, self.device)
        self.prefix_cache = PrefixCache(self.pools)
        self.admission = KVAdmission(self.pools.geometry, num_blocks)
        self.prefill_attention, fuse = resolve_fast_paths(custom, self.device.type)
        if fuse:
            fuse_projections(model)
            if HAS_TRITON and self.device.type == "cuda":
                fuse_norms(model)
                fuse_elementwise(model)
        self.graph_prefill = make_graph_prefill(model, self.pools, custom, self.prefill_attention,
                                                settings.prefill_chunk_tokens)
        self.runner = PagedRunner(model, self.pools, self.attention, self.prefill_attention, self.graph_prefill)
        self.batched_prefill: BatchedPrefill | None = None
        if batched_prefill:
            # with CUDA-graph prefill, one or a few chunks are cheaper replayed one by one than run eagerly
            self.batched_prefill = BatchedPrefill(model, self.pools, self.prefill_attention,
                                                  min_rows=4 if self.graph_prefill is not None else 2)
        self.decoder = make_decoder(model, self.pools, custom, self.attention, settings.max_batch_size,
                                    width=-(-max_len // self.block_size))
        self.mixed: MixedStep | None = None
        if custom.mixed_step:
            graphs = custom.cuda_graph and on_cuda and self.attention == "triton" and not config.moe_num_experts
            self.mixed = MixedStep(model, self.pools, "triton" if self.attention == "triton" else "reference",
                                   fast_prefill=custom.fast_prefill, graphs=graphs,
                                   max_tokens=settings.max_num_batched_tokens, max_seqs=settings.max_batch_size,
                                   width=-(-max_len // self.block_size))
        if self.mixed is not None and custom.graph_capture == "startup":
            seconds = self.mixed.capture_all()
            logger.info("custom_torch: captured %d tick graphs in %.1f s", len(seconds), sum(seconds.values()))
        windows_all = [g.window for g in kv_groups(config) if g.window is not None]
        self._max_step_chunk = min(windows_all) if windows_all else None  # a chunk stores every position it reads
        self.capabilities = BackendCapabilities(
            continuous_batching=True, uses_core_cache_manager=False, kv_reservation=True, logprobs=True,
            mixed_step=self.mixed is not None,
        )
        self.model_info = ModelInfo(
            name=name, vocab_size=config.vocab_size, max_model_len=max_len, eos_token_ids=config.eos_token_ids,
            architecture=config.model_type, dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
        )
        logger.info(
            "custom_torch: %s on %s (%s), block size %d, pools %s (%.1f MiB), decode attention %s (%s), prefill "
            "attention %s (%s), fused projections %s",
            name, self.device, self.model_info.dtype, self.block_size, num_blocks, self.pools.nbytes / 2**20,
            self.attention, "fixed buffers" if self.decoder is None else (
                "CUDA graphs" if self.decoder.graphs is not None else "fixed buffers, eager"),
            self.prefill_attention, "CUDA graphs for cold chunks" if self.graph_prefill else "eager", fuse,
        )

    @classmethod
    def from_checkpoint(
        cls, model_path: str | Path, device: str, settings: CoreSettings, custom: CustomTorchSettings
    ) -> CustomTorchBackend:
        """Load weights and tokenizer from a checkpoint folder. Raises ModelLoadError on a bad folder."""
        dtype = _DTYPES.get(settings.dtype) or (torch.float32 if device == "cpu" else torch.bfloat16)
        try:
            model = GemmaForCausalLM.from_hf(model_path, device=device, dtype=dtype)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load {model_path} with the custom_torch backend: {exc}") from exc
        return cls(model, HFTokenizer.from_pretrained(model_path), settings, custom, name=Path(model_path).name)

    # -- prefill -------------------------------------------------------------------------------
    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        if len(prompt) > self.model_info.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens but the model takes at most {self.model_info.max_model_len}"
            )
        row, hit = self.prefix_cache.lookup(prompt)
        self.last_cache_hit_tokens = hit
        return PrefillState(prompt, row, num_cached=hit, num_computed=hit)

    def prefill_chunk(self, state: PrefillState, num_tokens: int) -> None:
        num = min(num_tokens, state.num_remaining)
        if num <= 0:
            return
        start = state.num_computed
        done = start + num == len(state.prompt_ids)
        logits = self.runner.prefill(state.kv, state.prompt_ids[start : start + num], want_logits=done)
        state.num_computed += num
        self.prefix_cache.cache_prefix(state.prompt_ids, state.kv)  # before the next chunk drops sliding blocks
        if done:
            state.last_logits = logits

    def prefill_chunks(self, states: Sequence[PrefillState], num_tokens: Sequence[int]) -> list[Exception | None]:
        """Chunks that fit a batch (at most 128 tokens and the window) run through `BatchedPrefill`, in
        sub-batches of at least ``min_rows`` rows; the rest, and the rows of a batch that raised, run one by
        one (:meth:`prefill_chunk`), each reporting its own exception."""
        if len(states) != len(num_tokens):
            raise ValueError(f"{len(states)} states but {len(num_tokens)} chunk sizes")
        items = [(state, min(num, state.num_remaining)) for state, num in zip(states, num_tokens)]
        batched = self.batched_prefill
        eligible = [] if batched is None else [i for i, (s, n) in enumerate(items) if batched.applies(s.kv, n)]
        done: set[int] = set()
        errors: list[Exception | None] = [None] * len(items)
        if batched is not None and len(eligible) >= batched.min_rows:
            sizes = [items[i][1] for i in eligible]
            for group in batched.plan(sizes, [batched.num_keys(items[i][0].kv, items[i][1]) for i in eligible]):
                if len(group) < batched.min_rows:
                    continue
                chosen = [items[eligible[j]] for j in group]
                chunks = [state.prompt_ids[state.num_computed : state.num_computed + num] for state, num in chosen]
                finals = [state.num_computed + num == len(state.prompt_ids) for state, num in chosen]
                try:  # nothing has moved if this raises: the rows run one by one below, reusing prepared blocks
                    logits = batched.prefill([state.kv for state, _ in chosen], chunks, finals)
                except Exception as exc:
                    batched.fallbacks += 1
                    logger.info("custom_torch: batched prefill of %d rows fell back to one by one: %s: %s",
                                len(chosen), type(exc).__name__, exc)
                    continue
                done.update(eligible[j] for j in group)
                for (state, num), final, row_logits in zip(chosen, finals, logits):  # cannot raise
                    state.num_computed += num
                    if final:
                        state.last_logits = row_logits
                for j in group:
                    state = items[eligible[j]][0]
                    try:
                        self.prefix_cache.cache_prefix(state.prompt_ids, state.kv)
                    except Exception as exc:  # this request fails alone; its KV is consistent
                        errors[eligible[j]] = exc
        for i, (state, num) in enumerate(items):
            if i not in done and num > 0:
                try:
                    self.prefill_chunk(state, num)
                except Exception as exc:
                    errors[i] = exc
        return errors

    def forward_step(
        self, states: Sequence[PrefillState], num_tokens: Sequence[int], batched: BatchedPagedKVCache | None,
        input_ids: Sequence[int],
    ) -> StepOutput:
        """The tick as one `MixedStep` forward; a tick without chunks replays the decode graphs instead (when
        the fixed-buffer decoder exists). Chunks are capped at the narrowest window (each then stores every
        position its queries read). A chunk whose pool is short runs shorter; one that cannot take a single
        token runs alone afterwards (`prefill_chunk`, which frees its old window first); a chunk's
        prefix-cache failure is reported for it alone."""
        if self.mixed is None:
            return super().forward_step(states, num_tokens, batched, input_ids)
        if len(states) != len(num_tokens):
            raise ValueError(f"{len(states)} states but {len(num_tokens)} chunk sizes")
        rows = batched.rows if batched is not None else []
        if len(input_ids) != len(rows):
            raise ValueError(f"got {len(input_ids)} input ids for a batch of {len(rows)} rows")
        cap = self._max_step_chunk
        sizes = [min(num, state.num_remaining, cap or num) for state, num in zip(states, num_tokens)]
        work = [i for i, n in enumerate(sizes) if n > 0]
        if not work:
            logits = self.decode_step_batched(batched, input_ids) if rows else None
            return StepOutput([None] * len(states), logits)
        chunks = []
        for i in work:
            state, n = states[i], sizes[i]
            start = state.num_computed
            chunks.append((state.kv, state.prompt_ids[start : start + n], start + n == len(state.prompt_ids)))
        decode_logits, chunk_logits, ran = self.mixed.run(rows, input_ids, chunks)
        errors: list[Exception | None] = [None] * len(states)
        for j, i in enumerate(work):
            state = states[i]
            try:
                if not ran[j]:  # not one token fitted: the one-row path releases before it allocates
                    self.prefill_chunk(state, sizes[i])
                    continue
                state.num_computed += ran[j]
                if state.num_computed == len(state.prompt_ids):
                    state.last_logits = chunk_logits[j]
                self.prefix_cache.cache_prefix(state.prompt_ids, state.kv)
            except Exception as exc:  # this request fails alone; the others' KV is consistent
                errors[i] = exc
        return StepOutput(errors, decode_logits)

    def prefill_store(self, state: PrefillState) -> None:
        if state.is_complete:
            self.prefix_cache.store(state.prompt_ids, state.kv)

    # -- batch ops -----------------------------------------------------------------------------
    def stack_caches_left_padded(self, rows: Sequence[PagedKVCache]) -> BatchedPagedKVCache:
        batch = BatchedPagedKVCache(self.pools, self.device)
        for row in rows:
            batch.append(row)
        return batch

    def splice_into_batched(
        self, batched: BatchedPagedKVCache | None, new_kv: PagedKVCache, kv_len: int
    ) -> BatchedPagedKVCache:
        if kv_len != new_kv.length:
            raise ValueError(f"kv_len {kv_len} != the row's {new_kv.length} KV tokens")
        batch = batched if batched is not None else BatchedPagedKVCache(self.pools, self.device)
        batch.append(new_kv)
        return batch

    def remove_row_from_cache(self, batched: BatchedPagedKVCache, row_idx: int) -> None:
        batched.pop(row_idx).free_all()

    def decode_step_batched(self, batched: BatchedPagedKVCache, input_ids: Sequence[int]) -> torch.Tensor:
        """Logits [rows, vocab]; on the fixed-buffer path they are overwritten by the next step."""
        if self.decoder is not None:
            return self.decoder.decode(batched, input_ids)
        return self.runner.decode(batched, input_ids)

    def kv_length(self, kv: PagedKVCache | BatchedPagedKVCache, row_idx: int | None = None) -> int:
        if isinstance(kv, BatchedPagedKVCache):
            if row_idx is None:
                raise ValueError("kv_length of a batched KV needs row_idx")
            return kv.rows[row_idx].length
        return kv.length

    def sample(
        self, logits: torch.Tensor, rows: Sequence[RowSampling], *, want_logprobs: bool = False
    ) -> SampledTokens:
        greedy = None
        if self.decoder is not None and not want_logprobs and all(row.is_greedy for row in rows):
            greedy = self.decoder.greedy_tokens(logits)  # the argmax the decode graph already took
        if greedy is not None:
            return SampledTokens(greedy.tolist())  # int64 tensor: tolist() gives ints
        return sample_tokens(logits, rows, want_logprobs=want_logprobs)

    def free_row_kv(self, kv: PagedKVCache) -> None:
        kv.free_all()

    # -- admission -----------------------------------------------------------------------------
    def kv_reserve(self, request_id: str, num_tokens: int) -> bool:
        return self.admission.reserve(request_id, num_tokens)

    def kv_release(self, request_id: str) -> None:
        self.admission.release(request_id)

    def kv_stats(self) -> dict[str, int]:
        stats: dict[str, int] = {"blocks_total": 0, "blocks_used": 0, "blocks_free": 0}
        cached = self.prefix_cache.num_cached_blocks()
        for group, manager in self.pools.managers.items():
            short = "sliding" if group.startswith("sliding") else "full"
            values = {
                "blocks_total": manager.num_blocks, "blocks_used": manager.num_used, "blocks_free": manager.num_free,
                "blocks_cached": cached[group], "blocks_reserved": self.admission.reserved[group],
            }
            for key, value in values.items():
                stats[f"{short}_{key}"] = value
                if key in stats:
                    stats[key] += value
        stats.update(
            reserved_tokens=self.admission.reserved_tokens, reservations=len(self.admission),
            admission_rejections=self.admission.rejections, live_rows=len(self.pools.live_rows),
            prefix_hits=self.prefix_cache.stats["hits"], prefix_hit_tokens=self.prefix_cache.stats["hit_tokens"],
            prefix_lookups=self.prefix_cache.stats["lookups"],
        )
        if self.mixed is not None:
            stats.update(mixed_steps=self.mixed.steps, mixed_step_tokens=self.mixed.tokens,
                         mixed_step_shrunk_chunks=self.mixed.shrunk, mixed_step_deferred_chunks=self.mixed.deferred,
                         mixed_step_eager=self.mixed.eager_steps)
        if self.batched_prefill is not None:
            stats.update(prefill_batches=self.batched_prefill.batches, prefill_batch_fallbacks=self.batched_prefill.fallbacks)
        return stats

    # -- lifecycle -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pools.check_integrity()
        self.prefix_cache.check_integrity()
        self.admission.check_integrity()

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.prefix_cache.clear()
        for table in (self.pools.k, self.pools.v):
            table.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _budget_bytes(config: Any, settings: CoreSettings, custom: CustomTorchSettings, param: torch.Tensor) -> int:
    """The pool budget: KV_MEMORY_GB, or KV_BLOCKS uniform blocks, or by default uniform blocks for
    MAX_ACTIVE_KV_TOKENS (plus one partial block per row), capped at 90% of free CUDA memory or a quarter
    of the host RAM."""
    block_size = custom.block_size or settings.kv_block_size
    uniform = sum(g.bytes_per_block(block_size, param.element_size()) for g in kv_groups(config))
    if custom.kv_memory_gb is not None:
        return int(custom.kv_memory_gb * 2**30)
    if custom.kv_blocks is not None:
        return custom.kv_blocks * uniform
    blocks = -(-settings.max_active_kv_tokens // block_size) + settings.max_batch_size
    wanted = blocks * uniform
    if param.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(param.device)
        cap = int(free * 0.9)
    else:
        cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4 if hasattr(os, "sysconf") else wanted
    if wanted > cap:
        logger.warning("custom_torch: KV pools capped at %.1f GiB (MAX_ACTIVE_KV_TOKENS wants %.1f GiB)",
                       cap / 2**30, wanted / 2**30)
    return min(wanted, cap)
