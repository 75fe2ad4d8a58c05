"""Unit tests of the connection guards (core/gemmaserve/server/connections.py) that need no server."""

from __future__ import annotations

import logging

import pytest

from gemmaserve.server.connections import AcceptErrorFilter, effective_connection_limit


class _Loop:
    def __init__(self) -> None:
        self.passed: list[dict] = []

    def default_exception_handler(self, context: dict) -> None:
        self.passed.append(context)


def test_accept_errors_are_summarized_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    handler = AcceptErrorFilter(interval=10, clock=lambda: now[0])
    loop = _Loop()
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.WARNING, logger="gemmaserve.server.connections"):
        for _ in range(5000):
            handler(loop, context)
        now[0] = 10.5
        handler(loop, context)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and handler.total == 5001 and not loop.passed
    assert "Too many open files" in lines[0] and "5000 failed accept() calls in the last 10 s" in lines[1]
    handler(loop, {"message": "something else"})  # other loop errors keep their normal handling
    assert loop.passed == [{"message": "something else"}]


def test_the_connection_bound_leaves_descriptors_free() -> None:
    assert effective_connection_limit(2048, 100_000) == 2048
    assert effective_connection_limit(2048, 1024) == 1024 - 64


def test_websocket_upgrade_requests_never_leak_a_connection_slot() -> None:
    """An ``Upgrade: websocket`` request is served as plain HTTP: uvicorn would hand the transport to a WebSocket
    protocol (when ``websockets`` / ``wsproto`` is installed), the guarded protocol never saw the connection end,
    and LIMIT_CONCURRENCY such requests locked every later client out with 503s. Run with a stand-in WebSocket
    protocol class, so the upgrade path exists whatever is installed."""
    import asyncio
    import socket
    import threading
    import time

    import uvicorn

    from gemmaserve.server.connections import ConnectionLimits, guarded_protocol_class

    class _StandInWebSocket(asyncio.Protocol):
        def __init__(self, **kwargs: object) -> None:
            pass

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transport.close()

        def data_received(self, data: bytes) -> None:
            pass

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    limits = ConnectionLimits(timeout_keep_alive=5, header_timeout=5, body_timeout=5, limit_concurrency=3)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=guarded_protocol_class(limits),
                            ws=_StandInWebSocket, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)

        def get(extra: bytes = b"") -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra + b"\r\n")
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
                return data

        upgrade = (b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                   b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
        for _ in range(6):  # twice the bound
            assert get(upgrade).startswith(b"HTTP/1.1 200"), "an upgrade request is served as plain HTTP"
        time.sleep(0.1)
        assert get().startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(10)
