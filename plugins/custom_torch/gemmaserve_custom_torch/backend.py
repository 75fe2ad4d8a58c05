"""`CustomTorchBackend`: the InferenceBackend of custom-{cuda,mps,cpu} over the hand-written Gemma model.

In-flight KV is one `PagedKVCache` per row (``RowKV``) and a `BatchedPagedKVCache` for the decoding rows
(``BatchKV``). Every forward is a `MixedStep` tick: ``forward_step`` (decode rows + chunks), the
``prefill_chunk(s)`` primitives (prefill-only ticks) and ``decode_step_*`` (decode-only ticks). A tick with
prompt tokens is one ragged forward (CUDA graph per token bucket on CUDA); a decode-only tick runs the paged
decode kernel (triton; the gather reference on the portable path), on CUDA from fixed buffers replayed as a
CUDA graph per row bucket, with the greedy argmax taken inside the graph. A chunk whose sliding pool cannot
hold even one token's blocks runs alone on `PagedRunner.prefill` (it gathers its old window, then frees it).
q/k/v + gate/up weights, RMSNorms and
the elementwise chains are fused at load on CUDA (``CUSTOM_BACKEND_FUSE``). It caches prefixes itself
(`PrefixCache`, progressively after every prefill chunk), so ``set_cache_adapter`` is a no-op, and admits by
window-aware block reservations (`KVAdmission`). All methods run under ``self.lock`` (the caller's job).

Tensor parallel (``TENSOR_PARALLEL_SIZE`` N > 1, ``distributed/``): this process is rank 0 and holds its weight
shard; `TensorParallelWorkers` runs ranks 1..N-1. Every `MixedStep` tick is then eager (no fixed buffers, no
CUDA graphs, no asynchronous decode), and its `PackedTick` goes to the workers
right before rank 0 runs it, and every block copy outside a forward is repeated on them; sampling stays here.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gemmaserve.backend import (
    BackendCapabilities,
    InferenceBackend,
    LaunchedStep,
    ModelInfo,
    PendingTokens,
    PrefillState,
    ReadyTokens,
    SampledTokens,
    StepOutput,
    resolve_rows,
)
from gemmaserve.errors import (
    ConfigurationError,
    InvalidRequestError,
    KVCapacityError,
    ModelLoadError,
    PromptTooLongError,
)
from gemmaserve.hardware import cpu_has_native_bfloat16
from gemmaserve.sampling_params import RowSampling
from gemmaserve.settings import CoreSettings

from .distributed.shards import check_shardable
from .distributed.workers import TensorParallelWorkers, rank_device
from .kernels import HAS_TRITON
from .kv import (BatchedPagedKVCache, KVAdmission, KVPools, PagedKVCache, PrefixCache, kv_groups,
                 plan_pools_for_settings, reference_tokens)
from .models.fusion import (
    fuse_elementwise,
    fuse_moe,
    fuse_norms,
    fuse_projections,
    fuse_small_batch,
    moe_is_fused,
)
from .mixed_step import MixedStep
from .models.config import GemmaTextConfig
from .models.gemma import GemmaForCausalLM
from .models.quantization import uses_fp8
from .runner import PagedRunner
from .sampling import DeviceTokens, pinned_mask_memory, sample_on_device, sample_tokens
from .settings import CustomTorchSettings, load_custom_settings, resolve_attention, resolve_fast_paths
from .tokenizer import HFTokenizer

__all__ = ["CustomTorchBackend", "create_backend"]

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_dtype(device: str) -> torch.dtype:
    """``DTYPE=auto``: bfloat16 on GPUs and on CPUs with bfloat16 matmul instructions (AVX512_BF16 or AMX),
    float32 on other CPUs."""
    if device == "cpu" and not cpu_has_native_bfloat16():
        return torch.float32
    return torch.bfloat16


def create_backend(model_path: str, device: str, settings: CoreSettings) -> CustomTorchBackend:
    """Registry factory: load ``model_path`` on ``device`` with ``CUSTOM_BACKEND_*`` settings from the env."""
    return CustomTorchBackend.from_checkpoint(model_path, device, settings, load_custom_settings())


def fuse_model(model: GemmaForCausalLM) -> None:
    """Load-time fusion (``CUSTOM_BACKEND_FUSE``): q/k/v and gate/up matmuls, plus the norm, elementwise and
    fused-MoE kernels on CUDA with triton. Tensor-parallel workers fuse their shard the same way."""
    fuse_projections(model)
    if HAS_TRITON and next(model.parameters()).device.type == "cuda":
        fuse_norms(model)
        fuse_elementwise(model)
        fuse_moe(model)


#: CUSTOM_BACKEND_SKINNY_MAX_ROWS where it is unset and the load can run it: on an H100, E2B decode with the few-row
#: kernels and PDL took TPOT 3.35 -> 2.92 ms at 1 row, 3.54 -> 3.17 at 8, 3.67 -> 3.37 at 16 and 4.01 -> 3.95 at 32;
#: at 64 rows they were slower than cuBLAS (4.61 -> 4.80 ms; docs/benchmarks.md, run 28).
AUTO_SKINNY_MAX_ROWS = 32


def small_batch_plan(custom: CustomTorchSettings, device: torch.device, fused: bool,
                     tensor_parallel: bool = False, dense_fp8: bool = False) -> tuple[int, bool]:
    """(few-row matmul cap, programmatic dependent launches) for this load from CUSTOM_BACKEND_SKINNY_MAX_ROWS /
    CUSTOM_BACKEND_PDL: unset values take what the load can run (AUTO_SKINNY_MAX_ROWS, PDL on Hopper+ except for
    a dense model with FP8 weights: 31B FP8 decoded 6-7 % slower with it, runs 30 and 31); values asking for what
    it cannot run raise ConfigurationError naming what is missing."""
    names = "CUSTOM_BACKEND_SKINNY_MAX_ROWS / CUSTOM_BACKEND_PDL"
    asked = bool(custom.skinny_max_rows) or custom.pdl is True
    possible = HAS_TRITON and device.type == "cuda" and fused and not custom.compile and not tensor_parallel
    if asked and custom.compile:
        raise ConfigurationError(f"{names} are not supported under CUSTOM_BACKEND_COMPILE=1 (torch.compile would "
                                 "trace the Triton launches; the combination is not built): unset one or the other")
    if asked and tensor_parallel:
        raise ConfigurationError(f"{names} are not supported under tensor parallel (the worker ranks run cuBLAS and "
                                 "plain launches): unset them")
    if asked and not possible:
        raise ConfigurationError(f"{names} need a CUDA device, triton and fusion (CUSTOM_BACKEND_FUSE auto or on); "
                                 f"this load has device {device.type}, triton {'yes' if HAS_TRITON else 'no'}, fusion "
                                 f"{'on' if fused else 'off'}: unset them")
    rows = custom.skinny_max_rows if custom.skinny_max_rows is not None else (AUTO_SKINNY_MAX_ROWS if possible else 0)
    hopper = False
    if possible:
        from .kernels.pdl import pdl_supported

        hopper = pdl_supported(device)
    if custom.pdl is True and not hopper:
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigurationError(f"CUSTOM_BACKEND_PDL=1 needs compute capability 9.0 or newer (Hopper); this GPU has "
                                 f"{major}.{minor}: unset it")
    pdl = custom.pdl if custom.pdl is not None else hopper and not dense_fp8
    return rows, pdl


def decode_attention_kernel(pdl: bool) -> Callable[..., torch.Tensor] | None:
    """The paged decode attention kernel launched as a programmatic dependent (CUSTOM_BACKEND_PDL); None for the
    plain kernel."""
    if not pdl:
        return None
    from .kernels.paged_attention import paged_decode_attention

    return functools.partial(paged_decode_attention, pdl=True)


def _read_config(model_path: str | Path) -> GemmaTextConfig:
    """The checkpoint's text config (ModelLoadError on a bad folder), read before any weight or worker."""
    try:
        return GemmaTextConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {model_path} with the custom_torch backend: {exc}") from exc


