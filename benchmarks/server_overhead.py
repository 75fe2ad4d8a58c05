"""Host cost of streaming many requests through the HTTP server, the model forward stubbed (CPU).

The server runs in this process as ``gemmaserve serve`` runs it (uvicorn, ``create_app``, the engine thread) over
a custom_torch backend whose forward is stubbed (``host_overhead.stubbed_backend``: a tiny random Gemma 4
checkpoint, every token 7); ``gemmaserve bench`` streams ``--rows`` requests at once from a separate process
(``/v1/completions``, ``--input-len`` prompt tokens, ``--tokens`` output tokens, EOS ignored), once to warm up and
once timed. Everything measured is host work: the client's throughput and latencies, and per output token the CPU
time of the engine thread (scheduling, the events' hand-over) and of the event-loop thread (HTTP, detokenizing,
SSE chunks, the sockets), and the timed run's garbage collections (count, total and longest pause by generation).
Both threads share one GIL (and here two cores with the client): what the loop spends delays the engine's next
launch.

Usage (repo root):  TRITON_INTERPRET=1 PYTHONPATH=core:plugins/custom_torch:tests:benchmarks \\
                    .venv/bin/python benchmarks/server_overhead.py --rows 256 [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def thread_cpu_s(ident: int | None) -> float:
    """CPU seconds the thread ``ident`` has used (Linux / macOS)."""
    assert ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="requests streamed at once")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--input-len", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--profile", action="store_true", help="print the event-loop thread's top functions (cProfile)")
    args = parser.parse_args()

    import uvicorn
    from host_overhead import stubbed_backend

    from gemmaserve.engine.engine import Engine
    from gemmaserve.server.app import create_app

    backend, core = stubbed_backend(args.rows, blocks_per_row=24, attention="triton")  # async decode, as on CUDA
    engine = Engine(backend, core)
    engine.start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    result: dict[str, Any] = {"rows": args.rows, "output_tokens": args.tokens, "input_len": args.input_len}
    loop_thread = threading.get_ident()
    engine_thread = engine._thread.ident  # type: ignore[attr-defined]

    pauses: list[tuple[int, float]] = []  # (generation, seconds) of the timed run's collections, any thread
    started: dict[int, float] = {}
    timed = threading.Event()

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[threading.get_ident()] = time.perf_counter()
        elif timed.is_set() and threading.get_ident() in started:
            pauses.append((info["generation"], time.perf_counter() - started.pop(threading.get_ident())))

    gc.callbacks.append(on_gc)

    def client() -> None:
        try:
            while not server.started:
                time.sleep(0.05)
            with tempfile.TemporaryDirectory() as tmp:
                for name in ("warm-up", "timed"):
                    if name == "timed":
                        timed.set()
                    steps, engine_cpu, loop_cpu = engine.stats().num_steps, thread_cpu_s(engine_thread), \
                        thread_cpu_s(loop_thread)
                    out = Path(tmp) / f"{name}.json"
                    subprocess.run([sys.executable, "-m", "gemmaserve", "bench", "--base-url", f"http://127.0.0.1:{port}",
                                    "--num-prompts", str(args.rows), "--input-len", str(args.input_len),
                                    "--output-len", str(args.tokens), "--result-file", str(out), "--no-progress"],
                                   check=True, stdout=subprocess.DEVNULL)
                    ticks = engine.stats().num_steps - steps
                    engine_cpu, loop_cpu = thread_cpu_s(engine_thread) - engine_cpu, thread_cpu_s(loop_thread) - loop_cpu
                    summary = json.loads(out.read_text())
                tokens = summary["total_output_tokens"]
                result.update(
                    ticks=ticks, completed=summary["completed"], output_tokens_total=tokens,
                    output_throughput=round(summary["output_throughput"], 1),
                    engine_thread_cpu_us_per_token=round(engine_cpu * 1e6 / tokens, 1),
                    loop_thread_cpu_us_per_token=round(loop_cpu * 1e6 / tokens, 1),
                    **{key: summary[key] for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
                    gc_pauses={str(gen): {"count": len(ms), "total_ms": round(sum(ms), 2),
                                          "max_ms": round(max(ms), 2)}
                               for gen in (0, 1, 2) if (ms := [p * 1e3 for g, p in pauses if g == gen])},
                )
        finally:
            server.should_exit = True

    thread = threading.Thread(target=client, name="bench-client")
    thread.start()
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    try:
        server.run()
    finally:
        if profile is not None:
            profile.disable()
        thread.join()
        engine.shutdown()
    if profile is not None:
        import pstats

        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    med = {key: round(result[key]["median"], 2) for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") if key in result}
    print(f"rows={args.rows}: {result.get('completed')} completed, {result.get('output_throughput')} output tok/s, "
          f"medians {med}; CPU per output token: engine thread {result.get('engine_thread_cpu_us_per_token')} µs, "
          f"event-loop thread {result.get('loop_thread_cpu_us_per_token')} µs; collections by generation "
          f"{result.get('gc_pauses')}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
