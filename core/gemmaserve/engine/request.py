"""One request's lifecycle: state machine, generated tokens, timing, and what the caller gets back.

A :class:`Request` is owned by one thread at a time: the submitting thread until it is handed to the
scheduler, then the engine thread. :class:`RequestOutput` and :class:`RequestEvent` are snapshots that may
cross threads freely: nothing changes them once made (``RequestOutput`` is frozen; ``RequestEvent`` is read-only
by contract).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gemmaserve.sampling_params import RowSampling, SamplingParams, mask_allows
from gemmaserve.structured.grammar import ConstraintError, MaskBatch, MaskMemory, TokenConstraint
from gemmaserve.structured.grammar import start_masks as grammar_start_masks

if TYPE_CHECKING:
    from gemmaserve.backend import PrefillState, SampledTokens

logger = logging.getLogger(__name__)

MAX_BAD_WORD_TOKENS = 64
"""Longest bad-word token sequence kept (longer ones are refused at validation)."""

__all__ = ["RequestState", "FinishReason", "RequestMetrics", "RequestOutput", "RequestEvent", "Request", "MAX_TOP_K",
           "prepare_masks", "PendingMasks", "sampled_token", "start_masks"]


class RequestState(str, enum.Enum):
    """WAITING -> PREFILLING -> DECODING -> FINISHED; any state may jump to FINISHED."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended: ``stop`` (EOS or a stop token, kept in ``token_ids``; see
    ``RequestOutput.stop_token_id``), ``length``
    (``max_tokens``), ``cancelled`` (cancel/abort/shutdown) or ``error`` (see ``RequestOutput.error``)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


MAX_TOP_K = 2**31 - 1
"""Largest ``top_k`` handed to a backend; larger values mean the same (no vocabulary is that big)."""