def check_tensor_parallel_settings(custom: CustomTorchSettings, device: str) -> None:
    """Refuse the ``CUSTOM_BACKEND_*`` options tensor parallel does not run (ConfigurationError naming each): its
    ticks are eager `MixedStep` forwards, so the fixed-buffer options and CUDA graphs do not apply."""
    refused = []
    if custom.cuda_graph and torch.device(device).type == "cuda":
        refused.append("CUSTOM_BACKEND_CUDA_GRAPH=1 (CUDA graphs are not wired for the worker ranks yet: set "
                       "CUSTOM_BACKEND_CUDA_GRAPH=0)")
    if custom.graph_capture == "startup":
        refused.append("CUSTOM_BACKEND_GRAPH_CAPTURE=startup (no graphs are captured: leave it lazy)")
    if custom.compile:
        refused.append("CUSTOM_BACKEND_COMPILE=1 (it compiles the fixed-buffer decode forward, unused: unset it)")
    if custom.explain:
        refused.append("CUSTOM_BACKEND_EXPLAIN=1 (it explains the fixed-buffer decode forward, unused: unset it)")
    if custom.prefill_attention != "auto":
        refused.append(f"CUSTOM_BACKEND_PREFILL_ATTENTION={custom.prefill_attention} (it picks the one-row prefill "
                       "fallback's attention, which tensor parallel does not have: unset it)")
    if custom.skinny_max_rows or custom.pdl:
        refused.append("CUSTOM_BACKEND_SKINNY_MAX_ROWS / CUSTOM_BACKEND_PDL (the worker ranks run cuBLAS and plain "
                       "launches: unset them or set them to 0)")
    if refused:
        raise ConfigurationError("TENSOR_PARALLEL_SIZE > 1 runs every tick as an eager forward and does not support "
                                 + "; ".join(refused))


