"""``gemmaserve bench`` against what ``vllm bench serve`` users expect: an API key (flag or OPENAI_API_KEY), vLLM's
flat result keys and flag names, a per-request ``--timeout``, and token ids of a server that states no vocab size."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ThreadedServer, reference_engine

from gemmaserve.bench.dataset import BenchRequest, random_requests
from gemmaserve.bench.report import RequestRecord, format_report, summarize
from gemmaserve.bench.serving import BenchConfig, BenchError, _model_info, _one_request, _vocabulary_sample, \
    result_path, run_benchmark
from gemmaserve.cli import build_parser, main
from gemmaserve.server.app import create_app

KEY = "bench-secret"


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ThreadedServer]:
    """The reference backend behind a server started with an API key."""
    engine = reference_engine()
    server = ThreadedServer(create_app(engine, "tiny-ref", api_key=KEY))
    yield server
    server.stop()
    engine.shutdown(timeout=10)


def _config(server: ThreadedServer, **kwargs: Any) -> BenchConfig:
    return BenchConfig(base_url=server.base_url, num_prompts=3, input_len=8, output_len=3, **kwargs)


def test_bench_sends_the_api_key(keyed_server: ThreadedServer) -> None:
    summary = asyncio.run(run_benchmark(_config(keyed_server, api_key=KEY), progress=False))
    assert summary["completed"] == 3 and summary["failed"] == 0
    assert summary["config"]["api_key"] == "set"  # the key itself never reaches the result file
    assert KEY not in json.dumps(summary)


def test_bench_names_a_missing_or_wrong_key(keyed_server: ThreadedServer) -> None:
    with pytest.raises(BenchError, match="401: the server needs an API key; give it with --api-key"):
        asyncio.run(run_benchmark(_config(keyed_server), progress=False))
    with pytest.raises(BenchError, match="401: the API key sent .* was refused"):
        asyncio.run(run_benchmark(_config(keyed_server, api_key="wrong"), progress=False))


def test_bench_cli_reads_openai_api_key(keyed_server: ThreadedServer, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what vllm bench serve reads
    out = tmp_path / "r.json"
    argv = ["bench", "--base-url", keyed_server.base_url, "--num-prompts", "2", "--random-input-len", "6",
            "--random-output-len", "2", "--disable-tqdm", "--ignore-eos", "--dataset-name", "random",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9", "--result-file", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 2 and result["total_input_tokens"] == 12 and result["total_output_tokens"] == 4
    for key in ("mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms", "p50_e2el_ms"):
        assert result[key] > 0, key
    assert "mean_itl_ms" not in result and {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"} <= set(result)  # ours stay
    printed = capsys.readouterr().out
    assert "P99.9 TTFT (ms):" in printed and "Mean E2EL (ms):" in printed and "TPOT" not in printed
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    assert main(argv[:9]) == 2 and "was refused" in capsys.readouterr().err
    assert main([*argv[:9], "--api-key", KEY]) == 0  # the flag wins over the environment


def test_summary_has_vllms_flat_keys() -> None:
    records = [RequestRecord(ok=True, status=200, prompt_tokens=4, output_tokens=3, ttft=t, latency=t + 0.2,
                             itl=[0.1, 0.1]) for t in (0.1, 0.2, 0.3)]
    records.append(RequestRecord(ok=False, status=500, error="HTTP 500: boom"))
    summary = summarize(records, 2.0, {}, percentile_metrics=("ttft", "tpot", "itl", "e2el"), percentiles=(50, 90))
    assert summary["duration"] == summary["duration_s"] == 2.0
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["errors"] == ["", "", "", "HTTP 500: boom"] and summary["error_counts"] == {"HTTP 500: boom": 1}
    assert summary["total_input_tokens"] == 12 and summary["total_output_tokens"] == 9
    assert summary["request_throughput"] == 1.5 and summary["output_throughput"] == 4.5
    assert summary["total_token_throughput"] == 10.5
    assert summary["mean_ttft_ms"] == pytest.approx(200.0) and summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["std_ttft_ms"] == pytest.approx(81.6497, rel=1e-4)  # numpy's np.std (population)
    assert summary["p90_ttft_ms"] == pytest.approx(280.0) and summary["p50_e2el_ms"] == pytest.approx(400.0)
    assert summary["mean_tpot_ms"] == pytest.approx(100.0) and summary["p90_itl_ms"] == pytest.approx(100.0)
    assert "p99_ttft_ms" not in summary and summary["ttft_ms"]["p99"] is not None
    empty = summarize([], 0.0, {}, percentile_metrics=("ttft",), percentiles=(99,))
    assert empty["mean_ttft_ms"] is None and empty["p99_ttft_ms"] is None
    assert "n/a" in format_report(empty)


def test_bench_flags_take_vllms_names() -> None:
    parse = build_parser().parse_args
    args = parse(["bench", "--random-input-len", "10", "--random-output-len", "3", "--disable-tqdm",
                  "--percentile-metrics", "ttft", "--metric-percentiles", "25,75", "--ignore-eos", "--save-result",
                  "--result-dir", "out", "--host", "h", "--port", "9"])
    assert (args.input_len, args.output_len, args.no_progress) == (10, 3, True)
    assert args.percentile_metrics == ("ttft",) and args.metric_percentiles == (25.0, 75.0)
    summary = {"config": {"model": "org/tiny"}}
    when = datetime(2026, 1, 2, 3, 4, 5)
    assert result_path(args, summary, when) == Path("out/openai-infqps-tiny-20260102-030405.json")
    named = parse(["bench", "--result-filename", "x.json", "--max-concurrency", "4", "--request-rate", "2"])
    assert result_path(named, summary) == Path("x.json")  # --result-filename implies --save-result
    assert result_path(parse(["bench", "--result-file", "a/b.json"]), summary) == Path("a/b.json")
    assert result_path(parse(["bench"]), summary) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--dataset-name", "sharegpt"], "only 'random'"),
    (["--percentile-metrics", "ttft,goodput"], "among ttft, tpot, itl, e2el"),
    (["--metric-percentiles", "99,101"], "percentiles in [0, 100]"),
    (["--endpoint", "/v1/chat/completions"], "only /v1/completions"),
])
def test_bench_refuses_what_it_does_not_implement(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--base-url", "http://h:1", "--port", "2"], "either as --base-url URL or as --host / --port"),
    (["--result-file", "a.json", "--save-result"], "--result-file FILE names the JSON file itself"),
    (["--save-detailed"], "give --result-file FILE or --save-result"),
])
def test_bench_refuses_options_that_would_be_dropped(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def _slow_stream_transport(chunks: int, gap_s: float) -> httpx.AsyncBaseTransport:
    """A completions stream sending one token chunk every ``gap_s`` (each read well within any per-read timeout)."""
    async def body() -> AsyncIterator[bytes]:
        for _ in range(chunks):
            await asyncio.sleep(gap_s)
            yield b'data: {"choices": [{"text": "x"}]}\n\n'
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_timeout_bounds_the_whole_request() -> None:
    async def run(timeout_s: float) -> RequestRecord:
        async with httpx.AsyncClient(transport=_slow_stream_transport(10, 0.05), timeout=timeout_s) as client:
            return await _one_request(client, "http://h", "m", BenchRequest([5, 6], 10), timeout_s=timeout_s)

    slow = asyncio.run(run(0.2))  # every read takes 0.05 s, the request 0.5 s: a per-read timeout never fires
    assert not slow.ok and "timed out after 0.2 s" in (slow.error or "") and slow.ttft is not None
    done = asyncio.run(run(5.0))
    assert done.ok and done.output_tokens == 10


def _vllm_like_transport(seen: list[str]) -> httpx.AsyncBaseTransport:
    """/v1/models without vocab_size (as vLLM's) and a /tokenize answering ids below 300."""
    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "small", "root": "small", "max_model_len": 64}]})
        if request.url.path == "/tokenize":
            words = json.loads(request.content)["prompt"].split()
            return httpx.Response(200, json={"tokens": [sum(map(ord, w)) % 300 for w in words], "count": len(words)})
        return httpx.Response(404)

    return httpx.MockTransport(handler)