_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.PREFILLING, RequestState.FINISHED}),
    RequestState.PREFILLING: frozenset({RequestState.DECODING, RequestState.FINISHED}),
    RequestState.DECODING: frozenset({RequestState.FINISHED}),
    RequestState.FINISHED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic()`` seconds) and the latencies derived from them."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.first_token_time is None or self.finish_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        """Arrival to finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The final (or, inside an unfinished event, partial) result of one request.

    ``error``/``error_type`` are set only when ``finish_reason == "error"`` (``error_type`` is the
    exception class name, e.g. ``"BackendStepError"`` or ``"KVCapacityError"``). ``logprobs`` has one
    entry per token in ``token_ids`` when they were requested, else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason | None
    cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    error_type: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``SamplingParams.logprobs`` = k > 0: per token, the k most likely ``(token, logprob)`` pairs."""
    stop_token_id: int | None = None
    """The last token of ``token_ids`` when it ended the request as EOS (not ``ignore_eos``) or one of
    ``stop_token_ids``; else None (``length``, a complete constraint, a stop string, a cancellation). Its text is
    left out of the output text unless ``include_stop_str_in_output`` (vLLM's rule)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestEvent:
    """What one scheduler tick produced for one request: new tokens, and the output once finished.
    ``cached_tokens`` = prompt tokens served from the prefix cache (known once prefill started). Read-only once
    made (by contract, not ``frozen``: one is built per request per tick, and a frozen dataclass's field-by-field
    ``object.__setattr__`` made that 1.0 µs against 0.2 µs on the 2-core CPU)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None = None
    new_logprobs: list[float] | None = None
    cached_tokens: int = 0
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    produced_at: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the engine made it (its tokens' time, whenever a consumer reads them)."""

    def then(self, later: RequestEvent) -> RequestEvent:
        """One event saying what this one and ``later`` (the same request's next event) say: their tokens (and
        logprobs) in order, ``later``'s finish, output, cached count and time. Makes a new event; neither
        changes."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge events of {self.request_id!r} and {later.request_id!r}")
        if self.finished:
            raise ValueError(f"request {self.request_id!r} has no event after its final one")
        return RequestEvent(self.request_id, self.new_token_ids + later.new_token_ids, later.finished, later.output,
                            _joined(self.new_logprobs, later.new_logprobs), later.cached_tokens,
                            _joined(self.new_top_logprobs, later.new_top_logprobs), later.produced_at)


def _joined(first: list | None, second: list | None) -> list | None:
    return None if first is None and second is None else [*(first or ()), *(second or ())]


@dataclass(eq=False)
class Request:
    """Mutable per-request state, owned by the scheduler once added.

    ``seed`` is the effective sampling seed (the params' seed, or one drawn at admission), so a
    sampled request's tokens depend only on its own prompt, params and seed.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    want_logprobs: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()  # the model's, set when the scheduler queues it (min_tokens bans them)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cached_tokens: int = 0
    seed: int | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    """The EOS or stop token that ended the request (see :attr:`RequestOutput.stop_token_id`)."""
    error: str | None = None
    error_type: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_emitted: int = 0
    decode_retries: int = 0
    """Failed batched decode steps this request was retried alone after (see engine/isolation.py)."""
    prefill_state: PrefillState | None = None
    queued_at_tick: int = 0
    """The scheduler tick at which the request was queued (the prompt's prefill deadline counts from it)."""
    shared_prefix_lens: dict[str, int] = field(default_factory=dict)
    """Common prefix lengths with other requests' prompts, by request id, while this one waits for a shared
    prefix to be computed (``engine/shared_prefix.py``; owned by the scheduler)."""
    stream: Any = None
    """Streaming-only backends: the ``generate_stream`` iterator (owned by the scheduler)."""
    constraint: TokenConstraint | None = None
    """Structured output: the request's position in its grammar (compiled by the scheduler's validation)."""
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    """``bad_words`` as token sequences (set by the scheduler's validation, with the backend's tokenizer)."""
    allowed_mask: bytes | None = None
    """``allowed_token_ids`` as a ``RowSampling.allowed`` mask (set by the scheduler's validation); the same every
    step."""
    constraint_error: ConstraintError | None = None
    """Why the constraint cannot continue; the next appended token ends the request with it."""
    _next_mask: tuple[int, bytes | memoryview] | None = field(default=None, repr=False)
    """(step it is for, mask): computed by :func:`prepare_masks` for the next row_sampling()."""
    _ahead: _Ahead | None = field(default=None, repr=False)
    """Deferred sampling: the launched step's token, read but not appended (:meth:`take_ahead`)."""
    _prompt_set: frozenset[int] | None = field(default=None, repr=False)
    _output_counts: Counter[int] = field(default_factory=Counter, repr=False)
    """Penalties: how often each token was generated (kept up to date by append_token)."""

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.want_logprobs = True
        if self.seed is None:
            self.seed = self.params.seed
        self._ends = frozenset(self.params.stop_token_ids)  # O(1) per generated token, whatever the list's length

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def kv_budget(self) -> int:
        """Most KV tokens this request can ever hold: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def advance(self, new_state: RequestState) -> None:
        """Move along the state machine; an illegal move is a scheduler bug."""
        assert new_state in _TRANSITIONS[self.state], f"{self.request_id}: {self.state} -> {new_state}"
        self.state = new_state

    def row_sampling(self, ahead: int = 0) -> RowSampling:
        """Sampling view for the next token (``step`` = tokens generated so far, plus ``ahead`` sampled but not
        appended yet: a launched asynchronous decode step). A request that needs its previous token
        (:attr:`needs_previous_token`) takes ``ahead=1`` only after :meth:`take_ahead` gave it that token
        (deferred sampling). ``top_k`` is capped at MAX_TOP_K: any k beyond the vocabulary keeps every token,
        and backends that put k in a fixed-width integer (torch) must not overflow on, say, ``top_k=10**30``."""
        assert self.seed is not None, "seed is assigned at admission"
        params = self.params
        step = len(self.output_token_ids) + ahead
        if (self.constraint is None and not self.bad_word_ids and step >= params.min_tokens
                and not params.has_penalties and self.allowed_mask is None):  # per row per tick: only params
            if not ahead:
                self._ahead = None  # nothing to roll back without a constraint (_forget_ahead)
            return RowSampling.for_params(params, self.seed, step, top_k=min(params.top_k, MAX_TOP_K))
        ready = self._ahead if ahead else None
        if not ahead:
            self._forget_ahead()  # a token taken ahead that was never appended (a failed step) is forgotten
        top_k = min(params.top_k, MAX_TOP_K)
        if self.is_finished:  # its token is dropped: no mask, no penalties
            return RowSampling.for_params(params, self.seed, step, self.eos_token_ids, top_k=top_k)
        prompt_tokens: frozenset[int] = frozenset()
        counts: tuple[tuple[int, int], ...] = ()
        if params.has_penalties:
            assert not ahead or ready is not None, "a penalized request's next logits need its previous token"
            if params.repetition_penalty != 1.0:
                if self._prompt_set is None:
                    self._prompt_set = frozenset(self.prompt_token_ids)
                prompt_tokens = self._prompt_set
            output = self._output_counts
            if ready is not None:
                output = output.copy()
                output[ready.token] += 1
            counts = tuple(output.items())
        banned = self._bad_word_bans(ready.token if ready is not None else None) if self.bad_word_ids else ()
        return RowSampling.for_params(params, self.seed, step, self.eos_token_ids, top_k=top_k,
                                      allowed=self._allowed(ahead), prompt_tokens=prompt_tokens,
                                      output_counts=counts, banned=banned)

    def _bad_word_bans(self, pending: int | None) -> list[int]:
        """The last token of every bad-word sequence whose other tokens end the output (plus ``pending``, a
        token taken ahead): the next token must not complete it."""
        output = self.output_token_ids
        tail = output[-MAX_BAD_WORD_TOKENS:] + ([pending] if pending is not None else [])
        bans = []
        for sequence in self.bad_word_ids:
            body = len(sequence) - 1
            if body == 0 or (body <= len(tail) and tuple(tail[len(tail) - body:]) == sequence[:-1]):
                bans.append(sequence[-1])
        return bans

    @property
    def needs_previous_token(self) -> bool:
        """True when the next step's sampling depends on the token just sampled (a structured-output constraint
        or a penalty): that sampling waits until the token is on the host (:meth:`take_ahead`), or the step
        is not launched ahead of applying it."""
        return (self.constraint is not None or self.params.has_penalties
                or bool(self.bad_word_ids) and any(len(s) > 1 for s in self.bad_word_ids))

    def take_ahead(self, token_id: int) -> None:
        """Deferred sampling: ``token_id`` was sampled by the launched step and read, not appended yet. The
        constraint advances by it now (when its grammar accepts it), so the next ``row_sampling(ahead=1)`` gets
        the mask that follows it; :meth:`append_token` of that same token keeps the advance, any other way the
        token is dropped rolls it back (:meth:`_forget_ahead`). Penalties count it."""
        self._forget_ahead()
        constraint, result = None, None
        if self.constraint is not None and self.constraint_error is None:
            constraint = self.constraint
            result = constraint.advance_if_valid(token_id)
        self._ahead = _Ahead(len(self.output_token_ids), token_id, constraint, result)

    def _forget_ahead(self) -> None:
        """Drop the token taken ahead, if any, undoing the constraint's advance by it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.constraint is not None and not isinstance(ahead.result, ConstraintError):
            ahead.constraint.rollback()

    def _mask_constraint(self, ahead: int) -> TokenConstraint | None:
        """The constraint whose state gives the mask of the token ``ahead`` steps on, or None when that token
        needs none (no constraint, one that already failed, or one the token taken ahead completed or broke:
        the next token is then dropped)."""
        if self.constraint is None or self.constraint_error is not None:
            return None
        if not ahead:
            return self.constraint
        ready = self._ahead
        assert ready is not None, "a constrained request's next mask needs its previous token (take_ahead)"
        if ready.constraint is None or ready.result is not False or ready.mask_error is not None:
            return None
        return ready.constraint

    def _allowed(self, ahead: int) -> bytes | memoryview | None:
        """The constraint's mask for the next token (None without one, or when that token is dropped anyway). A
        constraint that cannot continue gives an empty mask and records why: the token sampled under it ends
        the request (:meth:`append_token`)."""
        if self.constraint is None:
            return self.allowed_mask
        constraint = self._mask_constraint(ahead)
        if constraint is None:
            return None if ahead else b""
        ready = self._next_mask
        if ready is not None and ready[0] == len(self.output_token_ids) + ahead:
            return ready[1]
        try:
            return constraint.allowed()
        except ConstraintError as exc:
            self._record_mask_error(exc, ahead)
            return b""

    def _record_mask_error(self, exc: ConstraintError, ahead: int) -> None:
        """No token can follow: the token sampled under the empty mask ends the request. For a mask one step
        ahead the error waits until the token before it is appended."""
        if ahead and self._ahead is not None:
            self._ahead.mask_error = exc
        else:
            self.constraint_error = exc

    def append_token(self, token_id: int, logprob: float | None, eos_token_ids: tuple[int, ...],
                     top: Sequence[tuple[int, float]] = ()) -> bool:
        """Record a generated token; finish (reason ``stop``/``length``) if it ends the request: a stop or EOS
        token, ``max_tokens``, or a structured-output constraint that is complete (``stop``) or cannot continue
        (``error``; the token is then dropped). Returns True when the request is now finished."""
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        complete = False
        ahead = self._ahead
        if ahead is not None and (ahead.token != token_id or ahead.length != len(self.output_token_ids)):
            self._forget_ahead()  # taken ahead for a step that was not the one applied: advance the constraint here
            ahead = None
        self._ahead = None
        if self.constraint is not None:
            if ahead is not None and ahead.constraint is not None:  # already advanced by it (take_ahead)
                if isinstance(ahead.result, ConstraintError):
                    self.constraint_error = ahead.result
                else:
                    complete = bool(ahead.result)
            elif self.constraint_error is None:
                try:
                    complete = self.constraint.accept(token_id)
                except ConstraintError as exc:
                    self.constraint_error = exc
            if self.constraint_error is not None:  # the token is not kept: nothing valid could be sampled
                self.finish(FinishReason.ERROR, self.constraint_error)
                return True
        elif self.allowed_mask is not None and not mask_allows(self.allowed_mask, token_id):
            # the bans (bad_words; EOS and stop ids before min_tokens) covered every allowed token, so the sampler
            # had nothing to pick: the token is not kept, as one a constraint cannot accept
            self.finish(FinishReason.ERROR, ConstraintError(
                f"bad_words (or, before min_tokens, EOS and stop_token_ids) ban every token allowed_token_ids allows "
                f"at step {len(self.output_token_ids)}: no token can be generated"))
            return True
        self.output_token_ids.append(token_id)
        if self.params.has_penalties:
            self._output_counts[token_id] += 1
        if self.want_logprobs and logprob is not None:
            self.output_logprobs.append(logprob)
            if self.params.logprobs:
                self.output_top_logprobs.append(list(top))
        params = self.params
        if token_id in self._ends or (not params.ignore_eos and token_id in eos_token_ids):
            self.stop_token_id = token_id
            self.finish(FinishReason.STOP)
        elif complete:
            self.finish(FinishReason.STOP)
        elif len(self.output_token_ids) >= params.max_tokens:
            self.finish(FinishReason.LENGTH)
        elif ahead is not None and ahead.mask_error is not None:
            self.constraint_error = ahead.mask_error  # the next token, sampled under an empty mask, ends it
        return self.is_finished

    def finish(self, reason: FinishReason, exc: BaseException | None = None, message: str | None = None) -> None:
        """Enter FINISHED. For ``error``, ``exc`` (or ``message``) describes what went wrong.
        Freeing KV is the scheduler's job, done before or right after this call."""
        self.advance(RequestState.FINISHED)
        self.finish_reason = reason
        self.finish_time = time.monotonic()
        if reason is FinishReason.ERROR:
            self.error_type = type(exc).__name__ if exc is not None else "BackendStepError"
            self.error = message or (str(exc) or type(exc).__name__ if exc is not None else "unknown error")

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.arrival_time, self.first_token_time, self.finish_time, len(self.output_token_ids))

    def to_output(self) -> RequestOutput:
        """Snapshot of the request (partial if it is still running)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            cached_tokens=self.cached_tokens,
            metrics=self.metrics(),
            error=self.error,
            error_type=self.error_type,
            logprobs=list(self.output_logprobs) if self.want_logprobs else None,
            top_logprobs=list(self.output_top_logprobs) if self.params.logprobs else None,
            stop_token_id=self.stop_token_id,
        )

    def take_event(self) -> RequestEvent:
        """Event with the tokens generated since the previous ``take_event`` (and the output once
        finished). Mutates the emitted-token watermark."""
        start = self.num_emitted
        self.num_emitted = len(self.output_token_ids)
        new_logprobs = self.output_logprobs[start:] if self.want_logprobs else None
        output = self.to_output() if self.is_finished else None
        new_ids = self.output_token_ids[start:]
        new_top = self.output_top_logprobs[start:] if self.params.logprobs else None
        return RequestEvent(self.request_id, new_ids, self.is_finished, output, new_logprobs, self.cached_tokens,
                            new_top)


def sampled_token(sampled: SampledTokens, index: int) -> tuple[int, float | None, list[tuple[int, float]]]:
    """Row ``index`` of a sampling call: (token, its logprob or None, its top alternatives or [])."""
    logprob = sampled.logprobs[index] if sampled.logprobs else None
    top = sampled.top_logprobs[index] if sampled.top_logprobs else []
    return sampled.token_ids[index], logprob, top


def prepare_masks(requests: Iterable[Request], memory: MaskMemory | None = None) -> None:
    """Compute the next masks of the constrained requests among ``requests`` in one parallel call, for their
    next ``row_sampling()`` to pick up: the mask after the token :meth:`Request.take_ahead` gave a request
    (``row_sampling(ahead=1)``), else after its last appended token (:func:`start_masks`, waited for at once).
    ``memory``: the backend's ``mask_memory``. Engine thread only."""
    start_masks(((request, int(request._ahead is not None)) for request in requests), overlap=False,
                memory=memory).wait()


