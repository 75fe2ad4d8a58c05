"""Delivering a response: a client that never reads a non-streamed body is cut like a stalled stream, the request
body is not kept once parsed, and building a large body does not stop the event loop (other streams keep flowing).
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from typing import Any

import httpx
import pytest
from server_harness import REFERENCE_MODEL, ThreadedServer, asgi_post, reference_engine, wait_until

from gemmaserve.server.app import create_app
from gemmaserve.server.connections import ABORT_KEY, UNSENT_KEY
from gemmaserve.testing.reference_backend import ReferenceBackend


class _Slow(ReferenceBackend):
    """A reference backend taking ``delay`` seconds per decode step."""

    def __init__(self, delay: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay = delay

    def decode_step_batched(self, batched: Any, input_ids: Any) -> Any:
        time.sleep(self.delay)
        return super().decode_step_batched(batched, input_ids)


async def _call(app: Any, path: str, body: bytes, send_pace: Any, state: dict[str, Any],
                timeout_s: float) -> list[dict[str, Any]]:
    """:func:`asgi_post` with a pace that sees only the message."""
    return await asgi_post(app, path, body, lambda message, sent: send_pace(message), state, timeout_s)


async def _into_buffer(message: dict[str, Any]) -> None:
    """uvicorn's send of a body: written into the transport's buffer whole, the send returns at once."""


async def _full_socket(message: dict[str, Any]) -> None:
    """A send that never completes once the body goes out (the socket and the write buffer are full)."""
    if message["type"] == "http.response.body":
        await asyncio.Event().wait()


@pytest.mark.parametrize("pace", [_into_buffer, _full_socket], ids=["body-buffered", "socket-full"])
def test_a_client_that_never_reads_a_full_response_is_dropped_and_counted_499(pace: Any) -> None:
    """A non-streamed answer to a client that takes none of it held the connection (and the body) for ever: the
    stream's STREAM_STALL_TIMEOUT_S rule now applies to it too."""
    engine = reference_engine(stream_stall_timeout_s=0.3)
    app = create_app(engine, REFERENCE_MODEL)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}).encode()

    async def serve_one() -> tuple[bool, list[dict[str, Any]]]:
        aborted = asyncio.Event()
        state = {ABORT_KEY: aborted.set, UNSENT_KEY: lambda: 10**6}  # a megabyte stays unread
        sent = await _call(app, "/v1/completions", body, pace, state, 10)
        return aborted.is_set(), sent

    try:
        aborted, sent = asyncio.run(serve_one())
        assert aborted and sent[0]["status"] == 200
        counted = app.state.metrics.render().decode()
        assert 'gemmaserve_requests_total{endpoint="completions",status="499"} 1.0' in counted
        assert 'status="200"' not in counted
    finally:
        engine.shutdown(timeout=5)


def test_tokenize_answers_are_guarded_too() -> None:
    engine = reference_engine(stream_stall_timeout_s=0.3)
    app = create_app(engine, REFERENCE_MODEL)

    async def serve_one() -> bool:
        aborted = asyncio.Event()
        state = {ABORT_KEY: aborted.set, UNSENT_KEY: lambda: 10**6}
        await _call(app, "/tokenize", json.dumps({"prompt": "abc " * 50}).encode(), _into_buffer, state, 10)
        return aborted.is_set()

    try:
        assert asyncio.run(serve_one())
    finally:
        engine.shutdown(timeout=5)