def test_ids_come_from_tokenize_when_the_server_states_no_vocab_size() -> None:
    seen: list[str] = []

    async def run() -> tuple[tuple[str, int | None], list[int]]:
        async with httpx.AsyncClient(transport=_vllm_like_transport(seen)) as client:
            info = await _model_info(client, "http://h", None, False)
            return info, await _vocabulary_sample(client, "http://h", info[0], 0)

    (model, vocab_size), ids = asyncio.run(run())
    assert (model, vocab_size) == ("small", None)  # not a guessed 32000: ids up to it would be 400s on this model
    assert seen[:2] == ["/v1/models", "/tokenize"] and set(seen[1:]) == {"/tokenize"} and max(ids) < 300
    requests = random_requests(20, 16, 2, 2, seed=1, token_ids=ids)
    assert {t for r in requests for t in r.prompt_ids} <= set(ids)


def test_vocabulary_sample_against_gemmaserves_tokenize() -> None:
    engine = reference_engine()
    server = ThreadedServer(create_app(engine, "tiny-ref"))

    async def run() -> list[int]:
        async with httpx.AsyncClient() as client:
            return await _vocabulary_sample(client, server.base_url, "tiny-ref", 0)

    try:
        ids = asyncio.run(run())
    finally:
        server.stop()
        engine.shutdown(timeout=10)
    assert len(ids) > 10 and all(0 <= t < engine.backend.model_info.vocab_size for t in ids)
