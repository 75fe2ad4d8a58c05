"""The ``hf`` backend: any Hugging Face causal LM, HF ``DynamicCache`` as in-flight KV, the core
prefix cache for prompt reuse.

Call protocol: :mod:`gemmaserve.backend`. Every method except ``generate_stream`` runs with
``self.lock`` held by the caller (the scheduler holds it for a whole tick), so nothing here locks.

KV ownership: ``prefill_lookup`` creates a :class:`RowCache` owned by the returned PrefillState;
``splice_into_batched`` / ``stack_caches_left_padded`` consume rows into a :class:`BatchCache`;
``remove_row_from_cache`` frees a row of the batch; ``free_row_kv`` frees a row never spliced.
Prefix-cache pools (``BlockPools``) are allocated by ``set_cache_adapter`` and owned by the backend.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gemmaserve.backend import BackendCapabilities, InferenceBackend, ModelInfo, PrefillState, SampledTokens, Tokenizer
from gemmaserve.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from gemmaserve.sampling_params import RowSampling
from gemmaserve_hf_torch.cache_rows import BatchCache, RowCache
from gemmaserve_hf_torch.kv_cache.hf_format import FORWARD_ERRORS, BlockPools, detect_layout, forward_failed
from gemmaserve_hf_torch.loader import LoadedModel, ModelForward, load_model
from gemmaserve_hf_torch.sampling import pinned_mask_memory, sample_tokens
from gemmaserve_hf_torch.settings import load_hf_settings

if TYPE_CHECKING:
    from transformers import DynamicCache

    from gemmaserve.kv.cache_manager import CacheManager
    from gemmaserve.settings import CoreSettings

__all__ = ["HFTorchBackend", "create_backend"]

_PROBE_TOKENS = 2
"""Tokens of the load-time probe forward (reveals the K/V shapes; warms up torch.compile)."""


class _IdsOnlyTokenizer:
    """Tokenizer of `HFTorchBackend.from_model` without one: the engine's token-id API works, text does not."""

    eos_token_ids: tuple[int, ...] = ()
    has_chat_template = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise InvalidRequestError("this in-memory model has no tokenizer; send token ids")

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        raise InvalidRequestError("this in-memory model has no tokenizer; read token ids")

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        raise InvalidRequestError("this in-memory model has no tokenizer or chat template; send token ids")


def create_backend(model_path: str, device: str, settings: CoreSettings) -> HFTorchBackend:
    """Registry factory: load ``model_path`` on ``device`` with the core + ``hf`` plugin settings."""
    return HFTorchBackend(load_model(model_path, device, settings, load_hf_settings()))