def test_a_slow_reader_of_a_full_response_is_not_cut() -> None:
    """The client takes the buffered body slowly (the unsent count shrinks for 1.2 s, four stall timeouts): the
    response completes and counts 200."""
    engine = reference_engine(stream_stall_timeout_s=0.3)
    app = create_app(engine, REFERENCE_MODEL)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}).encode()

    async def serve_one() -> bool:
        loop = asyncio.get_running_loop()
        written: list[float] = []

        async def write(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                written.append(loop.time())

        def unsent() -> int:  # 1,200 bytes taken at one a millisecond from the body's write on
            return 0 if not written else max(0, 1200 - int((loop.time() - written[0]) * 1000))

        aborted = asyncio.Event()
        await _call(app, "/v1/completions", body, write, {ABORT_KEY: aborted.set, UNSENT_KEY: unsent}, 10)
        assert unsent() == 0
        return aborted.is_set()

    try:
        assert not asyncio.run(serve_one())
        counted = app.state.metrics.render().decode()
        assert 'gemmaserve_requests_total{endpoint="completions",status="200"} 1.0' in counted
    finally:
        engine.shutdown(timeout=5)


@pytest.mark.parametrize("padding", [0, 2000], ids=["parsed-on-the-loop", "parsed-on-a-thread"])
def test_the_request_body_is_dropped_once_parsed(monkeypatch: pytest.MonkeyPatch, padding: int) -> None:
    """The body's bytes left MAX_BUFFERED_BODY_BYTES' count once read, but the handler kept them referenced until
    the answer was sent: now nothing holds them while the request runs (bodies over OFFLOAD_BODY_BYTES are parsed
    on a preparation thread)."""
    import gemmaserve.server.app as app_module

    freed = threading.Event()

    class Tracked(bytes):
        def __del__(self) -> None:
            freed.set()

    real_read_body = app_module.read_body

    async def tracked_read_body(*args: Any, **kwargs: Any) -> bytes:
        return Tracked(await real_read_body(*args, **kwargs))

    monkeypatch.setattr(app_module, "read_body", tracked_read_body)
    from fastapi.testclient import TestClient

    engine = reference_engine(_Slow(0.02, max_model_len=512))
    client = TestClient(create_app(engine, REFERENCE_MODEL))
    results: list[int] = []
    caller = threading.Thread(target=lambda: results.append(client.post(
        "/v1/completions", json={"prompt": "a" * 100, "max_tokens": 150, "ignore_eos": True,
                                 "user": "u" * padding}).status_code))
    try:
        caller.start()
        wait_until(lambda: engine.stats().running == 1, 10, "the request to run")
        gc.collect()
        assert freed.is_set(), "the request body is still referenced while the request runs"
        assert engine.stats().running == 1
        caller.join(30)
        assert results == [200]
    finally:
        caller.join(30)
        engine.shutdown(timeout=5)


def test_carried_text_fields_are_bounded(ref: Any) -> None:
    from gemmaserve.server.protocol import MAX_CARRIED_TEXT_CHARS

    client, _ = ref
    ok = {"prompt": "hi", "max_tokens": 1}
    long_text = "u" * (MAX_CARRIED_TEXT_CHARS + 1)
    refused = client.post("/v1/completions", json={**ok, "user": long_text})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "user" and str(MAX_CARRIED_TEXT_CHARS) in error["message"]
    assert client.post("/v1/completions", json={**ok, "user": long_text[:-1]}).status_code == 200
    for key in ("name", "description"):
        schema = {"type": "json_schema", "json_schema": {key: long_text, "schema": {"type": "object"}}}
        refused = client.post("/v1/completions", json={**ok, "response_format": schema})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "response_format", refused.text
        assert f"json_schema.{key}" in error["message"] and str(MAX_CARRIED_TEXT_CHARS) in error["message"]


def test_other_streams_keep_flowing_while_a_large_body_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-streamed body with many log-probabilities took seconds to build and encode on the event loop, and
    every other stream stopped meanwhile; a slow builder (1 s) now runs on a preparation thread."""
    import gemmaserve.server.app as app_module

    real_full_body = app_module._View.full_body

    def slow_full_body(self: Any) -> dict[str, Any]:
        time.sleep(1.0)
        return real_full_body(self)

    monkeypatch.setattr(app_module._View, "full_body", slow_full_body)
    engine = reference_engine(_Slow(0.01, max_model_len=512))
    server = ThreadedServer(create_app(engine, REFERENCE_MODEL))
    arrivals: list[float] = []

    def stream() -> None:
        body = {"prompt": [1, 2, 3], "max_tokens": 350, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", server.base_url + "/v1/completions",
                                                           json=body) as response:
            for line in response.iter_lines():
                if line:
                    arrivals.append(time.monotonic())

    streamer = threading.Thread(target=stream)
    try:
        streamer.start()
        wait_until(lambda: len(arrivals) >= 5, 20, "the stream to start")
        started = time.monotonic()
        # 100 tokens with 20 alternatives: 2,200 units, over OFFLOAD_RESPONSE_UNITS
        big = {"prompt": [4, 5, 6], "max_tokens": 100, "ignore_eos": True, "logprobs": 20}
        response = httpx.post(server.base_url + "/v1/completions", json=big, timeout=60)
        ended = time.monotonic()
        assert response.status_code == 200 and len(response.json()["choices"][0]["logprobs"]["tokens"]) == 100
        streamer.join(60)
        after = [t for t in arrivals if t > ended]
        assert after, "the stream ended before the body was built: the test proves nothing"
        during = [t for t in arrivals if started <= t <= ended] + after[:1]  # the chunk a stall held back included
        gaps = [b - a for a, b in zip(during, during[1:])]
        assert during and max(gaps) < 0.5, f"the stream stalled {max(gaps):.2f} s while the body was built"
    finally:
        streamer.join(60)
        server.stop()
        engine.shutdown(timeout=5)
