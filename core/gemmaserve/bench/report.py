"""Per-request records of ``gemmaserve bench`` and the summary computed from them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestRecord", "summarize", "format_report", "percentile"]

_LATENCIES = (
    ("ttft_ms", "Time to First Token"),
    ("tpot_ms", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "Inter-token Latency"),
    ("e2e_ms", "End-to-end Latency"),
)


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


def summarize(records: Sequence[RequestRecord], duration: float, config: dict[str, Any]) -> dict[str, Any]:
    """The report: counts, throughputs (per second of ``duration``), latency stats in ms."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    errors: dict[str, int] = {}
    for record in records:
        if not record.ok:
            key = record.error or f"HTTP {record.status}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "config": config,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(output_tokens + input_tokens),
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": _stats_ms([r.latency for r in ok]),
    }


def format_report(summary: dict[str, Any]) -> str:
    """The summary as the human-readable table ``gemmaserve bench`` prints."""
    def row(label: str, value: object) -> str:
        return f"{label:<42}{value}"

    lines = [
        "{s:=^60}".format(s=" Serving Benchmark Result "),
        row("Successful requests:", summary["completed"]),
        row("Failed requests:", summary["failed"]),
        row("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
        row("Total input tokens:", summary["total_input_tokens"]),
        row("Total generated tokens:", summary["total_output_tokens"]),
        row("Cached prompt tokens:", summary["cached_prompt_tokens"]),
        row("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
        row("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
        row("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"),
    ]
    for key, title in _LATENCIES:
        lines.append(f"{f' {title} ':-^60}")
        for stat in ("mean", "median", "p99"):
            value = summary[key][stat]
            label = f"{stat.capitalize()} {key.split('_')[0].upper()} (ms):"
            lines.append(row(label, "n/a" if value is None else f"{value:.2f}"))
    for error, count in sorted(summary["errors"].items()):
        lines.append(f"error x{count}: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)
