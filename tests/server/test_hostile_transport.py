"""The server under hostile or broken conditions: a hung backend call, withheld request bodies, cross-site bodies
without a Content-Type, slow second requests on a keep-alive connection, clients that never read their stream,
browser CORS preflights. In-process uvicorn servers over the reference engine (no subprocess)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import gemmaserve.server.app as app_module
from gemmaserve.server.app import create_app
from gemmaserve.server.connections import ConnectionLimits, guarded_protocol_class
from gemmaserve.server.metrics import ServerMetrics
from gemmaserve.testing.reference_backend import ReferenceBackend
from server_harness import REFERENCE_MODEL, ThreadedServer, asgi_post, reference_engine, wait_until


class _Wedgeable(ReferenceBackend):
    """A reference backend whose decode step blocks while ``wedge`` is set (a hung GPU kernel)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wedge = threading.Event()
        self.release = threading.Event()

    def decode_step_batched(self, batched: Any, input_ids: Any) -> Any:
        if self.wedge.is_set():
            self.release.wait(30)
        return super().decode_step_batched(batched, input_ids)


class _Slow(ReferenceBackend):
    """A reference backend taking 20 ms per decode step."""

    def decode_step_batched(self, batched: Any, input_ids: Any) -> Any:
        time.sleep(0.02)
        return super().decode_step_batched(batched, input_ids)


def _guarded_server(app: Any, limits: ConnectionLimits) -> ThreadedServer:
    """uvicorn with the production connection guards (``guarded_protocol_class``) serving ``app`` from a thread."""
    return ThreadedServer(app, http=guarded_protocol_class(limits), timeout_keep_alive=limits.timeout_keep_alive)


def _limits(**overrides: Any) -> ConnectionLimits:
    base: dict[str, Any] = {"timeout_keep_alive": 5.0, "header_timeout": 10.0, "body_timeout": 60.0,
                            "limit_concurrency": None}
    return ConnectionLimits(**{**base, **overrides})


def _read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, headers lower-cased, body)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response's headers; got {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


def _post_head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


# -- 1. a hung engine ---------------------------------------------------------------------------------
@pytest.fixture
def wedgeable() -> Iterator[tuple[_Wedgeable, Any, ThreadedServer]]:
    backend = _Wedgeable(max_model_len=512)
    engine = reference_engine(backend, engine_iteration_timeout_s=0.5)
    server = ThreadedServer(create_app(engine, REFERENCE_MODEL, debug_endpoints=True))
    try:
        yield backend, engine, server
    finally:
        backend.release.set()
        server.stop()
        engine.shutdown(timeout=5)


def test_a_hung_backend_call_fails_health_while_metrics_and_debug_kv_answer(
        wedgeable: tuple[_Wedgeable, Any, ThreadedServer], monkeypatch: pytest.MonkeyPatch) -> None:
    backend, engine, server = wedgeable
    base = server.base_url
    monkeypatch.setattr(app_module, "DEBUG_KV_TIMEOUT_S", 0.5, raising=False)
    assert httpx.get(base + "/health").status_code == 200
    assert "vllm:num_requests_running" in httpx.get(base + "/metrics").text  # a snapshot to fall back on
    backend.wedge.set()

    def stuck() -> None:
        try:
            httpx.post(base + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 50}, timeout=60)
        except httpx.HTTPError:
            pass

    threading.Thread(target=stuck, daemon=True).start()
    wait_until(lambda: engine.busy_for() > 0.7, 10, "the engine to be stuck in a decode step")
    health = httpx.get(base + "/health", timeout=5)
    assert health.status_code == 503, health.text
    error = health.json()["error"]
    assert error["code"] == "engine_unavailable" and "ENGINE_ITERATION_TIMEOUT_S=0.5" in error["message"]
    assert health.headers["retry-after"]
    started = time.monotonic()
    scrapes = [httpx.get(base + "/metrics", timeout=10) for _ in range(3)]
    assert time.monotonic() - started < 8  # ~1 s each (METRICS_STATS_TIMEOUT_S), not forever
    assert all(r.status_code == 200 and "vllm:num_requests_running" in r.text for r in scrapes)
    kv = httpx.get(base + "/debug/kv", timeout=10)
    assert kv.status_code == 503 and kv.json()["error"]["code"] == "engine_unavailable", kv.text
    backend.release.set()
    wait_until(lambda: httpx.get(base + "/health").status_code == 200, 10, "/health to recover")
    assert httpx.get(base + "/debug/kv", timeout=10).status_code == 200


