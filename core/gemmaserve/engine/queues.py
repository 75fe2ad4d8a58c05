"""Where every live request is and what it holds; the one place that frees KV and reservations.

Queues: ``waiting`` (FIFO) -> ``prefilling`` (batched path) or ``streams`` (streaming-only path)
-> ``rows`` (batched path, aligned with the backend batch). A request is in exactly one queue while
it lives in ``requests``; the scheduler (policy) moves it, this class (bookkeeping) retires it.
Driving thread only; methods that free KV expect ``backend.lock`` to be held by the caller.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Collection
from typing import TYPE_CHECKING

from gemmaserve.engine.request import FinishReason, Request, RequestEvent, RequestState
from gemmaserve.engine.rows import RowBatch
from gemmaserve.engine.validation import backend_error

if TYPE_CHECKING:
    from gemmaserve.backend import InferenceBackend

__all__ = ["RequestQueues"]

logger = logging.getLogger(__name__)


class RequestQueues:
    """Request queues plus the KV-token reservations of admitted requests."""

    def __init__(self, backend: InferenceBackend) -> None:
        self.backend = backend
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.streams: list[Request] = []
        self.rows = RowBatch(backend)
        self.requests: dict[str, Request] = {}
        self.reservations: dict[str, int] = {}
        self.reserved_tokens = 0
        self.finished: Counter[str] = Counter()

    @property
    def num_running(self) -> int:
        """Admitted requests: prefilling + decoding rows + streams."""
        return len(self.prefilling) + len(self.rows) + len(self.streams)

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def admit_head(self, budget: int, *, streaming: bool) -> Request:
        """Move the head of ``waiting`` to ``prefilling`` (or ``streams``), reserving ``budget`` tokens."""
        request = self.waiting.popleft()
        self.reservations[request.request_id] = budget
        self.reserved_tokens += budget
        request.advance(RequestState.PREFILLING)
        (self.streams if streaming else self.prefilling).append(request)
        return request

    def release(self, request: Request, events: list[RequestEvent]) -> None:
        """Take ``request`` out of its queue and free its KV (prefill state, stream or batch row).
        Backend errors while freeing are logged, not raised: the request is ending anyway."""
        if request in self.rows.rows:
            self.remove_row(self.rows.rows.index(request), events)
            return
        try:
            if request in self.waiting:
                self.waiting.remove(request)
            elif request in self.prefilling:
                self.prefilling.remove(request)
                state, request.prefill_state = request.prefill_state, None
                if state is not None:
                    self.backend.free_row_kv(state.kv)
            elif request in self.streams:
                self.streams.remove(request)
                stream, request.stream = request.stream, None
                if stream is not None and hasattr(stream, "close"):
                    stream.close()
        except Exception:
            logger.exception("freeing the KV of request %s failed", request.request_id)

    def free_kv(self, kv: object, request: Request) -> None:
        """Free a row KV of ``request`` that is in no batch; errors are logged, not raised."""
        try:
            self.backend.free_row_kv(kv)
        except Exception:
            logger.exception("freeing the KV of request %s failed", request.request_id)

    def remove_row(self, index: int, events: list[RequestEvent]) -> None:
        """Remove batch row ``index``; if the backend fails, the batch can no longer be trusted, so
        every remaining row fails too (rows already finished keep their reason)."""
        try:
            self.rows.remove(index)
        except Exception as exc:
            logger.exception("remove_row_from_cache failed; dropping the whole batch")
            self.fail_rows(exc, events, phase="row removal")

    def fail_rows(self, exc: BaseException, events: list[RequestEvent], *, phase: str) -> None:
        """Drop the whole batch; its unfinished rows fail with ``exc``; all of them retire."""
        for request in self.rows.drop_all():
            if not request.is_finished:
                request.finish(FinishReason.ERROR, backend_error(exc, phase))
            self.retire(request, events)

    def fail(self, request: Request, exc: BaseException, events: list[RequestEvent], *, phase: str) -> None:
        """Fail one request: free what it holds, finish it with ``finish_reason="error"``, retire it."""
        logger.warning("request %s failed during %s: %s: %s", request.request_id, phase, type(exc).__name__, exc)
        self.release(request, events)
        request.finish(FinishReason.ERROR, backend_error(exc, phase))
        self.retire(request, events)

    def retire(self, request: Request, events: list[RequestEvent]) -> None:
        """Release the reservation of a FINISHED request (and the backend's, if it reserves),
        forget the request and emit its final event. Its KV must already be freed."""
        assert request.finish_reason is not None
        budget = self.reservations.pop(request.request_id, None)
        if budget is not None:
            self.reserved_tokens -= budget
        if self.backend.capabilities.kv_reservation:
            try:
                self.backend.kv_release(request.request_id)
            except Exception:
                logger.exception("kv_release failed for request %s", request.request_id)
        del self.requests[request.request_id]
        self.finished[request.finish_reason.value] += 1
        events.append(request.take_event())

    def check_integrity(self, max_tokens: int, max_running: int, ahead: Collection[Request] = ()) -> None:
        """Raise RuntimeError if queues, states, reservations or batch KV lengths disagree (rows in ``ahead`` hold
        one KV position more: a launched decode step fed them a token not appended yet)."""
        queues = {
            "waiting": (list(self.waiting), {RequestState.WAITING}),
            "prefilling": (self.prefilling, {RequestState.PREFILLING}),
            "streams": (self.streams, {RequestState.PREFILLING, RequestState.DECODING}),
            "rows": (self.rows.rows, {RequestState.DECODING}),
        }
        ids: list[str] = []
        for name, (members, states) in queues.items():
            for request in members:
                ids.append(request.request_id)
                if request.state not in states:
                    raise RuntimeError(f"request {request.request_id} is {request.state.value} but queued in {name}")
        if len(ids) != len(set(ids)) or set(ids) != set(self.requests):
            raise RuntimeError(f"queued ids {sorted(ids)} disagree with known ids {sorted(self.requests)}")
        admitted = {r.request_id for r in (*self.prefilling, *self.streams, *self.rows.rows)}
        if set(self.reservations) != admitted or sum(self.reservations.values()) != self.reserved_tokens:
            raise RuntimeError(f"reservations {self.reservations} (sum {self.reserved_tokens}) != admitted {admitted}")
        if self.reserved_tokens > max_tokens or self.num_running > max_running:
            raise RuntimeError(f"over budget: {self.reserved_tokens} KV tokens, {self.num_running} running")
        for request in self.prefilling:
            state = request.prefill_state
            if state is not None and self.backend.kv_length(state.kv) != state.num_computed:
                raise RuntimeError(f"prefill KV of {request.request_id} != its {state.num_computed} computed tokens")
        self.rows.check_integrity(ahead)
