"""One HTTP generation: submit to the engine, turn engine events into text steps, cancel on demand.

Threading: everything here runs on the server's event loop, except the engine's ``on_event``
callback, which only hands events over (``engine/delivery.py``: one loop wake-up per engine tick). A generation
is driven by one coroutine at a time (the handler, or the SSE body iterator after it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gemmaserve.detokenize import IncrementalDetokenizer, hides_stop_token
from gemmaserve.engine.delivery import loop_delivery
from gemmaserve.engine.request import FinishReason
from gemmaserve.server.errors import APIError, ClientDisconnected, from_output_error
from gemmaserve.sampling_params import primary_eos_ids

if TYPE_CHECKING:
    from gemmaserve.backend import Tokenizer
    from gemmaserve.engine.engine import Engine
    from gemmaserve.engine.request import RequestEvent
    from gemmaserve.sampling_params import SamplingParams

__all__ = ["Prepared", "Step", "Generation"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, ready for the engine. ``prompt_param`` names the body field errors about
    the prompt point at (``prompt`` or ``messages``)."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    want_logprobs: bool
    prompt_param: str = "prompt"
    tool_parser: str | None = None
    """Chat with tools: the parser (``gemmaserve.tools.PARSERS``) that reads calls out of the reply."""
    parallel_tool_calls: bool = True
    """False: at most one tool call is returned (later ones are dropped, as OpenAI's flag promises)."""
    reasoning_parser: str | None = None
    """Chat: ``gemma4`` reads the reasoning channel out of the reply (``message.reasoning``)."""
    constraint_field: str | None = None
    """The request field ``params.structured_outputs`` came from (``tools`` for a tool_choice call constraint):
    what errors about the constraint name (:func:`~gemmaserve.server.errors.constraint_error`)."""
    named_tool_choice: bool = False
    """``tool_choice`` named a function: a reply that made its call ends with ``finish_reason: "stop"`` (OpenAI's and
    vLLM's rule), not ``tool_calls``."""
    shown_special_ids: frozenset[int] = frozenset()
    """Special tokens the reply's text shows although ``params.skip_special_tokens`` hides the others: the markers
    the tool-call / reasoning parsers read."""
    include_reasoning: bool = True
    """Chat with a reasoning parser: False leaves the channel's text out of the response (vLLM's
    ``include_reasoning``)."""


@dataclass(slots=True)
class Step:
    """What one engine event added to the response: final text, the tokens consumed (up to a stop
    string), their logprobs, and the finish reason (with the stop reason) once the generation is over."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_reason: int | str | None = None
    """With ``finish_reason``: :attr:`Generation.stop_reason`."""


@dataclass(slots=True)
class Timing:
    """Server-side latencies (``time.monotonic`` seconds): from the request's arrival, the times the engine
    produced its tokens (:attr:`RequestEvent.produced_at`, one per engine event: a busy event loop that sends
    several events' tokens in one chunk changes none of them) and the response's end."""

    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None
    gaps: list[float] = field(default_factory=list)
    """Seconds between successive token deliveries (inter-token latency)."""

    def on_tokens(self, now: float) -> None:
        """Tokens produced at ``now``."""
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.gaps.append(now - self.last_token)
        self.last_token = now

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    def tpot(self, num_tokens: int) -> float | None:
        if self.first_token is None or self.last_token is None or num_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (num_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start


def _failed(event: RequestEvent) -> bool:
    output = event.output
    return output is not None and output.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED)


class Generation:
    """Submits ``prepared`` on construction (engine validation errors raise right here, as
    :class:`~gemmaserve.errors.GemmaserveError`), then :meth:`next_step` yields text steps until
    the generation is over. Stop strings end it early (the engine request is cancelled); a
    cancelled or failed engine request raises :class:`APIError` or :class:`ClientDisconnected`.
    :meth:`submit_many` queues several at once (a request's ``n`` choices: all or none)."""

    @classmethod
    def submit_many(cls, engine: Engine, tokenizer: Tokenizer, prepared: Sequence[Prepared],
                    timings: Sequence[Timing]) -> list[Generation]:
        """One generation per ``prepared[i]``, queued together through ``Engine.submit_many``: a validation error
        or a queue without room for all of them raises (as the constructor does) with none of them queued, so a
        refused request leaves no cancelled choices behind. They share ``prepared[0].want_logprobs``."""
        generations = [cls(engine, tokenizer, p, timing=t, submit=False) for p, t in zip(prepared, timings)]
        handles = engine.submit_many([g.prepared.prompt_ids for g in generations],
                                     [g.prepared.params for g in generations], [g.request_id for g in generations],
                                     [g._on_event for g in generations], logprobs=prepared[0].want_logprobs,
                                     keep_events=False)
        eos_ids = primary_eos_ids(tokenizer, engine.backend.model_info.eos_token_ids)
        for generation, handle in zip(generations, handles):
            generation._handle, generation._engine_done, generation._eos_ids = handle, False, eos_ids
        return generations

    def __init__(self, engine: Engine, tokenizer: Tokenizer, prepared: Prepared, *, timing: Timing,
                 submit: bool = True) -> None:
        self.prepared = prepared
        self.timing = timing
        self.request_id = uuid.uuid4().hex
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        """vLLM's: the stop string that ended the reply, or the token id that did (:meth:`SamplingParams.stop_reason`:
        a stop token, or an EOS id other than the tokenizer's own); None for EOS, ``length`` and the rest."""
        self._eos_ids: frozenset[int] = frozenset()  # the EOS ids whose stop reports None, read when submitted
        self.cached_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if prepared.params.logprobs else None
        self._engine = engine
        params = prepared.params
        self._detok = IncrementalDetokenizer(tokenizer, prepared.stop, prompt_ids=prepared.prompt_ids,
                                             min_tokens=params.min_tokens,
                                             skip_special_tokens=params.skip_special_tokens,
                                             shown_special_ids=prepared.shown_special_ids,
                                             include_stop_str=params.include_stop_str_in_output)
        self._queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._held: RequestEvent | None = None  # a failed final event read while merging, for the next step
        self._engine_done = False
        self._client_gone = False
        # engine thread: hand over, nothing else (one loop wake-up per engine tick); a closed loop cancels
        self._on_event = loop_delivery(asyncio.get_running_loop()).callback(
            self._queue.put_nowait, lambda event: engine.cancel(event.request_id))
        if not submit:  # submit_many queues it; until then there is no engine request to cancel
            self._engine_done = True
            return
        self._handle = engine.submit(
            prepared.prompt_ids, prepared.params, self.request_id, self._on_event, logprobs=prepared.want_logprobs,
            keep_events=False,
        )
        self._eos_ids = primary_eos_ids(tokenizer, engine.backend.model_info.eos_token_ids)

    @property
    def text(self) -> str:
        return self._detok.text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prepared.prompt_ids)

    def usage(self) -> dict[str, object]:
        """OpenAI ``usage``: completion tokens are those up to (and including) a matched stop."""
        prompt, completion = self.num_prompt_tokens, len(self.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    async def next_step(self) -> Step | None:
        """The next step with tokens or a finish reason; None once the generation is over. Events that queued up
        while the consumer was busy (the event loop behind the engine) make one step together: one SSE chunk
        for several tokens, so a loaded server's per-chunk work does not grow with the token rate."""
        while not self.done:
            event = await self._next_event()
            times = [(event.produced_at, len(event.new_token_ids))]
            while not event.finished and not self._queue.empty():
                later = self._queue.get_nowait()
                if later.finished and event.new_token_ids and _failed(later):
                    self._held = later  # its tokens go out before the error or cancellation ends the stream
                    break
                times.append((later.produced_at, len(later.new_token_ids)))
                event = event.then(later)
            step = self._consume(event, times)
            if step.token_ids or step.finish_reason:
                return step
        return None

    def client_gone(self) -> None:
        """The HTTP client disconnected: cancel the engine request (its KV is freed). The consumer
        then gets the cancelled final event and raises ClientDisconnected."""
        if not self._client_gone and not self.done:
            logger.info("client disconnected; cancelling request %s", self.request_id)
            self._client_gone = True
            if not self._engine_done:
                self._handle.cancel()

    def close(self) -> None:
        """Consumer side, when it stops reading: cancel the engine request if it still runs. Idempotent. A
        generation closed before its end (the client went away) gets no end time: its end-to-end latency is not
        a request's."""
        if not self._engine_done:
            self._engine_done = True
            # a stop string ended it: the engine records "stop", not a client cancellation
            self._handle.cancel(reason=FinishReason.STOP if self.finish_reason == "stop" else FinishReason.CANCELLED)

    def __del__(self) -> None:
        """Safety net: a generation dropped unread (e.g. a stream never started) must not keep
        its engine request running."""
        if not getattr(self, "_engine_done", True) and hasattr(self, "_handle"):
            self._handle.cancel()

    # -- internals ---------------------------------------------------------------------------------
    async def _next_event(self) -> RequestEvent:
        """The next event. No timeout: the engine ends every request with a final event, also when its thread
        dies (``Engine._fail_everything``); a cancelled consumer task leaves the queue intact."""
        if self._held is not None:
            event, self._held = self._held, None
            return event
        return await self._queue.get()

    def _consume(self, event: RequestEvent, times: Sequence[tuple[float, int]]) -> Step:
        """Fold one engine event in (``times``: when each of the events merged into it was produced, and its
        token count); sets ``finish_reason`` when the generation is over."""
        self.cached_tokens = event.cached_tokens
        reason = None
        if event.finished:
            self._engine_done = True
            output = event.output
            assert output is not None and output.finish_reason is not None
            self.cached_tokens = output.cached_tokens
            reason = output.finish_reason.value
            if reason in ("cancelled", "error"):
                self._fail(reason, output.error_type, output.error)
        step = self._take_tokens(event.new_token_ids, event.new_logprobs, event.new_top_logprobs,
                                 hides_stop_token(event.output, self.prepared.params))
        before = 0
        for produced_at, count in times:
            if count and before < len(step.token_ids):  # an event a stop string cut off entirely is not timed
                self.timing.on_tokens(produced_at)
            before += count
        if self.done:  # a stop string matched: the engine request is no longer needed
            self.close()
        elif reason is not None:
            step.text += self._detok.flush()
            assert event.output is not None
            stop_reason = self.prepared.params.stop_reason(event.output.stop_token_id, self._eos_ids)
            if self._detok.stopped:  # the flush found a stop string in the held-back tail
                reason, stop_reason = "stop", self._detok.stop_string
            self.finish_reason = step.finish_reason = reason
            self.stop_reason = step.stop_reason = stop_reason
            self.timing.end = time.monotonic()
        return step

    def _take_tokens(self, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                     top: Sequence[list[tuple[int, float]]] | None = None, hide_last: bool = False) -> Step:
        """Feed ``token_ids`` to the detokenizer, up to a stop string; ``hide_last``: the last one is the EOS / stop
        token that ended the request (counted, its text left out: :func:`hides_stop_token`)."""
        step = Step("", [], [] if self.prepared.want_logprobs else None)
        shown, hidden_tail = token_ids, 0
        if hide_last and token_ids:
            shown, hidden_tail = token_ids[:-1], 1
        consumed, delta = self._detok.add_until_stop(shown)
        if not delta.stopped:
            consumed += hidden_tail
        step.text = delta.text
        step.token_ids = list(token_ids[:consumed])
        self.token_ids += step.token_ids
        if step.logprobs is not None and logprobs is not None:
            step.logprobs = list(logprobs[:consumed])
            self.logprobs += step.logprobs
            if self.top_logprobs is not None and top is not None:
                step.top_logprobs = list(top[:consumed])
                self.top_logprobs += step.top_logprobs
        if delta.stopped:
            self.finish_reason = step.finish_reason = "stop"
            self.stop_reason = step.stop_reason = delta.stop_string
            self.timing.end = time.monotonic()
        return step

    def _fail(self, reason: str, error_type: str | None, message: str | None) -> None:
        if reason == "error":  # an end, if not a good one; a cancelled request has none (close)
            self.timing.end = time.monotonic()
            raise from_output_error(error_type, message, prompt_param=self.prepared.prompt_param,
                                    constraint_field=self.prepared.constraint_field)
        if self._client_gone:
            raise ClientDisconnected(self.request_id)
        raise APIError(503, "the request was cancelled because the server is shutting down; retry later")
