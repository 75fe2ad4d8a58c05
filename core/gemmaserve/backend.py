"""The InferenceBackend contract: the only layer that knows what a tensor is.

Everything above a backend (scheduler, engine, server) talks in token IDs. A backend owns the
model, the tokenizer and the in-flight KV. The scheduler drives it through these primitives, always
while holding ``backend.lock``:

    state = prefill_lookup(prompt_ids)          # prefix-cache hit -> state.kv covers the hit
    prefill_chunk(state, n) ...                 # until state.is_complete (chunked prefill)
    prefill_store(state)                        # register the prompt's KV in the prefix cache
    tokens = sample(state.last_logits, [row])   # first token
    batch = splice_into_batched(batch, state.kv, kv_length(state.kv))
    logits = decode_step_batched(batch, last_tokens)   # every tick, one forward over all rows
    tokens = sample(logits, rows)
    remove_row_from_cache(batch, i)             # row i finished; rows after i shift down by one

Backends with ``capabilities.mixed_step`` run a whole tick (the decoding rows plus the prefill chunks
the token budget allows) as ONE call instead of ``prefill_chunks`` + ``decode_step_batched``:

    out = forward_step(states, num_tokens, batch, last_tokens)   # one forward over everything
    tokens = sample(out.decode_logits, rows)                     # first tokens from state.last_logits

Backends with ``capabilities.async_decode`` take a decode-only tick as a launch that does not wait for its
tokens; the scheduler launches step k+1 (rows whose token is still on the device name its row in step k)
before it reads step k's tokens, so its host work overlaps the device:

    pending = decode_step_async(batch, last_tokens, from_previous, rows)   # returns at once
    tokens = previous_pending.result()                                      # step k's tokens, on the host

Row order is list order: the batch's row ``i`` is the ``i``-th spliced row still present, and
``remove_row_from_cache`` behaves like ``list.pop(i)``. KV handles (``RowKV``, ``BatchKV``) are
opaque to the core; only the backend that made them may touch them.

Ownership and failure rules the scheduler relies on:

- A ``PrefillState``'s KV belongs to the caller until ``splice_into_batched`` returns; if splicing
  raises, the caller still owns it and frees it with ``free_row_kv`` (idempotent; never called on a
  KV that was spliced).
- ``remove_row_from_cache`` must work after a failed ``decode_step_batched`` (so a broken batch can
  still be emptied and its KV freed). Backends should leave the KV unchanged when a step raises.
- A full prefix hit may adopt ``len(prompt) - 1`` tokens and recompute the last one (its logits
  start decoding); ``num_cached`` and ``last_cache_hit_tokens`` count the tokens actually reused.
- ``kv_reserve`` returning False while nothing else holds KV means the request can never fit; the
  scheduler then fails it with ``KVCapacityError`` instead of waiting forever.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, runtime_checkable

from gemmaserve.errors import GemmaserveError

if TYPE_CHECKING:
    from gemmaserve.kv.cache_manager import CacheManager
    from gemmaserve.sampling_params import RowSampling, SamplingParams

__all__ = [
    "BackendCapabilities",
    "concat_sampled",
    "resolve_rows",
    "ModelInfo",
    "Tokenizer",
    "PrefillState",
    "PrefillResult",
    "SampledTokens",
    "PendingTokens",
    "ReadyTokens",
    "LaunchedStep",
    "StepOutput",
    "InferenceBackend",
    "StreamingBackend",
    "StreamingOnlyError",
    "RowKV",
    "BatchKV",
    "Logits",
]

RowKV = Any
"""One request's KV, in the backend's own format (e.g. an HF DynamicCache, a list of paged caches)."""
BatchKV = Any
"""The batched KV of all decoding rows, in the backend's own format."""
Logits = Any
"""Backend-native logits, shape [rows, vocab] (a torch tensor, an mx.array, a list of lists...)."""


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What the scheduler may ask of a backend.

    - ``continuous_batching``: implements the prefill/decode/row primitives. When False the backend is
      streaming-only: the scheduler calls :meth:`InferenceBackend.generate_stream` and runs at most
      ``max_concurrent_streams`` requests at once.
    - ``uses_core_cache_manager``: prefix caching goes through the core ``CacheManager`` handed over by
      :meth:`InferenceBackend.set_cache_adapter`. False means the backend caches internally (or not at
      all) and ``set_cache_adapter`` is a no-op.
    - ``kv_reservation``: implements ``kv_reserve`` / ``kv_release``; the scheduler admits a request only
      once its reservation succeeds.
    - ``logprobs``: ``sample(..., want_logprobs=True)`` returns the chosen tokens' log-probabilities.
    - ``top_logprobs``: with ``want_logprobs``, every sampling call also returns, for each row whose
      ``RowSampling.top_logprobs`` is k > 0, its k most likely tokens and their log-probabilities under the
      same distribution (most likely first, ties: lower id first; ``SampledTokens.top_logprobs``). Without it
      the scheduler refuses requests with ``logprobs`` > 0.
    - ``mixed_step``: implements :meth:`InferenceBackend.forward_step`; the scheduler then runs each tick's
      prefill chunks and decode rows through that one call.
    - ``async_decode``: :meth:`InferenceBackend.decode_step_async` returns before the step's tokens reach the
      host, and feeds tokens the host has not read yet from the device; the scheduler (``ASYNC_SCHEDULING``)
      then launches decode step k+1 before it applies step k's tokens, so its bookkeeping overlaps the device.
      With ``mixed_step`` too, ticks that carry prompt tokens launch the same way (``forward_step_async``).
    - ``deferred_sampling`` (with ``async_decode``): :meth:`InferenceBackend.decode_step_async` accepts its
      ``rows`` as a callable and calls it once, after launching the step's forward and before its sampling;
      the scheduler then launches a batch with rows whose next sampling needs the previous token on the host
      (structured-output masks, penalties) ahead too, and reads that token while the device runs the forward.
    - ``allowed_token_masks``: every sampling call honours ``RowSampling.allowed`` (structured output's
      per-row mask: tokens outside it get -inf before temperature and the filters, as
      ``gemmaserve.engine.sampling_cpu`` defines). Without it the scheduler refuses constrained requests.
    - ``progressive_cache_block_size`` (with ``uses_core_cache_manager`` False; 0 = none): the block size of the
      backend's own prefix cache when that cache finds a prompt's full blocks as soon as a chunk has computed
      them (not only once the prompt completed); the scheduler then holds back a request that shares blocks
      with a prompt being prefilled until they are computed, so it hits them instead of computing them again
      (``gemmaserve.engine.shared_prefix``). Core ``CacheManager`` backends get the completion-time form of this
      without declaring anything.
    """

    continuous_batching: bool = True
    uses_core_cache_manager: bool = True
    kv_reservation: bool = False
    logprobs: bool = False
    top_logprobs: bool = False
    mixed_step: bool = False
    async_decode: bool = False
    deferred_sampling: bool = False
    allowed_token_masks: bool = False
    progressive_cache_block_size: int = 0
    max_concurrent_streams: int = 1


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about the loaded model the layers above need."""

    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    architecture: str = ""
    dtype: str = ""
    device: str = ""


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token IDs. ``apply_chat_template`` raises ``InvalidRequestError`` if the model has none.

    Optional, found by the server when present (``gemmaserve.hf_tokenizer.HFTokenizerAdapter`` has them all):
    ``apply_chat_template`` keywords ``add_generation_prompt``, ``continue_final_message`` and
    ``template_kwargs`` (without them a request setting those options gets a 400 naming the field);
    ``chat_stop_token_ids`` (tokens that end a chat turn, treated like EOS on chat requests);
    ``set_chat_template(template)`` (``--chat-template``); and ``tokenizer_json()`` (the Hugging Face
    ``tokenizer.json`` text: structured output compiles its grammars against this vocabulary)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]: ...

    @property
    def has_chat_template(self) -> bool: ...


