"""In-process API behaviour over the deterministic reference backend: texts match the backend's own
ground truth, streaming is well-formed and equals the non-streamed text, stop strings are cut and
never streamed, seeds reproduce, usage/cached tokens/logprobs/metrics are right."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL as MODEL
from server_harness import metric, parse_prometheus, sse_events

from gemmaserve.engine.engine import Engine
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.testing.reference_backend import ReferenceBackend

Client = tuple[TestClient, Engine]


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client: TestClient, path: str, **body: Any) -> list[Any]:
    response = client.post(path, json={"model": MODEL, "stream": True, **body})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def expected_text(engine: Engine, prompt: str, **params: Any) -> tuple[str, list[int]]:
    backend = engine.backend
    assert isinstance(backend, ReferenceBackend)
    ids = backend.reference_generate(backend.tokenizer.encode(prompt), SamplingParams(**params))
    return backend.tokenizer.decode(ids), ids


def test_greedy_completion_matches_the_backend_ground_truth(ref: Client) -> None:
    client, engine = ref
    body = complete(client, prompt="hello world", max_tokens=12, temperature=0, ignore_eos=True)
    text, ids = expected_text(engine, "hello world", max_tokens=12, ignore_eos=True)
    (choice,) = body["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    prompt_tokens = len(engine.backend.tokenizer.encode("hello world"))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == len(ids) == 12
    assert body["usage"]["total_tokens"] == prompt_tokens + 12


def test_token_id_prompts_in_both_spellings(ref: Client) -> None:
    client, engine = ref
    ids = engine.backend.tokenizer.encode("token ids")
    flat = complete(client, prompt=ids, max_tokens=6, temperature=0, ignore_eos=True)
    nested = complete(client, prompt=[ids], max_tokens=6, temperature=0, ignore_eos=True)
    text, _ = expected_text(engine, "token ids", max_tokens=6, ignore_eos=True)
    assert flat["choices"][0]["text"] == nested["choices"][0]["text"] == text


def test_repeated_prompt_reports_cached_tokens_and_same_text(ref: Client) -> None:
    client, _ = ref
    prompt = "the repeated prompt shares its whole prefix"
    first = complete(client, prompt=prompt, max_tokens=8, temperature=0)
    second = complete(client, prompt=prompt, max_tokens=8, temperature=0)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]


def test_streamed_completion_equals_the_full_text(ref: Client) -> None:
    client, _ = ref
    full = complete(client, prompt="stream me", max_tokens=20, temperature=0, ignore_eos=True)
    events = stream(client, "/v1/completions", prompt="stream me", max_tokens=20, temperature=0, ignore_eos=True,
                    stream_options={"include_usage": True})
    *chunks, usage_chunk = events
    assert all(chunk["object"] == "text_completion" and len(chunk["choices"]) == 1 for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len({chunk["id"] for chunk in events}) == 1
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 20
    assert usage_chunk["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]


def test_chat_completion_and_its_stream(ref: Client) -> None:
    client, engine = ref
    parts = [{"type": "text", "text": "hi"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 10,
                                                         "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and body["choices"][0]["finish_reason"] == "length"
    template_ids = engine.backend.tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "hi"}])
    ids = engine.backend.reference_generate(template_ids, SamplingParams(max_tokens=10, ignore_eos=True))
    assert message["content"] == engine.backend.tokenizer.decode(ids)
    assert body["usage"]["prompt_tokens"] == len(template_ids)
    events = stream(client, "/v1/chat/completions", messages=messages, max_tokens=10, temperature=0, ignore_eos=True)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(event["object"] == "chat.completion.chunk" for event in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == message["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_default_max_tokens_uses_the_rest_of_the_context(make_client: Any) -> None:
    client, _ = make_client(max_model_len=48)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "go"}],
                                                         "temperature": 0, "ignore_eos": True})
    usage = response.json()["usage"]
    assert response.status_code == 200 and usage["total_tokens"] == 48
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_completion_default_max_tokens_is_16(ref: Client) -> None:
    body = complete(ref[0], prompt="defaults", temperature=0, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 16


def test_stop_string_cuts_the_text_and_is_never_streamed(ref: Client) -> None:
    client, _ = ref
    base = {"prompt": "stop strings", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = complete(client, **base)["choices"][0]["text"]
    stop = full[12:14]
    expected = full[: full.index(stop)]
    body = complete(client, **base, stop=[stop])
    assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 40
    chunks = stream(client, "/v1/completions", **base, stop=stop)
    texts = [chunk["choices"][0]["text"] for chunk in chunks]
    assert "".join(texts) == expected and stop not in "".join(texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_earliest_of_several_stop_strings_wins(ref: Client) -> None:
    client, _ = ref
    base = {"prompt": "several stops", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = complete(client, **base)["choices"][0]["text"]
    late, early = full[20:23], full[6:8]
    body = complete(client, **base, stop=[late, early])
    cut = min(full.index(late), full.index(early))
    assert body["choices"][0]["text"] == full[:cut]


def test_stop_token_ids_and_ignore_eos_extensions(ref: Client) -> None:
    client, engine = ref
    _, ids = expected_text(engine, "extensions", max_tokens=30, ignore_eos=True)
    stop_token = ids[5]
    body = complete(client, prompt="extensions", max_tokens=30, temperature=0, ignore_eos=True,
                    stop_token_ids=[stop_token])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == ids.index(stop_token) + 1


def test_same_seed_same_text_other_seed_other_text(ref: Client) -> None:
    client, _ = ref
    base = {"prompt": "sampling", "max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "ignore_eos": True}
    first = complete(client, **base, seed=7)["choices"][0]["text"]
    again = complete(client, **base, seed=7)["choices"][0]["text"]
    others = {complete(client, **base, seed=seed)["choices"][0]["text"] for seed in (8, 9)}
    assert first == again
    assert others != {first}


def test_bad_words_keep_words_out_of_the_reply(ref: Client) -> None:
    """Token-level, as vLLM defines it: no two successive generated tokens spell a two-character bad word (the
    reference tokenizer has one token per character; some tokens decode to nothing, so the text may still)."""
    client, _ = ref
    base = {"prompt": "bad words", "max_tokens": 30, "temperature": 1.5, "seed": 4, "ignore_eos": True, "logprobs": 0}
    free = complete(client, **base)["choices"][0]["logprobs"]["tokens"]
    pairs = [a + b for a, b in zip(free, free[1:]) if len(a) == len(b) == 1 and not (a + b).isspace()]
    words = sorted(set(pairs))[:4]
    assert words and any(word in pairs for word in words), free
    banned = complete(client, **base, bad_words=words)["choices"][0]["logprobs"]["tokens"]
    assert not {a + b for a, b in zip(banned, banned[1:])} & set(words), (words, banned)
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "bad_words": ["x"] * 129})
    assert response.status_code == 400 and response.json()["error"]["param"] == "bad_words"


def test_logprobs_for_completions_and_chat(ref: Client) -> None:
    client, _ = ref
    body = complete(client, prompt="logprobs", max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == 6
    assert all(value <= 0.0 for value in logprobs["token_logprobs"])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "lp"}],
                                                         "max_tokens": 5, "logprobs": True, "ignore_eos": True})
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(entry["logprob"] <= 0.0 and entry["top_logprobs"] == [] for entry in content)
    chunks = stream(client, "/v1/completions", prompt="logprobs", max_tokens=6, temperature=0, logprobs=0,
                    ignore_eos=True)
    streamed = [lp for c in chunks for lp in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == logprobs["token_logprobs"]


def test_echo_prepends_the_prompt(ref: Client) -> None:
    client, _ = ref
    plain = complete(ref[0], prompt="echo this", max_tokens=4, temperature=0, ignore_eos=True)
    echoed = complete(client, prompt="echo this", max_tokens=4, temperature=0, ignore_eos=True, echo=True)
    assert echoed["choices"][0]["text"] == "echo this" + plain["choices"][0]["text"]
    # a token-id prompt echoes every token's text, special ones too (as the same text prompt echoes its <bos>)
    ids = ref[1].backend.tokenizer.encode("echo this")
    by_ids = complete(client, prompt=ids, max_tokens=4, temperature=0, ignore_eos=True, echo=True)
    assert by_ids["choices"][0]["text"] == "<bos>echo this" + plain["choices"][0]["text"]


def test_models_health_and_debug_endpoints(ref: Client) -> None:
    client, _ = ref
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512 and models["data"][0]["vocab_size"] == 64
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/health").json() == {"status": "ok"}
    report = client.get("/debug/kv").json()
    assert report["integrity"] == "ok" and report["running"] == 0 and report["live_rows"] == 0
    assert report["prefix_cache"]["num_blocks"] == 256


def test_metrics_are_prometheus_text_and_counters_move(make_client: Any) -> None:
    client, _ = make_client()
    before = parse_prometheus(client.get("/metrics").text)
    assert metric(before, "gemmaserve_prompt_tokens_total") == 0
    prompt = "metrics count every token of this prompt"
    bodies = [complete(client, prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True) for _ in range(2)]
    assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = parse_prometheus(response.text)
    prompt_tokens = sum(b["usage"]["prompt_tokens"] for b in bodies)
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    assert metric(after, "gemmaserve_requests_total", endpoint="completions", status="200") == 2
    assert metric(after, "gemmaserve_requests_total", endpoint="completions", status="400") == 1
    assert metric(after, "gemmaserve_prompt_tokens_total") == prompt_tokens
    assert metric(after, "gemmaserve_generation_tokens_total") == 10
    assert metric(after, "gemmaserve_prefix_cache_hit_tokens_total") == cached > 0
    assert metric(after, "gemmaserve_prefix_cache_hit_rate") == pytest.approx(cached / prompt_tokens)
    assert metric(after, "gemmaserve_request_finished_total", reason="length") == 2
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert metric(after, f"gemmaserve_{name}_count") == 2
        assert metric(after, f"gemmaserve_{name}_bucket", le="+Inf") == 2
        assert metric(after, f"gemmaserve_{name}_sum") > 0
    assert metric(after, "gemmaserve_num_requests_running") == 0
    assert metric(after, "gemmaserve_num_requests_waiting") == 0
    total, used, free = (metric(after, f"gemmaserve_kv_blocks_{k}") for k in ("total", "used", "free"))
    assert total == 256 and used > 0 and used + free == total
    assert metric(after, "gemmaserve_prefix_cache_blocks", state="used") == used
    # vLLM's names, for routers and autoscalers: the same numbers, labelled with the served model name
    vllm = {"model_name": MODEL, "engine": "0"}  # a single server is engine 0
    assert metric(after, "vllm:prompt_tokens_total", **vllm) == prompt_tokens
    assert metric(after, "vllm:generation_tokens_total", **vllm) == 10
    assert metric(after, "vllm:prefix_cache_queries_total", **vllm) == prompt_tokens
    assert metric(after, "vllm:prefix_cache_hits_total", **vllm) == cached
    assert metric(after, "vllm:num_requests_running", **vllm) == 0 == metric(after, "vllm:num_requests_waiting", **vllm)
    evictable = metric(after, "gemmaserve_prefix_cache_blocks", state="evictable")
    assert evictable == used  # idle: every used block is only cached, which vLLM counts as free
    assert metric(after, "vllm:kv_cache_usage_perc", **vllm) == pytest.approx((used - evictable) / total) == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert metric(after, f"vllm:{name}_count", **vllm) == 2
        assert metric(after, f"vllm:{name}_sum", **vllm) == pytest.approx(metric(after, f"gemmaserve_{name}_sum"))
    gaps = metric(after, "vllm:inter_token_latency_seconds_count", **vllm)
    assert 2 <= gaps <= 8 and metric(after, "vllm:inter_token_latency_seconds_bucket", le="+Inf", **vllm) == gaps


def test_kv_cache_usage_counts_blocks_only_the_cache_holds_as_free() -> None:
    """vLLM's meaning: blocks no request holds (free, or cached and evictable) are not usage. A backend reports its
    cache-only blocks as ``blocks_evictable`` (custom_torch, hf and mlx do)."""
    from gemmaserve.engine.engine import EngineStats
    from gemmaserve.server.metrics import _vllm_families

    kv = {"blocks_total": 100, "blocks_used": 40, "blocks_free": 60, "blocks_evictable": 30}
    stats = EngineStats(running=0, waiting=0, finished={}, prompt_tokens=0, cached_tokens=0, generated_tokens=0,
                        num_steps=0, decode_failures=0, cache=None, kv=kv)
    families = {family.name: family.samples[0] for family in _vllm_families(stats, "m", "2")}
    usage = families["vllm:kv_cache_usage_perc"]
    assert usage.value == pytest.approx(0.1) and usage.labels == {"model_name": "m", "engine": "2"}


@pytest.mark.parametrize("reserved, blocks_used, expected", [(0, 40, 0.1), (500, 40, 0.5), (1000, 0, 1.0),
                                                             (50, 100, 0.7)])
def test_kv_cache_usage_is_the_fuller_of_the_pool_and_the_admission_budget(reserved: int, blocks_used: int,
                                                                           expected: float) -> None:
    """Backends whose running rows keep their KV outside the block pool (hf, mlx: the pool is the prefix cache's)
    report a pool of cached blocks only: the admission budget (reserved KV tokens / MAX_ACTIVE_KV_TOKENS) is what
    fills up as requests run."""
    from gemmaserve.engine.engine import EngineStats
    from gemmaserve.server.metrics import kv_usage

    kv = {"blocks_total": 100, "blocks_used": blocks_used, "blocks_free": 100 - blocks_used, "blocks_evictable": 30}
    stats = EngineStats(running=1, waiting=0, finished={}, prompt_tokens=0, cached_tokens=0, generated_tokens=0,
                        num_steps=0, decode_failures=0, kv=kv, reserved_kv_tokens=reserved, kv_token_budget=1000)
    assert kv_usage(stats) == pytest.approx(expected)


def test_kv_cache_usage_rises_while_a_core_cache_backend_runs_requests() -> None:
    """The reference backend (core prefix cache, rows' KV outside it): every block it caches is evictable, yet
    four running requests fill the admission budget."""
    from gemmaserve.server.metrics import kv_usage
    from gemmaserve.settings import CoreSettings

    class SlowReference(ReferenceBackend):  # 70 steps take >= 0.7 s: the poll below sees all four running
        def decode_step_batched(self, batch, input_ids):  # type: ignore[no-untyped-def]
            time.sleep(0.01)
            return super().decode_step_batched(batch, input_ids)

    settings = CoreSettings(max_batch_size=4, max_active_kv_tokens=400, kv_block_size=4, prefix_cache_blocks=32)
    engine = Engine(SlowReference(), settings)
    try:
        with engine._cond:  # all four admitted before the first tick
            handles = [engine.submit([i + 2] * 30, SamplingParams(max_tokens=70, ignore_eos=True)) for i in range(4)]
        deadline = time.monotonic() + 10
        while (stats := engine.stats()).running < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert stats.running == 4 and stats.reserved_kv_tokens == 400 and kv_usage(stats) == 1.0
        for handle in handles:
            handle.cancel()
            handle.result(timeout=10)
        assert kv_usage(engine.stats()) == 0.0
    finally:
        engine.shutdown()


def test_text_parts_join_with_newlines_and_empty_call_arguments_are_an_empty_object() -> None:
    """vLLM's rules for what a chat template sees: a message's text parts joined with newlines (they were glued:
    "HelloWorld"), and a replayed call's empty ``arguments`` as ``{}`` (it was a 400)."""
    from gemmaserve.server.protocol import ChatMessage

    parts = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                    {"type": "text", "text": "World"}]})
    assert parts.as_template_dict()["content"] == "Hello\nWorld"
    call = {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": ""}}
    replayed = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})
    assert replayed.as_template_dict()["tool_calls"][0]["function"]["arguments"] == {}