class HFTorchBackend(InferenceBackend):
    """Continuous-batching backend over a transformers causal LM (see the module docstring)."""

    capabilities = BackendCapabilities(
        continuous_batching=True, uses_core_cache_manager=True, kv_reservation=False, logprobs=True, top_logprobs=True,
        allowed_token_masks=True,
    )

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__()
        self.loaded = loaded
        self.device = loaded.device
        self.tokenizer = loaded.tokenizer
        self.forward = loaded.forward
        self.layout = detect_layout(
            loaded.text_config, self._probe_forward, dtype=loaded.dtype, device=loaded.device,
            probe_tokens=_PROBE_TOKENS,
        )
        self._check_incremental()
        config = loaded.text_config
        architectures = getattr(loaded.model.config, "architectures", None) or [type(loaded.model).__name__]
        self.model_info = ModelInfo(
            name=loaded.path.name,
            vocab_size=int(config.vocab_size),
            max_model_len=loaded.max_model_len,
            eos_token_ids=loaded.eos_token_ids,
            architecture=str(architectures[0]),
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(loaded.device),
        )
        self.cache_manager: CacheManager | None = None
        self.pools: BlockPools | None = None
        self._rows: weakref.WeakSet[RowCache] = weakref.WeakSet()
        self._batches: weakref.WeakSet[BatchCache] = weakref.WeakSet()
        self._closed = False

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, tokenizer: Tokenizer | None = None, *, max_model_len: int | None = None,
        compile_model: bool = False, name: str = "in-memory",
    ) -> HFTorchBackend:
        """Wrap a transformers causal LM already in memory (put in eval mode; stays on its device and dtype),
        e.g. for benchmarks. ``tokenizer=None``: token ids only (text calls raise InvalidRequestError).
        ``max_model_len`` defaults to the config's max_position_embeddings. EOS ids come from the configs."""
        param = next(model.parameters())
        text_config = model.config.get_text_config(decoder=True)
        eos: list[int] = []
        for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                       getattr(model.config, "eos_token_id", None)):
            eos.extend(v for v in (source if isinstance(source, (list, tuple)) else [source]) if isinstance(v, int))
        loaded = LoadedModel(
            path=Path(name), model=model.eval(), forward=ModelForward(model, compile_model=compile_model),
            tokenizer=tokenizer or _IdsOnlyTokenizer(), text_config=text_config, dtype=param.dtype,
            device=param.device, max_model_len=max_model_len or int(text_config.max_position_embeddings),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )
        return cls(loaded)

    @torch.inference_mode()
    def _check_incremental(self) -> None:
        """ModelLoadError unless a three-token prompt's last logits come out the same in one forward as after two
        tokens and then one more through the cache: what continuous batching relies on (a model whose earlier
        positions see later ones, or whose cache argument is not transformers' cache, fails it)."""
        vocab = int(self.loaded.text_config.vocab_size)
        device = self.loaded.device
        forward = ModelForward(self.loaded.model, compile_model=False)  # eager: no compile of three more shapes
        ids = torch.tensor([[min(t, vocab - 1) for t in (1, 2, 3)]], dtype=torch.long, device=device)
        positions = torch.arange(3, device=device)[None, :]
        try:
            whole = forward(ids, cache=self.layout.new_cache(), position_ids=positions, last_only=True)[:, -1]
            cache = self.layout.new_cache()
            forward(ids[:, :2], cache=cache, position_ids=positions[:, :2], last_only=True)
            step = forward(ids[:, 2:], cache=cache, position_ids=positions[:, 2:], last_only=True)[:, -1]
        except FORWARD_ERRORS as exc:
            raise forward_failed("a prompt continued through the cache", exc) from exc
        whole, step = whole.float(), step.float()
        scale = float(whole.abs().max()) + float(step.abs().max())
        tolerance = (1e-3 if self.loaded.dtype == torch.float32 else 5e-2) * max(scale, 1e-6)
        gap = float((whole - step).abs().max())
        if not math.isfinite(gap) or gap > tolerance:
            raise ModelLoadError(
                f"unsupported architecture for the hf backend: the last logits of a 3-token prompt differ by {gap:.3g}"
                f" (allowed {tolerance:.3g}) between one forward and two tokens plus one through the cache; the "
                "backend needs a causal decoder whose cache continues a prompt exactly (a bidirectional model, or "
                "a cache argument of another kind, cannot be served)")

    @torch.inference_mode()
    def _probe_forward(self, cache: DynamicCache) -> None:
        """Two tokens through an empty layout cache (reveals K/V shapes; warms up torch.compile)."""
        token = min(1, int(self.loaded.text_config.vocab_size) - 1)
        ids = torch.full((1, _PROBE_TOKENS), token, dtype=torch.long, device=self.loaded.device)
        positions = torch.arange(_PROBE_TOKENS, device=self.loaded.device)[None, :]
        self.forward(ids, cache=cache, position_ids=positions, last_only=True)

    # -- prefix cache -------------------------------------------------------------------------
    @torch.inference_mode()
    def set_cache_adapter(self, cache_manager: CacheManager | None) -> None:
        """Adopt ``cache_manager`` and allocate one K and one V pool per storing layer, shaped
        [num_blocks, block_size, kv_heads, head_dim]; None frees the pools and disables caching."""
        self._require_open()
        self.pools = None
        self.cache_manager = cache_manager
        if cache_manager is not None:
            self.pools = BlockPools(self.layout, cache_manager.num_blocks, cache_manager.block_size)

    # -- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        """Validate the prompt, copy the longest cached prefix into a fresh row KV (a full hit
        leaves the last token to recompute, for its logits) and release the match."""
        self._require_open()
        prompt = self._validated_prompt(prompt_ids)
        row = RowCache.empty(self.layout)
        cm, pools = self.cache_manager, self.pools
        if cm is not None and pools is not None:
            match = cm.lookup(prompt)
            try:
                hit = min(match.num_tokens, len(prompt) - 1)
                if hit > 0:
                    row = RowCache(self.layout, self.layout.cache_from_tensors(pools.read(match.block_ids, hit)), hit)
            finally:
                cm.release(match)
        self._rows.add(row)
        self.last_cache_hit_tokens = row.num_tokens
        return PrefillState(prompt_ids=prompt, kv=row, num_cached=row.num_tokens, num_computed=row.num_tokens)

    @torch.inference_mode()
    def prefill_chunk(self, state: PrefillState, num_tokens: int) -> None:
        """Forward the next ``num_tokens`` (clamped) prompt tokens through the row's cache."""
        self._require_open()
        row: RowCache = state.kv
        count = min(num_tokens, state.num_remaining)
        if count < 1:
            raise ValueError(f"prefill_chunk needs num_tokens >= 1 with {state.num_remaining} tokens remaining")
        start = state.num_computed
        assert row.alive and row.num_tokens == start, "row KV out of step with its prefill state"
        device = self.device
        ids = torch.tensor(state.prompt_ids[start : start + count], dtype=torch.long, device=device)[None, :]
        positions = torch.arange(start, start + count, device=device)[None, :]
        logits = self.forward(ids, cache=row.cache, position_ids=positions, last_only=True)
        row.num_tokens += count
        state.num_computed += count
        if state.num_computed == len(state.prompt_ids):
            state.last_logits = logits[:, -1, :]

    @torch.inference_mode()
    def prefill_store(self, state: PrefillState) -> None:
        """Write the prompt's not-yet-cached blocks from the row KV into the pools and commit them
        (the CacheManager may plan only a prefix under memory pressure)."""
        self._require_open()
        if not state.is_complete:
            raise ValueError("prefill_store needs a completed prefill (is_complete)")
        cm, pools = self.cache_manager, self.pools
        if cm is None or pools is None:
            return
        row: RowCache = state.kv
        plan = cm.begin_store(state.prompt_ids)
        try:
            pools.write(row.tensors(), plan.writes)
        except BaseException:
            cm.abort_store(plan)
            raise
        cm.commit_store(plan)

    # -- batch ops ----------------------------------------------------------------------------
    @torch.inference_mode()
    def stack_caches_left_padded(self, rows: Sequence[RowCache]) -> BatchCache:
        self._require_open()
        batch = BatchCache.from_rows(self.layout, list(rows))
        self._batches.add(batch)
        return batch

    @torch.inference_mode()
    def splice_into_batched(self, batched: BatchCache | None, new_kv: RowCache, kv_len: int) -> BatchCache:
        self._require_open()
        if kv_len != new_kv.num_tokens:
            raise ValueError(f"splice_into_batched: kv_len={kv_len} but the row holds {new_kv.num_tokens} tokens")
        if batched is None:
            return self.stack_caches_left_padded([new_kv])
        batched.append_row(new_kv)
        return batched

    @torch.inference_mode()
    def remove_row_from_cache(self, batched: BatchCache, row_idx: int) -> None:
        batched.pop_row(row_idx)

    @torch.inference_mode()
    def decode_step_batched(self, batched: BatchCache, input_ids: Sequence[int]) -> torch.Tensor:
        """One forward over every row (2-D padding mask, per-row positions); logits [rows, vocab]."""
        self._require_open()
        if batched.num_rows == 0 or len(input_ids) != batched.num_rows:
            raise ValueError(f"decode_step_batched: {len(input_ids)} input ids for {batched.num_rows} rows")
        ids, mask, positions = batched.decode_inputs(input_ids)
        logits = self.forward(ids, cache=batched.cache, position_ids=positions, attention_mask=mask, last_only=True)
        batched.advance()
        return logits[:, -1, :]

    def kv_length(self, kv: RowCache | BatchCache, row_idx: int | None = None) -> int:
        if isinstance(kv, BatchCache):
            if row_idx is None:
                raise ValueError("kv_length of a batched KV needs row_idx")
            return kv.row_length(row_idx)
        return kv.num_tokens

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
        return sample_tokens(logits, rows, want_logprobs=want_logprobs)

    def mask_memory(self, nbytes: int) -> tuple[int, object] | None:
        return pinned_mask_memory(nbytes, self.device)

    def free_row_kv(self, kv: RowCache) -> None:
        kv.release()

    # -- bookkeeping --------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, int]:
        if self.cache_manager is None:
            return {}
        stats = self.cache_manager.stats()
        return {"blocks_total": stats.num_blocks, "blocks_used": stats.used_blocks, "blocks_free": stats.free_blocks,
                "blocks_evictable": stats.evictable_blocks}

    @property
    def num_live_rows(self) -> int:
        """Row KVs created by prefill_lookup and neither freed, spliced nor garbage-collected."""
        return sum(1 for row in self._rows if row.alive)

    def close(self) -> None:
        """Drop this backend's pools, cache manager and model references (the model is freed unless
        someone else holds the LoadedModel). Idempotent; every later KV call raises RuntimeError."""
        if self._closed:
            return
        self._closed = True
        self.pools = None
        self.cache_manager = None
        device = self.device
        del self.forward
        del self.loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the hf backend was closed")

    def check_integrity(self) -> None:
        """Raise RuntimeError if the pools disagree with the cache manager or any live row/batch KV
        disagrees with its own bookkeeping."""
        if (self.pools is None) != (self.cache_manager is None):
            raise RuntimeError("hf backend: prefix pools and cache manager must be set together")
        if self.pools is not None and self.cache_manager is not None:
            if (self.pools.num_blocks, self.pools.block_size) != (
                self.cache_manager.num_blocks,
                self.cache_manager.block_size,
            ):
                raise RuntimeError("hf backend: pool geometry differs from the cache manager's")
            self.pools.check_integrity()
            self.cache_manager.check_integrity()
        for row in list(self._rows):
            row.check_integrity()
        for batch in list(self._batches):
            batch.check_integrity()

    def _validated_prompt(self, prompt_ids: Sequence[int]) -> tuple[int, ...]:
        prompt = tuple(prompt_ids)
        if not prompt:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        vocab = self.model_info.vocab_size
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token {bad!r} is not a token id of this model; ids are in [0, {vocab})")
        if len(prompt) > self.model_info.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens but the model context is {self.model_info.max_model_len} "
                "tokens; shorten the prompt"
            )
        return prompt
