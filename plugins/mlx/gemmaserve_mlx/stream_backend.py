"""BACKEND=mlx-stream: streaming-only generation with mlx_lm's ``generate_step``.

One request at a time (``continuous_batching=False``): the scheduler calls :meth:`generate_stream`.
Seeded sampling uses the same (seed, step) keys as BACKEND=mlx. The KV of recent streams is kept
(``MLX_STREAM_PROMPT_CACHES`` of them) and reused for the longest prompt prefix a new stream shares
with one of them (``session_cache``); ``last_cache_hit_tokens`` reports it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from gemmaserve.backend import BackendCapabilities, SampledTokens, StreamingBackend, StreamingOnlyError

from gemmaserve_mlx.loader import LoadedModel, load_model
from gemmaserve_mlx.sampling import StreamSampler, sample_rows
from gemmaserve_mlx.session_cache import SessionCache, SessionEntry
from gemmaserve_mlx.settings import MlxSettings, load_mlx_settings
from gemmaserve_mlx.validation import check_prompt

if TYPE_CHECKING:
    from gemmaserve.sampling_params import RowSampling, SamplingParams
    from gemmaserve.settings import CoreSettings

__all__ = ["MlxStreamBackend", "StreamingOnlyError", "create_backend"]


def create_backend(model_path: str, device: str, settings: CoreSettings) -> MlxStreamBackend:
    """Registry factory: load ``model_path`` and build the streaming backend."""
    return MlxStreamBackend(load_model(model_path, device, settings), load_mlx_settings())


class MlxStreamBackend(StreamingBackend):
    """mlx_lm generation, one stream at a time, reusing recent streams' KV for shared prefixes (the batched
    primitives raise :class:`StreamingOnlyError`, from :class:`StreamingBackend`)."""

    batched_hint = "drive it through generate_stream, or use BACKEND=mlx for continuous batching"

    def __init__(self, loaded: LoadedModel, mlx_settings: MlxSettings) -> None:
        super().__init__()
        self.capabilities = BackendCapabilities(
            continuous_batching=False, uses_core_cache_manager=False, max_concurrent_streams=1
        )
        self.model_info = loaded.info
        self.tokenizer = loaded.tokenizer
        self._model = loaded.model
        self._device = loaded.device
        self._stream = mx.new_thread_local_stream(loaded.device)
        self._sessions = SessionCache(mlx_settings.stream_prompt_caches)
        self._anonymous = itertools.count()
        self._active_streams = 0

    def generate_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str | None = None
    ) -> Iterator[int]:
        """Yield up to ``params.max_tokens`` tokens (no EOS handling: the caller stops). Takes
        ``self.lock`` around each step; sets ``last_cache_hit_tokens`` at the first step."""
        prompt = check_prompt(prompt_ids, self.model_info.vocab_size)
        seed = params.seed if params.seed is not None else 0
        return self._stream_tokens(prompt, params, seed, session_id)

    def _stream_tokens(
        self, prompt: tuple[int, ...], params: SamplingParams, seed: int, session_id: str | None
    ) -> Iterator[int]:
        with self.lock:
            entry, reused = self._sessions.take_longest(prompt, session_id)
            cache = entry.cache if entry is not None else make_prompt_cache(self._model)
            self.last_cache_hit_tokens = reused
            steps = generate_step(
                mx.array(prompt[reused:], dtype=mx.int32),
                self._model,
                self._stream,
                max_tokens=params.max_tokens,
                sampler=StreamSampler(params, seed, self.model_info.eos_token_ids),
                prompt_cache=cache,
            )
            self._active_streams += 1
        produced: list[int] = []
        try:
            while True:
                with self.lock:
                    step = next(steps, None)
                if step is None:
                    return
                produced.append(int(step[0]))
                yield produced[-1]
        finally:
            with self.lock:
                steps.close()
                self._active_streams -= 1
                key = session_id if session_id is not None else f"anonymous-{next(self._anonymous)}"
                self._sessions.put(key, SessionEntry([*prompt, *produced], cache))

    def sample(self, logits: Any, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
        with mx.stream(self._device):
            return sample_rows(logits, rows, want_logprobs=want_logprobs)

    # -- bookkeeping ------------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, int]:
        return {"prompt_caches": len(self._sessions), "streams_active": self._active_streams}

    def close(self) -> None:
        with self.lock:
            self._sessions.clear()

    def check_integrity(self) -> None:
        if self._active_streams < 0:
            raise RuntimeError(f"MlxStreamBackend: {self._active_streams} active streams")
        self._sessions.check_integrity()

