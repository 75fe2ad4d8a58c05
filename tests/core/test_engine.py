"""Engine: the background thread, handles, async streams, cancellation, shutdown, build_engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from gemmaserve.engine import Engine, RequestEvent, RequestStream, build_engine
from gemmaserve.errors import EngineOverloadedError, InvalidRequestError, PromptTooLongError
from gemmaserve.hardware import DeviceReport
from gemmaserve.hookspecs import hookimpl
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.plugins import register_plugin, unregister_plugin
from gemmaserve.registry import BackendSpec
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings
from gemmaserve.testing.reference_backend import ReferenceBackend

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def make_engine(backend: ReferenceBackend | None = None, **overrides: int) -> Engine:
    backend = backend or ReferenceBackend()
    cache = CacheManager(64, 4)
    backend.set_cache_adapter(cache)
    values = {"max_batch_size": 8, "prefill_chunk_tokens": 8, "max_active_kv_tokens": 8192, **overrides}
    return Engine(backend, CoreSettings(**values), cache)


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = make_engine()
    yield engine
    engine.shutdown()


def reference(engine: Engine) -> ReferenceBackend:
    assert isinstance(engine.backend, ReferenceBackend)
    return engine.backend


def wait_until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def assert_idle(engine: Engine) -> None:
    wait_until(lambda: engine.stats().running == 0 and engine.stats().waiting == 0)
    engine.check_integrity()
    backend = engine.backend
    assert isinstance(backend, ReferenceBackend)
    with backend.lock:
        backend.check_integrity()
        assert backend.num_live_rows == 0 and backend.num_reservations == 0
    assert engine.cache_manager is not None and engine.cache_manager.stats().pinned_blocks == 0


def test_submit_result_and_event_iteration(engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=3)
    seen: list[RequestEvent] = []
    handle = engine.submit([5, 6, 7], params, request_id="r1", on_event=seen.append)
    events = list(handle)
    output = handle.result(timeout=5)
    assert handle.request_id == output.request_id == "r1" and handle.done
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    assert [t for e in events for t in e.new_token_ids] == output.token_ids
    assert output.token_ids == reference(engine).reference_generate([5, 6, 7], params)
    wait_until(lambda: len(seen) == len(events))
    assert seen == events
    assert handle.cancel() is False  # already finished
    assert_idle(engine)


def test_generate_batches_and_matches_single_runs(engine: Engine) -> None:
    prompts = [[5 + i % 4] * (3 + i) for i in range(12)]
    params = [SamplingParams(max_tokens=4 + i, temperature=0.5 * (i % 3), seed=i) for i in range(12)]
    outputs = engine.generate(prompts, params)
    backend = reference(engine)
    assert [o.token_ids for o in outputs] == [backend.reference_generate(p, q) for p, q in zip(prompts, params)]
    again = engine.generate(prompts[:2], SamplingParams(max_tokens=3))
    assert all(o.cached_tokens > 0 for o in again)
    stats = engine.stats()
    assert sum(stats.finished.values()) == 14 and stats.generated_tokens == sum(
        len(o.token_ids) for o in [*outputs, *again]
    )
    assert stats.cache is not None and stats.cache.hit_tokens > 0 and stats.num_steps > 0
    with pytest.raises(InvalidRequestError, match="2 prompts but 1"):
        engine.generate([[5], [6]], [SamplingParams()])
    assert_idle(engine)


def test_generate_waits_for_queue_room_instead_of_failing() -> None:
    with make_engine(max_waiting_requests=2, max_batch_size=2) as engine:
        outputs = engine.generate([[5, i % 10 + 5] for i in range(20)], SamplingParams(max_tokens=3))
        assert len(outputs) == 20 and all(o.finish_reason in ("length", "stop") for o in outputs)


def test_validation_errors_raise_synchronously(engine: Engine) -> None:
    with pytest.raises(PromptTooLongError, match="maximum model length"):
        engine.submit([5] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="not a valid token id"):
        engine.submit([5, 99])
    handle = engine.submit([5], LONG, request_id="dup")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.submit([5], request_id="dup")
    handle.cancel()
    assert handle.result(timeout=5).finish_reason == "cancelled"
    assert_idle(engine)


def test_queue_overflow_raises_overloaded() -> None:
    engine = make_engine(max_waiting_requests=2)
    try:
        with engine.backend.lock:  # the engine thread cannot step, so nothing gets admitted
            engine.submit([5], LONG)
            engine.submit([6], LONG)
            with pytest.raises(EngineOverloadedError, match="MAX_WAITING_REQUESTS=2"):
                engine.submit([7], LONG)
    finally:
        engine.shutdown()


def test_cancel_running_request_frees_its_kv() -> None:
    with make_engine(ReferenceBackend(decode_delay_s=0.002)) as engine:
        bystander = engine.submit([8, 9], SamplingParams(max_tokens=30, ignore_eos=True))
        handle = engine.submit([5, 6, 7], LONG)
        events = iter(handle)
        next(events)
        assert engine.cancel(handle.request_id) is True
        output = handle.result(timeout=5)
        assert output.finish_reason == "cancelled" and 1 <= len(output.token_ids) < 400
        assert bystander.result(timeout=5).token_ids == reference(engine).reference_generate(
            [8, 9], SamplingParams(max_tokens=30, ignore_eos=True)
        )
        assert engine.cancel(handle.request_id) is False and engine.cancel("unknown") is False
        assert_idle(engine)


def test_cancel_from_the_event_callback_is_deterministic(engine: Engine) -> None:
    def cancel_on_first(event: RequestEvent) -> None:
        if event.new_token_ids and not event.finished:
            engine.cancel(event.request_id)

    handle = engine.submit([5, 6, 7], LONG, on_event=cancel_on_first)
    output = handle.result(timeout=5)
    assert output.finish_reason == "cancelled" and len(output.token_ids) <= 2
    assert engine.stats().finished.get("cancelled") == 1
    assert_idle(engine)


def test_shutdown_cancels_pending_requests_and_is_idempotent() -> None:
    backend = ReferenceBackend(decode_delay_s=0.002)
    engine = make_engine(backend, max_batch_size=2)
    handles = [engine.submit([5 + i], LONG) for i in range(5)]
    handles[0].__iter__().__next__()  # something is running
    engine.shutdown()
    engine.shutdown()
    assert all(h.result(timeout=0).finish_reason == "cancelled" for h in handles)
    assert not engine.is_alive()
    with pytest.raises(EngineOverloadedError, match="shut down"):
        engine.submit([5])
    with backend.lock:
        assert backend.num_live_rows == 0


def test_engine_owning_its_backend_closes_it() -> None:
    backend = ReferenceBackend()
    engine = Engine(backend, CoreSettings(), owns_backend=True, backend_name="reference")
    engine.generate([[5]], SamplingParams(max_tokens=2))
    assert engine.is_alive() and engine.backend_name == "reference"
    engine.shutdown()
    assert backend.closed and not engine.is_alive()


def test_prefill_failure_reports_error_and_engine_keeps_serving() -> None:
    with make_engine(ReferenceBackend(fail_on_token=40)) as engine:
        bad, good = engine.generate([[5, 40, 6], [5, 6]], SamplingParams(max_tokens=3))
        assert bad.finish_reason == "error" and bad.error_type == "BackendStepError" and "injected" in (bad.error or "")
        assert good.finish_reason in ("length", "stop") and engine.stats().finished.get("error") == 1
        assert_idle(engine)


@pytest.mark.parametrize("half", ["step_prefill", "step_decode"])
@pytest.mark.parametrize("abort_also_fails", [False, True])
def test_a_crashing_scheduler_step_fails_in_flight_requests_and_serving_continues(abort_also_fails: bool, half: str) -> None:
    engine = make_engine()
    broken = engine.scheduler
    step, abort_all = getattr(broken, half), broken.abort_all
    crashes = {half: 1, "abort_all": int(abort_also_fails)}

    def crashing(name, original):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            if crashes[name]:
                crashes[name] -= 1
                raise RuntimeError(f"{name} bug")
            return original(*args, **kwargs)

        return call

    setattr(broken, half, crashing(half, step))
    broken.abort_all = crashing("abort_all", abort_all)  # type: ignore[method-assign]
    try:
        output = engine.submit([5, 6], SamplingParams(max_tokens=3)).result(timeout=5)
        assert output.finish_reason == "error" and f"{half} bug" in (output.error or "")
        assert (engine.scheduler is not broken) == abort_also_fails  # else the old one recovered
        assert engine.generate([[5]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"
        assert engine.is_alive()
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_engine_thread_idles_without_polling(engine: Engine) -> None:
    engine.generate([[5]], SamplingParams(max_tokens=2))
    steps = engine.stats().num_steps
    time.sleep(0.2)
    assert engine.stats().num_steps == steps  # no ticks without work
    assert any(t.name == "gemmaserve-engine" for t in threading.enumerate())


# -- asyncio -------------------------------------------------------------------------------------------


def test_async_stream_delivers_every_token(engine: Engine) -> None:
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    async def consume() -> list[RequestEvent]:
        return [event async for event in engine.stream([5, 6], params, logprobs=True)]

    events = asyncio.run(consume())
    assert events[-1].finished and events[-1].output is not None
    assert [t for e in events for t in e.new_token_ids] == events[-1].output.token_ids
    assert events[-1].output.logprobs is not None and len(events[-1].output.logprobs) == 10
    assert events[-1].output.token_ids == reference(engine).reference_generate([5, 6], params)


def test_async_stream_validation_raises_at_call(engine: Engine) -> None:
    async def call() -> None:
        engine.stream([], SamplingParams())

    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(call())


@pytest.fixture
def slow_engine() -> Iterator[Engine]:
    engine = make_engine(ReferenceBackend(decode_delay_s=0.002))
    yield engine
    engine.shutdown()


async def _finish_reason(stream: RequestStream) -> str:
    """Wait (without blocking the loop, which stays alive) for the request's final output."""
    output = await asyncio.to_thread(stream.handle.result, 5)
    return str(output.finish_reason)


