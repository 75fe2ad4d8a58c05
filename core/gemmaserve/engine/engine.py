"""The engine: a background thread driving the scheduler, and thread-safe ways in and out.

Threading: ``submit``/``cancel``/``generate``/``stats``/``shutdown`` may be called from any thread;
``stream`` from a coroutine. Only the engine thread touches the scheduler and the backend. Callers
hand requests and cancellations over through an inbox guarded by a Condition, which also wakes the
idle engine thread (no polling). ``stats`` and ``check_integrity`` take the step lock, so they may
wait for the tick in progress.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gemmaserve.engine.delivery import batched_delivery
from gemmaserve.engine.handles import EventCallback, RequestHandle, RequestStream
from gemmaserve.engine.request import FinishReason, Request, RequestEvent, RequestMetrics, RequestOutput
from gemmaserve.engine.scheduler import AbortIncompleteError, ContinuousBatchScheduler
from gemmaserve.errors import EngineOverloadedError, InvalidRequestError
from gemmaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gemmaserve.backend import InferenceBackend
    from gemmaserve.kv.cache_manager import CacheManager, CacheStats
    from gemmaserve.kv.events import ZmqEventPublisher
    from gemmaserve.settings import CoreSettings
    from gemmaserve.structured.spec import StructuredOutputs

__all__ = ["Engine", "EngineStats"]

logger = logging.getLogger(__name__)

_FROZEN = threading.Lock()
_frozen = False


def freeze_startup_objects() -> None:
    """Once per process: collect, then move every object alive now (the model, its tensors and modules, the
    libraries) to the cyclic garbage collector's permanent generation, so its collections during serving scan
    only the objects serving makes. Without this, the collections the engine thread's allocations trigger
    re-scan the whole model: ~3 ms of a ~4.7 ms decode tick at 256 rows on the CI box, forward stubbed
    (``benchmarks/host_overhead.py --engine [--no-gc-freeze]``)."""
    global _frozen
    with _FROZEN:
        if _frozen:
            return
        _frozen = True
        gc.collect()
        gc.freeze()
        logger.debug("froze %d startup objects out of the cyclic garbage collector's scans", gc.get_freeze_count())


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot. ``finished`` counts by finish reason (``"stop"``, ``"length"``, ``"cancelled"``,
    ``"error"``); ``cache`` is the core prefix cache's stats (None without one); ``kv`` is the
    backend's ``kv_stats()`` (read under the backend lock); ``decode_rows_retried`` counts rows
    retried alone after a failed batched decode step."""

    running: int
    waiting: int
    finished: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    num_steps: int
    decode_failures: int
    cache: CacheStats | None = None
    kv: dict[str, int] = field(default_factory=dict)
    decode_rows_retried: int = 0
    prefix_waits: int = 0
    """Ticks in which a request waited for an earlier prompt's shared prefix blocks (``engine/shared_prefix.py``)."""
    reserved_kv_tokens: int = 0
    """KV tokens the admitted requests reserve (prompt + max_tokens each, capped), out of ``kv_token_budget``."""
    kv_token_budget: int = 0
    """The admission budget, ``MAX_ACTIVE_KV_TOKENS``."""


