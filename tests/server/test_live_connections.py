"""Idle, slow and too many clients against the real server (raw sockets, a `gemmaserve serve` subprocess with
TIMEOUT_KEEP_ALIVE=2, CLIENT_HEADER_TIMEOUT=CLIENT_BODY_TIMEOUT=1.5, LIMIT_CONCURRENCY=3 and 256 file descriptors):
a silent connection is closed, a request that trickles its headers or body gets a 408 and is closed, a
connection past the bound gets a clean 503, and running out of file descriptors logs one line, not a flood."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from server_harness import LiveServer, ServerPool, wait_until

HEADER_TIMEOUT = 1.5
BODY_TIMEOUT = 1.5
KEEP_ALIVE = 2.0


@pytest.fixture(scope="module", params=["guarded"])
def live_server(request: pytest.FixtureRequest, server_pool: ServerPool) -> Iterator[LiveServer]:
    server = server_pool.take(request.param)
    yield server
    server.stop()


def connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (monotonic) it closed."""
    data = b""
    sock.settimeout(limit_s)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data, time.monotonic()
        data += chunk


def response_json(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return status, headers, json.loads(body)


def trickle_until_closed(sock: socket.socket, pieces: Iterator[bytes]) -> tuple[bytes, float]:
    """Send one piece every 0.25 s until the server answers (a JSON body arrived) or hangs up; then everything
    it sent and when it closed the connection."""
    sock.settimeout(0.25)
    received = b""
    for piece in pieces:
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        with contextlib.suppress(socket.timeout):
            chunk = sock.recv(65536)
            received += chunk
            if not chunk or b"}" in received:
                break
    rest, closed = read_until_closed(sock)
    return received + rest, closed


def test_a_silent_connection_is_closed_after_the_keep_alive_timeout(live_server: LiveServer) -> None:
    with connect(live_server) as sock:
        start = time.monotonic()
        data, closed = read_until_closed(sock)
    assert data == b""
    assert KEEP_ALIVE - 0.5 <= closed - start < KEEP_ALIVE + 3, closed - start


def test_headers_trickled_past_the_header_timeout_get_408_and_close(live_server: LiveServer) -> None:
    with connect(live_server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        # a header line every 0.25 s: each byte would reset an idle timer, not this one
        raw, closed = trickle_until_closed(sock, (f"X-Slow-{i}: 1\r\n".encode() for i in range(40)))
    status, headers, body = response_json(raw)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout" and "headers" in body["error"]["message"]
    assert HEADER_TIMEOUT - 0.3 <= closed - start < HEADER_TIMEOUT + 3, closed - start


def _completions_by_status(live_server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{live_server.base_url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'gemmaserve_requests_total\{endpoint="completions",status="(\d+)"\} (\S+)', text)}


def test_a_body_trickled_past_the_body_timeout_gets_408_and_close(live_server: LiveServer) -> None:
    body = json.dumps({"prompt": "hello", "max_tokens": 1}).encode()
    counted = _completions_by_status(live_server)
    with connect(live_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body) + 100}\r\n\r\n".encode() + body)
        start = time.monotonic()
        # one byte every 0.25 s, never reaching Content-Length in time
        raw, closed = trickle_until_closed(sock, (b" " for _ in range(40)))
    status, headers, error = response_json(raw)
    assert status == 408 and headers["connection"] == "close"
    assert error["error"]["code"] == "request_timeout" and "body" in error["error"]["message"]
    assert BODY_TIMEOUT - 0.3 <= closed - start < BODY_TIMEOUT + 3, closed - start
    assert httpx.get(f"{live_server.base_url}/health", timeout=10).status_code == 200
    after = _completions_by_status(live_server)  # counted as the 408 it was answered, not as a client gone (499)
    assert after.get("408", 0) == counted.get("408", 0) + 1 and after.get("499", 0) == counted.get("499", 0), after


def test_a_connection_past_the_bound_gets_a_clean_503(live_server: LiveServer) -> None:
    held = [connect(live_server) for _ in range(3)]  # LIMIT_CONCURRENCY=3, all idle
    try:
        time.sleep(0.2)  # let the server accept them
        with connect(live_server) as extra:
            extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            raw, _ = read_until_closed(extra)
        status, headers, body = response_json(raw)
        assert status == 503 and headers["connection"] == "close" and int(headers["retry-after"]) >= 1
        assert body["error"]["code"] == "too_many_connections"
        assert "LIMIT_CONCURRENCY" in body["error"]["message"]
        with connect(live_server) as extra:  # a liveness probe still gets its answer, on a connection then closed
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            raw, _ = read_until_closed(extra)
        status, headers, body = response_json(raw)
        assert status == 200 and headers["connection"] == "close" and body == {"status": "ok"}
        with connect(live_server) as extra:  # refused there for another reason: still closed after the answer
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: evil.example\r\n\r\n")
            raw, _ = read_until_closed(extra)
        status, headers, body = response_json(raw)
        assert status == 400 and headers["connection"] == "close" and body["error"]["code"] == "invalid_host"
    finally:
        for sock in held:
            sock.close()
    # the held connections are gone: a new one is served again
    wait_until(lambda: httpx.get(f"{live_server.base_url}/health", timeout=10).status_code == 200, 10,
               "the server to serve a new connection")


def test_running_out_of_file_descriptors_logs_one_line_not_a_flood(live_server: LiveServer) -> None:
    before = live_server.log_path.stat().st_size
    sockets = []
    try:
        for _ in range(400):  # more than the server's 256 file descriptors; they wait in the listen backlog
            sockets.append(socket.create_connection(("127.0.0.1", live_server.port), timeout=10))
        time.sleep(3)
        live_server.log_tail()  # flushes
        grown = live_server.log_path.read_bytes()[before:].decode(errors="replace")
    finally:
        for sock in sockets:
            sock.close()
    assert "cannot accept new connections" in grown, grown[-2000:]
    assert "Traceback" not in grown and len(grown) < 4000, (len(grown), grown[:2000])
    wait_until(lambda: httpx.get(f"{live_server.base_url}/health", timeout=10).status_code == 200, 20,
               "the server to serve again once the clients are gone")