def test_async_stream_aclose_cancels(slow_engine: Engine) -> None:
    async def main() -> str:
        stream = slow_engine.stream([5, 6], LONG)
        async for event in stream:
            if event.new_token_ids:
                break
        await stream.aclose()
        return await _finish_reason(stream)

    assert asyncio.run(main()) == "cancelled"
    assert_idle(slow_engine)


def test_cancelling_the_consumer_task_cancels_the_request(slow_engine: Engine) -> None:
    async def main() -> str:
        stream = slow_engine.stream([7, 8], LONG)  # kept alive here: only the task is cancelled
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in stream:
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _finish_reason(stream)

    assert asyncio.run(main()) == "cancelled"
    assert_idle(slow_engine)


def test_dropping_an_unfinished_stream_cancels_the_request(slow_engine: Engine) -> None:
    async def main() -> str:
        async for event in slow_engine.stream([9, 9], LONG, request_id="dropped"):
            if event.new_token_ids:
                break  # the stream object is unreachable from here on
        await asyncio.to_thread(wait_until, lambda: slow_engine.stats().finished.get("cancelled") == 1)
        return "cancelled"

    assert asyncio.run(main()) == "cancelled"
    assert_idle(slow_engine)


# -- build_engine ----------------------------------------------------------------------------------------


