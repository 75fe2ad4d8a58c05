"""BACKEND=mlx: continuous batching on mlx.core through the core primitives (see gemmaserve.backend).

- Row KV and batch KV are both :class:`KVBatch` handles (one row during prefill).
- Prefix cache: the core ``CacheManager`` decides which blocks to read and write; the K/V live in
  :class:`KVPools` allocated by :meth:`set_cache_adapter`.
- Decode: one forward over every row with left padding, per-row RoPE positions and masks
  (``batched_cache``); Gemma 4's KV-shared layers read the K/V their source layer just fetched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from gemmaserve.backend import BackendCapabilities, InferenceBackend, PrefillState, SampledTokens
from gemmaserve.errors import ModelLoadError

from gemmaserve_mlx.kv_batch import KVBatch
from gemmaserve_mlx.kv_format import KVPools
from gemmaserve_mlx.layout import KVLayout, discover_layout
from gemmaserve_mlx.loader import LoadedModel, load_model
from gemmaserve_mlx.model_dir import BATCHED_ARCHITECTURES, rope_scalings
from gemmaserve_mlx.runner import ModelRunner
from gemmaserve_mlx.sampling import sample_rows
from gemmaserve_mlx.settings import MlxSettings, load_mlx_settings
from gemmaserve_mlx.validation import check_prompt

if TYPE_CHECKING:
    from gemmaserve.kv.cache_manager import CacheManager
    from gemmaserve.sampling_params import RowSampling
    from gemmaserve.settings import CoreSettings

__all__ = ["MlxBatchBackend", "create_backend"]

logger = logging.getLogger(__name__)


def create_backend(model_path: str, device: str, settings: CoreSettings) -> MlxBatchBackend:
    """Registry factory: load ``model_path`` and build the batched backend."""
    loaded = load_model(model_path, device, settings)
    if loaded.model_dir.architecture not in BATCHED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {loaded.info.architecture!r} has no batched-KV support in BACKEND=mlx; "
            "use BACKEND=mlx-stream"
        )
    if any(kind == "dynamic" for kind, _ in rope_scalings(loaded.model_dir.config)):
        raise ModelLoadError(
            f"{loaded.info.architecture!r} checkpoint with dynamic RoPE: mlx_lm rescales it from one cache offset, "
            "and the batched cache holds one per row (every decode step would fail); use BACKEND=mlx-stream or hf")
    return MlxBatchBackend(loaded, load_mlx_settings())


class MlxBatchBackend(InferenceBackend):
    """Continuous-batching backend over an mlx_lm model. All methods run under ``self.lock`` (held by
    the caller) and on the loaded device's default stream."""

    def __init__(self, loaded: LoadedModel, mlx_settings: MlxSettings) -> None:
        super().__init__()
        self.capabilities = BackendCapabilities(continuous_batching=True, uses_core_cache_manager=True, logprobs=True,
                                                top_logprobs=True, allowed_token_masks=True)
        self.model_info = loaded.info
        self.tokenizer = loaded.tokenizer
        self._device = loaded.device
        self._growth = mlx_settings.kv_growth
        with mx.stream(self._device):
            self.layout: KVLayout = discover_layout(loaded.model)
            self._runner = ModelRunner(loaded.model)
        self._cache_manager: CacheManager | None = None
        self._pools: KVPools | None = None
        self._live: dict[int, KVBatch] = {}  # handles that hold rows and are neither consumed nor freed

    # -- prefix cache ---------------------------------------------------------------------------
    def set_cache_adapter(self, cache_manager: CacheManager | None) -> None:
        """Use ``cache_manager`` (None: no prefix caching) and allocate its block pools."""
        self._pools = None
        self._cache_manager = None
        if cache_manager is not None and cache_manager.num_blocks > 0:
            with mx.stream(self._device):
                self._pools = KVPools(self.layout, cache_manager.num_blocks, cache_manager.block_size)
            self._cache_manager = cache_manager
            logger.info(
                "mlx prefix-cache pools: %d blocks x %d tokens x %d bytes/token = %.1f MiB",
                cache_manager.num_blocks,
                cache_manager.block_size,
                self.layout.bytes_per_token(),
                self._pools.nbytes / 2**20,
            )

    # -- prefill --------------------------------------------------------------------------------
    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        prompt = check_prompt(prompt_ids, self.model_info.vocab_size)
        cached = 0
        kv: KVBatch | None = None
        if self._cache_manager is not None and self._pools is not None:
            match = self._cache_manager.lookup(prompt)
            try:
                cached = min(match.num_tokens, len(prompt) - 1)
                if cached > 0:
                    blocks = match.block_ids[: -(-cached // self._pools.block_size)]
                    with mx.stream(self._device):
                        arrays = self._pools.read(blocks, cached)
                    kv = KVBatch.from_arrays(self.layout, arrays, cached, growth=self._growth)
            finally:
                self._cache_manager.release(match)
        if kv is None:
            kv = KVBatch(self.layout, [0], growth=self._growth, trim_sliding=False)
        self._track(kv)
        self.last_cache_hit_tokens = cached
        return PrefillState(prompt, kv, num_cached=cached, num_computed=cached)

    def prefill_chunk(self, state: PrefillState, num_tokens: int) -> None:
        kv = self._own(state.kv)
        count = min(num_tokens, state.num_remaining)
        if count <= 0:
            if not state.is_complete:
                raise ValueError(f"prefill_chunk needs num_tokens >= 1 (got {num_tokens})")
            return
        start = state.num_computed
        assert kv.lengths == [start], "prefill KV disagrees with num_computed"
        last = start + count == len(state.prompt_ids)
        tokens = mx.array([state.prompt_ids[start : start + count]], dtype=mx.int32)
        with mx.stream(self._device):
            try:
                logits = self._runner.prefill(tokens, kv.begin_forward(count), want_logits=last)
                mx.eval(kv.arrays(), logits if logits is not None else [])
            except Exception:
                kv.mark_broken()
                raise
        kv.end_forward(count)
        state.num_computed += count
        if last:
            state.last_logits = logits

    def prefill_store(self, state: PrefillState) -> None:
        if self._cache_manager is None or self._pools is None:
            return
        if not state.is_complete:
            raise ValueError("prefill_store needs a completed prefill")
        kv = self._own(state.kv)
        plan = self._cache_manager.begin_store(state.prompt_ids)
        try:
            with mx.stream(self._device):
                self._pools.write(kv, plan.writes)
        except BaseException:
            self._cache_manager.abort_store(plan)
            raise
        self._cache_manager.commit_store(plan)

    # -- batch ops --------------------------------------------------------------------------------
    def stack_caches_left_padded(self, rows: Sequence[Any]) -> KVBatch:
        batch = KVBatch(self.layout, [], growth=self._growth, trim_sliding=True)
        return self._extend(batch, [self._own(row) for row in rows])

    def splice_into_batched(self, batched: Any, new_kv: Any, kv_len: int) -> KVBatch:
        row = self._own(new_kv)
        if row.lengths != [kv_len]:
            raise ValueError(f"splice_into_batched: kv_len {kv_len} but the row KV holds {row.lengths}")
        if batched is None:
            batched = KVBatch(self.layout, [], growth=self._growth, trim_sliding=True)
        elif not isinstance(batched, KVBatch):
            raise TypeError(f"not a batch of this backend: {type(batched).__name__}")
        return self._extend(batched, [row])

    def remove_row_from_cache(self, batched: Any, row_idx: int) -> None:
        if not isinstance(batched, KVBatch):
            raise TypeError(f"not a batch of this backend: {type(batched).__name__}")
        with mx.stream(self._device):
            batched.pop_row(row_idx)
        self._track(batched)

    def decode_step_batched(self, batched: Any, input_ids: Sequence[int]) -> mx.array:
        batch = self._own(batched)
        if len(input_ids) != batch.num_rows:
            raise ValueError(f"decode_step_batched: {len(input_ids)} input ids for {batch.num_rows} rows")
        tokens = mx.array(list(input_ids), dtype=mx.int32)[:, None]
        with mx.stream(self._device):
            try:
                logits = self._runner.decode(tokens, batch.begin_forward(1))
                mx.eval(logits, batch.arrays())
            except Exception:
                batch.mark_broken()
                raise
        batch.end_forward(1)
        return logits

    def kv_length(self, kv: Any, row_idx: int | None = None) -> int:
        handle = self._own(kv)
        lengths = handle.lengths
        if row_idx is None:
            if len(lengths) != 1:
                raise ValueError(f"kv_length of a {len(lengths)}-row batch needs row_idx")
            return lengths[0]
        return lengths[row_idx]

    def sample(self, logits: Any, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
        with mx.stream(self._device):
            return sample_rows(logits, rows, want_logprobs=want_logprobs)

    def free_row_kv(self, kv: Any) -> None:
        if not isinstance(kv, KVBatch):
            raise TypeError(f"not a KV of this backend: {type(kv).__name__}")
        kv.free()
        self._live.pop(id(kv), None)

    # -- bookkeeping ------------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, int]:
        stats = {
            "rows_in_flight": sum(kv.num_rows for kv in self._live.values()),
            "kv_tokens_in_flight": sum(sum(kv.lengths) for kv in self._live.values()),
        }
        if self._cache_manager is not None:
            cache = self._cache_manager.stats()
            stats.update(blocks_total=cache.num_blocks, blocks_used=cache.used_blocks, blocks_free=cache.free_blocks,
                         blocks_evictable=cache.evictable_blocks)
        return stats

    def close(self) -> None:
        for kv in list(self._live.values()):
            if kv.status in ("live", "broken"):
                kv._release("freed")
        self._live.clear()
        self._pools = None
        self._cache_manager = None

    def check_integrity(self) -> None:
        """Every live handle is consistent and holds rows; pools match the layout."""
        for key, kv in self._live.items():
            if id(kv) != key or kv.status not in ("live", "broken") or kv.num_rows == 0:
                raise RuntimeError(f"MlxBatchBackend: tracked KV is {kv.status} with {kv.num_rows} rows")
            kv.check_integrity()
        if self._pools is not None:
            self._pools.check_integrity()

    def _own(self, kv: Any) -> KVBatch:
        """``kv`` as a usable handle of this backend, else TypeError/RuntimeError."""
        if not isinstance(kv, KVBatch) or kv.layout is not self.layout:
            raise TypeError(f"not a KV of this backend: {type(kv).__name__}")
        kv.require_live()
        return kv

    def _extend(self, batch: KVBatch, rows: list[KVBatch]) -> KVBatch:
        with mx.stream(self._device):
            batch.extend(rows)
            mx.eval(batch.arrays())
        for row in rows:
            self._live.pop(id(row), None)
        self._track(batch)
        return batch

    def _track(self, kv: KVBatch) -> None:
        if kv.num_rows > 0 and kv.status in ("live", "broken"):
            self._live[id(kv)] = kv
        else:
            self._live.pop(id(kv), None)
