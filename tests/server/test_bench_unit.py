"""``gemmaserve bench`` pieces without a server: dataset, arrivals, statistics, CLI errors; and one
in-process run against the reference backend over real sockets."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import ThreadedServer, free_port, reference_engine

from gemmaserve.bench.dataset import arrival_gaps, random_requests
from gemmaserve.bench.report import RequestRecord, format_report, percentile, summarize
from gemmaserve.bench.serving import BenchConfig, run_benchmark, server_root
from gemmaserve.server.app import create_app


def test_random_requests_have_the_asked_lengths_and_ids() -> None:
    fixed = random_requests(20, 32, 8, 512, seed=3)
    assert [len(r.prompt_ids) for r in fixed] == [32] * 20 and {r.output_len for r in fixed} == {8}
    assert all(100 <= t < 512 for r in fixed for t in r.prompt_ids)
    assert random_requests(20, 32, 8, 512, seed=3) == fixed != random_requests(20, 32, 8, 512, seed=4)
    ranged = random_requests(200, 100, 10, 64, range_ratio=0.5, seed=0)
    lengths = [len(r.prompt_ids) for r in ranged]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 20
    assert all(32 <= t < 64 for r in ranged for t in r.prompt_ids)
    with pytest.raises(ValueError):
        random_requests(1, 0, 1, 512)


def test_arrival_gaps_mean_and_infinite_rate() -> None:
    gaps = arrival_gaps(20.0, seed=1)
    sample = [next(gaps) for _ in range(4000)]
    assert statistics.fmean(sample) == pytest.approx(1 / 20, rel=0.1)
    bursty = arrival_gaps(20.0, burstiness=0.25, seed=1)
    assert statistics.pstdev([next(bursty) for _ in range(4000)]) > 1.5 * statistics.pstdev(sample)
    instant = arrival_gaps(math.inf)
    assert [next(instant) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == pytest.approx(4.0 + 0.96 * 6.0)
    assert percentile(values, 100) == 10.0 and percentile([7.0], 99) == 7.0


def test_summary_counts_throughput_and_latencies() -> None:
    records = [
        RequestRecord(ok=True, status=200, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestRecord(ok=True, status=200, prompt_tokens=10, output_tokens=3, cached_tokens=4, ttft=0.3, latency=0.7,
                      itl=[0.2, 0.2]),
        RequestRecord(ok=False, status=429, error="HTTP 429: busy"),
    ]
    summary = summarize(records, 2.0, {"num_prompts": 3})
    assert (summary["completed"], summary["failed"], summary["error_counts"]) == (2, 1, {"HTTP 429: busy": 1})
    assert summary["errors"] == ["", "", "HTTP 429: busy"]  # vLLM's: one string per request
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 4.0
    assert summary["total_token_throughput"] == 14.0 and summary["cached_prompt_tokens"] == 4
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0) and summary["ttft_ms"]["median"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx((100.0 + 200.0) / 2)
    assert summary["itl_ms"]["median"] == pytest.approx(100.0) and summary["itl_ms"]["p99"] == pytest.approx(200.0)
    report = format_report(summary)
    assert "Successful requests:" in report and "Median TTFT (ms):" in report and "HTTP 429: busy" in report
    assert summarize([], 0.0, {})["ttft_ms"] == {"mean": None, "median": None, "p99": None}


def test_bench_cli_reports_an_unreachable_server(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "gemmaserve", "bench", "--base-url", url, "--num-prompts", "2",
                           "--no-progress"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "is the server running" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "gemmaserve", "bench", "--num-prompts", "0"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "--num-prompts" in bad.stderr and ">= 1" in bad.stderr
    lost = subprocess.run([sys.executable, "-m", "gemmaserve", "bench", "--base-url", url, "--save-detailed"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert lost.returncode == 2 and "give --result-file" in lost.stderr  # the records would go nowhere


def test_benchmark_against_the_reference_backend() -> None:
    engine = reference_engine()
    server = ThreadedServer(create_app(engine, "tiny-ref"))
    try:
        # the OpenAI client's base URL (with /v1) works too: the bench must not ask for /v1/v1/models
        config = BenchConfig(base_url=server.base_url + "/v1/", num_prompts=12, input_len=16, output_len=5, max_concurrency=3,
                             request_rate=200.0)
        summary = asyncio.run(run_benchmark(config, progress=False, detailed=True))
    finally:
        server.stop()
        engine.shutdown(timeout=10)
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 60 and summary["total_input_tokens"] == 12 * 16
    assert summary["config"]["model"] == "tiny-ref"
    # one gap per SSE chunk after the first (as vLLM's bench counts them); a server behind the engine sends a
    # chunk with several tokens, so 5 tokens make at most 4 gaps
    assert all(len(r["itl"]) <= 4 and r["ttft"] > 0 for r in summary["per_request"])
    assert all(sum(r["itl"]) <= r["latency"] - r["ttft"] + 1e-6 for r in summary["per_request"])
    assert engine.stats().finished == {"length": 12}
    json.dumps(summary)  # the result file is plain JSON


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/",
                                 " http://h:8000/v1 "])
def test_base_url_with_or_without_v1(url: str) -> None:
    assert server_root(url) == "http://h:8000"
    assert server_root("http://h:8000/api/v1") == "http://h:8000/api"  # a proxy prefix is kept
