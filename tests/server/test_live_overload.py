"""The real server with MAX_WAITING_REQUESTS=1 and MAX_BATCH_SIZE=1: one request decoding, one
queued, the next one gets 429 with Retry-After (no crash, no hang) and the server recovers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, ServerPool, metric, parse_prometheus, wait_until


@pytest.fixture(scope="module", params=["overload"])
def live_server(request: pytest.FixtureRequest, server_pool: ServerPool) -> Iterator[LiveServer]:
    server = server_pool.take(request.param)
    yield server
    server.stop()


def state(server: LiveServer) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/debug/kv", timeout=30).json()


def test_queue_full_gives_429_with_retry_after(live_server: LiveServer) -> None:
    base = live_server.base_url
    long = {"prompt": "The quick brown fox", "max_tokens": 800, "temperature": 0, "ignore_eos": True}
    queued: dict[str, httpx.Response] = {}
    with httpx.Client(base_url=base, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as running:
            lines = running.iter_lines()  # keep it referenced: a collected iterator closes the connection
            next(line for line in lines if line.startswith("data: {"))

            def send_queued() -> None:
                queued["response"] = httpx.post(f"{base}/v1/completions", timeout=120,
                                                json={"prompt": "queued", "max_tokens": 4, "temperature": 0})

            waiter = threading.Thread(target=send_queued)
            waiter.start()
            wait_until(lambda: state(live_server)["waiting"] == 1, 30, "the second request to queue")
            assert state(live_server)["running"] == 1
            chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            for path, body in (("/v1/completions", {"prompt": "one too many", "max_tokens": 4}),
                               ("/v1/chat/completions", chat)):
                rejected = client.post(path, json=body)
                assert rejected.status_code == 429, rejected.text
                assert int(rejected.headers["retry-after"]) >= 1
                error = rejected.json()["error"]
                assert error["type"] == "rate_limit_error" and "MAX_WAITING_REQUESTS=1" in error["message"]
            assert httpx.get(f"{base}/health").status_code == 200
        waiter.join(timeout=120)  # leaving the stream cancelled the long request; the queued one ran
    assert queued["response"].status_code == 200
    body = queued["response"].json()
    assert 1 <= body["usage"]["completion_tokens"] <= 4 and body["choices"][0]["finish_reason"] in ("length", "stop")
    wait_until(lambda: (s := state(live_server))["running"] + s["waiting"] == 0, 30, "the server to drain")
    report = state(live_server)
    assert report["integrity"] == "ok" and report["finished"].get("cancelled") == 1
    samples = parse_prometheus(httpx.get(f"{base}/metrics").text)
    assert metric(samples, "gemmaserve_requests_total", endpoint="completions", status="429") == 1
    assert metric(samples, "gemmaserve_requests_total", endpoint="chat", status="429") == 1
    after = httpx.post(f"{base}/v1/completions", json={"prompt": "after", "max_tokens": 3}, timeout=60)
    assert after.status_code == 200