def _checked_params(params: object) -> SamplingParams:
    """``params``, or the defaults for None; InvalidRequestError naming the type for anything else."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be a gemmaserve.SamplingParams (e.g. "
                                  f"SamplingParams(max_tokens=16)) or None, got {type(params).__name__}")
    return params


class Engine:
    """Continuous-batching engine over one backend. ``start`` is implicit on the first submit;
    ``shutdown`` cancels what is pending. With ``owns_backend`` the backend is closed at shutdown
    (``close`` is idempotent, so callers closing it again is harmless). ``backend_name`` is the
    registry name it was selected under (default: the class name). ``kv_events``: the publisher of the prefix
    cache's changes (``gemmaserve.kv.events``), which the engine owns: closed at shutdown after the backend, so
    the cache's last changes go out first."""

    def __init__(
        self,
        backend: InferenceBackend,
        settings: CoreSettings,
        cache_manager: CacheManager | None = None,
        *,
        owns_backend: bool = False,
        backend_name: str | None = None,
        kv_events: ZmqEventPublisher | None = None,
    ) -> None:
        freeze_startup_objects()  # the backend is built: its objects live as long as the process serves
        self.backend = backend
        self.backend_name = backend_name or type(backend).__name__
        self.settings = settings
        self.cache_manager = cache_manager
        self.scheduler = ContinuousBatchScheduler(backend, settings, cache_manager)
        self._owns_backend = owns_backend
        self.kv_events = kv_events
        self._cond = threading.Condition()  # guards everything below
        self._inbox: list[Request] = []
        self._cancels: list[tuple[str, FinishReason, RequestHandle]] = []  # the handle the cancel was meant for
        self._handles: dict[str, RequestHandle] = {}
        self._room_waiters = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step_lock = threading.Lock()  # held by the engine thread while it uses the scheduler
        self._part_started: float | None = None  # when the running part of a tick began (busy_for)
        self._in_hand = 0  # requests the engine thread took from the inbox and has not added yet (under _cond)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent). Raises EngineOverloadedError after shutdown."""
        with self._cond:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._stopping:
            raise EngineOverloadedError("the engine is shut down and takes no new requests")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gemmaserve-engine", daemon=True)
            self._thread.start()

    INTERRUPT_AFTER_S = 10.0
    """Seconds :meth:`shutdown` waits for a backend call in progress before it asks the backend to interrupt it."""

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine: pending and running requests finish as ``cancelled``; then the engine
        thread exits (joined, up to ``timeout`` seconds, unless called from it). A backend call still running
        ``INTERRUPT_AFTER_S`` into the wait is interrupted (``InferenceBackend.interrupt``: a hung worker must not
        hold the shutdown). Idempotent."""
        with self._cond:
            already, self._stopping = self._stopping, True
            thread = self._thread
            self._cond.notify_all()
        if thread is None and not already:
            self._close_backend()
        elif thread is not None and thread is not threading.current_thread():
            self._join_interrupting(thread, timeout)

    def _join_interrupting(self, thread: threading.Thread, timeout: float | None) -> None:
        """Join the stopping engine thread (up to ``timeout`` seconds), asking the backend once to interrupt a call
        that has run ``INTERRUPT_AFTER_S`` and started at least that long into the wait or before it."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        interrupted = False
        while thread.is_alive():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            hung = now - started >= self.INTERRUPT_AFTER_S and self.busy_for() >= self.INTERRUPT_AFTER_S
            if hung and not interrupted:
                interrupted = True
                logger.warning("shutdown: a backend call has run for %.0f s; interrupting it", self.busy_for())
                try:
                    self.backend.interrupt()
                except Exception:
                    logger.exception("interrupting the backend failed")
            thread.join(0.5 if deadline is None else max(0.0, min(0.5, deadline - now)))

    def busy_for(self) -> float:
        """Seconds the engine thread has spent in the part of a tick it is running now (0.0 between parts): a
        value that keeps growing means a stuck backend call (``/health`` reports it). Lock-free."""
        started = self._part_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def is_alive(self) -> bool:
        """True while the engine thread runs and no shutdown was requested."""
        with self._cond:
            return self._thread is not None and self._thread.is_alive() and not self._stopping

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- requests ---------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_event: EventCallback | None = None,
        *,
        logprobs: bool = False,
        wait_for_room: bool = False,
        keep_events: bool = True,
    ) -> RequestHandle:
        """Queue a request and return its handle. Validation errors (InvalidRequestError,
        PromptTooLongError) and EngineOverloadedError (queue full, or shut down) raise right here;
        with ``wait_for_room`` a full queue blocks until there is room instead. ``keep_events=False`` (with an
        ``on_event`` callback): the handle keeps no events (not iterable; ``result()`` works), so a long stream read
        through the callback holds no backlog."""
        request = Request(request_id or uuid.uuid4().hex, tuple(prompt_ids), _checked_params(params), logprobs)
        return self._submit([request], [on_event], wait_for_room=wait_for_room, keep_events=keep_events)[0]

    def compile_constraint(self, spec: StructuredOutputs) -> None:
        """Compile a structured-output constraint now, on the calling thread (pathological ones take up to about a
        second): the :meth:`submit` of a request carrying ``spec`` then only copies it. A server calls this on its
        request-preparing threads so that neither its event loop nor the engine thread compiles. Raises
        InvalidRequestError as :meth:`submit` would for ``spec``. Thread-safe."""
        self.scheduler.constraint_compiler().prepare(spec)

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams | None],
        request_ids: Sequence[str | None] | None = None,
        on_events: Sequence[EventCallback | None] | None = None,
        *,
        logprobs: bool = False,
        wait_for_room: bool = False,
        keep_events: bool = True,
    ) -> list[RequestHandle]:
        """Queue several requests at once (lists of equal length; ids and callbacks optional, as in
        :meth:`submit`) and return their handles in order. Every request is validated before any is queued (the
        first error raises and nothing is queued); they then enter the engine together, so its next tick plans
        them all (a loop of :meth:`submit` races the engine thread, which may start a tick after the first).
        Without ``wait_for_room`` a queue without room for all of them raises EngineOverloadedError and queues
        none; with it, they are queued in order as room opens. ``keep_events``: as in :meth:`submit`."""
        count = len(prompts)
        ids = list(request_ids) if request_ids is not None else [None] * count
        callbacks = list(on_events) if on_events is not None else [None] * count
        if not (len(params) == len(ids) == len(callbacks) == count):
            raise InvalidRequestError(f"submit_many got {count} prompts, {len(params)} params, {len(ids)} request "
                                      f"ids and {len(callbacks)} callbacks: give one of each per prompt")
        requests = [Request(rid or uuid.uuid4().hex, tuple(prompt), _checked_params(sample), logprobs)
                    for prompt, sample, rid in zip(prompts, params, ids)]
        return self._submit(requests, callbacks, wait_for_room=wait_for_room, keep_events=keep_events)

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        logprobs: bool = False,
    ) -> RequestStream:
        """Submit now (validation errors raise here) and return an async iterator of its events:
        ``async for event in engine.stream(ids, params): ...``. Call from a coroutine. Stopping the
        iteration early (break, task cancelled, ``aclose``) cancels the request."""
        return RequestStream(
            self, lambda on_event: self.submit(prompt_ids, params, request_id, on_event, logprobs=logprobs,
                                               keep_events=False)
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        logprobs: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt (batched together) and return their outputs in order. Blocks; waits for
        queue room instead of failing when there are more prompts than MAX_WAITING_REQUESTS."""
        if isinstance(params, (list, tuple)):
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise InvalidRequestError(f"got {len(prompts)} prompts but {len(per_prompt)} sampling params")
        else:
            per_prompt = [_checked_params(params)] * len(prompts)
        handles = self.submit_many(prompts, per_prompt, logprobs=logprobs, wait_for_room=True)
        try:
            return [handle.result() for handle in handles]
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise

    def cancel(self, request_id: str, *, reason: FinishReason = FinishReason.CANCELLED,
               handle: RequestHandle | None = None) -> bool:
        """Cancel a request in any phase; True if it was still pending. Its final event/output has
        ``finish_reason=reason`` (applied at the start of the next tick): ``cancelled`` by default,
        ``stop`` when the caller ended it on a stop string the engine does not see. ``handle``: cancel only the
        request of that handle (``RequestHandle.cancel``: a request that finished and whose id a new request took
        is not the new one)."""
        if reason not in (FinishReason.CANCELLED, FinishReason.STOP):
            raise ValueError(f"cancel reason must be 'cancelled' or 'stop', got {reason!r}")
        with self._cond:
            current = self._handles.get(request_id)
            if current is None or (handle is not None and current is not handle):
                return False
            handle = current
            self._cancels.append((request_id, reason, handle))
            self._cond.notify_all()
            return True

    def _submit(self, requests: Sequence[Request], on_events: Sequence[EventCallback | None], *,
                wait_for_room: bool, keep_events: bool) -> list[RequestHandle]:
        """Validate every request, then queue them in order under the lock (see :meth:`submit_many`)."""
        shared: dict[Any, Any] = {}  # one tokenization of bad_words etc. for the choices that share them
        for request in requests:
            self.scheduler.validate_request(request, shared)
        ids = [request.request_id for request in requests]
        repeated = sorted(rid for rid, count in Counter(ids).items() if count > 1)
        if repeated:
            raise InvalidRequestError(f"request ids {repeated} are given more than once; pick unique ids")
        handles = [RequestHandle(self, request.request_id, on_event, keep_events=keep_events)
                   for request, on_event in zip(requests, on_events)]
        with self._cond:
            self._start_locked()  # raises once the engine is shut down
            in_use = [rid for rid in ids if rid in self._handles]
            if in_use:
                raise InvalidRequestError(f"request id {in_use[0]!r} is already in use; pick a unique id")
            if not wait_for_room:
                waiting = len(self._inbox) + self._in_hand + self.scheduler.num_waiting
                if waiting + len(requests) > self.settings.max_waiting_requests:
                    raise EngineOverloadedError(
                        f"{waiting} requests are already waiting (MAX_WAITING_REQUESTS="
                        f"{self.settings.max_waiting_requests}); retry later"
                        + (f" (this call brings {len(requests)})" if len(requests) > 1 else "")
                    )
            queued = 0
            try:
                for request, handle in zip(requests, handles):
                    while (len(self._inbox) + self._in_hand + self.scheduler.num_waiting
                           >= self.settings.max_waiting_requests):
                        self._cond.notify_all()  # what is queued so far may start while this call waits for room
                        self._room_waiters += 1
                        try:
                            self._cond.wait()
                        finally:
                            self._room_waiters -= 1
                        if self._stopping:
                            raise EngineOverloadedError("the engine is shut down and takes no new requests")
                    if request.request_id in self._handles:  # taken by another caller while this one waited
                        raise InvalidRequestError(f"request id {request.request_id!r} is already in use; pick a "
                                                  "unique id")
                    self._handles[request.request_id] = handle
                    self._inbox.append(request)
                    queued += 1
            except BaseException:
                # the caller gets no handles: what this call queued already is cancelled, not left running
                self._cancels.extend((request.request_id, FinishReason.CANCELLED, handle)
                                     for request, handle in zip(requests[:queued], handles))
                raise
            finally:
                self._cond.notify_all()
        return handles

    # -- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._cancels or self._stopping or self.scheduler.has_work):
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    self._in_hand = len(inbox)  # counted as waiting until _tick adds them
                    # a cancel whose request finished meanwhile is void, also when a new request took its id
                    cancels = [(rid, reason) for rid, reason, handle in self._cancels if self._handles.get(rid) is handle]
                    self._cancels = []
                    stopping = self._stopping
                self._guarded(lambda events: self._tick(inbox, cancels, stopping, events))
                if stopping:
                    break
                self._guarded(self.scheduler.step_decode)
        except BaseException as exc:  # not a tick's failure (those are guarded): the thread itself is going
            logger.critical("the engine thread is exiting on %r; failing every request", exc)
            self._fail_everything(exc)
            raise
        finally:
            with self._step_lock:  # /metrics and /debug read the backend under it
                self._close_backend()

    def _fail_everything(self, exc: BaseException) -> None:
        """The engine thread is dying: refuse new requests and end every known one with an error, so no
        caller waits forever (``RequestHandle.result``, streams, the server's generations)."""
        with self._cond:
            self._stopping = True
            inbox, self._inbox = self._inbox, []
            self._cancels.clear()
        events: list[RequestEvent] = []
        try:
            for request in inbox:
                request.finish(FinishReason.ERROR, exc)
                events.append(request.take_event())
            with self._step_lock:
                events += self._recover(exc)
        except BaseException:
            logger.exception("failing the in-flight requests raised")
        try:
            self._deliver(events)
        except BaseException:
            logger.exception("delivering the final events raised")
        with self._cond:  # anything still registered had no final event: end it without the scheduler
            leftover, self._handles = dict(self._handles), {}
        now = time.monotonic()
        for request_id, handle in leftover.items():
            output = RequestOutput(request_id, [], [], FinishReason.ERROR, 0, RequestMetrics(now, None, now),
                                   error=f"the engine thread stopped: {exc!r}", error_type=type(exc).__name__)
            try:
                handle.deliver(RequestEvent(request_id, [], True, output))
            except BaseException:
                logger.exception("delivering request %s's final event raised", request_id)

    def _guarded(self, part: Callable[[list[RequestEvent]], None]) -> None:
        """Run one part of a tick under the step lock, then deliver its events (first tokens of the
        prefill half go out before the decode half runs). A raise is a scheduler bug: fail what is in
        flight and keep serving."""
        events: list[RequestEvent] = []
        try:
            with self._step_lock:
                self._part_started = time.monotonic()
                try:
                    part(events)
                except Exception as exc:
                    logger.critical("engine tick raised; failing all in-flight requests", exc_info=True)
                    if isinstance(exc, AbortIncompleteError):  # the final events of those it did abort
                        events += exc.events
                    events += self._recover(exc)
                finally:
                    self._part_started = None
        except BaseException:  # the thread is going (see _run): what the tick made so far still goes out
            self._deliver(events)
            raise
        self._deliver(events)

    def _tick(self, inbox: list[Request], cancels: list[tuple[str, FinishReason]], stopping: bool, events: list[RequestEvent]) -> None:
        """Apply submissions and cancellations, then the prefill half of a scheduler step (or abort all
        when stopping). Appends to ``events`` as it goes, so a failure part-way loses none of them."""
        try:
            for request in inbox:
                try:
                    self.scheduler.add_request(request)
                except Exception as exc:  # lost a race (queue bound); validation already passed
                    request.finish(FinishReason.ERROR, exc)
                    events.append(request.take_event())
        finally:
            self._in_hand = 0
        for request_id, reason in cancels:
            events += self.scheduler.abort_request(request_id, reason=reason)
        if stopping:
            events += self.scheduler.abort_all()
        else:
            self.scheduler.step_prefill(events)

    def _recover(self, exc: BaseException) -> list[RequestEvent]:
        try:
            return self.scheduler.abort_all(error=exc)
        except Exception as abort_exc:
            logger.critical("could not abort in-flight requests; starting a fresh scheduler", exc_info=True)
            events = list(abort_exc.events) if isinstance(abort_exc, AbortIncompleteError) else []
            orphans = self.scheduler.release_all_best_effort(events)
            fresh = ContinuousBatchScheduler(self.backend, self.settings, self.cache_manager)
            fresh.continue_counts(self.scheduler, orphans=len(orphans))
            self.scheduler = fresh
            for request in orphans:
                request.finish(FinishReason.ERROR, exc)
            return events + [request.take_event() for request in orphans]

    def _deliver(self, events: list[RequestEvent]) -> None:
        with self._cond:
            targets = [(self._handles.get(event.request_id), event) for event in events]
            for event in events:
                if event.finished:
                    self._handles.pop(event.request_id, None)
            if self._room_waiters:
                self._cond.notify_all()
        failure: BaseException | None = None
        with batched_delivery():  # the streams' events reach each asyncio loop in one hand-over
            for handle, event in targets:
                if handle is not None:
                    try:
                        handle.deliver(event)
                    except BaseException as exc:  # ends the thread (see _run), after the others' events
                        failure = failure or exc
        if failure is not None:
            raise failure

    def _close_backend(self) -> None:
        if self._owns_backend:
            try:
                self.backend.close()
            except Exception:
                logger.exception("closing the backend failed")
        if self.kv_events is not None:
            try:
                self.kv_events.close()  # idempotent
            except Exception:
                logger.exception("closing the KV-event publisher failed")

    # -- observability ------------------------------------------------------------------------------
    def stats(self, timeout: float | None = None) -> EngineStats:
        """A snapshot, taken between ticks' parts (it waits for the one running). ``timeout``: seconds to wait at
        most, then TimeoutError (a scraper must not hang on a stuck tick); None waits as long as it takes."""
        if not self._step_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"the engine's tick has run for {self.busy_for():.1f} s: no snapshot within "
                               f"{timeout} s")
        try:
            sched = self.scheduler.stats()
            cache = self.cache_manager.stats() if self.cache_manager is not None else None
            with self.backend.lock:
                kv = dict(self.backend.kv_stats())
            with self._cond:  # under the step lock: a request taken from the inbox is in _in_hand or added
                inbox = len(self._inbox) + self._in_hand
        finally:
            self._step_lock.release()
        return EngineStats(
            running=sched.num_prefilling + sched.num_decoding,
            waiting=sched.num_waiting + inbox,
            finished=sched.finished,
            prompt_tokens=sched.prompt_tokens,
            cached_tokens=sched.cached_tokens,
            generated_tokens=sched.generated_tokens,
            num_steps=sched.num_steps,
            decode_failures=sched.decode_failures,
            cache=cache,
            kv=kv,
            decode_rows_retried=sched.decode_rows_retried,
            prefix_waits=sched.prefix_waits,
            reserved_kv_tokens=sched.reserved_kv_tokens,
            kv_token_budget=self.settings.max_active_kv_tokens,
        )

    def check_integrity(self) -> None:
        """Raise RuntimeError if the scheduler is inconsistent or a live request has no handle."""
        with self._step_lock:
            self.scheduler.check_integrity()
            with self._cond:
                live = {request.request_id for request in self.scheduler.live_requests()}
                missing = live - set(self._handles)
            if missing:
                raise RuntimeError(f"requests without a handle: {sorted(missing)}")
