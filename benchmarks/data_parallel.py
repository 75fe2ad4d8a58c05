"""Data-parallel replicas behind vllm-router under shared-prefix traffic (docs/scaling.md's figures, CPU, loopback).

For each ``--policies`` entry: starts ``gemmaserve serve --data-parallel-size N --router-policy P`` on a free
loopback port, sends ``--requests`` streamed completions (the requests and report of ``gemmaserve bench``) whose
token-id prompts are one of ``--groups`` shared prefixes plus a unique suffix, in a seeded random order at
``--concurrency``, and reads every replica's ``/metrics`` before and after: prefix-cache hit rate
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, tokens) and requests per replica.
With ``--kill-after S`` a last cache_aware run SIGKILLs replica 0 S seconds into the load and reports what the
clients saw and when the replica was back behind the router.

    python benchmarks/data_parallel.py --tiny --replicas 3 --kill-after 3 --result-file out.json

``--tiny`` builds the tests' tiny random Gemma 4 checkpoint (tests/tiny_checkpoints.py) in a temp folder;
``--model DIR`` serves a checkpoint of yours. ``gemmaserve bench`` itself has no shared-prefix dataset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from gemmaserve.bench.dataset import BenchRequest
from gemmaserve.bench.report import RequestRecord, format_report, summarize
from gemmaserve.bench.serving import _one_request
from gemmaserve.server.data_parallel import REPLICA_LOG_LINE



def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Launcher:
    """``gemmaserve serve --data-parallel-size N`` as a subprocess, its output in ``log_path``."""

    def __init__(self, model: str, replicas: int, policy: str, backend: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.size = replicas
        self.log_path = workdir / f"dp-{policy}-{self.port}.log"
        env = {**os.environ, "MODEL": model, "DEVICE": "cpu", "DTYPE": "float32", "BACKEND": backend,
               "LOG_LEVEL": "info"}
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gemmaserve", "serve", "--data-parallel-size", str(replicas), "--router-policy",
             policy, "--host", "127.0.0.1", "--port", str(self.port)], env=env, stdout=self._log,
            stderr=subprocess.STDOUT)

    def replicas(self) -> dict[int, tuple[int, int]]:
        """index -> (pid, port) of each replica's latest process."""
        self._log.flush()
        found: dict[int, tuple[int, int]] = {}
        for match in REPLICA_LOG_LINE.finditer(self.log_path.read_text(errors="replace")):
            found[int(match.group(1))] = (int(match.group(2) or match.group(3)), int(match.group(4)))
        return found

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the launcher exited with {self.process.returncode}; see {self.log_path}")
        try:
            workers = httpx.get(f"{self.url}/workers", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        return workers["total"] == self.size and all(worker["is_healthy"] for worker in workers["workers"])

    def wait_ready(self, timeout: float = 300.0) -> float:
        start = time.monotonic()
        while not self.ready():
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"not ready after {timeout} s; see {self.log_path}")
            time.sleep(0.25)
        return time.monotonic() - start

    def stop(self) -> int | None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        return self.process.returncode


def scrape(port: int) -> dict[str, float]:
    """The replica's counters (and its running requests) this benchmark reads, summed over label sets."""
    wanted = {"vllm:prefix_cache_hits_total": "hits", "vllm:prefix_cache_queries_total": "queries",
              "vllm:e2e_request_latency_seconds_count": "requests", "vllm:prompt_tokens_total": "prompt_tokens",
              "vllm:num_requests_running": "running"}
    totals = dict.fromkeys(wanted.values(), 0.0)
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def shared_prefix_requests(groups: int, prefix_len: int, suffix_len: int, output_len: int, count: int,
                           vocab: int, seed: int) -> list[BenchRequest]:
    """``count`` requests, ``count // groups`` per prefix group, shuffled (seeded): prefix + unique suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(prefix_len)] for _ in range(groups)]
    requests = [BenchRequest(prefixes[i % groups] + [rng.randrange(100, vocab) for _ in range(suffix_len)],
                             output_len) for i in range(count)]
    rng.shuffle(requests)
    return requests


async def send(url: str, requests: list[BenchRequest], concurrency: int,
               during: Any = None) -> tuple[list[RequestRecord], float]:
    """Stream every request through the router; ``during`` (a coroutine) runs alongside the load."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)

        async def one(request: BenchRequest) -> RequestRecord:
            async with gate:
                return await _one_request(client, url, model, request)

        start = time.perf_counter()
        side = asyncio.create_task(during) if during is not None else None
        records = await asyncio.gather(*(one(request) for request in requests))
        if side is not None:
            await side
        return list(records), time.perf_counter() - start