def start_masks(rows: Iterable[tuple[Request, int]], *, overlap: bool = True,
                memory: MaskMemory | None = None) -> PendingMasks:
    """Start computing, in one parallel call (:func:`~gemmaserve.structured.grammar.start_masks`), the masks that
    the constrained requests among ``rows`` = ``(request, ahead)`` will sample under with ``row_sampling(ahead)``
    (``ahead=1``: after the token :meth:`Request.take_ahead` gave it; ``ahead=0``: after its last appended token,
    a token taken ahead being forgotten first, as ``row_sampling(0)`` would). Each of those requests holds its
    mask's view at once, so its ``row_sampling(ahead)`` may be taken while the masks are computed (the point:
    that Python work overlaps the native work); such a sampling is valid only after :meth:`PendingMasks.wait`
    and only for the requests it does not return. Until then those requests must not advance, roll back or copy
    their constraints (append no token, take none ahead). ``overlap=False``: computed before returning, and
    ``memory`` where they are written (see :func:`~gemmaserve.structured.grammar.start_masks`). Mutates only the
    requests' mask caches and forgotten tokens. Engine thread only."""
    todo: list[tuple[Request, TokenConstraint, int, int]] = []
    for request, ahead in rows:
        if request.constraint is None or request.is_finished:  # the common case, per row per tick: cheap first
            continue
        if not ahead:
            request._forget_ahead()
        constraint = request._mask_constraint(ahead)
        step = len(request.output_token_ids) + ahead
        if constraint is not None and (request._next_mask is None or request._next_mask[0] != step):
            todo.append((request, constraint, step, ahead))
    if len(todo) < 2:  # one mask: its row_sampling() computes it (no thread hand-over for one row)
        return PendingMasks([], None)
    try:
        batch = grammar_start_masks([constraint for _, constraint, _, _ in todo], overlap=overlap, memory=memory)
    except Exception:
        logger.warning("starting %d structured-output masks at once failed; computing them one by one", len(todo),
                       exc_info=True)
        return PendingMasks([], None)
    for (request, _, step, _), view in zip(todo, batch.views):
        request._next_mask = (step, view)
    return PendingMasks(todo, batch)