class _ReferencePlugin:
    @hookimpl
    def gemmaserve_register_backends(self, register) -> None:  # type: ignore[no-untyped-def]
        register(
            BackendSpec(
                "reference-test",
                "gemmaserve.testing.reference_backend:create_reference_backend",
                ("cpu",),
                description="deterministic toy backend",
            )
        )


def test_build_engine_selects_builds_and_attaches_the_prefix_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gemmaserve.selection.detect_devices", lambda: DeviceReport("cpu", ("cpu",)))  # no torch import
    register_plugin(_ReferencePlugin(), "reference-test-plugin")
    try:
        settings = CoreSettings(
            backend="reference-test", device="cpu", model="/no/weights", prefix_cache_blocks=16, kv_block_size=2
        )
        engine = build_engine(settings)
        with engine:
            assert engine.backend_name == "reference-test" and isinstance(engine.backend, ReferenceBackend)
            assert engine.cache_manager is not None and engine.cache_manager.block_size == 2
            assert engine.backend.cache is engine.cache_manager
            out = engine.generate([[5, 6, 7, 8, 9]] * 2, SamplingParams(max_tokens=2))
            assert len(out) == 2
        assert engine.backend.closed
        no_cache = build_engine(settings.model_copy(update={"prefix_cache_blocks": 0}))
        assert no_cache.cache_manager is None and reference(no_cache).cache is None
        no_cache.shutdown()
    finally:
        unregister_plugin("reference-test-plugin")


