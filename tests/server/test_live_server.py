"""The real server (`python -m gemmaserve serve` in a subprocess) over the tiny random Gemma 4
checkpoint, once per torch backend: the official openai client for completions, chat and
streaming; raw httpx for errors, metrics and disconnects; `gemmaserve bench` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, ServerPool, metric, parse_prometheus, plugin_installed, sse_events, wait_until

openai = pytest.importorskip("openai")

def _backend(name: str, module: str, source: str) -> Any:
    reason = f"{module} plugin not installed (pip install -e {source})"
    return pytest.param(name, marks=pytest.mark.skipif(not plugin_installed(module), reason=reason))


BACKENDS = [
    _backend("hf", "gemmaserve_hf_torch", "plugins/hf_torch"),
    _backend("custom-cpu", "gemmaserve_custom_torch", "plugins/custom_torch"),
]
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps"
GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module", params=BACKENDS)
def live_server(request: pytest.FixtureRequest, server_pool: ServerPool) -> Iterator[LiveServer]:
    """One server per backend, for this module only."""
    server = server_pool.take(request.param)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(live_server: LiveServer) -> LiveServer:
    return live_server


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI, chat_checkpoint: Path) -> str:
    (card,) = client.models.list().data
    assert card.id == chat_checkpoint.name
    return card.id


def scrape(server: LiveServer) -> dict[Any, float]:
    return parse_prometheus(httpx.get(f"{server.base_url}/metrics", timeout=30).text)


def debug_kv(server: LiveServer) -> dict[str, Any]:
    report = httpx.get(f"{server.base_url}/debug/kv", timeout=30).json()
    assert report["integrity"] == "ok", report["integrity"]
    return report


def test_health_and_models(server: LiveServer, model: str) -> None:
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    card = httpx.get(f"{server.base_url}/v1/models/{model}").json()
    assert card["vocab_size"] == 512 and card["max_model_len"] == 1024


def test_completion_repeat_hits_the_prefix_cache_with_the_same_text(client: openai.OpenAI, model: str) -> None:
    prompt = f"{PROMPT} (cache check)"
    first = client.completions.create(model=model, prompt=prompt, **GREEDY, extra_body={"ignore_eos": True})
    second = client.completions.create(model=model, prompt=prompt, **GREEDY, extra_body={"ignore_eos": True})
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 12
    assert second.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 10
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_completion_equals_the_full_text(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, **GREEDY, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model, prompt=PROMPT, **GREEDY, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_and_streamed_chat(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]
    reply = client.chat.completions.create(model=model, messages=messages, **GREEDY, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    stream = client.chat.completions.create(model=model, messages=messages, **GREEDY, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_and_are_never_streamed(client: openai.OpenAI, model: str) -> None:
    body = {"model": model, "prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 32}
    full = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text
    pairs = (full[i : i + 2] for i in range(4, len(full) - 2))
    stop = next(pair for pair in pairs if pair.strip() and "\ufffd" not in pair)
    expected = full[: full.index(stop)]
    cut = client.completions.create(**body, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = [c.choices[0].text for c in client.completions.create(**body, stop=stop, stream=True,
                                                                      extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(streamed) == expected


def test_seed_reproduces_sampled_text(client: openai.OpenAI, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "top_p": 0.95}
    texts = [client.completions.create(**body, seed=seed).choices[0].text for seed in (11, 11, 12, 13)]
    assert texts[0] == texts[1]
    assert set(texts[2:]) != {texts[0]}


def test_concurrent_requests_are_batched(server: LiveServer, model: str) -> None:
    before = scrape(server)
    results: list[httpx.Response] = []

    def send(index: int) -> None:
        body = {"model": model, "prompt": f"{PROMPT} #{index}", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        results.append(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in results] == [200] * 6
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in results)
    after = scrape(server)
    steps = metric(after, "gemmaserve_engine_steps_total") - metric(before, "gemmaserve_engine_steps_total")
    tokens = metric(after, "gemmaserve_generation_tokens_total") - metric(before, "gemmaserve_generation_tokens_total")
    assert tokens == 96
    assert steps < 0.75 * tokens, f"{steps} scheduler steps for {tokens} tokens: requests were not batched"


def test_metrics_counters_move(server: LiveServer, client: openai.OpenAI, model: str) -> None:
    before = scrape(server)
    prompt = f"{PROMPT} (metrics)"
    outs = [client.completions.create(model=model, prompt=prompt, **GREEDY, extra_body={"ignore_eos": True})
            for _ in range(2)]
    assert httpx.post(f"{server.base_url}/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("gemmaserve_requests_total", endpoint="completions", status="200") == 2
    assert delta("gemmaserve_requests_total", endpoint="completions", status="404") == 1
    assert delta("gemmaserve_prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert delta("gemmaserve_generation_tokens_total") == 24
    cached = sum(o.usage.prompt_tokens_details.cached_tokens for o in outs)
    assert delta("gemmaserve_prefix_cache_hit_tokens_total") == cached > 0
    assert delta("gemmaserve_time_to_first_token_seconds_count") == 2
    assert delta("gemmaserve_time_per_output_token_seconds_count") == 2
    assert delta("gemmaserve_request_finished_total", reason="length") == 2
    assert 0 < metric(after, "gemmaserve_prefix_cache_hit_rate") <= 1
    total, used, free = (metric(after, f"gemmaserve_kv_blocks_{key}") for key in ("total", "used", "free"))
    assert total > 0 and used > 0 and used + free == total
    assert metric(after, "gemmaserve_num_requests_running") == metric(after, "gemmaserve_num_requests_waiting") == 0


def in_flight_blocks(report: dict[str, Any]) -> int | None:
    """Blocks held by running requests (custom backend: used minus prefix-cached); None if unknown."""
    kv = report["kv"]
    cached = [value for key, value in kv.items() if key.endswith("_blocks_cached")]
    return kv["blocks_used"] - sum(cached) if cached else None


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "non-stream"])
def test_disconnect_cancels_and_frees_kv(server: LiveServer, model: str, streaming: bool) -> None:
    before = debug_kv(server)
    body = {"model": model, "prompt": f"{PROMPT} (disconnect)", "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": streaming}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=None if streaming else 1.0)) as http:
        if streaming:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                for _ in range(3):
                    assert next(line for line in lines if line.startswith("data: {"))
                running = debug_kv(server)
                assert running["running"] == 1
                if in_flight_blocks(running) is not None:
                    assert in_flight_blocks(running) > 0 and running["kv"]["reserved_tokens"] > 0
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body)
    after = wait_until(lambda: (r := debug_kv(server))["running"] == 0 and r, 30, "the request to be cancelled")
    assert after["waiting"] == 0
    assert after["finished"].get("cancelled", 0) == before["finished"].get("cancelled", 0) + 1
    assert after["finished"].get("length", 0) == before["finished"].get("length", 0)
    if after["live_rows"] is not None:
        assert after["live_rows"] == 0
    if in_flight_blocks(after) is not None:
        assert in_flight_blocks(after) == 0 and after["kv"]["reserved_tokens"] == 0


BAD_INPUTS = [
    ({"prompt": "x" * 3000}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 2000}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": 101}, 400, "temperature"),
    ({"prompt": "hi", "n": 65}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 600]}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-4o"}, 404, "model"),
]


def test_bad_inputs_get_4xx(server: LiveServer, model: str) -> None:
    for patch, status, param in BAD_INPUTS:
        response = httpx.post(f"{server.base_url}/v1/completions", json={"model": model, **patch}, timeout=30)
        assert response.status_code == status, (patch, response.text)
        assert response.json()["error"]["param"] == param, (patch, response.text)
    malformed = httpx.post(f"{server.base_url}/v1/chat/completions", content=b'{"messages": [', timeout=30)
    assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    assert info.value.status_code == 400
    debug_kv(server)


def test_bench_runs_end_to_end_and_writes_json(server: LiveServer, tmp_path: Path) -> None:
    result = tmp_path / "bench" / "result.json"
    command = [sys.executable, "-m", "gemmaserve", "bench", "--base-url", server.base_url, "--num-prompts", "8",
               "--input-len", "24", "--output-len", "6", "--max-concurrency", "4", "--request-rate", "50",
               "--result-file", str(result), "--save-detailed"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout and "Output token throughput" in done.stdout
    summary = json.loads(result.read_text())
    assert summary["completed"] == 8 and summary["failed"] == 0 and summary["error_counts"] == {}
    assert summary["total_output_tokens"] == 48 and summary["total_input_tokens"] == 8 * 24
    assert summary["request_throughput"] > 0 and summary["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert 0 < stats["median"] <= stats["p99"], (key, stats)
        assert stats["mean"] > 0
    # one gap per SSE chunk after the first: tokens that queued up while the event loop was busy share a chunk
    assert all(len(record["itl"]) <= 5 for record in summary["per_request"])
    assert all(sum(r["itl"]) <= r["latency"] - r["ttft"] + 1e-6 for r in summary["per_request"])
    assert summary["config"]["max_concurrency"] == 4 and summary["config"]["request_rate"] == 50
    debug_kv(server)


def test_sse_wire_format(server: LiveServer, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.split("\n\n") if block)
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and len(events) >= 2