@dataclass(slots=True)
class PrefillState:
    """A prompt being prefilled. Created by ``prefill_lookup``, advanced by ``prefill_chunk``.

    ``kv`` holds the KV of ``prompt_ids[:num_computed]``; ``num_cached`` of those tokens came from the
    prefix cache (the hit). ``last_logits`` (shape [1, vocab]) is set once ``num_computed ==
    len(prompt_ids)``. ``backend_data`` is private to the backend. Whoever abandons a state before it
    is spliced into the batch must call ``InferenceBackend.free_row_kv(state.kv)``.
    """

    prompt_ids: tuple[int, ...]
    kv: RowKV
    num_cached: int = 0
    num_computed: int = 0
    last_logits: Logits | None = None
    backend_data: dict[str, Any] = field(default_factory=dict)

    @property
    def num_remaining(self) -> int:
        return len(self.prompt_ids) - self.num_computed

    @property
    def is_complete(self) -> bool:
        return self.num_computed == len(self.prompt_ids) and self.last_logits is not None


@dataclass(slots=True)
class PrefillResult:
    """Result of a one-shot :meth:`InferenceBackend.prefill`."""

    kv: RowKV
    last_logits: Logits
    num_prompt_tokens: int
    last_cache_hit_tokens: int


@dataclass(slots=True)
class SampledTokens:
    """One sampled token per row; ``logprobs`` only when requested and supported; ``top_logprobs`` (with
    ``logprobs``, ``capabilities.top_logprobs``): per row, its ``RowSampling.top_logprobs`` most likely
    ``(token, logprob)`` pairs (an empty list for rows that asked for none)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def resolve_rows(rows: Sequence[RowSampling] | Callable[[], Sequence[RowSampling]],
                 count: int) -> Sequence[RowSampling]:
    """``decode_step_async``'s samplings: ``rows`` itself, or what the deferred callable returns (called once,
    after the forward was launched; ``capabilities.deferred_sampling``). Raises ValueError unless ``count``."""
    resolved = rows() if callable(rows) else rows
    if len(resolved) != count:
        raise ValueError(f"{len(resolved)} samplings for {count} rows")
    return resolved


def concat_sampled(parts: Sequence[SampledTokens], want_logprobs: bool) -> SampledTokens:
    """Several sampling calls' results as one, in order (logprobs kept only when wanted; top lists when a part
    has them, empty for the rows of parts without)."""
    token_ids = [t for part in parts for t in part.token_ids]
    if not want_logprobs:
        return SampledTokens(token_ids)
    logprobs = [x for part in parts for x in part.logprobs or []]
    top = None
    if any(part.top_logprobs is not None for part in parts):
        top = [row for part in parts for row in (part.top_logprobs or [[] for _ in part.token_ids])]
    return SampledTokens(token_ids, logprobs, top)


class PendingTokens:
    """The sampled tokens of a launched decode step (:meth:`InferenceBackend.decode_step_async`).

    :meth:`result` waits until they are on the host and returns them; it may be called more than once (same
    object back). A backend's subclass starts the device-to-host copy when the step is launched."""

    def result(self) -> SampledTokens:
        raise NotImplementedError


