"""The engine thread ending on something its ticks' guard does not catch (a ``BaseException``): every request it
knows ends with an error event (blocking handles, async streams, HTTP streams), later submissions are refused, and
nobody waits forever."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gemmaserve.engine import Engine
from gemmaserve.engine.request import FinishReason
from gemmaserve.errors import EngineOverloadedError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings
from gemmaserve.testing.reference_backend import ReferenceBackend

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


class ThreadKiller(BaseException):
    """Not an ``Exception``: the tick's guard lets it through, so it ends the engine thread."""


class DyingBackend(ReferenceBackend):
    """Decodes normally until ``arm()``; the next decode step raises :class:`ThreadKiller`."""

    def __init__(self, **options: Any) -> None:
        super().__init__(decode_delay_s=0.002, **options)
        self.armed = threading.Event()
        self.decodes = 0

    def arm(self) -> None:
        self.armed.set()

    def decode_step_batched(self, batched: Any, input_ids: Any) -> list[list[float]]:
        self.decodes += 1
        if self.armed.is_set():
            raise ThreadKiller("simulated death of the engine thread")
        return super().decode_step_batched(batched, input_ids)


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """The engine thread re-raises what killed it; collect it instead of letting pytest warn."""
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def dying_engine(**overrides: int) -> tuple[Engine, DyingBackend]:
    backend = DyingBackend()
    cache = CacheManager(64, 4)
    backend.set_cache_adapter(cache)
    values = {"max_batch_size": 2, "prefill_chunk_tokens": 8, "max_active_kv_tokens": 8192, **overrides}
    return Engine(backend, CoreSettings(**values), cache), backend


def wait_for_decoding(backend: DyingBackend) -> None:
    for _ in range(5000):
        if backend.decodes >= 3:
            return
        threading.Event().wait(0.001)
    raise AssertionError("the engine never decoded")


def test_blocking_handles_end_with_the_error_and_new_requests_are_refused(thread_errors: list[BaseException]) -> None:
    engine, backend = dying_engine()  # two rows run, the third request waits for one
    try:
        handles = [engine.submit([1, 2, 3 + i], LONG) for i in range(3)]
        wait_for_decoding(backend)
        backend.arm()
        outputs = [handle.result(timeout=10) for handle in handles]
        assert [o.finish_reason for o in outputs] == [FinishReason.ERROR] * 3
        assert all("simulated death" in (o.error or "") for o in outputs)
        assert any(o.token_ids for o in outputs)  # the running rows keep what they had produced
        assert not engine.is_alive()
        with pytest.raises(EngineOverloadedError, match="shut down"):
            engine.submit([1, 2], SamplingParams(max_tokens=2))
        assert engine._thread is not None
        engine._thread.join(timeout=10)
        assert not engine._thread.is_alive()
        assert [type(exc) for exc in thread_errors] == [ThreadKiller]
    finally:
        engine.shutdown(timeout=10)


def test_an_async_stream_gets_its_final_error_event(thread_errors: list[BaseException]) -> None:
    engine, backend = dying_engine()

    async def consume() -> list[Any]:
        events = []
        async for event in engine.stream([5, 6, 7], LONG):
            events.append(event)
            if len(events) == 2:
                backend.arm()
        return events

    try:
        events = asyncio.run(asyncio.wait_for(consume(), timeout=10))
        assert events[-1].finished and events[-1].output.finish_reason is FinishReason.ERROR
        assert "simulated death" in (events[-1].output.error or "")
    finally:
        engine.shutdown(timeout=10)


def test_an_http_stream_ends_with_an_error_instead_of_hanging(thread_errors: list[BaseException]) -> None:
    from server_harness import REFERENCE_MODEL, ThreadedServer, reference_engine

    from gemmaserve.server.app import create_app

    backend = DyingBackend(max_model_len=512)
    engine = reference_engine(backend)
    server = ThreadedServer(create_app(engine, REFERENCE_MODEL))
    try:
        body = {"model": REFERENCE_MODEL, "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        chunks: list[str] = []
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=20) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[len("data: "):])
                    if len(chunks) == 2:
                        backend.arm()
        assert chunks[-1] == "[DONE]"
        error = json.loads(chunks[-2])
        assert "simulated death" in error["error"]["message"], error
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503
        refused = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False}, timeout=5)
        assert refused.status_code in (429, 503), refused.text
    finally:
        server.stop()
        engine.shutdown(timeout=10)


def test_a_callback_that_kills_the_thread_does_not_strand_the_others(thread_errors: list[BaseException]) -> None:
    """Three requests finish in the same tick; the middle one's callback raises a BaseException: the other two
    still get their real final events, and the engine stops taking requests."""
    engine, _ = dying_engine(max_batch_size=4)
    seen: list[str] = []

    def killer(event: Any) -> None:
        if event.finished:
            raise ThreadKiller("a callback ended the thread")

    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        handles = engine.submit_many([[1, 2, 3], [1, 2, 4], [1, 2, 5]], [params] * 3,
                                     on_events=[lambda e: seen.append(e.request_id), killer, None])
        outputs = [handle.result(timeout=10) for handle in handles]
        assert [o.finish_reason for o in outputs] == [FinishReason.LENGTH] * 3
        assert [len(o.token_ids) for o in outputs] == [3, 3, 3]
        assert seen.count(handles[0].request_id) >= 2  # its callback saw its tokens and its final event
        assert engine._thread is not None
        engine._thread.join(timeout=10)
        assert not engine.is_alive()
        assert [type(exc) for exc in thread_errors] == [ThreadKiller]
    finally:
        engine.shutdown(timeout=10)


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Iterator[None]:
    yield
    assert not [t for t in threading.enumerate() if t.name == "gemmaserve-engine" and t.is_alive()]
