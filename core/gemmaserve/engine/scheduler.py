"""Continuous batching over the InferenceBackend primitives (call protocol: ``gemmaserve.backend``).

Threading: ONE thread drives a scheduler (the engine thread); ``validate_request`` is pure and may
run anywhere. ``step`` holds ``backend.lock`` for the whole tick, and so does ``abort_request``.

Ownership: a PREFILLING request owns ``request.prefill_state.kv`` until it is spliced; from then on
the batch (:class:`~gemmaserve.engine.rows.RowBatch`) owns it. :class:`RequestQueues` frees KV and
reservations when a request ends, before its final event is emitted.

Failure isolation: a backend exception during one request's admission (``kv_reserve``), prefill,
first sample or splice fails only that request (``finish_reason="error"``, KV freed). An exception
from ``decode_step_batched`` (or a ``forward_step``) or the sampling after it drops the batch and retries the
step for each row alone (:mod:`gemmaserve.engine.isolation`): only rows whose solo step fails too are failed.

A tick's work is planned against ``MAX_NUM_BATCHED_TOKENS`` (decode rows first, then prefill chunks in arrival
order) and runs as ``prefill_chunks`` + ``decode_step_batched``, or as one ``forward_step`` for backends with
``capabilities.mixed_step``.

Asynchronous decode (``ASYNC_SCHEDULING`` and ``capabilities.async_decode``): a decode-only tick launches step
k+1 (``decode_step_async``; rows feed step k's tokens straight from the device) and only then applies step k's
tokens (stops, events, finished rows leave), so that bookkeeping runs while the device computes. A row that
finished at step k was launched once more: that token is dropped (it emits nothing after its end) and its KV
freed; the extra position fits its reservation (prompt + max_tokens). Any other forward first applies the
launched step (:meth:`_collect_launched`), so prefill, mixed ticks and solo retries see settled rows. With
``mixed_step`` too, ticks that carry prompt tokens launch the same way (``forward_step_async``): a prompt that
completes at tick k gets its first token (sampled on the device at k) when tick k is applied, during tick
k+1, and joins the batch then; until then it is not planned again.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gemmaserve.engine.isolation import MAX_ROW_RETRIES, retry_row_alone
from gemmaserve.engine.queues import RequestQueues
from gemmaserve.engine.request import (
    MAX_BAD_WORD_TOKENS,
    FinishReason,
    Request,
    RequestEvent,
    RequestState,
    prepare_masks,
    sampled_token,
    start_masks,
)
from gemmaserve.engine.shared_prefix import should_wait
from gemmaserve.engine.validation import backend_error, validate_request
from gemmaserve.errors import ConfigurationError, EngineOverloadedError, InvalidRequestError, KVCapacityError
from gemmaserve.sampling_params import allowed_mask
from gemmaserve.structured.grammar import GrammarCompiler, TokenConstraint

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gemmaserve.backend import InferenceBackend, PendingTokens, PrefillState, SampledTokens
    from gemmaserve.sampling_params import RowSampling
    from gemmaserve.structured.spec import StructuredOutputs
    from gemmaserve.kv.cache_manager import CacheManager
    from gemmaserve.settings import CoreSettings

__all__ = ["AbortIncompleteError", "ContinuousBatchScheduler", "SchedulerStats"]


class AbortIncompleteError(RuntimeError):
    """:meth:`ContinuousBatchScheduler.abort_all` could not abort every request; ``events`` are the final
    events of those it did abort (deliver them)."""

    def __init__(self, events: list[RequestEvent]) -> None:
        super().__init__(f"aborting in-flight requests failed after {len(events)} final events")
        self.events = events

logger = logging.getLogger(__name__)

#: With MIXED_PREFILL_CHUNK_TOKENS set, a prompt is spread over at most this many ticks after it was queued
#: (its deadline): a tick beside decoding rows prefills what the queued prompts' deadlines need, and a prompt
#: past its deadline gets the full budget, so a queue drains however fast prompts arrive.
PREFILL_SPREAD_TICKS = 8


@dataclass(frozen=True, slots=True)
class _LaunchedStep:
    """A launched step whose tokens are not applied yet: its handle, its decode rows in launch order, and the
    prefilling requests whose first token follows the rows' tokens (``forward_step_async``)."""

    pending: PendingTokens
    requests: list[Request]
    completions: tuple[Request, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Gauges now, counters since construction; ``finished`` maps a finish reason to a count."""

    num_waiting: int
    num_prefilling: int
    num_decoding: int
    reserved_kv_tokens: int
    num_steps: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    decode_failures: int
    decode_rows_retried: int
    skipped_stores: int
    finished: dict[str, int]
    prefix_waits: int = 0
    """Ticks in which a request got no budget while an earlier prompt computed blocks they share
    (``engine/shared_prefix.py``)."""


class ContinuousBatchScheduler:
    """FIFO admission under a KV-token budget, chunked prefill under a per-tick token budget
    (``MAX_NUM_BATCHED_TOKENS``: decode rows first), one batched decode per tick.

    Streaming-only backends (``capabilities.continuous_batching`` False) run up to
    ``max_concurrent_streams`` requests through ``generate_stream``, one token each per tick.
    """

    def __init__(
        self, backend: InferenceBackend, settings: CoreSettings, cache_manager: CacheManager | None = None
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.cache_manager = cache_manager
        self._caps = backend.capabilities
        self._eos = tuple(backend.model_info.eos_token_ids)
        model_len = backend.model_info.max_model_len
        if settings.max_model_len and settings.max_model_len > model_len:
            raise ConfigurationError(
                f"MAX_MODEL_LEN={settings.max_model_len} (--max-model-len) exceeds the model's context of {model_len} "
                f"tokens (its positions end there); set at most {model_len}, or leave it unset to use the model's")
        self.max_model_len = settings.max_model_len or model_len
        pool = backend.max_request_tokens()
        self.request_token_limit = min(self.max_model_len, settings.max_active_kv_tokens,
                                       pool if pool is not None else self.max_model_len)
        """The most tokens (prompt + max_tokens) one request may hold: the model length, MAX_ACTIVE_KV_TOKENS and
        what one request can hold in the backend's KV pool (``validate_request`` refuses more, naming which)."""
        self._streaming = not self._caps.continuous_batching
        self._max_running = self._caps.max_concurrent_streams if self._streaming else settings.max_batch_size
        self._q = RequestQueues(backend)
        # the block size of the prefix cache whose lookups find other prompts' blocks (0: none), and whether they
        # are found as soon as computed (a backend's progressive cache) or once stored (core cache); shared_prefix.py
        self._shared_block, self._progressive = 0, False
        if cache_manager is not None and self._caps.uses_core_cache_manager:
            self._shared_block = cache_manager.block_size
        elif self._caps.progressive_cache_block_size > 0 and not self._caps.uses_core_cache_manager:
            self._shared_block, self._progressive = self._caps.progressive_cache_block_size, True
        self._seed_rng = random.Random()
        self._counters: Counter[str] = Counter()
        self._async = self._caps.async_decode and settings.async_scheduling and not self._streaming
        self._launched: _LaunchedStep | None = None
        self._awaiting_first: set[str] = set()  # prompts complete, first token launched but not applied
        self._grammars: GrammarCompiler | None = None  # structured output, built on the first constraint
        self._compiler_lock = threading.Lock()

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._q.waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests: prefilling + decoding (or live streams)."""
        return self._q.num_running

    @property
    def has_work(self) -> bool:
        return bool(self._q.requests)

    def live_requests(self) -> list[Request]:
        """Every request not finished yet, in any phase (a snapshot list)."""
        return list(self._q.requests.values())

    def stats(self) -> SchedulerStats:
        q, c = self._q, self._counters
        decoding = len(q.rows) + sum(r.state is RequestState.DECODING for r in q.streams)
        return SchedulerStats(
            num_waiting=len(q.waiting),
            num_prefilling=q.num_running - decoding,
            num_decoding=decoding,
            reserved_kv_tokens=q.reserved_tokens,
            num_steps=c["steps"],
            prompt_tokens=c["prompt_tokens"],
            cached_tokens=c["cached_tokens"],
            generated_tokens=c["generated_tokens"],
            decode_failures=c["decode_failures"],
            decode_rows_retried=c["decode_rows_retried"],
            skipped_stores=c["skipped_stores"],
            finished=dict(q.finished),
            prefix_waits=c["prefix_waits"],
        )

    # -- requests in and out ----------------------------------------------------------------------
    def validate_request(self, request: Request, shared: dict[Any, Any] | None = None) -> None:
        """Raise InvalidRequestError / PromptTooLongError if ``request`` can never run. Compiles its structured
        output constraint (once: sets ``request.constraint``), tokenizes its ``bad_words`` and builds its
        ``allowed_token_ids`` mask; otherwise pure. ``shared``: a dict the caller keeps while the requests of one
        submission (the ``n`` choices of a prompt share their params' fields) are validated, so that work is done
        once per distinct field, not per request. Thread-safe."""
        validate_request(request, self.backend, self.max_model_len, self.settings.max_active_kv_tokens)
        params = request.params
        memo = shared if shared is not None else {}
        spec = params.structured_outputs
        if spec is not None and request.constraint is None:
            first = memo.get(("constraint", id(spec)))
            if first is None:
                first = memo[("constraint", id(spec))] = (spec, self.compile_constraint(spec))
                request.constraint = first[1]
            else:
                request.constraint = first[1].copy()
        if params.bad_words and not request.bad_word_ids:
            key = ("bad_words", params.bad_words)
            if key not in memo:
                memo[key] = self._bad_word_ids(params.bad_words)
            request.bad_word_ids = memo[key]
        if params.min_tokens and params.allowed_token_ids is None:
            self._refuse_min_tokens_banning_everything(request)
        if params.allowed_token_ids is not None and request.allowed_mask is None:
            key = ("allowed", id(params.allowed_token_ids), request.bad_word_ids, params.stop_token_ids,
                   params.ignore_eos, params.min_tokens)
            if key not in memo:  # the ids object is held below, so its id is not reused while the memo lives
                memo[key] = (params.allowed_token_ids, self._allowed_mask(request))
            request.allowed_mask = memo[key][1]
        if self._streaming and request.params.has_penalties:
            params = request.params
            given = [name for name, value, neutral in (("repetition_penalty", params.repetition_penalty, 1.0),
                                                       ("presence_penalty", params.presence_penalty, 0.0),
                                                       ("frequency_penalty", params.frequency_penalty, 0.0))
                     if value != neutral]
            raise InvalidRequestError(f"{' and '.join(given)}: this backend streams whole generations (no per-step "
                                      "sampling), so it cannot apply penalties; leave "
                                      "repetition_penalty at 1 and presence_penalty / frequency_penalty at 0")

    def compile_constraint(self, spec: StructuredOutputs) -> TokenConstraint:
        """A fresh constraint for ``spec``, compiled on the calling thread once per distinct spec, then copied (a
        server compiles on its own threads before submitting, :meth:`Engine.compile_constraint`, so the engine
        thread only copies). Raises InvalidRequestError when this backend applies no masks or ``spec`` is
        refused. Thread-safe."""
        return self.constraint_compiler().compile(spec)

    def constraint_compiler(self) -> GrammarCompiler:
        """The compiler of this backend's constraints. Raises InvalidRequestError when the backend applies no
        allowed-token masks (it cannot serve structured output). Thread-safe."""
        if self._streaming or not self._caps.allowed_token_masks:
            raise InvalidRequestError(
                f"the backend serving {self.backend.model_info.name!r} does not apply allowed-token masks "
                "(capabilities.allowed_token_masks), so it cannot serve structured output; send the request "
                "without structured_outputs / response_format")
        return self._grammar_compiler()

    def _refuse_min_tokens_banning_everything(self, request: Request) -> None:
        """InvalidRequestError when, before ``min_tokens``, the bans (EOS, ``stop_token_ids``, one-token
        ``bad_words``) cover the whole vocabulary: no token could be sampled (a small vocabulary can be listed)."""
        params = request.params
        vocab_size = self.backend.model_info.vocab_size
        if len(params.stop_token_ids) + len(request.bad_word_ids) + len(self._eos) < vocab_size:
            return  # too few to cover it
        bad, ends = self._bans(request)
        if len({token for token in ends | bad if 0 <= token < vocab_size}) >= vocab_size:
            raise InvalidRequestError(f"before min_tokens={params.min_tokens} every token of the vocabulary is banned "
                                      "(EOS, stop_token_ids and one-token bad_words cover it): no token could be "
                                      "generated; list fewer stop_token_ids or drop min_tokens")

    def _bans(self, request: Request) -> tuple[set[int], set[int]]:
        """The tokens ``request`` bans: its one-token ``bad_words`` (always), and the ones that end it (EOS unless
        ``ignore_eos``, ``stop_token_ids``), which ``min_tokens`` bans before then."""
        params = request.params
        bad = {sequence[0] for sequence in request.bad_word_ids if len(sequence) == 1}
        return bad, {*params.stop_token_ids, *(() if params.ignore_eos else self._eos)}

    def _allowed_mask(self, request: Request) -> bytes:
        """``request``'s ``allowed_token_ids`` as a mask. Raises InvalidRequestError for an id outside the vocabulary,
        a backend that applies no masks, or allowed ids that its one-token ``bad_words`` (or, before
        ``min_tokens``, its EOS and stop ids) ban all of: no token could be sampled."""
        params = request.params
        token_ids = params.allowed_token_ids or ()
        allowed = set(token_ids)
        bad, ends = self._bans(request)
        if allowed <= bad:
            raise InvalidRequestError("every token allowed_token_ids allows is one of the bad_words: no token could be "
                                      "generated; drop those bad_words or allow more tokens")
        if params.min_tokens and allowed <= ends | bad:
            raise InvalidRequestError(f"every token allowed_token_ids allows ends the request (EOS or stop_token_ids), "
                                      f"which min_tokens={params.min_tokens} bans before then: no token could be "
                                      "generated; allow more tokens or drop min_tokens")
        vocab_size = self.backend.model_info.vocab_size
        outside = [token for token in token_ids if token >= vocab_size]
        if outside:
            raise InvalidRequestError(f"allowed_token_ids names token {outside[0]}, outside the vocabulary; token ids "
                                      f"are integers in [0, {vocab_size})")
        if self._streaming or not self._caps.allowed_token_masks:
            raise InvalidRequestError(
                f"the backend serving {self.backend.model_info.name!r} does not apply allowed-token masks "
                "(capabilities.allowed_token_masks), so it cannot serve allowed_token_ids; send the request without "
                "it")
        return allowed_mask(token_ids, vocab_size)

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word tokenized as it is (leading blanks dropped) and with one leading space, without
        special tokens; distinct sequences only. Raises InvalidRequestError for a streaming-only backend or a
        word of more than MAX_BAD_WORD_TOKENS tokens."""
        if self._streaming:
            raise InvalidRequestError(f"the backend serving {self.backend.model_info.name!r} streams whole generations "
                                      "(no per-step sampling), so it cannot ban bad_words; send none")
        sequences: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.backend.tokenizer.encode(text, add_special_tokens=False))
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise InvalidRequestError(f"bad_words entry {word[:40]!r} is {len(ids)} tokens long; at most "
                                              f"{MAX_BAD_WORD_TOKENS} are accepted")
                if ids:
                    sequences[ids] = None
        return tuple(sequences)

    def warm_grammars(self) -> bool:
        """Build structured output's view of the vocabulary now (seconds for a large one) rather than on the
        first constrained request. False (nothing done) when this backend cannot serve constraints."""
        if self._streaming or not self._caps.allowed_token_masks or GrammarCompiler.available(self.backend.tokenizer):
            return False
        self._grammar_compiler().warm()
        return True

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.backend.tokenizer, self.backend.model_info.vocab_size,
                                                 self._eos)
            return self._grammars

    def add_request(self, request: Request) -> None:
        """Validate and queue (FIFO). Raises the validation errors, InvalidRequestError for an id
        already in use, or EngineOverloadedError when MAX_WAITING_REQUESTS are already waiting."""
        self.validate_request(request)
        if request.request_id in self._q.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use; pick a unique id")
        if len(self._q.waiting) >= self.settings.max_waiting_requests:
            raise EngineOverloadedError(
                f"{len(self._q.waiting)} requests are already waiting "
                f"(MAX_WAITING_REQUESTS={self.settings.max_waiting_requests}); retry later"
            )
        request.eos_token_ids = self._eos
        request.queued_at_tick = self._counters["steps"]
        self._q.enqueue(request)

    def abort_request(
        self, request_id: str, *, error: BaseException | None = None, reason: FinishReason = FinishReason.CANCELLED
    ) -> list[RequestEvent]:
        """Cancel a request in any phase (or, given ``error``, fail it) and free all it holds.
        Returns the final events: the request's own and, only if the backend failed to remove its
        row, those of the batch rows failed with it. Empty if the id is unknown or finished."""
        request = self._q.requests.get(request_id)
        events: list[RequestEvent] = []
        if request is None:
            return events
        with self.backend.lock:
            self._q.release(request, events)
            if error is None:
                request.finish(reason)
            else:
                request.finish(FinishReason.ERROR, backend_error(error, "engine step"))
            self._q.retire(request, events)
        return events

    def abort_all(self, *, error: BaseException | None = None) -> list[RequestEvent]:
        """Cancel (or fail, given ``error``) every request; returns their final events. If aborting
        some request raises, the others are still aborted and :class:`AbortIncompleteError` (carrying
        the events made so far) is raised at the end."""
        events: list[RequestEvent] = []
        failure: Exception | None = None
        for rid in list(self._q.requests):
            try:
                events += self.abort_request(rid, error=error)
            except Exception as exc:
                logger.exception("aborting request %s failed", rid)
                failure = failure or exc
        self._launched = None  # every row it carried is gone
        self._awaiting_first.clear()
        if failure is not None:
            raise AbortIncompleteError(events) from failure
        return events

    def continue_counts(self, old: ContinuousBatchScheduler, orphans: int = 0) -> None:
        """Carry ``old``'s counters and finish counts into this (fresh) scheduler, plus ``orphans`` requests that
        ``old`` left unfinished and the caller fails: a scheduler rebuilt after a failure keeps the process's
        counters going up (metrics scrapers treat a drop as a restart)."""
        self._counters.update(old._counters)
        self._q.finished.update(old._q.finished)
        self._q.finished[FinishReason.ERROR.value] += orphans

    def release_all_best_effort(self, events: list[RequestEvent]) -> list[Request]:
        """Last resort after :meth:`abort_all` raised: free whatever each live request holds (KV,
        reservations; every failure logged and skipped), appending the final events of requests that
        this retires to ``events``, and return the unfinished requests. The scheduler must not be
        used afterwards."""
        orphans: list[Request] = []
        self._launched = None
        self._awaiting_first.clear()
        with self.backend.lock:
            for request in list(self._q.requests.values()):
                try:
                    self._q.release(request, events)
                except Exception:
                    logger.exception("could not free the KV of request %s", request.request_id)
                if self._caps.kv_reservation:
                    try:
                        self.backend.kv_release(request.request_id)
                    except Exception:
                        logger.exception("could not release the reservation of request %s", request.request_id)
                if not request.is_finished:
                    orphans.append(request)
        return orphans

    # -- the tick -----------------------------------------------------------------------------------
    def step(self) -> list[RequestEvent]:
        """One tick: admit, prefill chunks under the token budget, one batched decode (or one
        token per stream). Returns an event for every request that got tokens or finished.
        Same as :meth:`step_prefill` followed by :meth:`step_decode`."""
        events = self.step_prefill()
        events += self.step_decode()
        return events

    def step_prefill(self, events: list[RequestEvent] | None = None) -> list[RequestEvent]:
        """First half of a tick: admit, then the prefill chunks the token budget allows (requests that
        complete their prompt get their first token here). The engine publishes these events before
        the decode half runs, so a first token does not wait for the batch's decode step. Backends with
        ``mixed_step`` run the whole tick here, decode rows included, in one ``forward_step``.
        Appends its events to ``events`` (a new list if None) as they are made and returns that list: if
        the tick raises part-way, the events made before the raise are in the caller's list."""
        events = [] if events is None else events
        with self.backend.lock:
            self._counters["steps"] += 1
            self._admit(events)
            if self._streaming:
                pass
            elif self._caps.mixed_step:
                self._mixed_tick(events)
            else:
                self._prefill(events)
        return events

    def step_decode(self, events: list[RequestEvent] | None = None) -> list[RequestEvent]:
        """Second half of a tick: one batched decode over the decoding rows (or one token per stream).
        ``events`` as :meth:`step_prefill`'s."""
        events = [] if events is None else events
        with self.backend.lock:
            if self._streaming:
                self._step_streams(events)
            elif not self._caps.mixed_step:  # mixed-step backends decoded in the first half
                self._decode(events)
        return events

    def _admit(self, events: list[RequestEvent]) -> None:
        q = self._q
        while q.waiting and q.num_running < self._max_running:
            request = q.waiting[0]
            budget = request.kv_budget
            if q.reserved_tokens + budget > self.settings.max_active_kv_tokens:
                return  # FIFO: the head waits until running requests free budget
            if self._caps.kv_reservation:
                try:
                    reserved = self.backend.kv_reserve(request.request_id, budget)
                    if not reserved and q.num_running == 0:
                        raise KVCapacityError(
                            f"the backend cannot reserve KV for {budget} tokens (prompt + max_tokens) even with "
                            "no other request running; lower max_tokens or shorten the prompt"
                        )
                except Exception as exc:
                    q.fail(request, exc, events, phase="KV reservation")
                    continue
                if not reserved:
                    return
            q.admit_head(budget, streaming=self._streaming)
            if request.seed is None:
                request.seed = self._seed_rng.randrange(2**63)

    def _plan_chunks(self, events: list[RequestEvent]) -> list[tuple[Request, PrefillState, int, int]]:
        """This tick's prefill work under the token budget: ``MAX_NUM_BATCHED_TOKENS`` minus one token per
        decoding row, handed to prefilling requests in arrival order (each at most ``PREFILL_CHUNK_TOKENS``), so
        a long prompt is split across ticks and a burst never stalls the decoding rows for more than one budget.
        With ``MIXED_PREFILL_CHUNK_TOKENS`` set, a tick that carries decoding rows spends on prompts only
        ``max(MIXED_PREFILL_CHUNK_TOKENS, what the queued prompts' deadlines need)`` (:meth:`_deadline_tokens`):
        steady arrivals are spread thinly over the ticks (short ticks for the streams), while a burst, whose
        prompts cannot all meet their deadlines, gets the full budget. Looks a request's prompt up in the prefix
        cache when it first gets budget; a request not looked up yet gets no budget while an earlier prefill is
        computing blocks their prompts share (``engine/shared_prefix.py``: it hits them afterwards instead of
        computing them again). Returns ``(request, state, chunk tokens, num_computed before)``."""
        budget = self.settings.max_num_batched_tokens - len(self._q.rows)
        mixed = self.settings.mixed_prefill_chunk_tokens
        if mixed and self._q.rows and budget > mixed:
            budget = max(mixed, self._deadline_tokens(budget))
        cap = self.settings.prefill_chunk_tokens
        work: list[tuple[Request, PrefillState, int, int]] = []
        # (id, prompt, computed, findable by a lookup now) of earlier prefills under way (engine/shared_prefix.py)
        leaders: list[tuple[str, tuple[int, ...], int, int]] = []
        for request in list(self._q.prefilling):
            if budget <= 0:
                break
            state = request.prefill_state
            if request.request_id in self._awaiting_first:
                if state is not None:
                    leaders.append(self._as_leader(request, state))
                continue
            if state is None and self._shared_block and should_wait(
                request.prompt_token_ids, leaders, self._shared_block, progressive=self._progressive, chunk=cap,
                memo=request.shared_prefix_lens,
            ):
                self._counters["prefix_waits"] += 1
                continue
            try:
                if state is None:
                    state = request.prefill_state = self.backend.prefill_lookup(request.prompt_token_ids)
                    request.cached_tokens = state.num_cached
            except Exception as exc:
                self._q.fail(request, exc, events, phase="prefill")
                continue
            leaders.append(self._as_leader(request, state))
            num = min(cap, state.num_remaining, budget)
            if num > 0 or state.is_complete:
                work.append((request, state, num, state.num_computed))
                budget -= num
        return work

    def _as_leader(self, request: Request, state: PrefillState) -> tuple[str, tuple[int, ...], int, int]:
        """``request`` as a leader for ``should_wait``: (id, prompt, computed, findable now). A progressive cache
        finds what the prompt computed; a completion-time cache only what the prompt itself found in it."""
        findable = state.num_computed if self._progressive else state.num_cached
        return request.request_id, request.prompt_token_ids, state.num_computed, findable

    def _deadline_tokens(self, enough: int) -> int:
        """Prompt tokens this tick must prefill for every admitted prompt to finish within
        ``PREFILL_SPREAD_TICKS`` ticks of being queued: its remaining tokens over its ticks left, all of them
        once it is late (a prompt that waited for admission is late at once). A prompt not looked up in the
        prefix cache yet counts in full. Requests still waiting for admission cannot be prefilled this tick and
        do not count. Summed only up to ``enough``."""
        total = 0
        tick = self._counters["steps"]
        for request in self._q.prefilling:
            state = request.prefill_state
            remaining = len(request.prompt_token_ids) if state is None else state.num_remaining
            ticks_left = request.queued_at_tick + PREFILL_SPREAD_TICKS - tick
            total += remaining if ticks_left <= 1 else -(-remaining // ticks_left)
            if total >= enough:
                return enough
        return total

    def _prefill(self, events: list[RequestEvent]) -> None:
        """The planned chunks through one ``prefill_chunks`` call (backends may batch them)."""
        work = self._plan_chunks(events)
        pending = [(request, state, num) for request, state, num, _ in work if num > 0]
        errors: dict[str, Exception] = {}
        if pending:
            self._collect_launched(events)
        if len(pending) > 1:
            try:
                results = self.backend.prefill_chunks([s for _, s, _ in pending], [n for _, _, n in pending])
                if len(results) != len(pending):
                    raise RuntimeError(f"prefill_chunks returned {len(results)} results for {len(pending)} states")
                errors = {r.request_id: exc for (r, _, _), exc in zip(pending, results) if exc is not None}
            except Exception:
                logger.warning("batched prefill of %d requests failed; retrying each alone", len(pending),
                               exc_info=True)
        self._finish_chunks(work, errors, events)

    def _finish_chunks(self, work: list[tuple[Request, PrefillState, int, int]], errors: dict[str, Exception],
                       events: list[RequestEvent]) -> None:
        """After the tick's chunk call: fail requests whose chunk raised, run alone (``prefill_chunk``) those
        that did not advance, and complete those whose prompt is done. A chunk's failure stays with its
        request."""
        errors = self._run_chunks_alone(work, errors)
        for request, state, _, _ in work:
            try:
                if request.request_id in errors:
                    raise errors[request.request_id]
                if state.is_complete:
                    self._complete_prefill(request, events)
            except Exception as exc:
                self._q.fail(request, exc, events, phase="prefill")

    def _run_chunks_alone(self, work: list[tuple[Request, PrefillState, int, int]],
                          errors: dict[str, Exception]) -> dict[str, Exception]:
        """Run alone (``prefill_chunk``) each planned chunk that did not advance and has no error in ``errors``;
        returns ``errors`` with those that raised (or made no progress) added. Running it again does nothing."""
        errors = dict(errors)
        for request, state, num, before in work:
            if request.request_id in errors or state.is_complete or state.num_computed != before or num <= 0:
                continue
            try:
                self.backend.prefill_chunk(state, num)
                if state.num_computed <= before and not state.is_complete:
                    raise RuntimeError(f"prefill made no progress at {before}/{len(state.prompt_ids)} tokens")
            except Exception as exc:
                errors[request.request_id] = exc
        return errors

    def _mixed_tick(self, events: list[RequestEvent]) -> None:
        """The whole tick as one ``forward_step``: the decoding rows (one token each) and the planned chunks.
        Decode results are applied first (rows finish and leave), then prompts that completed join the batch.
        If the call raises, the rows are retried alone and chunks that did not advance run alone."""
        work = self._plan_chunks(events)
        pending = [(request, state, num) for request, state, num, _ in work if num > 0]
        batch = self._q.rows
        if not pending and self._async:
            self._async_decode(events)
            self._finish_chunks(work, {}, events)
            return
        if self._async:
            self._async_mixed_tick(work, pending, events)
            return
        self._collect_launched(events)
        if not pending and not batch.rows:
            self._finish_chunks(work, {}, events)
            return
        errors: dict[str, Exception] = {}
        sampled: SampledTokens | None = None
        failure: Exception | None = None
        try:
            out = self.backend.forward_step(
                [s for _, s, _ in pending], [n for _, _, n in pending], batch.batch,
                [request.output_token_ids[-1] for request in batch.rows],
            )
            if len(out.prefill_errors) != len(pending):
                raise RuntimeError(f"forward_step returned {len(out.prefill_errors)} results for {len(pending)} states")
            errors = {r.request_id: exc for (r, _, _), exc in zip(pending, out.prefill_errors) if exc is not None}
            if batch.rows:
                if out.decode_logits is None:
                    raise RuntimeError(f"forward_step returned no decode logits for {len(batch)} rows")
                sampled = batch.sample(out.decode_logits)
        except Exception as exc:
            failure = exc
            logger.warning("mixed step over %d rows and %d chunks failed; retrying each alone", len(batch),
                           len(pending), exc_info=True)
        if batch.rows:
            if sampled is not None:
                self._apply_decode(sampled, events)
            else:
                assert failure is not None
                errors = self._run_chunks_alone(work, errors)  # a chunk that fails alone was the cause
                self._counters["decode_failures"] += 1
                self._retry_rows_alone(failure, events, charge=not errors)
        self._finish_chunks(work, errors, events)

    def _complete_prefill(self, request: Request, events: list[RequestEvent],
                          first: tuple[int, float | None, list[tuple[int, float]]] | None = None) -> None:
        """Store the prompt, sample the first token (or take ``first``, sampled in a launched step), then splice
        the row (or finish right away)."""
        state = request.prefill_state
        assert state is not None and state.is_complete
        if self._may_store():
            self.backend.prefill_store(state)
        else:
            self._counters["skipped_stores"] += 1
        if first is None:
            first = sampled_token(self.backend.sample(state.last_logits, [request.row_sampling()],
                                                      want_logprobs=request.want_logprobs), 0)
        self._counters.update(prompt_tokens=request.num_prompt_tokens, cached_tokens=request.cached_tokens)
        self._counters["generated_tokens"] += 1
        if request.append_token(first[0], first[1], self._eos, first[2]):
            self._q.release(request, events)  # frees the prefill KV
            self._q.retire(request, events)
            return
        self._q.rows.splice(request, state.kv)  # takes ownership of the KV
        request.prefill_state = None
        self._q.prefilling.remove(request)
        request.advance(RequestState.DECODING)
        events.append(request.take_event())

    def _may_store(self) -> bool:
        """Soft gate: skip the store when the core prefix pool has no block to give at all."""
        if self.cache_manager is None or not self._caps.uses_core_cache_manager:
            return True
        return self.cache_manager.free_capacity_blocks() > 0

    def _decode(self, events: list[RequestEvent]) -> None:
        if self._async:
            self._async_decode(events)
            return
        batch = self._q.rows
        if not batch.rows:
            return
        try:
            sampled = batch.decode()
        except Exception as exc:
            self._counters["decode_failures"] += 1
            logger.exception("decode step over %d rows failed; retrying each row alone", len(batch))
            self._retry_rows_alone(exc, events)
            return
        self._apply_decode(sampled, events)

    def _apply_decode(self, sampled: SampledTokens, events: list[RequestEvent]) -> None:
        """Append each row's sampled token; finished rows leave the batch (their KV freed)."""
        batch = self._q.rows
        rows = list(batch.rows)
        self._counters["generated_tokens"] += len(rows)
        for index, request in enumerate(rows):
            token, logprob, top = sampled_token(sampled, index)
            request.append_token(token, logprob, self._eos, top)
        for index in reversed(range(len(rows))):
            request = rows[index]
            if request.is_finished and batch.rows[index : index + 1] == [request]:  # else dropped+retired
                self._q.remove_row(index, events)
                self._q.retire(request, events)
        events.extend(request.take_event() for request in rows if not request.is_finished)

    def _async_decode(self, events: list[RequestEvent]) -> None:
        """Launch this tick's decode step, then apply the step launched last tick (see the module docstring).
        Applies first instead when every row's length limit ends with the launched token (nothing to win)."""
        batch = self._q.rows
        launched, self._launched = self._launched, None
        deferred = launched is not None and self._launched_constrained(launched)
        if launched is not None and (not batch.rows or self._launched_ends_every_row(launched)
                                     or (deferred and not self._caps.deferred_sampling)):
            self._apply_launched(launched, events)
            launched, deferred = None, False
        if not batch.rows:
            return
        rows = list(batch.rows)
        input_ids, sources, sampling = self._row_inputs(rows, launched, deferred)
        try:
            pending = self.backend.decode_step_async(
                batch.batch, input_ids, sources, sampling, want_logprobs=any(r.want_logprobs for r in rows))
        except Exception as exc:
            logger.warning("decode step over %d rows failed; retrying each row alone", len(rows), exc_info=True)
            self._launch_failed(launched, exc, events)
            return
        self._launched = _LaunchedStep(pending, rows)
        if launched is not None:
            self._apply_launched(launched, events)

    def _row_inputs(self, rows: list[Request], launched: _LaunchedStep | None, deferred: bool = False,
                    ) -> tuple[list[int], list[int], Sequence[RowSampling] | Callable[[], list[RowSampling]]]:
        """Per decode row: its host input id (0 when it feeds on the device), its row in ``launched`` (-1 = none)
        and its sampling (step one ahead when its previous token is not applied yet). ``deferred`` (a launched
        row needs its token on the host to be sampled next: structured output, penalties): the samplings come
        as a callable that the backend calls after launching the forward (``capabilities.deferred_sampling``);
        it reads ``launched``'s tokens, gives them to those rows (:meth:`Request.take_ahead`) and computes
        their masks while the device runs the forward."""
        if launched is not None and launched.requests == rows:  # the steady state (identity: eq=False requests)
            sources, input_ids = list(range(len(rows))), [0] * len(rows)
        else:
            index = {id(request): i for i, request in enumerate(launched.requests)} if launched is not None else {}
            sources = [index.get(id(request), -1) for request in rows]
            input_ids = [request.output_token_ids[-1] if source < 0 else 0 for request, source in zip(rows, sources)]
        memory = self.backend.mask_memory

        def samplings() -> list[RowSampling]:
            if deferred:
                assert launched is not None
                tokens = launched.pending.result().token_ids
                for request, source in zip(rows, sources):
                    if source >= 0 and request.needs_previous_token and not request.is_finished:
                        request.take_ahead(tokens[source])
            pending = start_masks(((request, int(source >= 0)) for request, source in zip(rows, sources)
                                   if source < 0 or deferred), memory=memory)
            try:  # the row samplings are built while the masks are computed
                samplings = [request.row_sampling(ahead=int(source >= 0)) for request, source in zip(rows, sources)]
            finally:  # the native work reads the constraints: it ends before anything else may touch them
                redo = pending.wait()
            if redo:
                samplings = [request.row_sampling(ahead=int(source >= 0)) if id(request) in redo else sampling
                             for request, source, sampling in zip(rows, sources, samplings)]
            return samplings

        return input_ids, sources, (samplings if deferred else samplings())

    def _async_mixed_tick(self, work: list[tuple[Request, PrefillState, int, int]],
                          pending: list[tuple[Request, PrefillState, int]], events: list[RequestEvent]) -> None:
        """A tick with prompt chunks through ``forward_step_async``, then the previous launch applied. A chunk's
        error fails its request at once; prompts that completed wait for their first token (next apply). If the
        call raises, the previous launch is applied, the rows are retried alone and the chunks run as in a
        synchronous tick."""
        batch = self._q.rows
        launched, self._launched = self._launched, None
        if launched is not None and self._launched_constrained(launched):
            self._apply_launched(launched, events)  # their masks need the launched tokens
            launched = None
        rows = list(batch.rows)
        # constrained rows never feed on the launched step
        prepare_masks([*(r for r, _, _ in pending), *rows], self.backend.mask_memory)
        input_ids, sources, sampling = self._row_inputs(rows, launched)
        states = [state for _, state, _ in pending]
        first_rows = [request.row_sampling() for request, _, _ in pending]
        want = any(r.want_logprobs for r in rows) or any(r.want_logprobs for r, _, _ in pending)
        try:
            out = self.backend.forward_step_async(states, [n for _, _, n in pending], batch.batch, input_ids, sources,
                                                  sampling, first_rows, want_logprobs=want)
            if len(out.prefill_errors) != len(pending):
                raise RuntimeError(f"forward_step_async returned {len(out.prefill_errors)} results for {len(pending)} states")
        except Exception as exc:
            logger.warning("mixed step over %d rows and %d chunks failed; retrying each alone", len(rows),
                           len(pending), exc_info=True)
            self._finish_chunks(work, self._launch_failed(launched, exc, events, work), events)
            return
        completions = []
        befores = {id(request): before for request, _, _, before in work}
        for (request, state, _), error in zip(pending, out.prefill_errors):
            before = befores[id(request)]
            if error is None and state.num_computed <= before and not state.is_complete:
                error = RuntimeError(f"forward_step_async made no progress at {before}/{len(state.prompt_ids)} tokens")
            if error is not None:
                self._q.fail(request, error, events, phase="prefill")
            elif state.is_complete:
                completions.append(request)
                self._awaiting_first.add(request.request_id)
        self._launched = _LaunchedStep(out.tokens, rows, tuple(completions))
        if launched is not None:
            self._apply_launched(launched, events)
        self._finish_chunks([w for w in work if w[2] == 0], {}, events)  # prompts complete with nothing to run

    def _launch_failed(self, launched: _LaunchedStep | None, exc: Exception, events: list[RequestEvent],
                       work: list[tuple[Request, PrefillState, int, int]] | None = None) -> dict[str, Exception]:
        """A launch raised (nothing ran): apply the step launched before it, run the tick's chunks (``work``)
        alone, then retry the rows alone. The rows are charged a retry only when neither the applied step
        already retried them (its tokens could not be read: that is this failure) nor a chunk failed alone (that
        chunk was the cause). Returns the chunks' errors."""
        retried = launched is not None and not self._apply_launched(launched, events)
        errors = self._run_chunks_alone(work or [], {})
        if self._q.rows.rows:
            if not retried:  # a failed read of the applied step counted this failure already
                self._counters["decode_failures"] += 1
            self._retry_rows_alone(exc, events, charge=not (retried or errors))
        return errors

    @staticmethod
    def _launched_ends_every_row(launched: _LaunchedStep) -> bool:
        """True when every live row of ``launched`` reaches its ``max_tokens`` with the launched token."""
        return all(r.is_finished or len(r.output_token_ids) + 1 >= r.params.max_tokens for r in launched.requests)

    @staticmethod
    def _launched_constrained(launched: _LaunchedStep) -> bool:
        """True when a live row of ``launched`` samples its next token from what it sampled last
        (``Request.needs_previous_token``: a constraint's mask, penalties' counts), so the step is applied
        before the next one launches."""
        return any(r.needs_previous_token and not r.is_finished for r in launched.requests)

    def _collect_launched(self, events: list[RequestEvent]) -> None:
        """Apply the launched step, if any (before any forward other than ``decode_step_async``)."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._apply_launched(launched, events)

    def _apply_launched(self, launched: _LaunchedStep, events: list[RequestEvent]) -> bool:
        """Wait for ``launched``'s tokens and append them to its rows that are still live (a row cancelled or
        failed meanwhile gets nothing); finished rows leave the batch; prompts that completed get their first
        token and join the batch. If reading them raises, the step launched after it (which fed on them) is
        dropped too, the rows are retried alone and the completed prompts sample their first token again: then
        False is returned."""
        count = len(launched.requests) + len(launched.completions)
        want_logprobs = any(r.want_logprobs for r in (*launched.requests, *launched.completions))
        try:
            sampled = launched.pending.result()
            if len(sampled.token_ids) != count:
                raise RuntimeError(f"backend sampled {len(sampled.token_ids)} tokens for {count} rows and prompts")
            if want_logprobs and (sampled.logprobs is None or len(sampled.logprobs) != count):
                raise RuntimeError("backend did not return one logprob per row although logprobs were requested")
        except Exception as exc:
            dropped, self._launched = self._launched, None
            for request in (*launched.completions, *(dropped.completions if dropped is not None else ())):
                self._awaiting_first.discard(request.request_id)  # planned again: first token from last_logits
            self._counters["decode_failures"] += 1
            logger.warning("reading a launched step failed; retrying each row alone", exc_info=True)
            self._retry_rows_alone(exc, events)
            return False
        live: list[Request] = []
        ended: set[int] = set()
        for i, request in enumerate(launched.requests):  # per row per tick: one pass
            if request.state is RequestState.FINISHED:
                continue
            live.append(request)
            token, logprob, top = sampled_token(sampled, i)
            if request.append_token(token, logprob, self._eos, top):
                ended.add(id(request))
        self._counters["generated_tokens"] += len(live)
        batch = self._q.rows
        for index in reversed(range(len(batch.rows)) if ended else ()):
            request = batch.rows[index] if index < len(batch.rows) else None
            if request is not None and id(request) in ended:
                self._q.remove_row(index, events)
                if request.request_id in self._q.requests:  # else a failed removal retired the whole batch
                    self._q.retire(request, events)
        events.extend(request.take_event() for request in live if not request.is_finished)
        for j, request in enumerate(launched.completions, start=len(launched.requests)):
            self._awaiting_first.discard(request.request_id)
            if request.is_finished:  # cancelled or failed while its first token was in flight
                continue
            try:
                self._complete_prefill(request, events, sampled_token(sampled, j))
            except Exception as exc:
                self._q.fail(request, exc, events, phase="prefill")
        return True

    def _retry_rows_alone(self, exc: Exception, events: list[RequestEvent], *, charge: bool = True) -> None:
        """The batched step raised ``exc``: drop the batch (freeing its KV), then redo the step for
        each row alone. Rows whose solo step raises fail; so do rows that used up MAX_ROW_RETRIES when ``charge``
        (the failure is not known to be another request's: each row is charged one retry). The others get their
        token and form a fresh batch, in the same order."""
        for request in self._q.rows.drop_all():
            if charge:
                if request.decode_retries >= MAX_ROW_RETRIES:
                    self._q.fail(request, exc, events,
                                 phase=f"decode (after {MAX_ROW_RETRIES} retries of this request)")
                    continue
                request.decode_retries += 1
            self._counters["decode_rows_retried"] += 1
            try:
                retry = retry_row_alone(self.backend, request, self.settings.prefill_chunk_tokens)
            except Exception as row_exc:
                self._q.fail(request, row_exc, events, phase="decode (retried without the other rows)")
                continue
            self._counters["generated_tokens"] += 1
            if request.append_token(retry.token_id, retry.logprob, self._eos, retry.top):
                self._q.free_kv(retry.kv, request)
                self._q.retire(request, events)
                continue
            try:
                self._q.rows.splice(request, retry.kv)
            except Exception as splice_exc:
                self._q.free_kv(retry.kv, request)
                self._q.fail(request, splice_exc, events, phase="splice after a decode retry")
                continue
            events.append(request.take_event())

    def _step_streams(self, events: list[RequestEvent]) -> None:
        for request in list(self._q.streams):
            try:
                if request.stream is None:
                    params = dataclasses.replace(request.params, seed=request.seed, top_k=request.row_sampling().top_k)
                    stream = self.backend.generate_stream(
                        request.prompt_token_ids, params, session_id=request.request_id
                    )
                    request.stream = iter(stream)
                token_id = next(request.stream, None)
            except Exception as exc:
                self._q.fail(request, exc, events, phase="generate_stream")
                continue
            if request.state is RequestState.PREFILLING:
                request.cached_tokens = self.backend.last_cache_hit_tokens
                self._counters.update(prompt_tokens=request.num_prompt_tokens, cached_tokens=request.cached_tokens)
                request.advance(RequestState.DECODING)
            if token_id is None:  # the backend ended the stream on its own
                request.finish(FinishReason.STOP)
            else:
                self._counters["generated_tokens"] += 1
                request.append_token(token_id, None, self._eos)
            if request.is_finished:
                self._q.release(request, events)
                self._q.retire(request, events)
            else:
                events.append(request.take_event())

    # -- invariants ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise RuntimeError if queues, states, reservations or batch KV lengths disagree."""
        with self.backend.lock:
            ahead = self._launched.requests if self._launched is not None else ()
            self._q.check_integrity(self.settings.max_active_kv_tokens, self._max_running, ahead)
