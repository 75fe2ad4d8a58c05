"""CI variant of the load test (``loadgen.py``): 256 streaming requests all in flight at once, short
outputs, against the real server (custom-cpu). Every request completes or gets a clean 429/503;
greedy streamed text equals the non-streamed text; afterwards 0 KV blocks leak and the server's
RSS is back near its post-warm-up baseline."""

from __future__ import annotations

import pytest
from loadgen import LoadConfig, run_rounds
from reliability_harness import LiveServer

RSS_TOLERANCE_MIB = 48


@pytest.mark.timeout(420)
def test_256_concurrent_streams_complete_without_leaks(load_server: LiveServer) -> None:
    config = LoadConfig(requests=256, concurrency=256, max_tokens=12)
    result = run_rounds(load_server.base_url, load_server.process.pid, config, rounds=2, warmup=64)
    for report in result.reports:
        assert not report.problems(), report.problems()
        assert report.completed >= 200, report.summary()  # a 429 is retried, so nearly all complete
        assert report.greedy_pairs >= 80 and not report.greedy_mismatches, report.summary()
    assert all(figures["leaked_blocks"] == 0 for figures in result.leak_figures)
    growth = result.rss_growth_kib()
    assert growth is not None and growth < RSS_TOLERANCE_MIB * 1024, (result.baseline_rss_kib, result.rss_after_kib)
    print({"rounds": [r.summary() for r in result.reports], "rss_mib": (result.baseline_rss_kib // 1024,
           [k // 1024 for k in result.rss_after_kib], (result.peak_rss_kib or 0) // 1024)})
