"""A graceful drain on SIGTERM (a `gemmaserve serve` subprocess with SHUTDOWN_TIMEOUT=3 whose decode steps take
20 ms, so a 20-token stream ends in ~0.4 s and a 600-token one would need ~12 s): a stream open at SIGTERM that
ends within the timeout completes normally; one that cannot is cancelled at the timeout with the clean in-band
error; new requests are refused meanwhile; the process exits 0."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
from reliability_harness import LiveServer, sse_events

SHUTDOWN_TIMEOUT = 3.0


def _stream(base: str, max_tokens: int, started: threading.Event, out: dict[str, Any]) -> None:
    body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    lines = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        out["status"] = response.status_code
        for line in response.iter_lines():
            if line.strip():
                lines.append(line)
                started.set()
    out["events"] = sse_events(lines)
    out["ended"] = time.monotonic()


def test_sigterm_lets_running_streams_finish_refuses_new_ones_and_exits(draining_server: LiveServer) -> None:
    live_server = draining_server
    base = live_server.base_url
    short: dict[str, Any] = {}
    long: dict[str, Any] = {}
    short_started, long_started = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_stream, args=(base, 600, long_started, long)),
               threading.Thread(target=_stream, args=(base, 20, short_started, short))]
    threads[0].start()
    assert long_started.wait(60)
    threads[1].start()
    assert short_started.wait(60)
    live_server.process.send_signal(signal.SIGTERM)
    sigterm = time.monotonic()

    refused = []
    for _ in range(10):  # during the drain: no new request is served
        try:
            response = httpx.post(f"{base}/v1/completions", json={"prompt": "new", "max_tokens": 2}, timeout=10)
        except httpx.TransportError:  # the listening socket is closed
            refused.append("connection refused")
        else:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "server_shutting_down"
            refused.append("503")
        time.sleep(0.1)
    assert len(refused) == 10

    for thread in threads:
        thread.join(timeout=30)
    # the short stream finished on its own: 20 tokens, finish_reason length, no error
    chunks = [e for e in short["events"] if e != "[DONE]"]
    assert short["events"][-1] == "[DONE]" and not any("error" in c for c in chunks), short["events"][-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert short["ended"] - sigterm < SHUTDOWN_TIMEOUT
    # the long one ran until the timeout, then got the clean shutting-down error in-band
    assert long["events"][-1] == "[DONE]" and "error" in long["events"][-2], long["events"][-3:]
    assert "shutting down" in long["events"][-2]["error"]["message"]
    assert long["events"][-2]["error"]["type"] == "service_unavailable_error"
    assert SHUTDOWN_TIMEOUT - 0.5 <= long["ended"] - sigterm < SHUTDOWN_TIMEOUT + 3
    assert live_server.process.wait(timeout=15) == 0, live_server.log_tail()
