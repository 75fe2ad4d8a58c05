"""Caller-side views of one submitted request: a blocking :class:`RequestHandle` and an asyncio
:class:`RequestStream`. Both are fed by the engine thread and read by any other thread or loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from gemmaserve.engine.delivery import loop_delivery
from gemmaserve.engine.request import FinishReason, RequestEvent, RequestOutput

if TYPE_CHECKING:
    from gemmaserve.engine.engine import Engine

__all__ = ["RequestHandle", "RequestStream", "EventCallback"]

logger = logging.getLogger(__name__)

EventCallback = Callable[[RequestEvent], None]
"""Called on the engine thread for every event of a request; must be quick and must not block.
Exceptions are logged and ignored. It may call ``Engine.cancel`` / ``Engine.submit``."""


class RequestHandle:
    """A submitted request. ``result()`` blocks for the final output; iterating yields every
    :class:`RequestEvent` (the last has ``finished=True``) and may be done by one consumer only. A handle made with
    ``keep_events=False`` (its events go to an ``on_event`` callback alone: the server's streams, ``Engine.stream``)
    keeps none of them, so a long stream holds no growing backlog, and cannot be iterated."""

    def __init__(self, engine: Engine, request_id: str, on_event: EventCallback | None = None, *,
                 keep_events: bool = True) -> None:
        self.request_id = request_id
        self._engine = engine
        self._on_event = on_event
        self._keep_events = keep_events
        self._events: queue.SimpleQueue[RequestEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self._output: RequestOutput | None = None
        self._cached_tokens = 0

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, as of the latest event (0 before prefill)."""
        return self._cached_tokens

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output (``finish_reason`` says how it ended; errors are in ``output.error``).
        Raises TimeoutError if it has not finished within ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        assert self._output is not None
        return self._output

    def __iter__(self) -> Iterator[RequestEvent]:
        if not self._keep_events:
            raise TypeError(f"request {self.request_id} was submitted with keep_events=False: its events go to its "
                            "on_event callback only")
        while True:
            event = self._events.get()
            yield event
            if event.finished:
                return

    def cancel(self, *, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """Ask the engine to cancel (``reason`` = cancelled or stop); False if it already finished."""
        return self._engine.cancel(self.request_id, reason=reason, handle=self)

    def deliver(self, event: RequestEvent) -> None:
        """Engine thread only: record ``event`` and run the callback."""
        self._cached_tokens = event.cached_tokens
        if self._keep_events:
            self._events.put(event)
        if event.finished:
            self._output = event.output
            self._done.set()
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                logger.exception("on_event callback of request %s raised", self.request_id)


class RequestStream:
    """``AsyncIterator[RequestEvent]`` over one request, made by :meth:`Engine.stream` (the request is
    submitted when the stream is created). Events arrive through the loop's :class:`~gemmaserve.engine.delivery.LoopDelivery`.
    Leaving early cancels the request: ``aclose()``, the consumer task being cancelled while it
    waits, or the stream being garbage-collected before the final event."""

    def __init__(self, engine: Engine, handle_factory: Callable[[EventCallback], RequestHandle]) -> None:
        self._finished = False
        events: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._events = events
        # engine thread; holds no reference to the stream; a closed loop cancels the request
        on_event = loop_delivery(asyncio.get_running_loop()).callback(
            events.put_nowait, lambda event: engine.cancel(event.request_id))
        self.handle = handle_factory(on_event)
        self.request_id = self.handle.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestEvent:
        if self._finished:
            raise StopAsyncIteration
        try:
            event = await self._events.get()
        except BaseException:  # CancelledError (task cancelled) or the loop going away
            self._abandon()
            raise
        if event.finished:
            self._finished = True
        return event

    async def aclose(self) -> None:
        """Stop listening; cancels the request if it has not finished."""
        self._abandon()

    def _abandon(self) -> None:
        if not self._finished:
            self._finished = True
            self.handle.cancel()

    def __del__(self) -> None:
        if not getattr(self, "_finished", True) and hasattr(self, "handle"):
            self.handle.cancel()
