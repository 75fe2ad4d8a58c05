"""Prometheus metrics (text exposition format 0.0.4), without extra dependencies.

HTTP-side counters and latency histograms live here; token counters, finish reasons, queue and KV
gauges are read from :meth:`Engine.stats` at scrape time, so they are the engine's own numbers.
Thread-safe: observed on the event loop, rendered in a worker thread.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gemmaserve.engine.engine import EngineStats

__all__ = ["ServerMetrics", "Histogram", "TTFT_BUCKETS", "TPOT_BUCKETS", "PREFIX"]

PREFIX = "gemmaserve"
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


class Histogram:
    """Cumulative-bucket histogram (not thread-safe by itself; ServerMetrics locks around it)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        assert list(buckets) == sorted(buckets) and buckets, "buckets must be ascending"
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_num(bound)}"}} {n}' for bound, n in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        return out + [f"{name}_sum {_num(self.total)}", f"{name}_count {self.count}"]


class ServerMetrics:
    """HTTP request counts by endpoint and status, and TTFT / TPOT / end-to-end latency histograms
    (seconds, measured in the server from request arrival, so queueing is included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def record_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[(endpoint, str(status))] += 1

    def observe(self, ttft: float | None, tpot: float | None, e2e: float | None) -> None:
        with self._lock:
            for histogram, value in ((self.ttft, ttft), (self.tpot, tpot), (self.e2e, e2e)):
                if value is not None:
                    histogram.observe(value)

    def request_count(self, endpoint: str, status: int) -> int:
        with self._lock:
            return self._requests[(endpoint, str(status))]

    def render(self, stats: EngineStats) -> str:
        """The exposition text: these metrics plus the engine snapshot ``stats``."""
        out: list[str] = []
        with self._lock:
            requests = sorted(self._requests.items())
            _family(out, "requests_total", "counter", "HTTP generation requests by endpoint and status code.",
                    [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in requests])
            for name, histogram, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Request arrival to first generated token."),
                ("time_per_output_token_seconds", self.tpot, "Mean time per generated token after the first."),
                ("e2e_request_latency_seconds", self.e2e, "Request arrival to last token."),
            ):
                out += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} histogram"]
                out += histogram.lines(f"{PREFIX}_{name}")
        _engine_metrics(out, stats)
        return "\n".join(out) + "\n"


def _engine_metrics(out: list[str], stats: EngineStats) -> None:
    _family(out, "request_finished_total", "counter", "Engine requests finished, by finish reason.",
            [(f'{{reason="{reason}"}}', n) for reason, n in sorted(stats.finished.items())])
    for name, value, help_text in (
        ("prompt_tokens_total", stats.prompt_tokens, "Prompt tokens prefilled (including cached ones)."),
        ("generation_tokens_total", stats.generated_tokens, "Tokens generated."),
        ("prefix_cache_hit_tokens_total", stats.cached_tokens, "Prompt tokens served from the prefix cache."),
        ("engine_steps_total", stats.num_steps, "Scheduler ticks."),
        ("decode_failures_total", stats.decode_failures, "Batched decode steps that failed."),
        ("decode_rows_retried_total", stats.decode_rows_retried, "Rows retried alone after a failed decode step."),
    ):
        _family(out, name, "counter", help_text, [("", value)])
    hit_rate = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    _family(out, "prefix_cache_hit_rate", "gauge", "Cached / all prompt tokens since start.", [("", hit_rate)])
    _family(out, "num_requests_running", "gauge", "Requests prefilling or decoding.", [("", stats.running)])
    _family(out, "num_requests_waiting", "gauge", "Requests queued for admission.", [("", stats.waiting)])
    blocks = _kv_blocks(stats)
    for key in ("total", "used", "free"):
        if key in blocks:
            _family(out, f"kv_blocks_{key}", "gauge", f"KV blocks ({key}).", [("", blocks[key])])
    if stats.cache is not None:
        cache = stats.cache
        states = {"used": cache.used_blocks, "free": cache.free_blocks,
                  "evictable": cache.evictable_blocks, "pinned": cache.pinned_blocks}
        _family(out, "prefix_cache_blocks", "gauge", "Core prefix-cache pool blocks by state.",
                [(f'{{state="{state}"}}', n) for state, n in states.items()])
    _family(out, "backend_kv", "gauge", "The backend's own KV statistics (kv_stats), by name.",
            [(f'{{stat="{key}"}}', value) for key, value in sorted(stats.kv.items())])


def _kv_blocks(stats: EngineStats) -> dict[str, int]:
    """Block totals: the backend's ``blocks_*`` stats, else the core prefix-cache pool's."""
    kv = stats.kv
    if all(f"blocks_{key}" in kv for key in ("total", "used", "free")):
        return {key: int(kv[f"blocks_{key}"]) for key in ("total", "used", "free")}
    if stats.cache is not None:
        return {"total": stats.cache.num_blocks, "used": stats.cache.used_blocks, "free": stats.cache.free_blocks}
    return {}


def _family(out: list[str], name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]) -> None:
    full = f"{PREFIX}_{name}"
    out += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    out += [f"{full}{labels} {_num(value)}" for labels, value in samples]


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
