"""Client-side serving benchmark against a running OpenAI-compatible server (like ``vllm bench serve``).

Random token-id prompts of a set input length and a set output length (``ignore_eos``), sent at a
request rate (Poisson / gamma arrivals) and/or bounded concurrency, streamed over
``/v1/completions``. Reports request throughput, output tokens/s, TTFT / TPOT / ITL / end-to-end
mean, median and percentiles, and optionally writes the summary as JSON (with ``vllm bench serve``'s keys).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmaserve.bench.dataset import BenchRequest, arrival_gaps, random_requests
from gemmaserve.bench.report import (
    DEFAULT_PERCENTILE_METRICS, DEFAULT_PERCENTILES, PERCENTILE_METRICS, RequestRecord, detailed_lists, format_report,
    summarize,
)

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
    api_key: str | None = field(default=None, repr=False)
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS
    metric_percentiles: tuple[float, ...] = DEFAULT_PERCENTILES

    def as_json(self) -> dict[str, Any]:
        """The config as the result JSON records it: the API key is never written, only whether one was sent."""
        data = asdict(self)
        data["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        data["api_key"] = "set" if self.api_key else None
        data["percentile_metrics"] = list(self.percentile_metrics)
        data["metric_percentiles"] = list(self.metric_percentiles)
        return data

    def headers(self) -> dict[str, str]:
        """``Authorization: Bearer <api_key>`` when a key is set (what a server started with ``--api-key`` needs)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def server_root(base_url: str) -> str:
    """The server's root URL from ``--base-url`` given with or without the OpenAI client's ``/v1`` suffix
    (``http://h:8000``, ``http://h:8000/``, ``http://h:8000/v1`` and ``http://h:8000/v1/`` all give
    ``http://h:8000``); the benchmark adds ``/v1/models`` and ``/v1/completions`` itself."""
    root = base_url.strip().rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def run_benchmark(config: BenchConfig, *, progress: bool = True, detailed: bool = False) -> dict[str, Any]:
    """Run the workload against ``config.base_url`` and return the summary (``per_request`` and vLLM's per-request
    lists too when ``detailed``). Raises BenchError if the server cannot be queried for its model (401: the key)."""
    import httpx
    from tqdm import tqdm

    base = server_root(config.base_url)
    connections = config.max_concurrency or config.num_prompts
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = config.headers()
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits, headers=headers) as client:
        model, vocab_size = await _model_info(client, base, config.model, bool(config.api_key))
        token_ids = None if vocab_size is not None else await _vocabulary_sample(client, base, model, config.seed)
        requests = random_requests(
            config.num_prompts, config.input_len, config.output_len, vocab_size or 2,
            range_ratio=config.range_ratio, seed=config.seed, token_ids=token_ids,
        )
        limiter = asyncio.Semaphore(connections)
        bar = tqdm(total=config.num_prompts, disable=not progress, desc="requests", unit="req")

        async def limited(request: BenchRequest) -> RequestRecord:
            async with limiter:
                record = await _one_request(client, base, model, request, timeout_s=config.timeout_s)
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
    summary = summarize(records, duration, config.as_json() | {"model": model},
                        percentile_metrics=config.percentile_metrics, percentiles=config.metric_percentiles)
    if detailed:
        summary |= detailed_lists(records)
        summary["per_request"] = [asdict(record) for record in records]
    return summary


async def _model_info(client: httpx.AsyncClient, base: str, model: str | None, keyed: bool) -> tuple[str, int | None]:
    """The model to ask for (``model``, else the server's first) and the server's ``vocab_size`` (None when its
    /v1/models does not say, as vLLM's does not). ``keyed``: whether an API key was sent (for the 401 message)."""
    try:
        response = await client.get(f"{base}/v1/models")
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise BenchError(f"cannot query {base}/v1/models ({reason}); is the server running?") from None
    if response.status_code == 401:
        raise BenchError(
            f"{base}/v1/models answered 401: the API key sent (--api-key, else OPENAI_API_KEY) was refused; give "
            "the key the server was started with" if keyed else
            f"{base}/v1/models answered 401: the server needs an API key; give it with --api-key KEY (or set "
            "OPENAI_API_KEY), the key the server was started with (its --api-key)")
    try:
        response.raise_for_status()
        card = response.json()["data"][0]
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise BenchError(f"cannot query {base}/v1/models ({reason}); is the server running?") from None
    vocab_size = card.get("vocab_size")
    return model or str(card["id"]), int(vocab_size) if vocab_size else None


_SAMPLE_WORDS = 1000
"""Random words tokenized to learn ids of a server that does not state its vocabulary size."""
_WORDS_PER_CALL = 32
"""Words per /tokenize call: few enough for a short context (a call refused as too long is retried with half)."""


