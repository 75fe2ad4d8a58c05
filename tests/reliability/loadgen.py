"""Load test: many concurrent streaming requests of mixed lengths against a real gemmaserve server.

One command (loopback only; spawns ``gemmaserve serve`` with the custom-cpu backend over a tiny
random Gemma 4 checkpoint unless ``--base-url`` names a running server)::

    .venv/bin/python tests/reliability/loadgen.py --requests 512 --concurrency 256

Each request is a streamed completion or chat request with a random prompt (1-60 words, or token
ids) and a random ``max_tokens``. Every greedy streamed request also gets a non-streamed twin with
the same body. A 429 is retried after its ``Retry-After`` (a well-behaved client); the final answer
of every request must be a completed stream or a clean 429/503 with an error body. Checked
afterwards: greedy streamed text == non-streamed text, the server goes idle with integrity ok and
0 leaked KV blocks (``/debug/kv`` and ``/metrics``), and its RSS comes back near the baseline
taken after a warm-up round. Prints requests/s, TTFT percentiles and errors; exit status 1 if a
check fails. ``tests/reliability/test_load.py`` runs a small variant in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from reliability_harness import (
    LiveServer,
    StreamResult,
    assert_no_leaks,
    build_chat_checkpoint,
    post_json,
    response_text,
    rss_kib,
    stream_completion,
)

__all__ = ["SERVER_ENV", "LoadConfig", "LoadReport", "main", "run_load", "run_rounds"]

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "cat", "sleeps", "in", "warm",
    "sun", "gemma", "family", "of", "lightweight", "open", "models", "sliding", "window", "attention", "key",
    "value", "cache", "stores", "keys", "and", "values", "once", "upon", "a", "time", "village", "sea",
)
SERVER_ENV = {"BACKEND": "custom-cpu", "MAX_WAITING_REQUESTS": "160"}
"""The load server: default batch size (64), a queue bound low enough that a 256-request burst
meets 429s."""


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """One round of load. ``max_tokens`` is the largest output length (each request draws 1..it)."""

    requests: int = 256
    concurrency: int = 256
    max_tokens: int = 16
    max_prompt_words: int = 60
    greedy_fraction: float = 0.5
    chat_fraction: float = 0.2
    seed: int = 0
    request_timeout_s: float = 300.0
    max_429_retries: int = 50


@dataclass(slots=True)
class _Spec:
    index: int
    path: str
    body: dict[str, Any]
    greedy: bool


@dataclass(slots=True)
class LoadReport:
    """Figures of one round. ``problems()`` lists what broke the rules (empty = passed)."""

    requests: int
    concurrency: int
    duration_s: float = 0.0
    completed: int = 0
    rejected: int = 0
    retried_429: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    greedy_pairs: int = 0
    greedy_mismatches: list[int] = field(default_factory=list)
    tokens: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.duration_s if self.duration_s else 0.0

    def ttft_percentile(self, q: float) -> float | None:
        if not self.ttft_s:
            return None
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def problems(self) -> list[str]:
        out = list(self.errors[:20])
        if self.greedy_mismatches:
            out.append(f"greedy streamed != non-streamed text for requests {self.greedy_mismatches[:20]}")
        if self.completed + self.rejected != self.requests:
            out.append(f"{self.requests} requests but {self.completed} completed + {self.rejected} rejected")
        return out

    def summary(self) -> dict[str, Any]:
        p50, p99 = self.ttft_percentile(0.5), self.ttft_percentile(0.99)
        return {
            "requests": self.requests, "concurrency": self.concurrency, "duration_s": round(self.duration_s, 2),
            "completed": self.completed, "rejected_429_503": self.rejected, "retried_429": self.retried_429,
            "errors": len(self.errors), "requests_per_s": round(self.requests_per_s, 2),
            "ttft_p50_s": None if p50 is None else round(p50, 3), "ttft_p99_s": None if p99 is None else round(p99, 3),
            "greedy_pairs": self.greedy_pairs, "greedy_mismatches": len(self.greedy_mismatches),
            "streamed_chunks": self.tokens,
        }


def _plan(config: LoadConfig) -> list[_Spec]:
    rng = random.Random(config.seed)
    specs = []
    for index in range(config.requests):
        greedy = rng.random() < config.greedy_fraction
        params: dict[str, Any] = {"max_tokens": rng.randint(1, config.max_tokens), "ignore_eos": rng.random() < 0.7}
        params.update({"temperature": 0.0} if greedy else {"temperature": 0.8, "top_p": 0.9, "seed": index})
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, config.max_prompt_words)))
        if rng.random() < config.chat_fraction:
            specs.append(_Spec(index, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": f"{index}: {words}"}], **params}, greedy))
        elif rng.random() < 0.2:
            prompt = [rng.randrange(4, 512) for _ in range(rng.randint(1, 4 * config.max_prompt_words))]
            specs.append(_Spec(index, "/v1/completions", {"prompt": prompt, **params}, greedy))
        else:
            specs.append(_Spec(index, "/v1/completions", {"prompt": f"{index} {words}", **params}, greedy))
    return specs


async def _with_retries(config: LoadConfig, report: LoadReport, call: Any) -> Any:
    """Run ``call()`` until it is not a 429 (sleeping Retry-After), at most max_429_retries times."""
    for _ in range(config.max_429_retries):
        status, result = await call()
        if status != 429:
            return status, result
        report.retried_429 += 1
        await asyncio.sleep(float(_retry_after(result) or 1))
    return status, result


def _retry_after(result: Any) -> str | None:
    return result.retry_after if isinstance(result, StreamResult) else None


async def _run_one(client: httpx.AsyncClient, spec: _Spec, config: LoadConfig, report: LoadReport,
                   twins: dict[int, tuple[str, str]]) -> None:
    async def streamed() -> tuple[int, StreamResult]:
        result = await stream_completion(client, spec.path, spec.body)
        return result.status, result

    async def plain() -> tuple[int, dict[str, Any]]:
        return await post_json(client, spec.path, spec.body)

    try:
        status, result = await _with_retries(config, report, streamed)
        if status in (429, 503):
            report.rejected += 1
            if not (result.error and result.error.get("message")):
                report.errors.append(f"request {spec.index}: {status} without an error message")
            return
        if status != 200 or result.error or not result.done or result.finish_reason not in ("stop", "length"):
            report.errors.append(f"request {spec.index}: status {status}, error {result.error}, done {result.done}")
            return
        report.completed += 1
        report.tokens += result.chunks
        if result.ttft is not None:
            report.ttft_s.append(result.ttft)
        if spec.greedy:
            twin_status, payload = await _with_retries(config, report, plain)
            if twin_status == 200:
                twins[spec.index] = (result.text, response_text(spec.path, payload))
            elif twin_status not in (429, 503):
                report.errors.append(f"twin of request {spec.index}: status {twin_status}: {payload}")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        report.errors.append(f"request {spec.index}: {type(exc).__name__}: {exc}")


async def run_load(base_url: str, config: LoadConfig) -> LoadReport:
    """One round: ``config.requests`` requests, at most ``config.concurrency`` in flight."""
    report = LoadReport(config.requests, config.concurrency)
    specs = _plan(config)
    gate = asyncio.Semaphore(config.concurrency)
    twins: dict[int, tuple[str, str]] = {}
    # idle connections expire well before uvicorn's 5 s keep-alive timeout closes them, so a POST
    # never goes out on a connection the server is closing (a client-side race, not a server fault)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=1.0)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30)

    async def gated(spec: _Spec) -> None:
        async with gate:
            await _run_one(client, spec, config, report, twins)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(gated(spec) for spec in specs))
        report.duration_s = time.monotonic() - start
    report.greedy_pairs = len(twins)
    report.greedy_mismatches = sorted(i for i, (streamed, plain) in twins.items() if streamed != plain)
    return report


@dataclass(slots=True)
class RoundsResult:
    """Warm-up, then ``rounds`` measured rounds; leak figures and RSS (KiB) after each."""

    baseline_rss_kib: int | None
    reports: list[LoadReport] = field(default_factory=list)
    leak_figures: list[dict[str, Any]] = field(default_factory=list)
    rss_after_kib: list[int] = field(default_factory=list)
    peak_rss_kib: int | None = None

    def rss_growth_kib(self) -> int | None:
        if self.baseline_rss_kib is None or not self.rss_after_kib:
            return None
        return self.rss_after_kib[-1] - self.baseline_rss_kib


def run_rounds(base_url: str, pid: int | None, config: LoadConfig, *, rounds: int, warmup: int) -> RoundsResult:
    """Warm up (``warmup`` requests), take the RSS baseline, run ``rounds`` rounds; after each,
    wait for idle and assert no leaks (AssertionError otherwise)."""
    warm = LoadConfig(**{**asdict(config), "requests": warmup, "seed": config.seed + 10_000})
    if warmup:
        asyncio.run(run_load(base_url, warm))
    assert_no_leaks(base_url)
    result = RoundsResult(rss_kib(pid) if pid else None)
    for number in range(rounds):
        this = LoadConfig(**{**asdict(config), "seed": config.seed + number})
        sampler = _PeakRss(pid)
        report = asyncio.run(sampler.around(run_load(base_url, this)))
        result.reports.append(report)
        result.leak_figures.append(assert_no_leaks(base_url))
        if pid:
            result.rss_after_kib.append(rss_kib(pid))
            result.peak_rss_kib = max(result.peak_rss_kib or 0, sampler.peak)
    return result


class _PeakRss:
    """Samples a process's RSS every 100 ms while a coroutine runs."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.peak = 0

    async def around(self, coro: Any) -> Any:
        task = asyncio.ensure_future(coro)
        while self.pid and not task.done():
            self.peak = max(self.peak, rss_kib(self.pid))
            await asyncio.wait({task}, timeout=0.1)
        return await task


