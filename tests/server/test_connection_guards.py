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