class _ChunkFaults(ReferenceBackend):
    """``prefill_chunks`` either raises as a whole (``mode="raise"``) or runs every chunk and then reports an
    exception for the prompts holding token 57 (``mode="report"``: the state advanced, yet it failed)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.calls = 0

    def prefill_chunks(self, states, num_tokens):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("the batched forward broke")
        results = super().prefill_chunks(states, num_tokens)
        return [RuntimeError("chunk fault") if 57 in state.prompt_ids else exc for state, exc in zip(states, results)]


@pytest.mark.parametrize("mode", ["raise", "report"])
def test_prefill_chunks_failures_stay_with_their_requests(mode: str) -> None:
    backend = _ChunkFaults(mode)
    with make_engine(backend) as engine:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        with engine._cond:  # the engine thread takes all three in one tick (one prefill_chunks call), even on a busy box
            handles = [engine.submit(prompt, params) for prompt in ([5, 6, 7], [57, 8], [9, 10, 11, 12])]
        outputs = [handle.result(timeout=10) for handle in handles]
        assert backend.calls >= 1
        if mode == "raise":  # every request retried alone and finished
            assert [o.finish_reason for o in outputs] == ["length"] * 3
        else:  # the reported one failed although its state advanced; the others finished
            assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
            assert "chunk fault" in (outputs[1].error or "")
        assert_idle(engine)


def test_recovery_delivers_every_final_event_when_one_abort_fails() -> None:
    """A crashed tick whose abort of one request also raises: the requests aborted before and after it
    still get their final events (no handle hangs) and the engine keeps serving."""
    engine = make_engine()
    broken = engine.scheduler
    step, abort_request = broken.step_decode, broken.abort_request
    crashed = {"step": False, "abort": False}

    def crashing_step(events=None):  # type: ignore[no-untyped-def]
        if not crashed["step"] and len(broken.live_requests()) == 3:
            crashed["step"] = True
            raise RuntimeError("step bug")
        return step(events)

    def flaky_abort(rid, **kwargs):  # type: ignore[no-untyped-def]
        if rid == "b" and not crashed["abort"]:
            crashed["abort"] = True
            raise RuntimeError("abort bug")
        return abort_request(rid, **kwargs)

    broken.step_decode = crashing_step  # type: ignore[method-assign]
    broken.abort_request = flaky_abort  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        with engine._cond:  # all three live at once, even on a busy box
            handles = [engine.submit([5, 6 + i], params, request_id=rid) for i, rid in enumerate("abc")]
        outputs = [handle.result(timeout=5) for handle in handles]
        assert crashed == {"step": True, "abort": True}
        assert [o.finish_reason for o in outputs] == ["error"] * 3
        assert engine.generate([[5]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_a_scheduler_rebuilt_after_a_failed_abort_keeps_the_counters_going_up() -> None:
    """When even abort_all fails, the engine starts a fresh scheduler: its counters continue the old one's (the
    metrics' counters never go back within a process) and the requests failed then count as errors."""
    engine = make_engine()
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.generate([[5, 6, 7]] * 3, params)
        before = engine.stats()
        broken = engine.scheduler

        def boom(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected failure")

        broken.step_prefill = boom  # type: ignore[method-assign]
        broken.abort_all = boom  # type: ignore[method-assign]
        failed = engine.generate([[5, 8]], SamplingParams(max_tokens=2))[0]
        assert failed.finish_reason == "error" and engine.scheduler is not broken
        engine.generate([[5, 9]], params)
        after = engine.stats()
        assert after.finished == {"length": before.finished["length"] + 1, "error": 1}
        assert after.prompt_tokens >= before.prompt_tokens + 2 and after.generated_tokens == before.generated_tokens + 4
        assert after.num_steps > before.num_steps
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_the_first_engine_freezes_the_startup_objects_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The objects alive when the first engine is built (the backend, the libraries) leave the cyclic GC's scans
    (gc.freeze after one collection); later engines do not collect or freeze again."""
    import gc

    from gemmaserve.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "_frozen", False)
    collections: list[int] = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(1) or collect(*args))
    gc.unfreeze()
    try:
        first = make_engine(ReferenceBackend())
        assert collections == [1] and gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        second = make_engine(ReferenceBackend())
        assert collections == [1] and gc.get_freeze_count() == frozen
        first.shutdown()
        second.shutdown()
    finally:
        gc.unfreeze()  # the rest of the test session collects everything again


class _LoggingBackend(ReferenceBackend):
    """Logs prefill lookups and decode steps in order; the first lookup is slow, which widens the window in which
    an engine tick that started early would run without the requests queued after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def prefill_lookup(self, prompt_ids):  # type: ignore[no-untyped-def]
        if not self.log:
            time.sleep(0.05)
        self.log.append("lookup")
        return super().prefill_lookup(prompt_ids)

    def decode_step_batched(self, batched, input_ids):  # type: ignore[no-untyped-def]
        self.log.append("decode")
        return super().decode_step_batched(batched, input_ids)


def test_submit_many_puts_every_request_into_the_same_first_tick() -> None:
    backend = _LoggingBackend()
    engine = make_engine(backend)
    try:
        prompts = [[3 + i, 5, 7, 9] for i in range(6)]
        handles = engine.submit_many(prompts, [SamplingParams(max_tokens=3, ignore_eos=True)] * 6,
                                     [f"r{i}" for i in range(6)])
        outputs = [handle.result(timeout=30) for handle in handles]
        assert [h.request_id for h in handles] == [f"r{i}" for i in range(6)]
        assert all(len(out.token_ids) == 3 for out in outputs)
        assert backend.log.index("decode") == 6, backend.log  # all six looked up before the first decode step
        for prompt, out in zip(prompts, outputs):
            assert out.token_ids == backend.reference_generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_submit_many_validates_everything_before_queueing_anything(engine: Engine) -> None:
    good = [1, 2, 3]
    with pytest.raises(InvalidRequestError):
        engine.submit_many([good, []], [None, None])  # the empty prompt is refused: nothing queued
    with pytest.raises(InvalidRequestError, match="more than once"):
        engine.submit_many([good, good], [None, None], ["same", "same"])
    with pytest.raises(InvalidRequestError, match="2 prompts, 1 params"):
        engine.submit_many([good, good], [None])
    assert engine.stats().waiting == 0 and engine.stats().running == 0
    handles = engine.submit_many([good, good], [SamplingParams(max_tokens=2)] * 2)
    assert all(len(h.result(timeout=30).token_ids) <= 2 for h in handles)
    assert_idle(engine)


def test_submit_many_without_room_for_all_queues_none() -> None:
    engine = make_engine(max_waiting_requests=3)
    try:
        with pytest.raises(EngineOverloadedError, match="this call brings 4"):
            engine.submit_many([[1, 2]] * 4, [LONG] * 4)
        assert engine.stats().waiting == 0
        outputs = engine.generate([[1, 2, 3]] * 5, SamplingParams(max_tokens=2))  # waits for room in pieces
        assert len(outputs) == 5 and all(out.token_ids for out in outputs)
        assert_idle(engine)
    finally:
        engine.shutdown()

def test_a_handle_that_keeps_no_events_is_fed_by_its_callback_alone(engine: Engine) -> None:
    """``keep_events=False`` (the server's streams, ``Engine.stream``, the offline API's watchers): the events go to
    the callback only, the handle holds no backlog (a long stream would grow one) and iterating it says why it
    cannot; ``result()`` works."""
    seen: list[RequestEvent] = []
    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), on_event=seen.append,
                           keep_events=False)
    output = handle.result(timeout=10)
    assert len(output.token_ids) == 5 and seen[-1].finished
    assert [t for e in seen for t in e.new_token_ids] == output.token_ids
    assert handle._events.empty()
    with pytest.raises(TypeError, match="keep_events=False"):
        next(iter(handle))



