"""Handing engine-thread events to asyncio loops: one loop wake-up per engine tick, not one per event.

The engine thread produces one event per running request per tick. A stream (the server's generations,
:class:`~gemmaserve.engine.handles.RequestStream`) must receive each on its own event loop; doing that with one
``loop.call_soon_threadsafe`` per event costs the engine thread a self-pipe write and a GIL hand-over per event
(~12 µs each on the 2-core CI box with the loop awake: ~3 ms of a 256-stream tick). A :class:`LoopDelivery`
gathers a loop's events while the engine delivers one tick (:func:`batched_delivery`) and hands them over in one
call when it ends; outside such a scope an event goes over at once. Per loop, events keep their order.

Contract: ``put`` runs on the loop, never on the engine thread; ``on_closed`` runs on the thread that found the
loop closed (the engine thread) and must be quick (the server cancels the request there). Thread-safe: any
number of engine threads may feed one loop's delivery.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gemmaserve.engine.request import RequestEvent

__all__ = ["LoopDelivery", "batched_delivery", "loop_delivery"]

logger = logging.getLogger(__name__)

EventSink = Callable[[RequestEvent], None]

_scope = threading.local()  # .pending: the deliveries to flush when this thread's batched_delivery() ends
_deliveries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopDelivery] = weakref.WeakKeyDictionary()
_deliveries_lock = threading.Lock()


@contextmanager
def batched_delivery() -> Iterator[None]:
    """Around one engine tick's event callbacks (engine thread): every :class:`LoopDelivery` fed inside hands its
    events to its loop once, when the outermost scope ends (also when it ends by an exception)."""
    if getattr(_scope, "pending", None) is not None:  # nested: the outer scope flushes
        yield
        return
    pending: list[LoopDelivery] = []
    _scope.pending = pending
    try:
        yield
    finally:
        _scope.pending = None
        for delivery in pending:
            try:
                delivery.flush()
            except Exception:  # one loop's failure must not strand the others' events
                logger.exception("handing events to an event loop failed")


def loop_delivery(loop: asyncio.AbstractEventLoop) -> LoopDelivery:
    """The one :class:`LoopDelivery` of ``loop`` (made on first use; forgotten with the loop). A loop that takes
    no weak reference gets a new one per call: still in order per caller, batched per caller only."""
    with _deliveries_lock:
        try:
            delivery = _deliveries.get(loop)
            if delivery is None:
                delivery = _deliveries[loop] = LoopDelivery(loop)
        except TypeError:  # not weak-referenceable
            return LoopDelivery(loop)
        return delivery


class LoopDelivery:
    """Events bound for one asyncio loop (see the module docstring). Make it with :func:`loop_delivery`. Holds
    the loop weakly (a loop that is gone counts as closed), so the registry forgets both with the loop. Several
    engine threads may feed one loop: an event then waits at most for the end of the tick delivery under way
    in the thread that queued the loop's first pending event."""

    __slots__ = ("_loop", "_lock", "_pending", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self._loop: Callable[[], asyncio.AbstractEventLoop | None] = weakref.ref(loop)
        except TypeError:  # not weak-referenceable: held strongly (such a delivery is not registered)
            self._loop = lambda: loop
        self._lock = threading.Lock()
        self._pending: list[tuple[EventSink, EventSink, RequestEvent]] = []

    def callback(self, put: EventSink, on_closed: EventSink) -> EventSink:
        """An engine ``on_event`` callback: ``put(event)`` later on the loop, or ``on_closed(event)`` now if the
        loop is closed by the time the event is handed over."""

        def on_event(event: RequestEvent) -> None:
            self.add(put, on_closed, event)

        return on_event

    def add(self, put: EventSink, on_closed: EventSink, event: RequestEvent) -> None:
        """Queue one event. The caller that makes the queue non-empty sees that it is flushed: at the end of its
        thread's :func:`batched_delivery`, or at once outside one."""
        with self._lock:
            self._pending.append((put, on_closed, event))
            first = len(self._pending) == 1
        if not first:
            return
        scope = getattr(_scope, "pending", None)
        if scope is None:
            self.flush()
        else:
            scope.append(self)

    def flush(self) -> None:
        """Hand every queued event to the loop in one ``call_soon_threadsafe`` (or to ``on_closed`` if the loop
        is closed)."""
        with self._lock:  # held over the hand-over: batches reach the loop in the order they were taken
            batch, self._pending = self._pending, []
            if not batch:
                return
            loop = self._loop()
            try:
                if loop is not None:
                    loop.call_soon_threadsafe(_put_all, batch)
                    return
            except RuntimeError:  # the loop is closed: nobody will read these requests any more
                pass
        for _, on_closed, event in batch:
            try:
                on_closed(event)
            except Exception:
                logger.exception("on_closed of request %s raised", event.request_id)


def _put_all(batch: list[tuple[EventSink, EventSink, RequestEvent]]) -> None:
    """On the loop: each event to its sink, in order; one sink raising does not hold back the others."""
    for put, _, event in batch:
        try:
            put(event)
        except Exception:
            logger.exception("delivering an event of request %s on its loop raised", event.request_id)