async def _vocabulary_sample(client: httpx.AsyncClient, base: str, model: str, seed: int) -> list[int]:
    """Distinct token ids of ``model``'s vocabulary, from ``/tokenize`` (vLLM's and ours) of random lowercase
    words: for a server whose /v1/models has no ``vocab_size`` (any id guessed beyond its vocabulary is a 400).
    Raises BenchError when /tokenize is not served."""
    rng = random.Random(seed + 2)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(_SAMPLE_WORDS)]
    ids: set[int] = set()
    per_call, start = _WORDS_PER_CALL, 0
    while start < len(words):
        try:
            response = await client.post(f"{base}/tokenize", json={
                "model": model, "prompt": " ".join(words[start:start + per_call]), "add_special_tokens": False})
            if response.status_code == 400 and per_call > 1:
                per_call //= 2  # longer than the model's context, perhaps
                continue
            response.raise_for_status()
            ids.update(int(token) for token in response.json()["tokens"])
        except Exception as exc:
            raise BenchError(f"{base}/v1/models states no vocab_size and {base}/tokenize failed "
                             f"({type(exc).__name__}: {exc}): the benchmark cannot tell which token ids the model "
                             "has; serve /tokenize (vLLM and gemmaserve do) or a vocab_size in /v1/models") from None
        start += per_call
    if not ids:
        raise BenchError(f"{base}/tokenize returned no tokens for {_SAMPLE_WORDS} random words")
    return sorted(ids)


async def _one_request(
    client: httpx.AsyncClient, base: str, model: str, request: BenchRequest, *, timeout_s: float | None = None,
) -> RequestRecord:
    """Stream one completion; every chunk with a choice is a token arrival (TTFT, then ITL). ``timeout_s`` bounds
    the whole request, from sending it to ``[DONE]``: a request still running then is cancelled and recorded as
    failed (timed out)."""
    record = RequestRecord(prompt_tokens=len(request.prompt_ids))
    try:
        await asyncio.wait_for(_stream(client, base, model, request, record), timeout_s)
    except asyncio.TimeoutError:
        record.ok = False
        record.error = f"timed out after {timeout_s:g} s (--timeout bounds each request, sent to [DONE])"
    return record