def test_a_stuck_tick_shows_in_busy_for_and_a_timed_snapshot_gives_up() -> None:
    """A backend call that never returns: ``busy_for`` keeps growing (``/health`` reads it) and ``stats(timeout)``
    raises TimeoutError instead of waiting with it; once the call returns both are back to normal."""
    engine = make_engine()
    gate, entered = threading.Event(), threading.Event()
    step = engine.scheduler.step_decode

    def stuck(events=None):  # type: ignore[no-untyped-def]
        entered.set()
        gate.wait(10)
        return step(events)

    engine.scheduler.step_decode = stuck  # type: ignore[method-assign]
    try:
        assert engine.busy_for() == 0.0
        handle = engine.submit([5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
        assert entered.wait(10)
        time.sleep(0.05)
        assert engine.busy_for() >= 0.05
        with pytest.raises(TimeoutError, match="tick has run for"):
            engine.stats(timeout=0.01)
        gate.set()
        assert handle.result(timeout=10).finish_reason == "length"
        assert engine.stats(timeout=5).running == 0 and engine.busy_for() < 1
    finally:
        gate.set()
        engine.shutdown()


def test_a_cancel_meant_for_a_finished_request_spares_the_next_one_with_its_id() -> None:
    """``cancel("x")`` while "x" finishes in the same tick; a new request then takes the free id "x": the late
    cancel was for the old one and is void, the new one runs to completion."""
    engine = make_engine()
    second: dict[str, Any] = {}
    done = threading.Event()
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    def on_first(event: RequestEvent) -> None:
        if not event.finished and event.new_token_ids:
            assert engine.cancel("x")  # queued for the next tick; "x" finishes in this one (max_tokens=2)
        if event.finished:
            second["handle"] = engine.submit([9, 9, 9], params, request_id="x",
                                             on_event=lambda e: done.set() if e.finished else None)

    try:
        engine.submit([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id="x", on_event=on_first)
        assert done.wait(10)
        output = second["handle"].result(timeout=10)
        assert output.finish_reason == "length" and len(output.token_ids) == 5
        assert_idle(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("params", [{"max_tokens": 3}, "greedy", 3])
def test_params_that_are_not_sampling_params_are_refused_by_name(params: Any) -> None:
    engine = make_engine()
    try:
        with pytest.raises(InvalidRequestError, match=f"must be a gemmaserve.SamplingParams .* got "
                                                      f"{type(params).__name__}"):
            engine.submit([5, 6], params)
        with pytest.raises(InvalidRequestError, match="must be a gemmaserve.SamplingParams"):
            engine.submit_many([[5, 6]], [params])
    finally:
        engine.shutdown()


def test_an_old_handles_cancel_spares_the_new_request_with_its_id() -> None:
    """``old_handle.cancel()`` after "x" finished and a new "x" started: False, and the new one runs on."""
    engine = make_engine()
    try:
        old = engine.submit([5, 6], SamplingParams(max_tokens=2, ignore_eos=True), request_id="x")
        old.result(timeout=10)
        new = engine.submit([5, 7], SamplingParams(max_tokens=5, ignore_eos=True), request_id="x")
        assert old.cancel() is False
        assert new.result(timeout=10).finish_reason == "length"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("params", [{"max_tokens": 3}, {}])
def test_generate_refuses_a_dict_for_params_by_its_type(params: Any) -> None:
    engine = make_engine()
    try:
        with pytest.raises(InvalidRequestError, match="must be a gemmaserve.SamplingParams .* got dict"):
            engine.generate([[5, 6]], params)
    finally:
        engine.shutdown()


def test_a_request_the_engine_thread_has_taken_but_not_added_still_counts_as_waiting() -> None:
    """Between taking the inbox and adding its requests to the scheduler the engine thread holds them: stats()
    counts them as waiting there (it showed 0 waiting and 0 running: a test saw the queued request vanish)."""
    engine = make_engine()
    gate, entered = threading.Event(), threading.Event()
    guarded = engine._guarded

    def held(part):  # type: ignore[no-untyped-def]
        if not entered.is_set():
            entered.set()
            gate.wait(10)
        guarded(part)

    engine._guarded = held  # type: ignore[method-assign]
    try:
        handle = engine.submit([5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
        assert entered.wait(10)
        stats = engine.stats(timeout=5)
        assert stats.waiting + stats.running == 1, stats
        gate.set()
        assert handle.result(timeout=10).finish_reason == "length"
    finally:
        gate.set()
        engine.shutdown()



def create_unfinished_backend(model_path: str, device: str, settings: CoreSettings) -> object:
    from gemmaserve.backend import InferenceBackend

    class Missing(InferenceBackend):  # leaves every abstract method out
        pass

    return Missing()  # type: ignore[abstract]


class _UnfinishedPlugin:
    @hookimpl
    def gemmaserve_register_backends(self, register) -> None:  # type: ignore[no-untyped-def]
        register(BackendSpec("unfinished-test", f"{__name__}:create_unfinished_backend", ("cpu",),
                             description="a backend class missing methods"))


def test_a_backend_class_missing_methods_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third-party backend class that leaves abstract methods out is named with the missing methods, not a bare
    TypeError traceback."""
    from gemmaserve.errors import BackendUnavailableError

    monkeypatch.setattr("gemmaserve.selection.detect_devices", lambda: DeviceReport("cpu", ("cpu",)))
    register_plugin(_UnfinishedPlugin(), "unfinished-test-plugin")
    try:
        with pytest.raises(BackendUnavailableError, match=r"backend 'unfinished-test' .* cannot be built: .*abstract"):
            build_engine(CoreSettings(backend="unfinished-test", device="cpu", model="/no/weights"))
    finally:
        unregister_plugin("unfinished-test-plugin")


def test_a_tick_that_raises_late_still_delivers_what_it_made_before() -> None:
    """A scheduler raise part-way through a tick half: the events made before it (a request that finished earlier
    in the same half included) still reach their handles — they were dropped with the half's local list, so that
    request's handle waited forever."""
    from gemmaserve.engine.scheduler import ContinuousBatchScheduler

    engine = make_engine(ReferenceBackend(mixed_step=True), max_batch_size=4, prefill_chunk_tokens=2,
                         max_num_batched_tokens=4)
    broken = engine.scheduler
    finish_chunks = broken._finish_chunks
    armed = [True]

    def late_bug(work, errors, events):  # type: ignore[no-untyped-def]
        if armed[0] and broken._q.finished.get("length"):  # "short" finished earlier in this tick
            armed[0] = False
            raise RuntimeError("scheduler bug late in the tick")
        return finish_chunks(work, errors, events)

    broken._finish_chunks = late_bug  # type: ignore[method-assign]
    assert isinstance(broken, ContinuousBatchScheduler)
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        with engine._cond:
            short = engine.submit([5, 6], params, request_id="short")
            long_ = engine.submit(list(range(5, 40)), params, request_id="long")
        assert long_.result(timeout=10).finish_reason == "error"
        assert short.result(timeout=10).finish_reason == "length"
        assert not armed[0]
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_requests_aborted_before_a_failed_abort_at_shutdown_finish() -> None:
    """Shutdown's abort_all raising AbortIncompleteError part-way: the requests it did abort get their final events
    (the error's ``events`` were dropped, their handles waited forever)."""
    engine = make_engine(ReferenceBackend(decode_delay_s=0.01))
    broken = engine.scheduler
    abort_request = broken.abort_request
    failed: set[str] = set()

    def flaky_abort(rid, **kwargs):  # type: ignore[no-untyped-def]
        if rid == "b" and rid not in failed:
            failed.add(rid)
            raise RuntimeError("abort of b failed")
        return abort_request(rid, **kwargs)

    broken.abort_request = flaky_abort  # type: ignore[method-assign]
    with engine._cond:
        handles = [engine.submit([5, 6 + i], LONG, request_id=rid) for i, rid in enumerate("ab")]
    while not all(handle.request_id in {r.request_id for r in broken.live_requests()} for handle in handles):
        time.sleep(0.01)
    engine.shutdown(timeout=5)
    outputs = [handle.result(timeout=5) for handle in handles]
    assert failed == {"b"}
    assert outputs[0].finish_reason != "error" and outputs[1].finish_reason == "error", outputs