class CustomTorchBackend(InferenceBackend):
    """Paged-KV backend; see the module docstring. Build with :meth:`from_checkpoint`. With ``workers`` (tensor
    parallel) ``model`` is rank 0's shard and the constructed backend owns the workers: :meth:`close` stops them
    (if the constructor raises, the caller still owns them: :meth:`from_checkpoint` closes them)."""

    def __init__(
        self,
        model: GemmaForCausalLM,
        tokenizer: HFTokenizer,
        settings: CoreSettings,
        custom: CustomTorchSettings,
        *,
        name: str = "gemma",
        workers: TensorParallelWorkers | None = None,
    ) -> None:
        super().__init__()
        self.workers = workers
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
        windows = [g.window for g in kv_groups(config) if g.window is not None]
        budget = _budget_bytes(config, settings, custom, param)
        num_blocks = plan_pools_for_settings(config, settings, self.block_size, param.element_size(), budget,
                                             sliding_blocks=custom.sliding_blocks, max_len=max_len)
        # the reference request length of the default split (it sets the split when memory is tight; kv/pools.py)
        self.pool_reference_tokens = None if custom.sliding_blocks is not None else reference_tokens(
            kv_groups(config), self.block_size, param.element_size(), budget, max_rows=settings.max_batch_size,
            max_active_tokens=settings.max_active_kv_tokens, max_len=max_len)
        self.pools = KVPools(config, num_blocks, self.block_size, self.dtype, self.device)
        if workers is not None:
            self.pools.copy_listener = workers.send_copy
        self.prefix_cache = PrefixCache(self.pools)
        self.admission = KVAdmission(self.pools.geometry, num_blocks)
        self._max_request_tokens = self.admission.max_tokens(max_len)  # what one request can ever hold
        self.prefill_attention, fuse = resolve_fast_paths(custom, self.device.type)
        if fuse:
            fuse_model(model)
        skinny_rows, pdl = small_batch_plan(custom, self.device, fuse, tensor_parallel=workers is not None,
                                            dense_fp8=uses_fp8(model) and not config.moe_num_experts)
        if skinny_rows or pdl:
            fuse_small_batch(model, skinny_rows, pdl=pdl)
        width = -(-max_len // self.block_size)
        self.runner = PagedRunner(model, self.pools, self.prefill_attention)
        graphs, fixed = _fixed_buffer_options(model, custom, self.attention, on_cuda, workers is not None)
        tick_attention = "triton" if self.attention == "triton" else "reference"
        self.mixed = MixedStep(model, self.pools, tick_attention, fast_prefill=custom.fast_prefill, graphs=graphs,
                               fixed_buffers=fixed, max_tokens=settings.max_num_batched_tokens,
                               max_seqs=settings.max_batch_size, width=width, mirror=workers,
                               compile=fixed and custom.compile, explain=fixed and custom.explain,
                               decode_kernel=decode_attention_kernel(pdl) if self.attention == "triton" else None)
        # asynchronous decode: the decode kernel's ticks on this process alone (as the fixed-buffer decoder had)
        self.async_decode = workers is None and self.attention == "triton"
        if workers is not None:
            workers.build_pools(num_blocks, self.block_size, tick_attention, custom.fast_prefill, fuse)
        if custom.graph_capture == "startup":
            seconds = self.mixed.capture_all()
            logger.info("custom_torch: captured %d tick graphs (decode-only and mixed) in %.1f s", len(seconds),
                        sum(seconds.values()))
        self.max_chunk_tokens = min(windows) if windows else None  # a tick's chunk then stores all it reads
        self.capabilities = BackendCapabilities(
            continuous_batching=True, uses_core_cache_manager=False, kv_reservation=True, logprobs=True,
            top_logprobs=True,
            mixed_step=custom.mixed_step, async_decode=self.async_decode, deferred_sampling=True,
            allowed_token_masks=True, progressive_cache_block_size=self.block_size,
        )
        self._device_tokens: torch.Tensor | None = None  # the last decode_step_async's sampled ids
        self.model_info = ModelInfo(
            name=name, vocab_size=config.vocab_size, max_model_len=max_len, eos_token_ids=config.eos_token_ids,
            architecture=config.model_type, dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
        )
        logger.info(
            "custom_torch: %s on %s (%s)%s, block size %d, pools %s (%.1f MiB; %s), decode %s attention (%s), "
            "ticks %s (%s), fast prefill %s, fused %s",
            name, self.device, self.model_info.dtype + (", FP8 weights" if uses_fp8(model) else ""),
            "" if workers is None else f", tensor parallel over {workers.tp.world_size} ranks (sizes per rank)",
            self.block_size, num_blocks, self.pools.nbytes / 2**20,
            "CUSTOM_BACKEND_SLIDING_BLOCKS" if self.pool_reference_tokens is None
            else f"default split; when memory is tight, balanced at {self.pool_reference_tokens}-token requests",
            self.attention, "decode kernel" if self.attention == "triton" else "gather reference",
            "one forward" if custom.mixed_step else "prefill and decode apart",
            "CUDA graphs per row / token bucket" if graphs else "fixed buffers, eager" if fixed else "eager",
            self.mixed.narrow_layer is not None, fuse,
        )

    @classmethod
    def from_checkpoint(
        cls, model_path: str | Path, device: str, settings: CoreSettings, custom: CustomTorchSettings
    ) -> CustomTorchBackend:
        """Load weights and tokenizer from a checkpoint folder. Raises ModelLoadError on a bad folder. With
        ``TENSOR_PARALLEL_SIZE`` N > 1, starts ranks 1..N-1 (:meth:`_from_checkpoint_parallel`).
        ``ENABLE_EXPERT_PARALLEL`` on a model without MoE experts is a ConfigurationError (at N = 1 too, where the
        one rank holds every expert)."""
        dtype = _DTYPES.get(settings.dtype) or auto_dtype(device)
        if settings.tensor_parallel_size > 1:
            return cls._from_checkpoint_parallel(model_path, device, dtype, settings, custom)
        if settings.enable_expert_parallel:
            check_shardable(_read_config(model_path), 1, expert_parallel=True)
        try:
            model = GemmaForCausalLM.from_hf(model_path, device=device, dtype=dtype, quantization=settings.quantization)
        except ConfigurationError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load {model_path} with the custom_torch backend: {exc}") from exc
        return cls(model, HFTokenizer.from_pretrained(model_path), settings, custom, name=Path(model_path).name)

    @classmethod
    def _from_checkpoint_parallel(cls, model_path: str | Path, device: str, dtype: torch.dtype,
                                  settings: CoreSettings, custom: CustomTorchSettings) -> CustomTorchBackend:
        """Rank 0 of ``settings.tensor_parallel_size``: check the settings and the model's shardability, spawn the
        workers (they load their shards while this process loads its own), build the backend. Raises
        ConfigurationError for what cannot be sharded or run, ModelLoadError for a bad folder,
        TensorParallelWorkerError if a worker fails; no worker outlives a failure."""
        size, expert_parallel = settings.tensor_parallel_size, settings.enable_expert_parallel
        check_tensor_parallel_settings(custom, device)
        check_shardable(_read_config(model_path), size, expert_parallel)
        workers = TensorParallelWorkers.start(str(model_path), device, dtype, size, settings.quantization,
                                              expert_parallel)
        try:
            try:
                model = GemmaForCausalLM.from_hf(model_path, device=rank_device(device, 0), dtype=dtype,
                                                 tp=workers.tp, quantization=settings.quantization)
            except ConfigurationError:
                raise
            except (OSError, ValueError, KeyError) as exc:
                raise ModelLoadError(f"cannot load {model_path} with the custom_torch backend: {exc}") from exc
            workers.wait_loaded()
            return cls(model, HFTokenizer.from_pretrained(model_path), settings, custom, name=Path(model_path).name,
                       workers=workers)
        except BaseException:
            workers.close()
            raise

    # -- prefill -------------------------------------------------------------------------------
    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        prompt = tuple(map(operator.index, prompt_ids))  # ints (a float id raises TypeError); C speed
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
        """Exactly ``num_tokens`` more prompt tokens (clamped): prefill-only ticks (see :meth:`prefill_chunks`)."""
        error = self.prefill_chunks([state], [num_tokens])[0]
        if error is not None:
            raise error

    def prefill_chunks(self, states: Sequence[PrefillState], num_tokens: Sequence[int]) -> list[Exception | None]:
        """Every state advances by exactly its chunk: prefill-only `MixedStep` ticks (all chunks in one forward)
        until each is done, since a tick takes at most the narrowest window per chunk. A chunk that cannot get
        a single token's blocks runs alone on the one-row path, which frees its old window first."""
        if len(states) != len(num_tokens):
            raise ValueError(f"{len(states)} states but {len(num_tokens)} chunk sizes")
        targets = [state.num_computed + max(0, min(num, state.num_remaining)) for state, num in zip(states, num_tokens)]
        errors: list[Exception | None] = [None] * len(states)
        while True:
            pending = [i for i, state in enumerate(states) if errors[i] is None and state.num_computed < targets[i]]
            if not pending:
                return errors
            step = self._tick([states[i] for i in pending], [targets[i] - states[i].num_computed for i in pending],
                              [], [])
            for i, error in zip(pending, step.prefill_errors):
                errors[i] = error

    def forward_step(
        self, states: Sequence[PrefillState], num_tokens: Sequence[int], batched: BatchedPagedKVCache | None,
        input_ids: Sequence[int],
    ) -> StepOutput:
        """The tick as one `MixedStep` forward (a tick without chunks is a decode-only tick,
        :meth:`decode_step_batched`). Chunks are capped at the narrowest window (each then stores every
        position its queries read) and run shorter when their pool is short; a chunk's prefix-cache failure is
        reported for it alone."""
        if len(states) != len(num_tokens):
            raise ValueError(f"{len(states)} states but {len(num_tokens)} chunk sizes")
        rows = batched.rows if batched is not None else []
        if len(input_ids) != len(rows):
            raise ValueError(f"got {len(input_ids)} input ids for a batch of {len(rows)} rows")
        if not any(min(num, state.num_remaining) > 0 for state, num in zip(states, num_tokens)):
            logits = self.decode_step_batched(batched, input_ids) if rows else None
            return StepOutput([None] * len(states), logits)
        return self._tick(states, num_tokens, rows, input_ids)

    def _tick(self, states: Sequence[PrefillState], num_tokens: Sequence[int], rows: Sequence[PagedKVCache],
              input_ids: Sequence[int], sources: Sequence[int] | None = None,
              previous: torch.Tensor | None = None) -> StepOutput:
        """One `MixedStep` forward: ``rows`` decode ``input_ids``, each state takes up to its chunk (capped at
        the window, shorter when its pool is short). A chunk that got no block runs alone right after on the
        one-row path. Updates the states and the prefix cache; per state None or its exception."""
        self._device_tokens = None  # the next decode_step_async feeds from the host (contract)
        cap = self.max_chunk_tokens
        sizes = [min(num, state.num_remaining, cap or num) for state, num in zip(states, num_tokens)]
        work = [i for i, n in enumerate(sizes) if n > 0]
        chunks = []
        for i in work:
            state, start = states[i], states[i].num_computed
            chunks.append((state.kv, state.prompt_ids[start : start + sizes[i]],
                           start + sizes[i] == len(state.prompt_ids)))
        decode_logits, chunk_logits, ran = self.mixed.run(rows, input_ids, chunks, sources, previous)
        errors: list[Exception | None] = [None] * len(states)
        for j, i in enumerate(work):
            state = states[i]
            try:
                if not ran[j]:  # not one token's blocks: the one-row path frees the old window first
                    self._prefill_alone(state, sizes[i])
                    continue
                state.num_computed += ran[j]
                if state.num_computed == len(state.prompt_ids):
                    state.last_logits = chunk_logits[j]
                self.prefix_cache.cache_prefix(state.prompt_ids, state.kv)  # before the next chunk drops blocks
            except Exception as exc:  # this request fails alone; the others' KV is consistent
                errors[i] = exc
        return StepOutput(errors, decode_logits)

    def forward_step_async(
        self, states: Sequence[PrefillState], num_tokens: Sequence[int], batched: BatchedPagedKVCache | None,
        input_ids: Sequence[int], from_previous: Sequence[int], rows: Sequence[RowSampling],
        first_rows: Sequence[RowSampling], *, want_logprobs: bool = False,
    ) -> LaunchedStep:
        """The `MixedStep` tick with the decode rows fed from the previous step's device tokens and every token
        (decode rows', then first tokens of completed prompts) sampled on the device in one call; the copy to
        the host is queued behind the tick (:class:`DeviceTokens`). Without asynchronous decode (the gather
        path, tensor parallel): the contract's synchronous default."""
        if not self.async_decode:
            return super().forward_step_async(states, num_tokens, batched, input_ids, from_previous, rows,
                                              first_rows, want_logprobs=want_logprobs)
        decode_rows = batched.rows if batched is not None else []
        if not (len(input_ids) == len(from_previous) == len(rows) == len(decode_rows)) or len(first_rows) != len(states):
            raise ValueError(f"{len(input_ids)} input ids / {len(from_previous)} sources / {len(rows)} samplings for "
                             f"{len(decode_rows)} rows; {len(first_rows)} first-token samplings for {len(states)} states")
        if len(num_tokens) != len(states):
            raise ValueError(f"{len(states)} states but {len(num_tokens)} chunk sizes")
        if not any(min(num, state.num_remaining) > 0 for state, num in zip(states, num_tokens)):
            tokens = (self.decode_step_async(batched, input_ids, from_previous, rows, want_logprobs=want_logprobs)
                      if decode_rows else ReadyTokens(SampledTokens([])))
            return LaunchedStep([None] * len(states), tokens)
        previous = self._device_tokens  # _tick forgets it: the tick's own tokens replace it below
        out = self._tick(states, num_tokens, decode_rows, input_ids, from_previous, previous)
        completed = [i for i, state in enumerate(states) if out.prefill_errors[i] is None and state.is_complete]
        parts = ([out.decode_logits] if decode_rows else []) + [states[i].last_logits for i in completed]
        samplings = [*rows, *(first_rows[i] for i in completed)]
        if not parts:
            return LaunchedStep(out.prefill_errors, ReadyTokens(SampledTokens([])))
        logits = parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].dtype) for p in parts])
        tokens, logprobs = sample_on_device(logits, samplings, want_logprobs=want_logprobs)
        self._device_tokens = tokens
        return LaunchedStep(out.prefill_errors, DeviceTokens(tokens, logprobs))

    def _prefill_alone(self, state: PrefillState, num: int) -> None:
        """``num`` tokens of one row on the eager one-row path (`PagedRunner.prefill`: gathers the keys its
        first queries read, frees the out-of-window blocks, then allocates): the fallback for a tight pool. Not
        under tensor parallel (its forward is not a tick the workers could replay): KVCapacityError instead."""
        if self.workers is not None:
            raise KVCapacityError(
                "the sliding-window KV pool cannot hold this prompt chunk next to the running requests, and tensor "
                "parallel has no one-row fallback: raise CUSTOM_BACKEND_SLIDING_BLOCKS or lower MAX_BATCH_SIZE")
        start = state.num_computed
        done = start + num == len(state.prompt_ids)
        logits = self.runner.prefill(state.kv, state.prompt_ids[start : start + num], want_logits=done)
        state.num_computed += num
        self.prefix_cache.cache_prefix(state.prompt_ids, state.kv)
        if done:
            state.last_logits = logits

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
        """A decode-only `MixedStep` tick: logits [rows, vocab], valid until the next tick (graph outputs)."""
        self._device_tokens = None  # graph outputs the next async step could feed on are overwritten now
        return self._decode(batched, input_ids)

    def _decode(self, batched: BatchedPagedKVCache, input_ids: Sequence[int], sources: Sequence[int] | None = None,
                previous: torch.Tensor | None = None) -> torch.Tensor:
        if not batched.rows:
            raise ValueError("a decode step needs at least one row")
        logits = self.mixed.run(batched.rows, input_ids, [], sources, previous)[0]
        assert logits is not None
        return logits

    def decode_step_async(
        self, batched: BatchedPagedKVCache, input_ids: Sequence[int], from_previous: Sequence[int],
        rows: Sequence[RowSampling] | Callable[[], Sequence[RowSampling]], *, want_logprobs: bool = False,
    ) -> PendingTokens:
        """The decode-only tick with the sampling on the device and nothing read back: rows with a source take
        the previous step's device token (gathered before the forward), the tokens' copy to the host is queued
        behind the step. Deferred samplings (a callable ``rows``) are resolved after the forward's replay is
        queued, so the host reads the previous tokens and builds masks while the device computes. Without
        asynchronous decode (the gather path, tensor parallel): the contract's synchronous default."""
        if not self.async_decode:
            return super().decode_step_async(batched, input_ids, from_previous, rows, want_logprobs=want_logprobs)
        if len(input_ids) != len(from_previous):
            raise ValueError(f"{len(input_ids)} input ids and {len(from_previous)} sources")
        previous, self._device_tokens = self._device_tokens, None
        logits = self._decode(batched, input_ids, from_previous, previous)
        rows = resolve_rows(rows, len(input_ids))  # a deferred sampling runs while the forward does
        tokens = None
        if not want_logprobs and all(row.is_greedy and not row.adjusts_logits for row in rows):
            tokens = self.mixed.greedy_tokens(logits)  # the argmax the decode graph already took
        logprobs = None
        if tokens is None:
            tokens, logprobs = sample_on_device(logits, rows, want_logprobs=want_logprobs)
        self._device_tokens = tokens
        return DeviceTokens(tokens, logprobs)

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
        if not want_logprobs and all(row.is_greedy and not row.adjusts_logits for row in rows):
            greedy = self.mixed.greedy_tokens(logits)  # the argmax the decode graph already took
        if greedy is not None:
            return SampledTokens(greedy.tolist())  # int64 tensor: tolist() gives ints
        return sample_tokens(logits, rows, want_logprobs=want_logprobs)

    def mask_memory(self, nbytes: int) -> tuple[int, object] | None:
        return pinned_mask_memory(nbytes, self.device)

    def free_row_kv(self, kv: PagedKVCache) -> None:
        kv.free_all()

    # -- admission -----------------------------------------------------------------------------
    def kv_reserve(self, request_id: str, num_tokens: int) -> bool:
        return self.admission.reserve(request_id, num_tokens)

    def kv_release(self, request_id: str) -> None:
        self.admission.release(request_id)

    def max_request_tokens(self) -> int | None:
        return self._max_request_tokens

    def kv_stats(self) -> dict[str, int]:
        stats: dict[str, int] = {"blocks_total": 0, "blocks_used": 0, "blocks_free": 0, "blocks_evictable": 0}
        references = self.prefix_cache.references()
        for group, manager in self.pools.managers.items():
            short = "sliding" if group.startswith("sliding") else "full"
            held = references[group]
            values = {
                "blocks_total": manager.num_blocks, "blocks_used": manager.num_used, "blocks_free": manager.num_free,
                "blocks_cached": len(held), "blocks_reserved": self.admission.reserved[group],
                # held by the cache alone: reclaimable on demand, free as far as admission is concerned
                "blocks_evictable": sum(1 for block in held if manager.refcount(block) == 1),
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
        stats.update(mixed_steps=self.mixed.steps, mixed_step_tokens=self.mixed.tokens,
                     mixed_step_shrunk_chunks=self.mixed.shrunk, mixed_step_deferred_chunks=self.mixed.deferred,
                     mixed_step_eager=self.mixed.eager_steps, decode_steps=self.mixed.decode_steps,
                     decode_fed_rows=self.mixed.fed_rows)
        return stats

    # -- lifecycle -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pools.check_integrity()
        self.prefix_cache.check_integrity()
        self.admission.check_integrity()

    def failure(self) -> str | None:
        """A lost tensor-parallel worker (every later forward raises it), else None."""
        return None if self.workers is None or self.workers.closed else self.workers.failure_reason()

    def interrupt(self) -> None:
        """Shutdown with a forward stuck (a hung tensor-parallel worker holds rank 0 in a collective): kill the
        workers, which breaks rank 0's collective."""
        if self.workers is not None:
            self.workers.kill()

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.workers is not None:
            self.workers.close()
        self.prefix_cache.clear()
        for table in (self.pools.k, self.pools.v):
            table.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _fixed_buffer_options(model: GemmaForCausalLM, custom: CustomTorchSettings, attention: str, on_cuda: bool,
                          parallel: bool) -> tuple[bool, bool]:
    """(CUDA graphs, fixed buffers) of the backend's `MixedStep`: graphs on CUDA with triton attention unless the
    model has MoE layers on the eager expert loop (its host sync cannot be captured); fixed buffers with graphs,
    and for ``CUSTOM_BACKEND_COMPILE`` / ``EXPLAIN`` (they compile / explain the fixed-buffer decode forward).
    Otherwise every tick is an unpadded eager batch.
    Neither under tensor parallel (refused before, see :func:`check_tensor_parallel_settings`)."""
    if parallel:
        return False, False
    if attention != "triton":
        if custom.compile or custom.explain or (custom.cuda_graph and on_cuda):
            logger.warning("custom_torch: CUDA graphs / COMPILE / EXPLAIN need CUSTOM_BACKEND_ATTENTION=triton "
                           "(auto on CUDA); ticks run eagerly on the portable path")
        return False, False
    graphs = custom.cuda_graph and on_cuda
    if graphs and not moe_is_fused(model):
        logger.warning("custom_torch: MoE models run without CUDA graphs unless their experts are fused "
                       "(CUSTOM_BACKEND_FUSE): the eager expert loop syncs the host")
        graphs = False
    return graphs, graphs or custom.compile or custom.explain


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