class ReadyTokens(PendingTokens):
    """Tokens already on the host (a backend whose steps are synchronous)."""

    def __init__(self, sampled: SampledTokens) -> None:
        self.sampled = sampled

    def result(self) -> SampledTokens:
        return self.sampled


@dataclass(slots=True)
class LaunchedStep:
    """Result of :meth:`InferenceBackend.forward_step_async`: per prefill state None or the exception its chunk
    raised (known at launch), and the step's sampled tokens: one per decode row, then the first token of each
    state that completed its prompt in this call without an error, in state order."""

    prefill_errors: list[Exception | None]
    tokens: PendingTokens


@dataclass(slots=True)
class StepOutput:
    """Result of :meth:`InferenceBackend.forward_step`: per prefill state None or the exception its chunk
    raised, and the decode logits [rows, vocab] (None when the batch was empty)."""

    prefill_errors: list[Exception | None]
    decode_logits: Logits | None


_LOCK_CREATION = threading.Lock()


class InferenceBackend(ABC):
    """Base class every backend implements. See the module docstring for the call protocol.

    Subclasses set ``capabilities``, ``model_info`` and ``tokenizer`` in ``__init__``. All methods
    except :meth:`generate_stream` are called with :attr:`lock` held by the caller; ``generate_stream``
    takes the lock itself around each step so it is serialized against the batched path.
    """

    capabilities: BackendCapabilities = BackendCapabilities()
    model_info: ModelInfo
    tokenizer: Tokenizer
    last_cache_hit_tokens: int = 0

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.last_cache_hit_tokens = 0

    @property
    def lock(self) -> threading.RLock:
        """The backend's lock (see the class docstring). Created on first use when a subclass's ``__init__``
        did not call ``super().__init__()``, so such a backend still works instead of failing the engine."""
        lock = self.__dict__.get("_backend_lock")
        if lock is None:
            with _LOCK_CREATION:
                lock = self.__dict__.setdefault("_backend_lock", threading.RLock())
        return lock

    @lock.setter
    def lock(self, value: threading.RLock) -> None:  # wrappers share their inner backend's lock
        self.__dict__["_backend_lock"] = value

    # -- prefix cache -------------------------------------------------------------------------
    def set_cache_adapter(self, cache_manager: CacheManager | None) -> None:
        """Hand over the core prefix cache (or None to disable it). No-op for self-caching backends."""

    # -- prefill ------------------------------------------------------------------------------
    @abstractmethod
    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        """Start a prefill: look the prompt up in the prefix cache and return a state whose ``kv``
        covers the hit (``num_cached == num_computed``). Sets ``self.last_cache_hit_tokens``.
        A full hit may leave up to one token to recompute (logits are needed for the first sample)."""

    @abstractmethod
    def prefill_chunk(self, state: PrefillState, num_tokens: int) -> None:
        """Run the model over the next ``num_tokens`` prompt tokens; mutates ``state`` (kv,
        num_computed, and last_logits once the prompt is complete). ``num_tokens`` is clamped to
        ``state.num_remaining``."""

    def prefill_chunks(
        self, states: Sequence[PrefillState], num_tokens: Sequence[int]
    ) -> list[Exception | None]:
        """Advance several prefills by one chunk each (``num_tokens[i]`` for ``states[i]``, clamped like
        :meth:`prefill_chunk`). The scheduler calls this once per tick for the chunks the token budget allows, so a
        backend can run them as one batched forward (one pass over the weights for all of them).

        Returns, per state, None when its chunk ran, or the exception its chunk raised: that request then
        fails alone (its KV is freed), the others go on. The default runs :meth:`prefill_chunk` on each in
        turn and reports its exceptions. If the call itself raises, the scheduler retries every state that
        did not advance alone with :meth:`prefill_chunk`."""
        if len(states) != len(num_tokens):
            raise ValueError(f"{len(states)} states but {len(num_tokens)} chunk sizes")
        errors: list[Exception | None] = []
        for state, num in zip(states, num_tokens):
            try:
                self.prefill_chunk(state, num)
            except Exception as exc:
                errors.append(exc)
            else:
                errors.append(None)
        return errors

    def forward_step(
        self, states: Sequence[PrefillState], num_tokens: Sequence[int], batched: BatchKV | None,
        input_ids: Sequence[int],
    ) -> StepOutput:
        """One tick in one call (backends with ``capabilities.mixed_step``): advance ``states[i]`` by a chunk
        of at most ``num_tokens[i]`` tokens and at least one (a backend may take fewer, e.g. to stay within
        what its forward supports), setting ``last_logits`` where a prompt completes, and decode one token
        for every row of ``batched`` (row ``i`` consumes ``input_ids[i]``), as ``prefill_chunks`` followed by
        ``decode_step_batched`` would, but meant as one forward over all of it.

        A chunk's exception is reported in ``prefill_errors`` (that request fails alone). If the call raises,
        ``remove_row_from_cache`` must still empty the batch: the scheduler drops it (freeing every row's KV) and
        recomputes each row's step alone from its tokens, never reusing the failed batch's KV; states that did not
        advance are retried with ``prefill_chunk``. ``batched`` is None on a tick without decoding rows (the
        decode logits are then None). The states and the batch's rows are disjoint."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward_step (a backend that does "
                                  "declares capabilities.mixed_step)")

    @abstractmethod
    def prefill_store(self, state: PrefillState) -> None:
        """Register the completed prompt's KV in the prefix cache (best effort: may store only a
        prefix under memory pressure). Does not change ``state.kv``."""

    def prefill(self, prompt_ids: Sequence[int]) -> PrefillResult:
        """One-shot prefill = lookup + one chunk over the rest + store. If the chunk or the store raises, the
        row is freed before the exception propagates (the caller never got it)."""
        state = self.prefill_lookup(prompt_ids)
        try:
            self.prefill_chunk(state, state.num_remaining)
            self.prefill_store(state)
        except BaseException:
            self.free_row_kv(state.kv)
            raise
        assert state.is_complete
        return PrefillResult(state.kv, state.last_logits, len(state.prompt_ids), state.num_cached)

    # -- batch ops ----------------------------------------------------------------------------
    @abstractmethod
    def stack_caches_left_padded(self, rows: Sequence[RowKV]) -> BatchKV:
        """Build a batched KV from per-row KVs (left-padded to the longest). Takes ownership of rows."""

    @abstractmethod
    def splice_into_batched(self, batched: BatchKV | None, new_kv: RowKV, kv_len: int) -> BatchKV:
        """Append ``new_kv`` (holding ``kv_len`` real tokens) as the last row; left-pads whichever
        side is shorter. ``batched=None`` starts a batch. Returns the batch (possibly a new object);
        takes ownership of ``new_kv``."""

    @abstractmethod
    def remove_row_from_cache(self, batched: BatchKV, row_idx: int) -> None:
        """Drop row ``row_idx`` in place (like ``list.pop``) and free its KV; other rows keep
        their order and stay aligned. A batch may become empty."""

    @abstractmethod
    def decode_step_batched(self, batched: BatchKV, input_ids: Sequence[int]) -> Logits:
        """One forward over all rows: row ``i`` consumes ``input_ids[i]`` and appends its KV.
        Returns logits of shape [rows, vocab]. Mutates ``batched``."""

    def decode_step_async(
        self, batched: BatchKV, input_ids: Sequence[int], from_previous: Sequence[int],
        rows: Sequence[RowSampling] | Callable[[], Sequence[RowSampling]], *, want_logprobs: bool = False,
    ) -> PendingTokens:
        """One decode step and its sampling, launched without waiting for the tokens (``capabilities.async_decode``).

        Row ``i`` consumes ``input_ids[i]`` when ``from_previous[i] < 0``, else the token that row
        ``from_previous[i]`` of the previous asynchronous call (this or ``forward_step_async``) sampled, which the host may not have read
        yet (that entry of ``input_ids`` is ignored). ``rows[i]`` samples row ``i``, as :meth:`sample` does;
        with ``capabilities.deferred_sampling`` ``rows`` may be a callable, called once after the forward is
        launched (it may wait for the previous call's tokens), that returns them (:func:`resolve_rows`).
        Between two calls the caller may remove rows and splice new ones (new rows pass -1); after any other
        forward (``decode_step_batched``, ``forward_step``, a prefill outside ``forward_step_async``) it passes
        -1 for every row. Mutates
        ``batched`` like :meth:`decode_step_batched`; if it raises, the rows hold the KV they held before.

        The default is synchronous (:meth:`decode_step_batched` then :meth:`sample`): correct for every backend,
        with nothing overlapped. Backends that declare ``async_decode`` override it."""
        if not (len(input_ids) == len(from_previous)):
            raise ValueError(f"{len(input_ids)} input ids and {len(from_previous)} sources")
        ids = self._resolve_previous(input_ids, from_previous)
        logits = self.decode_step_batched(batched, ids)
        rows = resolve_rows(rows, len(ids))
        sampled = self.sample(logits, rows, want_logprobs=want_logprobs)
        self._async_previous = sampled.token_ids
        return ReadyTokens(sampled)

    def forward_step_async(
        self, states: Sequence[PrefillState], num_tokens: Sequence[int], batched: BatchKV | None,
        input_ids: Sequence[int], from_previous: Sequence[int], rows: Sequence[RowSampling],
        first_rows: Sequence[RowSampling], *, want_logprobs: bool = False,
    ) -> LaunchedStep:
        """A whole tick (``forward_step``) with its sampling, launched without waiting for the tokens (backends
        with ``mixed_step`` and ``async_decode``). Decode rows take their ids as in :meth:`decode_step_async`
        (``from_previous`` names rows of the previous asynchronous call) and are sampled with ``rows``; a
        state whose prompt completes is sampled with ``first_rows[i]`` (its first token; ``last_logits`` is
        still set). The tokens come back in one :class:`PendingTokens` (see :class:`LaunchedStep`); the
        failure rules are those of ``forward_step``.

        The default is synchronous (``forward_step`` then ``sample``); ``async_decode`` backends override it."""
        if not (len(input_ids) == len(from_previous) == len(rows)) or len(first_rows) != len(states):
            raise ValueError(f"{len(input_ids)} input ids, {len(from_previous)} sources and {len(rows)} samplings "
                             f"for the rows; {len(first_rows)} first-token samplings for {len(states)} states")
        ids = self._resolve_previous(input_ids, from_previous)
        out = self.forward_step(states, num_tokens, batched, ids)
        parts = [(out.decode_logits, list(rows))] if rows else []
        parts += [(state.last_logits, [first_rows[i]]) for i, state in enumerate(states)
                  if out.prefill_errors[i] is None and state.is_complete]
        sampled = concat_sampled([self.sample(logits, samplings, want_logprobs=want_logprobs)
                                  for logits, samplings in parts], want_logprobs)
        self._async_previous = sampled.token_ids
        return LaunchedStep(out.prefill_errors, ReadyTokens(sampled))

    def _resolve_previous(self, input_ids: Sequence[int], from_previous: Sequence[int]) -> list[int]:
        """Host ids of an asynchronous call's rows (the synchronous defaults' bookkeeping)."""
        previous = self._async_previous
        ids = []
        for token, source in zip(input_ids, from_previous):
            if source < 0:
                ids.append(token)
            elif previous is None or source >= len(previous):
                raise ValueError(f"row source {source} does not name a row of the previous asynchronous call")
            else:
                ids.append(previous[source])
        return ids

    _async_previous: list[int] | None = None

    @abstractmethod
    def kv_length(self, kv: RowKV | BatchKV, row_idx: int | None = None) -> int:
        """Real (non-padded) tokens in a row KV, or in row ``row_idx`` of a batched KV."""

    @abstractmethod
    def sample(
        self, logits: Logits, rows: Sequence[RowSampling], *, want_logprobs: bool = False
    ) -> SampledTokens:
        """Pick one token per logits row. Randomness is a pure function of each row's (seed, step),
        so a row's tokens do not depend on the rest of the batch."""

    def free_row_kv(self, kv: RowKV) -> None:
        """Free a row KV that never joined a batch (cancelled or failed during prefill)."""

    # -- optional: admission by KV reservation -----------------------------------------------
    def kv_reserve(self, request_id: str, num_tokens: int) -> bool:
        """Reserve KV for a request that will hold at most ``num_tokens`` tokens. True = reserved;
        False = not now (retry later). Raises ``KVCapacityError`` if it can never fit."""
        return True

    def kv_release(self, request_id: str) -> None:
        """Release what ``kv_reserve`` reserved for ``request_id`` (idempotent)."""

    def max_request_tokens(self) -> int | None:
        """The most tokens (prompt + ``max_tokens``) one request can ever hold in this backend's KV pools, or None
        when they set no such bound (the default). Requests beyond it are refused at submit, naming it, instead of
        when they reach the head of the waiting queue. Constant after construction; any thread may call it."""
        return None

    def kv_stats(self) -> dict[str, int]:
        """KV block usage for metrics, e.g. {"blocks_total": .., "blocks_used": .., "blocks_free": ..}; a backend with
        its own prefix cache adds ``blocks_evictable`` (used blocks only the cache holds: ``vllm:kv_cache_usage_perc``
        counts them as free, as vLLM does)."""
        return {}

    # -- streaming-only path ------------------------------------------------------------------
    def generate_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str | None = None
    ) -> Iterator[int]:
        """Yield generated token IDs one by one (no stop handling beyond ``max_tokens``; the caller
        stops iterating on EOS/stop tokens). The default runs the batched primitives for a batch of
        one, taking :attr:`lock` around each step. Streaming-only backends override this."""
        from gemmaserve.sampling_params import RowSampling

        seed = params.seed if params.seed is not None else 0
        with self.lock:
            result = self.prefill(prompt_ids)
            try:
                eos = self.model_info.eos_token_ids
                row = RowSampling.for_params(params, seed, 0, eos)
                token = self.sample(result.last_logits, [row]).token_ids[0]
                batched = self.splice_into_batched(None, result.kv, self.kv_length(result.kv))
            except BaseException:  # the prefilled row is not in a batch yet: free it here
                self.free_row_kv(result.kv)
                raise
        try:
            for step in range(1, params.max_tokens + 1):
                yield token
                if step == params.max_tokens:
                    return
                with self.lock:
                    logits = self.decode_step_batched(batched, [token])
                    row = RowSampling.for_params(params, seed, step, eos)
                    token = self.sample(logits, [row]).token_ids[0]
        finally:
            with self.lock:
                self.remove_row_from_cache(batched, 0)

    def mask_memory(self, nbytes: int) -> tuple[int, object] | None:
        """Optional (with ``allowed_token_masks``): where the engine has a tick's structured-output masks written
        (``nbytes`` of them, all rows of one batched mask call): ``(address, owner)``, at least ``nbytes`` of
        writable, 4-byte aligned memory at ``address`` that stays valid while ``owner`` lives (the engine holds it
        while any row's mask is in use; it need not be zeroed), e.g. pinned host memory that :meth:`sample` then
        copies to the device without staging (``gemmaserve.torch_sampling.pinned_mask_memory``). Memory that is
        misaligned or, as far as ``owner`` tells, too small is refused (``structured.grammar.MaskMemory``): that
        tick's masks are then computed row by row. None (the default): a fresh ``bytearray``. Engine thread."""
        return None

    def close(self) -> None:
        """Release device memory and threads. Idempotent."""

    def failure(self) -> str | None:
        """Why this backend can no longer run forwards (e.g. a lost worker process), or None while it can. Called
        from any thread (the HTTP server's /health answers 503 with it); must not block or take ``self.lock``."""
        return None

    def interrupt(self) -> None:
        """The engine is shutting down and a backend call has not returned within ``Engine.INTERRUPT_AFTER_S``:
        make the call in progress raise soon (e.g. stop the helper processes it waits on), so the engine thread can
        end. Called from another thread, while that call holds ``self.lock``: must not take it. The backend need
        not serve afterwards (``close`` follows). Default: nothing (the engine waits for the call)."""

    def check_integrity(self) -> None:
        """Raise (AssertionError or RuntimeError, naming the problem) if the KV bookkeeping is inconsistent (leaks,
        double frees); the kit and the engine treat both alike. May run at any time
        under :attr:`lock` (the conformance kit between calls, ``/debug/kv`` while requests are in flight): KV held
        by a live prefill state (prefilled, not yet spliced) is not a leak. Default: checks nothing."""