def test_metrics_without_any_engine_snapshot_leave_the_engine_families_out() -> None:
    metrics = ServerMetrics("m")

    def stuck(timeout: float | None = None) -> Any:
        raise TimeoutError("the engine's tick has run for 99.0 s")

    metrics.bind_engine(stuck)
    text = metrics.render().decode()
    assert "vllm:num_requests_running" not in text and "vllm:time_to_first_token_seconds" in text


def test_engine_iteration_timeout_reads_vllms_name_and_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemmaserve.errors import ConfigurationError
    from gemmaserve.settings import load_settings

    monkeypatch.setenv("VLLM_ENGINE_ITERATION_TIMEOUT_S", "7.5")
    assert load_settings().engine_iteration_timeout_s == 7.5
    monkeypatch.delenv("VLLM_ENGINE_ITERATION_TIMEOUT_S")
    monkeypatch.setenv("ENGINE_ITERATION_TIMEOUT_S", "0")
    with pytest.raises(ConfigurationError, match="ENGINE_ITERATION_TIMEOUT_S"):
        load_settings()


# -- 6. a server-wide budget of request-body bytes ---------------------------------------------------------
@pytest.fixture
def budget_server() -> Iterator[ThreadedServer]:
    engine = reference_engine(max_buffered_body_bytes=1000)
    server = ThreadedServer(create_app(engine, REFERENCE_MODEL))
    try:
        yield server
    finally:
        server.stop()
        engine.shutdown(timeout=5)


def _padded_completion(size: int) -> bytes:
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    return body + b" " * (size - len(body))


def _refused_for_budget(base: str) -> bool:
    body = json.dumps({"tokens": [1, 2]}) + " " * 250  # 270 bytes: over what a held 800 or 900 leaves
    response = httpx.post(base + "/detokenize", content=body, headers={"Content-Type": "application/json"}, timeout=5)
    if response.status_code != 503:
        assert response.status_code == 200, response.text
        return False
    error = response.json()["error"]
    assert error["code"] == "body_budget_exhausted" and "MAX_BUFFERED_BODY_BYTES=1000" in error["message"]
    assert response.headers["retry-after"] and response.headers["connection"] == "close"
    return True


def test_withheld_bodies_exhaust_the_body_budget_and_give_it_back(budget_server: ThreadedServer) -> None:
    base = budget_server.base_url
    assert not _refused_for_budget(base)
    body = _padded_completion(800)
    with socket.create_connection(("127.0.0.1", budget_server.port)) as idle:
        idle.sendall(_post_head("/v1/completions", len(body)))  # declares 800 bytes, sends none: reserves nothing
        time.sleep(0.3)
        assert not _refused_for_budget(base)  # headers alone cannot lock others out
        with socket.create_connection(("127.0.0.1", budget_server.port)) as sock:
            sock.sendall(_post_head("/v1/completions", len(body)) + body[:790])  # 790 bytes held, 10 withheld
            wait_until(lambda: _refused_for_budget(base), 10, "the withheld body to hold its 790 bytes")
            sock.sendall(body[790:])
            status, _, answer = _read_response(sock)
            assert status == 200, answer
    assert not _refused_for_budget(base)  # released once read
    too_big = httpx.post(base + "/v1/completions", content=_padded_completion(1001),
                         headers={"Content-Type": "application/json"})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "body_too_large"


def test_a_chunked_body_grows_its_reservation_and_releases_it_on_an_early_error(
        budget_server: ThreadedServer) -> None:
    base = budget_server.base_url
    with socket.create_connection(("127.0.0.1", budget_server.port)) as sock:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        sock.sendall(head + b"384\r\n" + b" " * 900 + b"\r\n")  # 900 bytes, then nothing
        wait_until(lambda: _refused_for_budget(base), 10, "the chunked body to hold 900 bytes")
        sock.sendall(b"c8\r\n" + b" " * 200 + b"\r\n")  # past the whole budget: 413, and its bytes go back
        status, _, answer = _read_response(sock)
        assert status == 413, answer
    wait_until(lambda: not _refused_for_budget(base), 10, "the refused body's bytes to be given back")


