"""Real sockets (uvicorn in a thread) over the reference backend: a client that disconnects
cancels its request and every KV row and reservation is freed; a full queue answers 429 with
Retry-After and the server keeps working."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import ThreadedServer, metric, parse_prometheus, reference_engine, wait_until

from gemmaserve.engine.engine import Engine
from gemmaserve.server.app import create_app
from gemmaserve.testing.reference_backend import ReferenceBackend

SLOW_DECODE_S = 0.01
LONG = {"prompt": "a long generation", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def served() -> Iterator[tuple[ThreadedServer, Engine, ReferenceBackend]]:
    backend = ReferenceBackend(kv_capacity_tokens=4096, decode_delay_s=SLOW_DECODE_S)
    engine = reference_engine(backend, max_batch_size=1, max_waiting_requests=1)
    server = ThreadedServer(create_app(engine, "tiny-ref"))
    yield server, engine, backend
    server.stop()
    engine.shutdown(timeout=10)


def assert_all_freed(engine: Engine, backend: ReferenceBackend) -> None:
    wait_until(lambda: engine.stats().running + engine.stats().waiting == 0, 10, "the engine to drop the request")
    engine.check_integrity()
    with backend.lock:
        backend.check_integrity()
        assert backend.num_live_rows == 0, "row KV leaked"
        assert backend.num_reservations == 0, "KV reservation leaked"


def test_stream_disconnect_cancels_and_frees_kv(served: Any) -> None:
    server, engine, backend = served
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(3):
                assert next(line for line in lines if line.startswith("data: "))
            with backend.lock:
                assert backend.num_live_rows == 1 and backend.num_reservations == 1
    assert_all_freed(engine, backend)
    assert engine.stats().finished == {"cancelled": 1}
    samples = parse_prometheus(httpx.get(f"{server.base_url}/metrics").text)
    assert metric(samples, "gemmaserve_requests_total", endpoint="completions", status="499") == 1
    assert metric(samples, "gemmaserve_request_finished_total", reason="cancelled") == 1
    # it produced tokens (counted as they came) but never reached its end: no end-to-end latency of a request
    labels = {"model_name": "tiny-ref", "engine": "0"}
    assert metric(samples, "vllm:time_to_first_token_seconds_count", **labels) == 1
    assert metric(samples, "vllm:e2e_request_latency_seconds_count", **labels) == 0


def test_non_streaming_disconnect_cancels_and_frees_kv(served: Any) -> None:
    server, engine, backend = served
    # the client gives up after 2 s, well inside the ~4 s generation and long after the request was admitted
    # (with 0.5 s a loaded CI box could time out before the server had submitted it: nothing to cancel)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=2.0))
    assert_all_freed(engine, backend)
    assert engine.stats().finished == {"cancelled": 1}
    report = httpx.get(f"{server.base_url}/debug/kv").json()
    assert report["integrity"] == "ok" and report["live_rows"] == 0 and report["kv"]["tokens_reserved"] == 0


@contextlib.contextmanager
def running_and_queued(server: ThreadedServer, engine: Engine, client: httpx.Client) -> Iterator[dict[str, Any]]:
    """A long stream decoding (a batch of one: full) and a request waiting behind it; on exit the stream is closed
    and the waiting request's response is under "queued" in the yielded dict."""
    results: dict[str, Any] = {}
    with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
        lines = running.iter_lines()  # keep it referenced: a collected iterator closes the connection
        next(line for line in lines if line.startswith("data: "))  # admitted, decoding

        def queued() -> None:
            results["queued"] = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                                           json={"prompt": "queued", "max_tokens": 3})

        waiter = threading.Thread(target=queued)
        waiter.start()
        wait_until(lambda: engine.stats().waiting == 1, 10, "the second request to queue")
        yield results
    waiter.join(timeout=30)


def test_full_queue_gives_429_with_retry_after(served: Any) -> None:
    server, engine, backend = served
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with running_and_queued(server, engine, client) as results:
            rejected = client.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 3})
            assert rejected.status_code == 429, rejected.text
            assert rejected.headers["retry-after"] == "1"
            error = rejected.json()["error"]
            assert error["type"] == "rate_limit_error" and "MAX_WAITING_REQUESTS" in error["message"]
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert chat.status_code == 429
    assert results["queued"].status_code == 200
    assert results["queued"].json()["usage"]["completion_tokens"] >= 1
    assert_all_freed(engine, backend)
    assert httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "after", "max_tokens": 2}).status_code == 200


def test_choices_that_do_not_all_fit_the_queue_are_refused_together() -> None:
    """n choices are queued together: with room for two and n=3, the request gets 429 and none of its choices
    was queued (nothing cancelled, the waiting request untouched); with room for all three they all run."""
    backend = ReferenceBackend(kv_capacity_tokens=4096, decode_delay_s=SLOW_DECODE_S)
    engine = reference_engine(backend, max_batch_size=1, max_waiting_requests=3)
    server = ThreadedServer(create_app(engine, "tiny-ref"))
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            with running_and_queued(server, engine, client) as results:
                rejected = client.post("/v1/completions", json={"prompt": "three", "max_tokens": 3, "n": 3})
                assert rejected.status_code == 429, rejected.text
                assert engine.stats().waiting == 1 and "cancelled" not in engine.stats().finished
        assert results["queued"].status_code == 200
        both = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                          json={"prompt": "three", "max_tokens": 3, "n": 3})
        assert both.status_code == 200 and len(both.json()["choices"]) == 3
        assert engine.stats().finished.get("cancelled", 0) == 1  # the stream this test closed, nothing else
        assert_all_freed(engine, backend)
    finally:
        server.stop()
        engine.shutdown(timeout=10)