class PendingMasks:
    """The masks :func:`start_masks` started. :meth:`wait` finishes them; until then they are being written."""

    def __init__(self, todo: list[tuple[Request, TokenConstraint, int, int]], batch: MaskBatch | None) -> None:
        self._todo = todo
        self._batch = batch

    def wait(self) -> set[int]:
        """Wait for the masks and record them (a constraint that cannot continue records its error as
        ``_allowed`` would, with an empty mask). Returns the ``id()`` of each request whose ``row_sampling()``
        taken before this call holds a wrong mask and must be taken again: those whose constraint cannot
        continue, or all of them if the native call failed (each then computes its own mask). Idempotent."""
        batch, self._batch = self._batch, None
        if batch is None:
            return set()
        try:
            masks = batch.result()
        except Exception:
            logger.warning("computing %d structured-output masks at once failed; computing them one by one",
                           len(self._todo), exc_info=True)
            for request, _, _, _ in self._todo:
                request._next_mask = None
            return {id(request) for request, _, _, _ in self._todo}
        redo: set[int] = set()
        for (request, _, step, ahead), mask in zip(self._todo, masks):
            if isinstance(mask, ConstraintError):
                request._record_mask_error(mask, ahead)
                request._next_mask = (step, b"")
                redo.add(id(request))
        return redo


@dataclass(slots=True)
class _Ahead:
    """A token taken ahead (:meth:`Request.take_ahead`): the output length it follows, the token, the request's
    constraint, advanced by it unless that failed (None without one), what advancing returned (True: complete,
    False: not, or the ConstraintError: then not advanced), and why no token can follow it, once a mask was
    tried."""

    length: int
    token: int
    constraint: TokenConstraint | None
    result: bool | ConstraintError | None
    mask_error: ConstraintError | None = None
