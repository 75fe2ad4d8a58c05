"""Chat requests without max_tokens get DEFAULT_MAX_TOKENS (capped by the rest of the context) instead of the
whole rest of the context, so a few of them cannot reserve all the KV and keep a small request queued."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from server_harness import REFERENCE_MODEL, ThreadedServer, reference_engine, wait_until

from gemmaserve.server.app import create_app
from gemmaserve.server.prepare import default_max_tokens_for
from gemmaserve.testing.reference_backend import ReferenceBackend


def test_four_default_chats_do_not_block_a_small_request() -> None:
    # context 512, KV budget 600: a chat reserving the rest of the context (~490 tokens) admits one at a time
    backend = ReferenceBackend(max_model_len=512, decode_delay_s=0.01)
    engine = reference_engine(backend, max_active_kv_tokens=600, default_max_tokens=32)
    server = ThreadedServer(create_app(engine, REFERENCE_MODEL))
    results: list[dict[str, Any]] = []
    try:
        def chat() -> None:
            body = {"messages": [{"role": "user", "content": "tell me a story"}], "ignore_eos": True}
            results.append(httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).json())

        chats = [threading.Thread(target=chat) for _ in range(4)]
        for thread in chats:
            thread.start()
        wait_until(lambda: (s := engine.stats()).running + s.waiting + sum(s.finished.values()) >= 4, 10,
                   "the four chats to reach the engine")
        start = time.monotonic()
        small = httpx.post(f"{server.base_url}/v1/completions", timeout=5,
                           json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        waited = time.monotonic() - start
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 4
        assert waited < 2.0, waited
        for thread in chats:
            thread.join(timeout=60)
    finally:
        server.stop()
        engine.shutdown(timeout=10)
    assert [r["usage"]["completion_tokens"] for r in results] == [32] * 4
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)


def test_the_default_is_capped_by_the_rest_of_the_context(make_client) -> None:
    assert default_max_tokens_for(100, 512, 2048) == 412
    assert default_max_tokens_for(100, 512, 64) == 64
    assert default_max_tokens_for(100, 512, 0) == 412  # 0 = no cap: the rest of the context
    assert default_max_tokens_for(600, 512, 64) == 1  # a prompt that fills the context is refused later
    client, _ = make_client(default_max_tokens=8)
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 8
    explicit = client.post("/v1/chat/completions", json={**body, "max_tokens": 12}).json()
    assert explicit["usage"]["completion_tokens"] == 12