# -- 3. a cross-site body without a Content-Type ----------------------------------------------------------
@pytest.fixture
def client() -> Iterator[tuple[Any, Any]]:
    from fastapi.testclient import TestClient

    engine = reference_engine()
    try:
        yield TestClient(create_app(engine, REFERENCE_MODEL), raise_server_exceptions=False), engine
    finally:
        engine.shutdown(timeout=10)


@pytest.mark.parametrize("headers", [{"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                                     {"Sec-Fetch-Site": "same-site"}, {"Origin": "null", "Sec-Fetch-Site": "none"}])
def test_a_web_page_body_without_a_content_type_runs_nothing(client: tuple[Any, Any],
                                                              headers: dict[str, str]) -> None:
    """A no-cors fetch with a Blob body has no Content-Type and no preflight: it must not run a generation."""
    test_client, engine = client
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        response = test_client.post(path, content=body, headers=headers)
        assert response.status_code == 415, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]
    assert engine.stats().finished == {}


def test_a_plain_client_without_a_content_type_still_works(client: tuple[Any, Any]) -> None:
    test_client, _ = client
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    assert test_client.post("/v1/completions", content=body).status_code == 200
    assert test_client.post("/v1/completions", content=body, headers={"Sec-Fetch-Site": "same-origin"}).status_code \
        == 200  # a same-origin page without an Origin header (browsers send one on POST: refused above)
    assert test_client.post("/v1/completions", json=json.loads(body), headers={"Origin": "http://localhost:8000"}) \
        .status_code == 200  # a page that declares its JSON is CORS's business, not this guard's


# -- 2. a slow second request on a keep-alive connection ------------------------------------------------
def test_a_slow_second_request_on_a_keep_alive_connection_gets_the_408() -> None:
    engine = reference_engine()
    server = _guarded_server(create_app(engine, REFERENCE_MODEL), _limits(timeout_keep_alive=8.0, header_timeout=1.0))
    try:
        request = b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request)
            assert _read_response(sock)[0] == 200
            started = time.monotonic()
            sock.settimeout(0.2)
            received = b""
            for byte in request[:-2]:  # never finishes its headers
                try:
                    sock.sendall(bytes([byte]))
                    received += sock.recv(65536)
                except (socket.timeout, TimeoutError):
                    continue
                except OSError:
                    break
                if b"\r\n\r\n" in received:
                    break
        assert received.startswith(b"HTTP/1.1 408"), received
        assert json.loads(received.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert time.monotonic() - started < 5
    finally:
        server.stop()
        engine.shutdown(timeout=5)


# -- 7. a client that never reads its stream ---------------------------------------------------------------
def test_a_stream_whose_client_stops_reading_is_cancelled_and_its_connection_dropped() -> None:
    from gemmaserve.server.connections import ABORT_KEY

    engine = reference_engine(_Slow(max_model_len=512), stream_stall_timeout_s=0.5)  # 400 tokens take 8 s
    app = create_app(engine, REFERENCE_MODEL)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()

    async def full_socket(message: dict[str, Any], sent: list[dict[str, Any]]) -> None:
        if message["type"] == "http.response.body" and len(sent) >= 3:
            await asyncio.Event().wait()  # its socket is full: sending never completes

    async def serve_one() -> tuple[bool, list[dict[str, Any]]]:
        aborted = asyncio.Event()
        sent = await asgi_post(app, "/v1/completions", body, full_socket, {ABORT_KEY: aborted.set}, 10)
        return aborted.is_set(), sent

    try:
        aborted, sent = asyncio.run(serve_one())
        assert aborted and sent[0]["status"] == 200
        wait_until(lambda: engine.stats().running == 0 and engine.stats().finished.get("cancelled") == 1, 10,
                   "the stalled stream's engine request to be cancelled")
        counted = app.state.metrics.render().decode()
        assert 'gemmaserve_requests_total{endpoint="completions",status="499"} 1.0' in counted
    finally:
        engine.shutdown(timeout=5)


# -- 4, 5. CORS for browser SDKs, and every answer in the error JSON -------------------------------------------
def _cors_client(**kwargs: Any) -> tuple[Any, Any]:
    from fastapi.testclient import TestClient

    engine = reference_engine()
    app = create_app(engine, REFERENCE_MODEL, allowed_origins=["https://app.example"], **kwargs)
    return TestClient(app, raise_server_exceptions=False), engine


_SDK_PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                  "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-lang"}


def test_the_openai_js_sdks_preflight_passes_by_default_without_credentials() -> None:
    client, engine = _cors_client()
    try:
        response = client.options("/v1/chat/completions", headers=_SDK_PREFLIGHT)
        assert response.status_code == 200, response.text
        assert "x-stainless-os" in response.headers["access-control-allow-headers"]
        assert "access-control-allow-credentials" not in response.headers
    finally:
        engine.shutdown(timeout=5)


def test_cors_headers_methods_and_credentials_are_settable_and_refusals_are_json() -> None:
    client, engine = _cors_client(allowed_headers=["authorization", "content-type"], allowed_methods=["POST"],
                                  allow_credentials=True)
    try:
        refused = client.options("/v1/chat/completions", headers=_SDK_PREFLIGHT)
        assert refused.status_code == 400 and refused.headers["content-type"] == "application/json"
        error = refused.json()["error"]
        assert error["code"] == "cors_refused" and "headers" in error["message"]
        assert "--allowed-headers" in error["message"]
        ok = client.options("/v1/chat/completions", headers={**_SDK_PREFLIGHT,
                                                             "Access-Control-Request-Headers": "content-type"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-credentials"] == "true"
        wrong_origin = client.options("/v1/completions", headers={**_SDK_PREFLIGHT, "Origin": "https://evil.example"})
        assert wrong_origin.status_code == 400 and "origin" in wrong_origin.json()["error"]["message"]
    finally:
        engine.shutdown(timeout=5)


def test_cors_settings_are_read_and_credentials_refuse_any_origin(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemmaserve.cli import build_parser, _replica_flags
    from gemmaserve.errors import ConfigurationError
    from gemmaserve.settings import load_settings

    settings = load_settings(allowed_headers="authorization", allowed_methods="GET", allow_credentials=True,
                             allowed_origins="https://app.example")
    assert (settings.allowed_headers, settings.allowed_methods, settings.allow_credentials) == \
        ("authorization", "GET", True)
    assert load_settings().allowed_headers == "*" and not load_settings().allow_credentials
    with pytest.raises(ConfigurationError, match="ALLOWED_ORIGINS='\\*'"):
        load_settings(allow_credentials=True, allowed_origins="*")
    args = build_parser().parse_args(["serve", "--allowed-headers", "x", "--allow-credentials", "--allowed-methods",
                                      "GET", "--stream-stall-timeout-s", "5"])
    assert _replica_flags(args) == ["--stream-stall-timeout-s=5.0"]  # CORS is the data-parallel router's


def test_a_trailing_slash_is_a_json_404_not_an_empty_redirect(client: tuple[Any, Any]) -> None:
    test_client, engine = client
    response = test_client.post("/v1/completions/", json={"prompt": [1], "max_tokens": 1}, follow_redirects=False)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error", response.text
    assert engine.stats().finished == {}


def test_a_slow_reader_that_keeps_taking_bytes_is_not_cut() -> None:
    """Each send waits 1.5 s, three times STREAM_STALL_TIMEOUT_S, but the client keeps taking bytes (the unsent
    count shrinks): the stream runs to its end, nothing is aborted."""
    from gemmaserve.server.connections import ABORT_KEY, UNSENT_KEY

    engine = reference_engine(_Slow(max_model_len=512), stream_stall_timeout_s=0.5)
    app = create_app(engine, REFERENCE_MODEL)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "ignore_eos": True}).encode()

    async def serve_one() -> tuple[bool, list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        ended = asyncio.Event()

        def unsent() -> int:  # a byte taken every millisecond, the rest at once after the response's end
            return 0 if ended.is_set() else max(0, 10**7 - int((loop.time() - started) * 1000))

        async def slow_reader(message: dict[str, Any], sent: list[dict[str, Any]]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                await asyncio.sleep(1.5)  # a slow reader: the buffer drains, slowly
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended.set()

        aborted = asyncio.Event()
        sent = await asgi_post(app, "/v1/completions", body, slow_reader, {ABORT_KEY: aborted.set, UNSENT_KEY: unsent}, 30)
        return aborted.is_set(), sent

    try:
        aborted, sent = asyncio.run(serve_one())
        assert not aborted and sent[0]["status"] == 200
        assert b"[DONE]" in b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    finally:
        engine.shutdown(timeout=5)