async def _stream(client: httpx.AsyncClient, base: str, model: str, request: BenchRequest,
                  record: RequestRecord) -> None:
    """Fill ``record`` from one streamed completion (its ``ok`` is set last, when ``[DONE]`` arrived)."""
    body = {
        "model": model, "prompt": request.prompt_ids, "max_tokens": request.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {_error_message(text)}"
                return
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
                    return
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
            return
        record.latency = time.perf_counter() - start
        record.output_tokens = record.output_tokens or chunks
        record.ok = True
    except Exception as exc:  # network errors count as failed requests, not benchmark crashes
        record.error = f"{type(exc).__name__}: {exc}"


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


def _dataset_name(value: str) -> str:
    if value != "random":
        raise argparse.ArgumentTypeError(f"only 'random' (random token ids of --input-len) is implemented, got "
                                         f"{value!r}; vLLM's file and Hugging Face datasets are not")
    return value


def _percentile_metrics(value: str) -> tuple[str, ...]:
    metrics = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [metric for metric in metrics if metric not in PERCENTILE_METRICS]
    if not metrics or unknown:
        raise argparse.ArgumentTypeError(f"comma-separated metric names among {', '.join(PERCENTILE_METRICS)}, "
                                         f"got {value!r}")
    return metrics


def _metric_percentiles(value: str) -> tuple[float, ...]:
    try:
        percentiles = tuple(float(part) for part in value.split(",") if part.strip())
    except ValueError:
        percentiles = ()
    if not percentiles or not all(0.0 <= q <= 100.0 for q in percentiles):
        raise argparse.ArgumentTypeError(f"comma-separated percentiles in [0, 100] (e.g. '50,90,99'), got {value!r}")
    return percentiles


def _endpoint(value: str) -> str:
    if value.rstrip("/") != "/v1/completions":
        raise argparse.ArgumentTypeError(f"only /v1/completions (streamed, token-id prompts) is benchmarked, got "
                                         f"{value!r}")
    return value


def _base_url(args: argparse.Namespace) -> str:
    """``--base-url``, else vLLM's ``--host`` / ``--port`` (127.0.0.1:8000); both forms at once are refused."""
    if args.base_url is not None and (args.host is not None or args.port is not None):
        raise BenchError("give the server either as --base-url URL or as --host / --port, not both")
    if args.base_url is not None:
        return str(args.base_url)
    host = args.host or "127.0.0.1"
    return f"http://[{host}]:{args.port or 8000}" if ":" in host else f"http://{host}:{args.port or 8000}"


def result_path(args: argparse.Namespace, summary: dict[str, Any], now: datetime | None = None) -> Path | None:
    """Where the JSON goes: ``--result-file``; else with ``--save-result`` (implied by ``--result-dir`` /
    ``--result-filename``) ``--result-filename`` or vLLM's name ``openai-<rate>qps[-concurrency<N>]-<model>-<time>
    .json``, in ``--result-dir`` (default: the current directory); None: no file."""
    if args.result_file:
        return Path(args.result_file)
    if not (args.save_result or args.result_dir or args.result_filename):
        return None
    name = args.result_filename
    if not name:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model = str(summary["config"]["model"]).split("/")[-1]
        stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
        name = f"openai-{args.request_rate}qps{concurrency}-{model}-{stamp}.json"
    return Path(args.result_dir or ".") / name


def _check_bench_args(args: argparse.Namespace) -> None:
    """Refuse combinations that would drop an option (BenchError naming what to change)."""
    saving = args.save_result or args.result_dir or args.result_filename
    if args.result_file and saving:
        raise BenchError("--result-file FILE names the JSON file itself: drop --save-result / --result-dir / "
                         "--result-filename (vLLM's way to name it), or use those instead of --result-file")
    if args.save_detailed and not (args.result_file or saving):
        raise BenchError("--save-detailed adds per-request records to the JSON of --result-file (or --save-result); "
                         "give --result-file FILE or --save-result")


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        _check_bench_args(args)
        base_url = _base_url(args)
    except BenchError as exc:
        print(f"gemmaserve bench: error: {exc}", file=sys.stderr)
        return 2
    config = BenchConfig(
        base_url=base_url, model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.random_range_ratio, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed, timeout_s=args.timeout,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        percentile_metrics=args.percentile_metrics, metric_percentiles=args.metric_percentiles,
    )
    try:
        summary = asyncio.run(run_benchmark(config, progress=not args.no_progress, detailed=args.save_detailed))
    except BenchError as exc:
        print(f"gemmaserve bench: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(summary))
    path = result_path(args, summary)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"results written to {path}")
    return 0 if summary["completed"] else 1


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """Register ``gemmaserve bench``: its flags, and ``vllm bench serve``'s names for the same things."""
    p = sub.add_parser("bench", help="client-side serving benchmark against a running server")
    p.add_argument("--base-url", default=None,
                   help="server address, with or without /v1 (default: http://127.0.0.1:8000, or --host / --port)")
    p.add_argument("--host", default=None, help="server host, when --base-url is not given (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="server port, when --base-url is not given (default 8000)")
    p.add_argument("--endpoint", type=_endpoint, default="/v1/completions",
                   help="only /v1/completions is benchmarked (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="send 'Authorization: Bearer KEY', for a server started with "
                   "--api-key (default: env OPENAI_API_KEY, as vllm bench serve reads it; unset = no header)")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--dataset-name", type=_dataset_name, default="random",
                   help="only 'random' is implemented: random token ids (default: %(default)s)")
    p.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send (default %(default)s)")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=_positive_int, default=128,
                   help="prompt tokens, random ids (default %(default)s; vLLM's default is 1024)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=_positive_int, default=64,
                   help="tokens per request, EOS ignored (default %(default)s; vLLM's default is 128)")
    p.add_argument("--random-range-ratio", type=_ratio, default=0.0,
                   help="draw lengths uniformly from len*(1-r)..len*(1+r) (default %(default)s)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="accepted for vLLM's command lines: every request already sends ignore_eos")
    p.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="requests/s; inf sends all at once (default %(default)s)")
    p.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of arrival gaps; 1 = Poisson (default %(default)s)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="cap on requests in flight (default: no cap)")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (default %(default)s)")
    p.add_argument("--timeout", type=_positive_float, default=600.0,
                   help="seconds each request may take, from sending it to its last token; later ones are cancelled "
                   "and count as failed (default %(default)s)")
    p.add_argument("--percentile-metrics", type=_percentile_metrics, default=DEFAULT_PERCENTILE_METRICS,
                   help="comma-separated metrics to report percentiles of, among "
                   f"{','.join(PERCENTILE_METRICS)} (default: all four; vLLM's default leaves out e2el)")
    p.add_argument("--metric-percentiles", type=_metric_percentiles, default=DEFAULT_PERCENTILES,
                   help="comma-separated percentiles of those metrics, e.g. 50,90,99 (default 99)")
    p.add_argument("--result-file", default=None, help="write the summary as JSON here (default: not written)")
    p.add_argument("--save-result", action="store_true", help="write the summary as JSON under vLLM's file name "
                   "(openai-<rate>qps[-concurrency<N>]-<model>-<time>.json) in --result-dir")
    p.add_argument("--result-dir", default=None, help="folder of --save-result's file, which it implies (default: "
                   "the current one)")
    p.add_argument("--result-filename", default=None, help="file name for --save-result, which it implies (default: "
                   "vLLM's name)")
    p.add_argument("--save-detailed", action="store_true",
                   help="include per-request records in the JSON (needs --result-file or --save-result)")
    p.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                   help="no progress bar")
    p.set_defaults(func=_cmd_bench)