# -- the command ----------------------------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=512, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens drawn")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds (RSS is checked after the last)")
    parser.add_argument("--warmup", type=int, default=64, help="warm-up requests before the RSS baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-tolerance-mib", type=float, default=64.0,
                        help="allowed RSS above the post-warm-up baseline after the last round")
    parser.add_argument("--base-url", help="use this running server instead of spawning one")
    parser.add_argument("--pid", type=int, help="the --base-url server's pid, for the RSS check")
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    return parser.parse_args(argv)


def _spawn(workdir: Path) -> LiveServer:
    print("building the tiny checkpoint and starting gemmaserve serve (custom-cpu) ...", flush=True)
    checkpoint = build_chat_checkpoint(workdir / "tiny-gemma4")
    return LiveServer({**SERVER_ENV, "MODEL": str(checkpoint)}, workdir).wait_healthy()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    config = LoadConfig(requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
                        seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="gemmaserve-load-") as tmp:
        server = None if args.base_url else _spawn(Path(tmp))
        base_url = args.base_url or server.base_url
        pid = args.pid if args.base_url else server.process.pid
        try:
            result = run_rounds(base_url, pid, config, rounds=args.rounds, warmup=args.warmup)
        except AssertionError as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            if server is not None:
                server.stop()
    problems = [problem for report in result.reports for problem in report.problems()]
    growth = result.rss_growth_kib()
    if growth is not None and growth > args.rss_tolerance_mib * 1024:
        problems.append(f"RSS grew {growth / 1024:.1f} MiB over the baseline (tolerance {args.rss_tolerance_mib} MiB)")
    figures = {
        "rounds": [report.summary() for report in result.reports],
        "leaks": result.leak_figures,
        "rss_baseline_mib": _mib(result.baseline_rss_kib), "rss_after_mib": [_mib(k) for k in result.rss_after_kib],
        "rss_peak_mib": _mib(result.peak_rss_kib), "problems": problems,
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print("PASSED" if not problems else "FAILED:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


if __name__ == "__main__":
    sys.exit(main())