class StreamingOnlyError(GemmaserveError, NotImplementedError):
    """A continuous-batching primitive was called on a streaming-only backend."""


class StreamingBackend(InferenceBackend):
    """Base of a streaming-only backend (``continuous_batching=False``): implement :meth:`generate_stream` (and set
    ``model_info`` and ``tokenizer``); the batched primitives, which the scheduler never calls on such a backend,
    raise NotImplementedError here. Its capabilities may not claim ``logprobs`` / ``top_logprobs`` (a stream yields
    token ids only) or ``mixed_step``; the engine refuses such a backend at build time. ``batched_hint``: what a
    caller of a batched primitive should use instead (appended to the error)."""

    capabilities = BackendCapabilities(continuous_batching=False)
    batched_hint = "drive it through generate_stream"

    @abstractmethod
    def generate_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str | None = None
    ) -> Iterator[int]:
        """Yield the generated token ids one at a time (see :meth:`InferenceBackend.generate_stream`)."""

    def _batched_only(self, name: str) -> NoReturn:
        raise StreamingOnlyError(f"{name}: {type(self).__name__} is streaming-only (continuous_batching=False); "
                                 f"{self.batched_hint}")

    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        self._batched_only("prefill_lookup")

    def prefill_chunk(self, state: PrefillState, num_tokens: int) -> None:
        self._batched_only("prefill_chunk")

    def prefill_store(self, state: PrefillState) -> None:
        self._batched_only("prefill_store")

    def stack_caches_left_padded(self, rows: Sequence[RowKV]) -> BatchKV:
        self._batched_only("stack_caches_left_padded")

    def splice_into_batched(self, batched: BatchKV | None, new_kv: RowKV, kv_len: int) -> BatchKV:
        self._batched_only("splice_into_batched")

    def remove_row_from_cache(self, batched: BatchKV, row_idx: int) -> None:
        self._batched_only("remove_row_from_cache")

    def decode_step_batched(self, batched: BatchKV, input_ids: Sequence[int]) -> Logits:
        self._batched_only("decode_step_batched")

    def kv_length(self, kv: RowKV | BatchKV, row_idx: int | None = None) -> int:
        self._batched_only("kv_length")

    def sample(self, logits: Logits, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
        self._batched_only("sample")
