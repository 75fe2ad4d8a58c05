"""Per-request records of ``gemmaserve bench`` and the summary computed from them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestRecord", "summarize", "format_report", "percentile", "detailed_lists", "PERCENTILE_METRICS"]

_LATENCIES = (
    ("ttft_ms", "ttft", "Time to First Token"),
    ("tpot_ms", "tpot", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "itl", "Inter-token Latency"),
    ("e2e_ms", "e2el", "End-to-end Latency"),
)
"""(our nested key, vLLM's metric name, title) of each latency metric."""

PERCENTILE_METRICS = tuple(metric for _, metric, _ in _LATENCIES)
"""The metric names ``--percentile-metrics`` accepts (vLLM's)."""
DEFAULT_PERCENTILE_METRICS = PERCENTILE_METRICS
"""All four (vLLM's default leaves out e2el, which our table has always shown)."""
DEFAULT_PERCENTILES = (99.0,)


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (seconds). ``ok`` = HTTP 200 and a complete stream."""

    ok: bool = False
    status: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of sorted values (numpy's default method)."""
    assert ordered and 0.0 <= q <= 100.0
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered) * 1000,
        "median": statistics.median(ordered) * 1000,
        "p99": percentile(ordered, 99.0) * 1000,
    }


def percentile_label(q: float) -> str:
    """vLLM's spelling of a percentile in key names: ``99`` for 99.0, ``99.9`` for 99.9."""
    return str(int(q)) if int(q) == q else str(q)


def _flat_stats(metric: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """vLLM's flat keys of one metric: ``mean_<m>_ms``, ``median_<m>_ms``, ``std_<m>_ms`` (population standard
    deviation, as numpy's) and ``p<q>_<m>_ms`` per percentile; None without values."""
    ordered = sorted(values)
    ms = (lambda f: f(ordered) * 1000) if ordered else (lambda f: None)
    flat = {
        f"mean_{metric}_ms": ms(statistics.fmean),
        f"median_{metric}_ms": ms(statistics.median),
        f"std_{metric}_ms": ms(statistics.pstdev),
    }
    for q in percentiles:
        flat[f"p{percentile_label(q)}_{metric}_ms"] = ms(lambda o, q=q: percentile(o, q))
    return flat


def summarize(
    records: Sequence[RequestRecord], duration: float, config: dict[str, Any], *,
    percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The report: counts, throughputs (per second of ``duration``), latency stats in ms. Holds vLLM's keys
    (``duration``, ``errors`` as one string per request, "" when it succeeded, and the flat ``mean_ttft_ms``,
    ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``... of the ``percentile_metrics`` at ``percentiles``) and
    ours (``duration_s``, ``error_counts``, the nested ``ttft_ms: {mean, median, p99}``... of all four metrics)."""
    unknown = [metric for metric in percentile_metrics if metric not in PERCENTILE_METRICS]
    if unknown or not all(0.0 <= q <= 100.0 for q in percentiles):
        raise ValueError(f"percentile_metrics must be among {PERCENTILE_METRICS} and percentiles in [0, 100]")
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    error_counts: dict[str, int] = {}
    for record in records:
        if not record.ok:
            key = record.error or f"HTTP {record.status}"
            error_counts[key] = error_counts.get(key, 0) + 1
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    summary: dict[str, Any] = {
        "config": config,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": ["" if r.ok else (r.error or f"HTTP {r.status}") for r in records],
        "error_counts": error_counts,
        "duration": duration,
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(output_tokens + input_tokens),
        "percentile_metrics": list(percentile_metrics),
        "metric_percentiles": list(percentiles),
    }
    for nested, metric, _ in _LATENCIES:
        summary[nested] = _stats_ms(values[metric])
    for metric in percentile_metrics:
        summary |= _flat_stats(metric, values[metric], percentiles)
    return summary


def detailed_lists(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """vLLM's per-request lists of ``--save-detailed`` (seconds; 0.0 where a failed request has none)."""
    return {
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft or 0.0 for r in records],
        "itls": [list(r.itl) for r in records],
        "latencies": [r.latency for r in records],
    }


def format_report(summary: dict[str, Any]) -> str:
    """The summary as the human-readable table ``gemmaserve bench`` prints."""
    def row(label: str, value: object) -> str:
        return f"{label:<42}{value}"

    lines = [
        "{s:=^60}".format(s=" Serving Benchmark Result "),
        row("Successful requests:", summary["completed"]),
        row("Failed requests:", summary["failed"]),
        row("Benchmark duration (s):", f"{summary['duration']:.2f}"),
        row("Total input tokens:", summary["total_input_tokens"]),
        row("Total generated tokens:", summary["total_output_tokens"]),
        row("Cached prompt tokens:", summary["cached_prompt_tokens"]),
        row("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
        row("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
        row("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"),
    ]
    for _, metric, title in _LATENCIES:
        if metric not in summary["percentile_metrics"]:
            continue
        lines.append(f"{f' {title} ':-^60}")
        cells = [("Mean", summary[f"mean_{metric}_ms"]), ("Median", summary[f"median_{metric}_ms"])]
        cells += [(f"P{percentile_label(q)}", summary[f"p{percentile_label(q)}_{metric}_ms"])
                  for q in summary["metric_percentiles"]]
        for stat, value in cells:
            lines.append(row(f"{stat} {metric.upper()} (ms):", "n/a" if value is None else f"{value:.2f}"))
    for error, count in sorted(summary["error_counts"].items()):
        lines.append(f"error x{count}: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)
