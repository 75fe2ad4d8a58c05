"""Faults against the real server (``gemmaserve serve`` subprocesses, custom-cpu): clients that vanish
mid-stream, requests cancelled while still queued, a backend exception inside one request's step
(the fault plugin), and an exhausted KV pool. After each: the server still serves and leaks nothing."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
from reliability_harness import (
    POISON,
    LiveServer,
    StreamResult,
    assert_no_leaks,
    kv_figures,
    metric,
    post_json,
    scrape,
    stream_completion,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps"


def _client(server: LiveServer) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=1.0)
    return httpx.AsyncClient(base_url=server.base_url, timeout=httpx.Timeout(120, connect=30), limits=limits)


def _finished(server: LiveServer) -> dict[str, int]:
    return dict(kv_figures(server.base_url)["finished"])


def _delta(after: dict[str, int], before: dict[str, int], reason: str) -> int:
    return after.get(reason, 0) - before.get(reason, 0)


def test_30_percent_of_clients_disconnect_mid_stream(load_server: LiveServer) -> None:
    rng = random.Random(30)
    total = 160
    plan = []
    for index in range(total):
        max_tokens = rng.randint(8, 40)
        cut = rng.randint(1, max_tokens - 1) if rng.random() < 0.3 else None
        body = {"prompt": f"{index} {PROMPT[: rng.randint(5, len(PROMPT))]}", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        plan.append((body, cut))
    before = _finished(load_server)

    async def run() -> list[StreamResult]:
        async with _client(load_server) as client:
            return list(await asyncio.gather(
                *(stream_completion(client, "/v1/completions", body, disconnect_after=cut) for body, cut in plan)
            ))

    results = asyncio.run(run())
    dropped = [r for r in results if r.disconnected]
    assert 0.2 * total <= len(dropped) <= 0.4 * total
    for (_, cut), result in zip(plan, results, strict=True):
        if cut is None:  # the others are unaffected: full length, proper end
            assert result.status == 200 and result.done and result.error is None, result
            assert result.finish_reason == "length" and result.chunks >= 1
    figures = assert_no_leaks(load_server.base_url)
    cancelled = _delta(figures["finished"], before, "cancelled")
    assert 0 < cancelled <= len(dropped)  # a client may vanish after its request already finished
    assert _delta(figures["finished"], before, "length") + cancelled == total
    after = httpx.post(f"{load_server.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
    assert after.status_code == 200


def test_requests_cancelled_while_queued_never_run(faulty_server: LiveServer) -> None:
    """MAX_BATCH_SIZE=4 and 20 ms per step: 4 long requests run, 8 wait; 6 of those clients leave.
    The 6 are dropped from the queue (never prefilled), the other 6 requests finish normally."""
    base = faulty_server.base_url
    blocker = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
    queued = {"prompt": "queued " + PROMPT, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    before, samples = _finished(faulty_server), scrape(base)
    prompt_tokens_before = metric(samples, "gemmaserve_prompt_tokens_total")

    async def run() -> tuple[list[StreamResult], list[StreamResult]]:
        async with _client(faulty_server) as client:
            blockers = [asyncio.ensure_future(stream_completion(client, "/v1/completions", blocker)) for _ in range(4)]
            await asyncio.to_thread(wait_until, lambda: kv_figures(base)["running"] == 4, 30, "4 running")
            waiting = [asyncio.ensure_future(stream_completion(client, "/v1/completions", queued)) for _ in range(8)]
            await asyncio.to_thread(wait_until, lambda: kv_figures(base)["waiting"] == 8, 30, "8 queued")
            for task in waiting[:6]:
                task.cancel()  # closes the connection before the request got a first token
            await asyncio.to_thread(wait_until, lambda: kv_figures(base)["waiting"] == 2, 30, "6 dropped")
            assert kv_figures(base)["running"] == 4, "the blockers are still decoding"
            survivors = await asyncio.gather(*waiting[6:])
            await asyncio.gather(*waiting[:6], return_exceptions=True)
            return list(await asyncio.gather(*blockers)), list(survivors)

    blockers, survivors = asyncio.run(run())
    for result in (*blockers, *survivors):
        assert result.status == 200 and result.done and result.finish_reason == "length", result
    figures = assert_no_leaks(base)
    assert _delta(figures["finished"], before, "cancelled") == 6
    assert _delta(figures["finished"], before, "length") == 6
    prompt_tokens = metric(scrape(base), "gemmaserve_prompt_tokens_total") - prompt_tokens_before
    sizes = [httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 1}, timeout=60).json()["usage"]
             for body in (blocker, queued)]
    assert prompt_tokens == 4 * sizes[0]["prompt_tokens"] + 2 * sizes[1]["prompt_tokens"]  # the 6 never ran


def _poisoned(extra_after: int) -> list[int]:
    """A token-id prompt holding the poison sequence followed by ``extra_after`` tokens."""
    return [10, 11, 12, *POISON, *range(20, 20 + extra_after)]


def test_backend_exception_fails_only_its_request(faulty_server: LiveServer) -> None:
    """A request whose step raises (two decode steps after the poison) gets a 500 carrying the
    message (in-band once streaming), while the requests batched with it finish with the text
    they produce without it; decode-phase failures are retried row by row, prefill ones fail alone."""
    base = faulty_server.base_url
    bystanders = [{"prompt": f"{i} {PROMPT}", "max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
                  for i in range(2)]
    poison = {"prompt": _poisoned(0), "max_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    before, samples = _finished(faulty_server), scrape(base)
    failures_before = metric(samples, "gemmaserve_decode_failures_total")

    async def run() -> tuple[list[StreamResult], StreamResult, tuple[int, dict[str, Any]], list[Any]]:
        async with _client(faulty_server) as client:
            calm = [asyncio.ensure_future(stream_completion(client, "/v1/completions", b)) for b in bystanders]
            await asyncio.to_thread(wait_until, lambda: kv_figures(base)["running"] == 2, 30, "bystanders running")
            streamed, plain = await asyncio.gather(stream_completion(client, "/v1/completions", poison),
                                                   post_json(client, "/v1/completions", poison))
            at_prefill = await asyncio.gather(stream_completion(client, "/v1/completions",
                                                                {**poison, "prompt": _poisoned(3)}),
                                              post_json(client, "/v1/completions", {**poison, "prompt": _poisoned(3)}))
            return list(await asyncio.gather(*calm)), streamed, plain, list(at_prefill)

    calm, streamed, plain, at_prefill = asyncio.run(run())
    assert streamed.status == 200 and streamed.chunks == 2 and streamed.done  # 2 tokens, then the step raised
    assert streamed.error is not None and streamed.error["type"] == "server_error"
    assert "injected fault" in streamed.error["message"] and "decode" in streamed.error["message"]
    status, body = plain
    assert status == 500 and "injected fault" in body["error"]["message"] and body["error"]["code"] == "backend_error"
    prefill_stream, (prefill_status, prefill_body) = at_prefill
    assert prefill_stream.status == 500 and "prefill" in prefill_stream.error["message"]
    assert prefill_status == 500 and "injected fault" in prefill_body["error"]["message"]
    for result, body in zip(calm, bystanders, strict=True):
        assert result.status == 200 and result.done and result.error is None and result.finish_reason == "length"
        status, alone = asyncio.run(_post_once(faulty_server, body))
        assert status == 200 and alone["choices"][0]["text"] == result.text  # the failures did not change it
    figures = assert_no_leaks(base)
    assert _delta(figures["finished"], before, "error") == 4
    samples = scrape(base)
    assert metric(samples, "gemmaserve_decode_failures_total") - failures_before >= 1
    assert metric(samples, "gemmaserve_decode_rows_retried_total") >= 3
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200


async def _post_once(server: LiveServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with _client(server) as client:
        return await post_json(client, "/v1/completions", body)


def test_kv_pool_exhaustion_rejects_new_work_instead_of_crashing(tiny_kv_server: LiveServer) -> None:
    """An 8-block pool: a request that can never fit is a 400; a burst larger than the pool queues
    (FIFO, admitted as blocks free up) and, past MAX_WAITING_REQUESTS=4, gets 429s; all else finishes."""
    base = tiny_kv_server.base_url
    report = httpx.get(f"{base}/debug/kv", timeout=30).json()
    pool_tokens = report["kv"]["full_blocks_total"] * 16
    for stream in (False, True):
        huge = httpx.post(f"{base}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": pool_tokens, "stream": stream})
        assert huge.status_code == 400, huge.text
        assert huge.json()["error"]["code"] == "kv_capacity_exceeded" and "KV" in huge.json()["error"]["message"]
    each = {"prompt": PROMPT, "max_tokens": pool_tokens // 2 - 20, "temperature": 0.0, "ignore_eos": True}

    async def burst() -> list[StreamResult]:
        async with _client(tiny_kv_server) as client:
            return list(await asyncio.gather(*(stream_completion(client, "/v1/completions", each) for _ in range(12))))

    results = asyncio.run(burst())
    statuses = sorted(result.status for result in results)
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 4, statuses
    for result in results:
        if result.status == 429:
            assert result.retry_after and "MAX_WAITING_REQUESTS" in result.error["message"]
        else:
            assert result.done and result.finish_reason == "length" and result.error is None
    figures = assert_no_leaks(base)
    assert metric(scrape(base), "gemmaserve_backend_kv", stat="admission_rejections") > 0  # it did run out
    assert figures["integrity"] == "ok"
    again = httpx.post(f"{base}/v1/completions", json={**each, "max_tokens": 4}, timeout=60)
    assert again.status_code == 200 and httpx.get(f"{base}/health").status_code == 200


def test_a_huge_prompt_does_not_stall_other_streams(load_server: LiveServer) -> None:
    """A 2 MB prompt cannot fit the context whatever it tokenizes to: it is refused before it is tokenized
    (tokenizing it took seconds before), and a concurrent stream keeps receiving tokens. A body over 16 MiB is
    refused with 413 before it is buffered."""
    huge = {"prompt": "The quick brown fox " * 100_000, "max_tokens": 2}
    streaming = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "stream": True}

    async def run() -> tuple[list[float], httpx.Response, float]:
        gaps: list[float] = []
        async with _client(load_server) as client:
            async def stream() -> None:
                async with client.stream("POST", "/v1/completions", json=streaming) as response:
                    last = None
                    async for line in response.aiter_lines():
                        now = asyncio.get_running_loop().time()
                        if line.startswith("data: ") and last is not None:
                            gaps.append(now - last)
                        last = now

            async def post_huge() -> tuple[httpx.Response, float]:
                await asyncio.sleep(0.3)
                start = asyncio.get_running_loop().time()
                response = await client.post("/v1/completions", json=huge)
                return response, asyncio.get_running_loop().time() - start

            _, (response, took) = await asyncio.gather(stream(), post_huge())
        return gaps, response, took

    gaps, response, took = asyncio.run(run())
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in response.json()["error"]["message"], "refused by its length, before tokenizing"
    assert took < 0.5, f"refusing the huge prompt took {took:.2f} s: was it tokenized?"
    assert max(gaps) < 1.0, (max(gaps), took)
    oversized = b'{"prompt": "' + b"a" * (16 * 2**20) + b'"}'
    response = httpx.post(f"{load_server.base_url}/v1/completions", content=oversized, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert_no_leaks(load_server.base_url)
