"""ReferenceBackend: a deterministic pure-Python backend with real KV semantics.

It is the core tests' backend and the worked example for backend authors. The "model" is in
:mod:`gemmaserve.testing.reference_model`: a token's KV entry is ``(token, position)`` and the
next-token logits hash the row's whole KV, so any KV bookkeeping bug changes the output.

KV formats: a row KV is a list of entries; the batched KV is a list of equally wide rows, each
left-padded with ``None``. Prefix caching goes through the core CacheManager: the backend keeps a
block pool (``block_id -> entries``) and copies blocks in and out. Every method expects
``self.lock`` to be held by the caller (the base ``generate_stream`` takes it itself).
"""

from __future__ import annotations

from collections import Counter

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gemmaserve.backend import (
    BackendCapabilities,
    InferenceBackend,
    ModelInfo,
    PrefillState,
    SampledTokens,
    StepOutput,
)
from gemmaserve.engine.sampling_cpu import sample_rows, top_logprobs
from gemmaserve.errors import KVCapacityError
from gemmaserve.testing.reference_model import EOS_ID, CharTokenizer, KVEntry, next_token_logits

if TYPE_CHECKING:
    from gemmaserve.kv.cache_manager import CacheManager
    from gemmaserve.sampling_params import RowSampling, SamplingParams
    from gemmaserve.settings import CoreSettings

__all__ = ["ReferenceBackend", "create_reference_backend", "InjectedFault"]

_HANDLES = itertools.count(1)


class InjectedFault(RuntimeError):
    """Raised by the fault-injection hooks (``fail_on_token``, ``fail_on_decode_token``)."""


class _RowKV:
    __slots__ = ("handle", "entries")

    def __init__(self, entries: list[KVEntry]) -> None:
        self.handle = next(_HANDLES)
        self.entries = entries


class _BatchKV:
    __slots__ = ("handle", "rows", "lengths")

    def __init__(self) -> None:
        self.handle = next(_HANDLES)
        self.rows: list[list[KVEntry | None]] = []  # left-padded with None, all the same width
        self.lengths: list[int] = []  # real entries per row

    @property
    def width(self) -> int:
        return len(self.rows[0]) if self.rows else 0