def run_policy(args: argparse.Namespace, model: str, policy: str, workdir: Path, kill_after: float | None = None
               ) -> dict[str, Any]:
    launcher = Launcher(model, args.replicas, policy, args.backend, workdir)
    try:
        startup_s = launcher.wait_ready()
        replicas = launcher.replicas()
        before = {index: scrape(port) for index, (_, port) in replicas.items()}
        requests = shared_prefix_requests(args.groups, args.prefix_len, args.suffix_len, args.output_len,
                                          args.requests, args.vocab, args.seed)
        kill: dict[str, Any] = {}

        async def killer() -> None:
            assert kill_after is not None
            await asyncio.sleep(kill_after)
            pid, port = replicas[0]
            kill["running_on_victim"] = scrape(port)["running"]
            os.kill(pid, signal.SIGKILL)
            kill["killed_at_s"] = kill_after
            kill["killed_at"] = time.monotonic()

        records, duration = asyncio.run(send(launcher.url, requests, args.concurrency,
                                             killer() if kill_after is not None else None))
        if kill_after is not None:
            while launcher.replicas()[0][0] == replicas[0][0] or not launcher.ready():
                time.sleep(0.25)
            kill["back_behind_router_after_s"] = round(time.monotonic() - kill.pop("killed_at"), 1)
            replicas = launcher.replicas()
            before[0] = dict.fromkeys(before[0], 0.0)  # a new process: its counters start at 0
        after = {index: scrape(port) for index, (_, port) in replicas.items()}
        per_replica = {index: {key: after[index][key] - before[index][key] for key in after[index]}
                       for index in after}
        hits = sum(replica["hits"] for replica in per_replica.values())
        queries = sum(replica["queries"] for replica in per_replica.values())
        summary = summarize(records, duration, {"policy": policy, "replicas": args.replicas, "groups": args.groups,
                                                "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                                                "output_len": args.output_len, "requests": args.requests,
                                                "concurrency": args.concurrency, "seed": args.seed})
        summary.update(startup_s=round(startup_s, 1), prefix_cache_hit_rate=hits / queries if queries else 0.0,
                       requests_per_replica={index: int(replica["requests"]) for index, replica in per_replica.items()},
                       hit_rate_per_replica={index: replica["hits"] / replica["queries"] if replica["queries"] else 0.0
                                             for index, replica in per_replica.items()}, kill=kill or None)
        return summary
    finally:
        launcher.stop()


def tiny_checkpoint(workdir: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import tiny_checkpoints

    return str(tiny_checkpoints.build_tiny_gemma4(workdir / "tiny-gemma4"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory to serve")
    source.add_argument("--tiny", action="store_true", help="the tests' tiny random Gemma 4 (vocab 512)")
    parser.add_argument("--backend", default="custom-cpu", help="BACKEND of the replicas (default %(default)s)")
    parser.add_argument("--replicas", type=int, default=3, help="--data-parallel-size (default %(default)s)")
    parser.add_argument("--policies", nargs="*", default=["cache_aware", "round_robin"],
                        help="policies to compare; none: only the --kill-after run (default: %(default)s)")
    parser.add_argument("--groups", type=int, default=32, help="shared prefixes (default %(default)s)")
    parser.add_argument("--prefix-len", type=int, default=192, help="tokens per shared prefix (default %(default)s)")
    parser.add_argument("--suffix-len", type=int, default=16, help="unique tokens per request (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=8, help="tokens generated, EOS ignored (default %(default)s)")
    parser.add_argument("--requests", type=int, default=192, help="requests per run (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=6, help="requests in flight (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=512, help="token ids drawn below this (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-after", type=float, default=None,
                        help="also run cache_aware once more and SIGKILL replica 0 this many s into the load")
    parser.add_argument("--result-file", default=None, help="write every summary here as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gemmaserve-dp-bench-") as tmp:
        workdir = Path(tmp)
        model = tiny_checkpoint(workdir) if args.tiny else args.model
        results = {policy: run_policy(args, model, policy, workdir) for policy in args.policies}
        if args.kill_after is not None:
            results["cache_aware+kill"] = run_policy(args, model, "cache_aware", workdir, args.kill_after)
    for name, summary in results.items():
        print(f"\n## {name}\n{format_report(summary)}")
        print(f"prefix-cache hit rate: {summary['prefix_cache_hit_rate']:.3f}  requests per replica: "
              f"{summary['requests_per_replica']}  hit rate per replica: "
              + ", ".join(f"{k}: {v:.3f}" for k, v in summary["hit_rate_per_replica"].items()))
        if summary["kill"]:
            print(f"kill: {summary['kill']}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {args.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
