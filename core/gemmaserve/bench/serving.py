"""Client-side serving benchmark against a running OpenAI-compatible server (like ``vllm bench serve``).

Random token-id prompts of a set input length and a set output length (``ignore_eos``), sent at a
request rate (Poisson / gamma arrivals) and/or bounded concurrency, streamed over
``/v1/completions``. Reports request throughput, output tokens/s, TTFT / TPOT / ITL / end-to-end
mean, median and p99, and optionally writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmaserve.bench.dataset import BenchRequest, arrival_gaps, random_requests
from gemmaserve.bench.report import RequestRecord, format_report, summarize

if TYPE_CHECKING:
    import httpx

__all__ = ["BenchConfig", "BenchError", "run_benchmark", "add_bench_command"]


class BenchError(Exception):
    """The benchmark cannot run (server unreachable, bad answer from /v1/models)."""


@dataclass(slots=True)
class BenchConfig:
    """What to send. ``request_rate`` inf = all requests at once; ``max_concurrency`` None = no cap."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return data


def server_root(base_url: str) -> str:
    """The server's root URL from ``--base-url`` given with or without the OpenAI client's ``/v1`` suffix
    (``http://h:8000``, ``http://h:8000/``, ``http://h:8000/v1`` and ``http://h:8000/v1/`` all give
    ``http://h:8000``); the benchmark adds ``/v1/models`` and ``/v1/completions`` itself."""
    root = base_url.strip().rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def run_benchmark(config: BenchConfig, *, progress: bool = True, detailed: bool = False) -> dict[str, Any]:
    """Run the workload against ``config.base_url`` and return the summary (``per_request`` too
    when ``detailed``). Raises BenchError if the server cannot be queried for its model."""
    import httpx
    from tqdm import tqdm

    base = server_root(config.base_url)
    connections = config.max_concurrency or config.num_prompts
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
        model, vocab_size = await _model_info(client, base, config.model)
        requests = random_requests(
            config.num_prompts, config.input_len, config.output_len, vocab_size,
            range_ratio=config.range_ratio, seed=config.seed,
        )
        limiter = asyncio.Semaphore(connections)
        bar = tqdm(total=config.num_prompts, disable=not progress, desc="requests", unit="req")

        async def limited(request: BenchRequest) -> RequestRecord:
            async with limiter:
                record = await _one_request(client, base, model, request)
            bar.update(1)
            return record

        gaps = arrival_gaps(config.request_rate, config.burstiness, seed=config.seed)
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(limited(request)))
            gap = next(gaps)
            if gap > 0:
                await asyncio.sleep(gap)
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    summary = summarize(records, duration, config.as_json() | {"model": model})
    if detailed:
        summary["per_request"] = [asdict(record) for record in records]
    return summary


async def _model_info(client: httpx.AsyncClient, base: str, model: str | None) -> tuple[str, int]:
    try:
        response = await client.get(f"{base}/v1/models")
        response.raise_for_status()
        card = response.json()["data"][0]
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise BenchError(f"cannot query {base}/v1/models ({reason}); is the server running?") from None
    return model or str(card["id"]), int(card.get("vocab_size") or 32000)


async def _one_request(client: httpx.AsyncClient, base: str, model: str, request: BenchRequest) -> RequestRecord:
    """Stream one completion; every chunk with a choice is a token arrival (TTFT, then ITL)."""
    body = {
        "model": model, "prompt": request.prompt_ids, "max_tokens": request.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    record = RequestRecord(prompt_tokens=len(request.prompt_ids))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {_error_message(text)}"
                return record
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"in-stream error: {chunk['error'].get('message', chunk['error'])}"
                    return record
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                    record.output_tokens = usage.get("completion_tokens", 0)
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if record.ttft is None:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    chunks += 1
        if not done:
            record.error = "the stream ended without data: [DONE]"
            return record
        record.latency = time.perf_counter() - start
        record.output_tokens = record.output_tokens or chunks
        record.ok = True
    except Exception as exc:  # network errors count as failed requests, not benchmark crashes
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except Exception:
        return text[:300]


# -- CLI ------------------------------------------------------------------------------------------
def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (or inf), got {value}")
    return number


def _ratio(value: str) -> float:
    number = float(value)
    if not 0.0 <= number < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return number


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.save_detailed and not args.result_file:
        print("gemmaserve bench: error: --save-detailed adds per-request records to the JSON of --result-file; "
              "give --result-file FILE", file=sys.stderr)
        return 2
    config = BenchConfig(
        base_url=args.base_url, model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.random_range_ratio, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed, timeout_s=args.timeout,
    )
    try:
        summary = asyncio.run(run_benchmark(config, progress=not args.no_progress, detailed=args.save_detailed))
    except BenchError as exc:
        print(f"gemmaserve bench: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(summary))
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"results written to {path}")
    return 0 if summary["completed"] else 1


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """Register ``gemmaserve bench``."""
    p = sub.add_parser("bench", help="client-side serving benchmark against a running server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server address, with or without /v1 (default %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send (default %(default)s)")
    p.add_argument("--input-len", type=_positive_int, default=128,
                   help="prompt tokens, random ids (default %(default)s)")
    p.add_argument("--output-len", type=_positive_int, default=64,
                   help="tokens per request, EOS ignored (default %(default)s)")
    p.add_argument("--random-range-ratio", type=_ratio, default=0.0,
                   help="draw lengths uniformly from len*(1-r)..len*(1+r) (default %(default)s)")
    p.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="requests/s; inf sends all at once (default %(default)s)")
    p.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of arrival gaps; 1 = Poisson (default %(default)s)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None, help="cap on requests in flight (default: no cap)")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (default %(default)s)")
    p.add_argument("--timeout", type=_positive_float, default=600.0,
                   help="per-request timeout, s (default %(default)s)")
    p.add_argument("--result-file", default=None, help="write the summary as JSON here (default: not written)")
    p.add_argument("--save-detailed", action="store_true",
                   help="include per-request records in the JSON (needs --result-file)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench)