class ReferenceBackend(InferenceBackend):
    """Toy deterministic backend. Options: ``kv_capacity_tokens`` turns on ``kv_reserve``;
    ``streaming_only`` hides the batched path (the scheduler then uses ``generate_stream``);
    ``fail_on_token`` makes ``prefill_chunk`` raise on a prompt chunk containing that token,
    ``fail_on_decode_token`` makes ``decode_step_batched`` raise when a row feeds that token;
    ``decode_delay_s`` sleeps in every decode step (engine timing tests); ``mixed_step`` declares
    :meth:`forward_step` (whole ticks in one call), whose chunks take at most ``max_step_chunk`` tokens;
    ``async_decode`` declares :meth:`decode_step_async` (the contract's synchronous default), so the scheduler
    launches each decode step before it applies the previous one's tokens."""

    def __init__(
        self,
        vocab_size: int = 64,
        max_model_len: int = 512,
        eos_token_id: int = EOS_ID,
        *,
        kv_capacity_tokens: int | None = None,
        streaming_only: bool = False,
        max_concurrent_streams: int = 2,
        fail_on_token: int | None = None,
        fail_on_decode_token: int | None = None,
        decode_delay_s: float = 0.0,
        mixed_step: bool = False,
        max_step_chunk: int | None = None,
        async_decode: bool = False,
    ) -> None:
        super().__init__()
        self.capabilities = BackendCapabilities(
            continuous_batching=not streaming_only,
            uses_core_cache_manager=True,
            kv_reservation=kv_capacity_tokens is not None,
            logprobs=True, top_logprobs=True,
            allowed_token_masks=True,
            max_concurrent_streams=max_concurrent_streams,
            mixed_step=mixed_step,
            async_decode=async_decode,
            deferred_sampling=True,
        )
        self.max_step_chunk = max_step_chunk
        self.step_calls: list[tuple[list[int], int]] = []  # (chunk sizes asked, decode rows) per forward_step
        self.model_info = ModelInfo(
            "reference", vocab_size, max_model_len, (eos_token_id,), "toy-kv-hash", "int", "cpu"
        )
        self.tokenizer = CharTokenizer(vocab_size)
        self.kv_capacity_tokens = kv_capacity_tokens
        self.fail_on_token = fail_on_token
        self.fail_on_decode_token = fail_on_decode_token
        self.decode_delay_s = decode_delay_s
        self.cache: CacheManager | None = None
        self._pool: dict[int, list[KVEntry]] = {}
        self._rows: dict[int, _RowKV] = {}  # live row KVs not (yet) in a batch
        self._batches: dict[int, _BatchKV] = {}  # batches holding at least one row
        self._reservations: dict[str, int] = {}
        self.closed = False

    # -- prefix cache ---------------------------------------------------------------------------
    def set_cache_adapter(self, cache_manager: CacheManager | None) -> None:
        if cache_manager is not self.cache:
            self._pool.clear()  # block ids of another pool mean nothing here
        self.cache = cache_manager

    # -- prefill --------------------------------------------------------------------------------
    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        prompt = tuple(prompt_ids)
        entries: list[KVEntry] = []
        if self.cache is not None and prompt:
            match = self.cache.lookup(prompt)
            try:
                for block_id in match.block_ids:
                    entries.extend(self._pool.get(block_id, ()))
            finally:
                self.cache.release(match)
            if len(entries) != match.num_tokens or [e.token for e in entries] != list(prompt[: match.num_tokens]):
                raise RuntimeError(
                    f"prefix cache returned blocks that do not hold the prompt's first {match.num_tokens} tokens"
                )
            del entries[len(prompt) - 1 :]  # recompute at least one token: its logits start decoding
        self.last_cache_hit_tokens = len(entries)
        row = self._register(_RowKV(entries))
        return PrefillState(prompt, row, num_cached=len(entries), num_computed=len(entries))

    def prefill_chunk(self, state: PrefillState, num_tokens: int) -> None:
        start = state.num_computed
        chunk = state.prompt_ids[start : start + max(0, min(num_tokens, state.num_remaining))]
        if self.fail_on_token is not None and self.fail_on_token in chunk:
            raise InjectedFault(f"injected prefill failure on token {self.fail_on_token}")
        row = self._live(state.kv)
        row.entries.extend(KVEntry(token, start + offset) for offset, token in enumerate(chunk))
        state.num_computed += len(chunk)
        if state.num_computed == len(state.prompt_ids):
            state.last_logits = [next_token_logits(row.entries, self.model_info.vocab_size)]

    def prefill_store(self, state: PrefillState) -> None:
        if self.cache is None:
            return
        entries = self._live(state.kv).entries
        plan = self.cache.begin_store(state.prompt_ids)
        try:
            for write in plan.writes:
                self._pool[write.block_id] = entries[write.token_start : write.token_end]
        except BaseException:
            self.cache.abort_store(plan)
            raise
        self.cache.commit_store(plan)

    def free_row_kv(self, kv: Any) -> None:
        self._take(kv)

    # -- batch ops ------------------------------------------------------------------------------
    def stack_caches_left_padded(self, rows: Sequence[Any]) -> _BatchKV:
        taken = [self._take(row) for row in rows]
        batch = _BatchKV()
        width = max((len(row.entries) for row in taken), default=0)
        for row in taken:
            batch.rows.append([None] * (width - len(row.entries)) + row.entries)
            batch.lengths.append(len(row.entries))
        if batch.rows:
            self._batches[batch.handle] = batch
        return batch

    def splice_into_batched(self, batched: _BatchKV | None, new_kv: Any, kv_len: int) -> _BatchKV:
        row = self._live(new_kv)
        if kv_len != len(row.entries):
            raise ValueError(f"kv_len {kv_len} != the row's {len(row.entries)} KV entries")
        batch = batched if batched is not None else _BatchKV()
        self._take(new_kv)
        grow = kv_len - batch.width
        if grow > 0:
            batch.rows = [[None] * grow + existing for existing in batch.rows]
        batch.rows.append([None] * (batch.width - kv_len if batch.rows else 0) + row.entries)
        batch.lengths.append(kv_len)
        self._batches[batch.handle] = batch
        return batch

    def remove_row_from_cache(self, batched: _BatchKV, row_idx: int) -> None:
        if not 0 <= row_idx < len(batched.rows):
            raise IndexError(f"row {row_idx} out of range for a batch of {len(batched.rows)}")
        batched.rows.pop(row_idx)
        batched.lengths.pop(row_idx)
        if not batched.rows:
            self._batches.pop(batched.handle, None)
            return
        trim = batched.width - max(batched.lengths)  # drop padding columns no row needs any more
        if trim:
            batched.rows = [row[trim:] for row in batched.rows]

    def decode_step_batched(self, batched: _BatchKV, input_ids: Sequence[int]) -> list[list[float]]:
        if len(input_ids) != len(batched.rows):
            raise ValueError(f"got {len(input_ids)} input ids for a batch of {len(batched.rows)} rows")
        if self.fail_on_decode_token is not None and self.fail_on_decode_token in input_ids:
            raise InjectedFault(f"injected decode failure on token {self.fail_on_decode_token}")
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)
        logits = []
        for index, token in enumerate(input_ids):
            row = batched.rows[index]
            row.append(KVEntry(token, batched.lengths[index]))
            batched.lengths[index] += 1
            logits.append(next_token_logits([e for e in row if e is not None], self.model_info.vocab_size))
        return logits

    def forward_step(
        self, states: Sequence[PrefillState], num_tokens: Sequence[int], batched: _BatchKV | None,
        input_ids: Sequence[int],
    ) -> StepOutput:
        """The decode step first (it raises before changing any row), then each chunk (capped at
        ``max_step_chunk``), each reporting its own exception."""
        if not self.capabilities.mixed_step:
            return super().forward_step(states, num_tokens, batched, input_ids)
        self.step_calls.append((list(num_tokens), len(input_ids)))
        logits = self.decode_step_batched(batched, input_ids) if batched is not None and batched.rows else None
        cap = self.max_step_chunk
        sizes = [num if cap is None else min(num, cap) for num in num_tokens]
        return StepOutput(self.prefill_chunks(states, sizes), logits)

    def kv_length(self, kv: Any, row_idx: int | None = None) -> int:
        if isinstance(kv, _BatchKV):
            if row_idx is None:
                raise ValueError("kv_length of a batched KV needs row_idx")
            return kv.lengths[row_idx]
        return len(kv.entries)

    def sample(self, logits: Any, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
        tokens, logprobs = sample_rows(logits, rows, want_logprobs=want_logprobs)
        top = [top_logprobs(row_logits, row) for row_logits, row in zip(logits, rows)] if want_logprobs else None
        return SampledTokens(tokens, logprobs, top)

    # -- reservation ------------------------------------------------------------------------------
    def kv_reserve(self, request_id: str, num_tokens: int) -> bool:
        if self.kv_capacity_tokens is None:
            return True
        if num_tokens > self.kv_capacity_tokens:
            raise KVCapacityError(f"{num_tokens} KV tokens requested, the pool holds {self.kv_capacity_tokens}")
        if sum(self._reservations.values()) + num_tokens > self.kv_capacity_tokens:
            return False
        self._reservations[request_id] = num_tokens
        return True

    def kv_release(self, request_id: str) -> None:
        self._reservations.pop(request_id, None)

    def kv_stats(self) -> dict[str, int]:
        reserved = sum(self._reservations.values())
        return {
            "tokens_total": self.kv_capacity_tokens or 0,
            "tokens_reserved": reserved,
            "live_rows": self.num_live_rows,
        }

    # -- ground truth -----------------------------------------------------------------------------
    def reference_generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The tokens one request must produce, computed without batching, chunking or caching.
        Sampled params (temperature > 0) need an explicit seed."""
        from gemmaserve.sampling_params import RowSampling

        if not params.is_greedy and params.seed is None:
            raise ValueError("reference_generate needs params.seed when temperature > 0")
        entries = [KVEntry(token, position) for position, token in enumerate(prompt_ids)]
        out: list[int] = []
        while True:
            row = RowSampling.for_params(params, params.seed or 0, len(out), self.model_info.eos_token_ids,
                                         prompt_tokens=frozenset(prompt_ids) if params.repetition_penalty != 1.0 else
                                         frozenset(), output_counts=tuple(Counter(out).items()) if params.has_penalties
                                         else ())
            token = sample_rows([next_token_logits(entries, self.model_info.vocab_size)], [row])[0][0]
            out.append(token)
            eos = not params.ignore_eos and token in self.model_info.eos_token_ids
            if eos or token in params.stop_token_ids or len(out) >= params.max_tokens:
                return out
            entries.append(KVEntry(token, len(entries)))

    # -- bookkeeping ------------------------------------------------------------------------------
    @property
    def num_live_rows(self) -> int:
        """Row KVs alive anywhere: not yet batched, or rows of a batch."""
        return len(self._rows) + sum(len(batch.rows) for batch in self._batches.values())

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def _register(self, row: _RowKV) -> _RowKV:
        self._rows[row.handle] = row
        return row

    def _live(self, kv: Any) -> _RowKV:
        if not isinstance(kv, _RowKV) or kv.handle not in self._rows:
            raise RuntimeError(f"row KV {kv!r} is not live (freed, spliced already, or foreign)")
        return kv

    def _take(self, kv: Any) -> _RowKV:
        return self._rows.pop(self._live(kv).handle)

    def close(self) -> None:
        self.closed = True

    def check_integrity(self) -> None:
        for row in self._rows.values():
            if [e.position for e in row.entries] != list(range(len(row.entries))):
                raise RuntimeError(f"row KV {row.handle} has entries out of position order")
        for batch in self._batches.values():
            if not batch.rows or len(batch.rows) != len(batch.lengths):
                raise RuntimeError(f"batch {batch.handle}: {len(batch.rows)} rows, {len(batch.lengths)} lengths")
            for index, (row, length) in enumerate(zip(batch.rows, batch.lengths)):
                pad = len(row) - length
                if len(row) != batch.width or pad < 0 or any(e is not None for e in row[:pad]):
                    raise RuntimeError(f"batch {batch.handle} row {index} is not left-padded to width {batch.width}")
                if [e.position if e else None for e in row[pad:]] != list(range(length)):
                    raise RuntimeError(f"batch {batch.handle} row {index} has entries out of position order")
            if batch.width != max(batch.lengths):
                raise RuntimeError(f"batch {batch.handle} keeps padding no row needs (width {batch.width})")
        reserved = sum(self._reservations.values())
        if self.kv_capacity_tokens is not None and reserved > self.kv_capacity_tokens:
            raise RuntimeError(f"{reserved} KV tokens reserved, capacity {self.kv_capacity_tokens}")
        if self.cache is not None and any(len(v) > self.cache.block_size for v in self._pool.values()):
            raise RuntimeError("a pool block holds more entries than the block size")


def create_reference_backend(model_path: str, device: str, settings: CoreSettings) -> ReferenceBackend:
    """BackendSpec factory: ``model_path`` is ignored (the toy model has no weights); CPU only."""
    if device != "cpu":
        from gemmaserve.errors import BackendUnavailableError

        raise BackendUnavailableError(f"the reference backend runs on cpu only, not {device}")
    return ReferenceBackend(max_model_len=settings.max_model_len or 512)
