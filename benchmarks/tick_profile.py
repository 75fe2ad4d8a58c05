"""Where an engine tick's time goes (diagnostic; CUDA, or --quick on CPU with the tiny model).

Drives the real Engine over the custom_torch backend at Gemma 4 E2B shapes (random bf16 weights, as
benchmarks/decode.py) and records, per tick on the engine thread: the interval between tick starts, the host
time of the launch call (``decode_step_async`` / ``forward_step_async``), the time blocked waiting for the
previous launch's tokens, event delivery, the decode rows and the prompt tokens it carried. Sections:

- ``decode``: workload A at ``--rows`` (every prompt at once), the steady decode ticks summarised;
- ``decode_cprofile``: the same under cProfile on the engine thread (top functions by own time);
- ``decode_trace``: torch.profiler over ``--trace-ticks`` decode ticks: GPU busy/idle in the window, the
  longest GPU-idle gaps, and the host ops by own CPU time;
- ``prefill_trace`` / ``prefill_cprofile``: workload A's prompt ticks under torch.profiler (GPU idle between
  them) and under cProfile (the host's share);
- ``serving``: workload C (Poisson arrivals, ``--rate``) with the longest ticks broken down, to explain the
  inter-token latency tail, and the objects the garbage collector tracks afterwards;
- ``prefix_hit``: workload B's prefix-hit requests, every tick (under cProfile);
- ``serving_cprofile``: workload C under cProfile on the engine thread;
- ``serving_sweep``: workload C over rates x chunk caps beside decoding rows (``--sweep-rates``,
  ``--sweep-chunks``).

Usage (repo root):  python benchmarks/tick_profile.py --json out.json      (H200: about 3 minutes)
                    python benchmarks/tick_profile.py --quick --json q.json (CPU, seconds)
"""

from __future__ import annotations

import argparse
import io
import json
import pstats
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_model as dm  # noqa: E402
from decode import _custom_backend, _settings  # noqa: E402
from decode_workloads import profile_engine_thread, random_prompts, run_engine  # noqa: E402
from serving_workloads import pct, run_arrivals, serving_requests  # noqa: E402

from gemmaserve.engine.engine import Engine  # noqa: E402
from gemmaserve.engine.scheduler import ContinuousBatchScheduler as Scheduler  # noqa: E402


class TickRecorder:
    """Patches the Scheduler, the Engine and ``backend`` (class/instance attributes) to time each tick; undo
    with :meth:`restore`. One record per ``step_prefill`` call (a tick starts there)."""

    def __init__(self, backend: Any, on_tick: Any = None) -> None:
        self.ticks: list[dict[str, float]] = []
        self.backend, self.on_tick = backend, on_tick
        self._saved: list[tuple[Any, str, Any]] = []
        self.depth = 0
        self._gc_start = 0.0
        rec = self

        def patch(owner: Any, name: str, make: Any) -> None:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, make(original))

        def step_prefill(original: Any) -> Any:
            def timed(sched: Scheduler, events: Any = None) -> Any:
                tick = {"start": time.perf_counter(), "launch_ms": 0.0, "wait_ms": 0.0, "deliver_ms": 0.0,
                        "rows": 0, "prompt_tokens": 0, "chunks": 0}
                rec.ticks.append(tick)
                if rec.on_tick is not None:
                    rec.on_tick(len(rec.ticks))
                out = original(sched, events)
                tick["prefill_half_ms"] = (time.perf_counter() - tick["start"]) * 1e3
                return out
            return timed

        def deliver(original: Any) -> Any:
            def timed(engine: Engine, events: Any) -> Any:
                t0 = time.perf_counter()
                out = original(engine, events)
                if rec.ticks:
                    rec.ticks[-1]["deliver_ms"] += (time.perf_counter() - t0) * 1e3
                return out
            return timed

        def wrap_pending(pending: Any) -> Any:
            result = pending.result

            def timed_result() -> Any:
                t0 = time.perf_counter()
                out = result()
                if rec.ticks:
                    rec.ticks[-1]["wait_ms"] += (time.perf_counter() - t0) * 1e3
                return out
            pending.result = timed_result
            return pending

        def launch(rows_arg: int, tokens_arg: int | None, pending: str | None) -> Any:
            def make(original: Any) -> Any:
                def timed(*args: Any, **kwargs: Any) -> Any:
                    t0 = time.perf_counter()
                    rec.depth += 1
                    try:
                        out = original(*args, **kwargs)
                    finally:
                        rec.depth -= 1
                    if rec.ticks and rec.depth == 0:  # a call made inside another launch call is its part
                        tick = rec.ticks[-1]
                        tick["launch_ms"] += (time.perf_counter() - t0) * 1e3
                        tick["rows"] += len(args[rows_arg])
                        if tokens_arg is not None:
                            tick["prompt_tokens"] += sum(args[tokens_arg])
                            tick["chunks"] += len(args[tokens_arg])
                        if pending == "self":
                            return wrap_pending(out)
                        if pending is not None:
                            wrap_pending(getattr(out, pending))
                    return out
                return timed
            return make

        def phase(column: str) -> Any:
            def make(original: Any) -> Any:
                def timed(*args: Any, **kwargs: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return original(*args, **kwargs)
                    finally:
                        if rec.ticks:
                            tick = rec.ticks[-1]
                            tick[column] = tick.get(column, 0.0) + (time.perf_counter() - t0) * 1e3
                return timed
            return make

        patch(Scheduler, "step_prefill", step_prefill)
        patch(Engine, "_deliver", deliver)
        for name in ("_admit", "_plan_chunks", "_apply_launched", "_complete_prefill", "_finish_chunks"):
            patch(Scheduler, name, phase(name.strip("_") + "_ms"))
        for owner, name in ((getattr(backend, "decoder", None), "decode"), (getattr(backend, "mixed", None), "run")):
            if owner is not None:
                patch(owner, name, phase(f"{type(owner).__name__}.{name}_ms"))
                graphs = getattr(owner, "graphs", None)
                if graphs is not None:
                    patch(graphs, "run", phase(f"{type(owner).__name__}.graphs.run_ms"))
                state = getattr(owner, "state", None)
                if state is not None:
                    patch(state, "load", phase(f"{type(owner).__name__}.state.load_ms"))
        # structured output's deferred sampling, inside the launch call: the tokens taken ahead, the masks, the
        # rows' samplings, the masks packed for the device
        import gemmaserve.engine.scheduler as scheduler_module
        import gemmaserve.torch_sampling as torch_sampling
        from gemmaserve.engine.request import Request

        patch(Request, "take_ahead", phase("take_ahead_ms"))
        patch(Request, "row_sampling", phase("row_sampling_ms"))
        patch(scheduler_module, "prepare_masks", phase("prepare_masks_ms"))
        patch(torch_sampling, "_packed_allowed", phase("packed_allowed_ms"))
        import gc

        def on_gc(stage: str, info: dict[str, Any]) -> None:
            if stage == "start":
                rec._gc_start = time.perf_counter()
            elif rec.ticks:
                tick = rec.ticks[-1]
                tick["gc_ms"] = tick.get("gc_ms", 0.0) + (time.perf_counter() - rec._gc_start) * 1e3
                if info.get("generation") == 2:
                    tick["gc2"] = tick.get("gc2", 0) + 1

        self._gc = on_gc
        gc.callbacks.append(on_gc)
        patch(backend, "decode_step_async", launch(1, None, "self"))
        patch(backend, "forward_step_async", launch(3, 1, "tokens"))
        patch(backend, "decode_step_batched", launch(1, None, None))  # the synchronous ticks (CPU)
        patch(backend, "forward_step", launch(3, 1, None))

    def restore(self) -> None:
        import gc

        gc.callbacks.remove(self._gc)
        for owner, name, original in reversed(self._saved):
            if isinstance(owner, (type, types.ModuleType)) or name not in vars(owner):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute shadowed the class's method

    def intervals(self) -> list[dict[str, float]]:
        """Each tick with ``interval_ms`` (start to the next tick's start); the last tick is dropped."""
        out = []
        for tick, after in zip(self.ticks, self.ticks[1:]):
            out.append({**tick, "interval_ms": (after["start"] - tick["start"]) * 1e3})
        return out


def _summary(ticks: list[dict[str, float]]) -> dict[str, Any]:
    keys = sorted({k for t in ticks for k in t if k.endswith("_ms") or k == "gc2"})
    out: dict[str, Any] = {"ticks": len(ticks)}
    for key in keys:
        values = [t.get(key, 0.0) for t in ticks]
        if values:
            out[key] = {"p50": round(statistics.median(values), 3), "p99": round(pct(values, 99) or 0, 3),
                        "mean": round(statistics.fmean(values), 3)}
    if ticks:
        out["host_not_waiting_ms_p50"] = round(statistics.median(t["interval_ms"] - t["wait_ms"] for t in ticks), 3)
    return out


def _decode(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(args.rows, args.prompt_len, vocab, seed=1)
    rec = TickRecorder(backend)
    try:
        result = run_engine(backend, settings, prompts, args.output_len)
    finally:
        rec.restore()
    ticks = rec.intervals()
    steady = [t for t in ticks if t["prompt_tokens"] == 0 and t["rows"] >= args.rows]
    steady = steady[5:-5] if len(steady) > 20 else steady
    prefill = [t for t in ticks if t["prompt_tokens"]]
    return {"rows": args.rows, "tpot_median_ms": round(statistics.median(result.tpot_ms), 3),
            "ttft_median_ms": round(statistics.median(result.ttft_ms), 3),
            "steady_decode_ticks": _summary(steady), "prefill_ticks": _summary(prefill),
            "prefill_tick_list": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items() if k != "start"}
                                  for t in prefill[:24]]}


def _profiled(work: Any) -> tuple[Any, str]:
    """``work()`` with cProfile on the engine thread; (its result, the top functions by own and cumulative time)."""
    result, profile = profile_engine_thread(work)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    return result, text.getvalue()


def _decode_cprofile(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(args.rows, args.prompt_len, vocab, seed=2)
    result, stats = _profiled(lambda: run_engine(backend, settings, prompts, args.output_len))
    return {"tpot_median_ms_under_cprofile": round(statistics.median(result.tpot_ms), 3), "stats": stats}


def trace_ticks(backend: Any, settings: Any, run: Any, first: int, ticks: int, trace_path: Path) -> dict[str, Any]:
    """torch.profiler over ticks ``first`` .. ``first + ticks`` of ``run()`` (which drives an Engine over
    ``backend``): GPU busy/idle in the window, the longest GPU-idle gaps (and the kernel after each), host ops by
    own CPU time, device ops by own device time; the Chrome trace goes to ``trace_path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if settings.device == "cuda" else [])
    prof = profile(activities=activities)
    window = {"on": False}

    def on_tick(n: int) -> None:
        if n == first and not window["on"]:
            if settings.device == "cuda":
                torch.cuda.synchronize()
            prof.start()
            window["on"] = True
        elif n == first + ticks and window["on"]:
            if settings.device == "cuda":
                torch.cuda.synchronize()
            prof.stop()
            window["on"] = False

    rec = TickRecorder(backend, on_tick)
    try:
        run()
    finally:
        rec.restore()
        if window["on"]:
            prof.stop()
    out: dict[str, Any] = {"ticks": ticks, "first_tick": first}
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if kernels:
        busy, gaps, end = 0.0, [], kernels[0][0]
        for start, stop, name in kernels:
            if start > end:
                gaps.append((start - end, name))
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        span = end - kernels[0][0]
        gaps.sort(reverse=True)
        out.update(gpu_span_us=round(span, 1), gpu_busy_us=round(busy, 1), gpu_idle_pct=round(100 * (1 - busy / span), 1),
                   gaps_over_20us=sum(1 for g, _ in gaps if g > 20), idle_in_gaps_over_20us=round(sum(g for g, _ in gaps if g > 20), 1),
                   longest_gaps_us=[(round(g, 1), n[:60]) for g, n in gaps[:15]])
    out["host_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    if settings.device == "cuda":
        out["device_ops"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20,
                                                      max_name_column_width=60)
    prof.export_chrome_trace(str(trace_path))
    return out


def _decode_trace(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    first = args.prompt_len // max(1, settings.max_num_batched_tokens // args.rows) + 20  # well into decode
    prompts = random_prompts(args.rows, args.prompt_len, vocab, seed=3)
    return trace_ticks(backend, settings, lambda: run_engine(backend, settings, prompts, args.output_len), first,
                       args.trace_ticks, args.json.parent / "decode_trace.json")


def _prefill_trace(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Workload A's prompt ticks (every prompt queued at once: the first ``rows x prompt_len / budget`` ticks)
    under torch.profiler: is the GPU idle between them while the host packs the next tick? The run decodes a
    few more ticks so that the window closes on the engine thread."""
    prompts = random_prompts(args.rows, args.prompt_len, vocab, seed=4)
    ticks = -(-args.rows * args.prompt_len // settings.max_num_batched_tokens)
    return trace_ticks(backend, settings, lambda: run_engine(backend, settings, prompts, ticks + 4), 1, ticks,
                       args.json.parent / "prefill_trace.json")


def _prefill_cprofile(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Workload A's prompts with two output tokens each under cProfile on the engine thread: the host's share of
    the prompt ticks."""
    prompts = random_prompts(args.rows, args.prompt_len, vocab, seed=5)
    result, stats = _profiled(lambda: run_engine(backend, settings, prompts, 2))
    return {"ttft_median_ms_under_cprofile": round(statistics.median(result.ttft_ms), 3), "stats": stats}


def _prefix_hit(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Workload B's prefix-hit half (64 requests = a cached 1,536-token prefix + 64 own tokens), every tick
    (timed under cProfile, whose top functions come with them)."""
    prefix = random_prompts(1, args.prefix_len, vocab, seed=8)[0]
    own = args.prefix_own
    run_engine(backend, settings, random_prompts(1, own, vocab, seed=11, prefix=prefix), 1)  # caches the prefix
    rec = TickRecorder(backend)
    try:
        result, stats = _profiled(lambda: run_engine(backend, settings, random_prompts(64, own, vocab, seed=10,
                                                                                   prefix=prefix), 8))
    finally:
        rec.restore()
    return {"ttft_median_ms": round(statistics.median(result.ttft_ms), 3),
            "cached_tokens_median": statistics.median(result.cached_tokens), "stats_under_cprofile": stats,
            "ticks": [{k: round(v, 3) for k, v in t.items() if k != "start"} for t in rec.intervals()[:20]]}


def _serving_work(args: argparse.Namespace, vocab: int, seed: int | str = 77) -> list[tuple[list[int], int]]:
    """Workload C's (prompt, output length) pairs from ``seed``: give every run its own seed (fresh prompts;
    ``run_arrivals`` also empties the prefix cache before it starts)."""
    inputs, outputs = (tuple(map(int, x.split(","))) for x in (args.serving_input, args.serving_output))
    return serving_requests(args.serving_requests, inputs, outputs, vocab, seed)


def _serving_cprofile(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    work = _serving_work(args, vocab, seed=78)  # not the prompts of the ``serving`` section
    row, stats = _profiled(lambda: run_arrivals(backend, settings, work, args.rate, seed=6))
    return {"result_under_cprofile": row, "stats": stats}


def _heap() -> dict[str, Any]:
    """Objects the garbage collector tracks (what a full collection walks), by type."""
    import gc
    from collections import Counter

    objects = gc.get_objects()
    return {"tracked": len(objects), "frozen": gc.get_freeze_count(),
            "top_types": Counter(type(o).__name__ for o in objects).most_common(12)}


def _serving(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    work = _serving_work(args, vocab, getattr(args, "serving_seed", 77))
    rec = TickRecorder(backend)
    try:
        row = run_arrivals(backend, settings, work, args.rate, seed=5)
    finally:
        rec.restore()
    ticks = rec.intervals()
    ticks = ticks[len(ticks) // 10:]  # past the ramp
    decode_only = [t for t in ticks if t["prompt_tokens"] == 0 and t["rows"] > 0]
    mixed = [t for t in ticks if t["prompt_tokens"] > 0]
    longest = sorted(ticks, key=lambda t: -t["interval_ms"])[: max(1, len(ticks) // 100)]
    return {"result": row, "heap_after": _heap(), "decode_only_ticks": _summary(decode_only), "mixed_ticks": _summary(mixed),
            "mixed_prompt_tokens_p50": statistics.median(t["prompt_tokens"] for t in mixed) if mixed else None,
            "idle_ticks": sum(1 for t in ticks if t["rows"] == 0 and t["prompt_tokens"] == 0),
            "longest_1pct": [{k: round(v, 3) for k, v in t.items() if k != "start"} for t in longest[:40]]}


def _serving_sweep(backend: Any, settings: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Workload C at every ``--sweep-rates`` x ``--sweep-chunks`` (``MIXED_PREFILL_CHUNK_TOKENS``) pair, with the
    decode-only and mixed tick intervals: how the chunk cap trades the ITL tail against TTFT."""
    rows = []
    for rate in (float(x) for x in args.sweep_rates.split(",") if x):
        for chunk in (int(x) for x in args.sweep_chunks.split(",") if x):
            variant = settings.model_copy(update={"mixed_prefill_chunk_tokens": chunk})
            seed = f"sweep:{rate:g}:{chunk}"  # fresh prompts per run
            one = _serving(backend, variant, argparse.Namespace(**{**vars(args), "rate": rate, "serving_seed": seed}),
                           vocab)
            summary = {"rate": rate, "prefill_chunk_tokens": settings.prefill_chunk_tokens,
                       "mixed_prefill_chunk_tokens": chunk, **one["result"],
                       "mixed_share": round(one["mixed_ticks"].get("ticks", 0)
                                            / max(1, one["mixed_ticks"].get("ticks", 0)
                                                  + one["decode_only_ticks"].get("ticks", 0)), 3),
                       "mixed_prompt_tokens_p50": one["mixed_prompt_tokens_p50"]}
            for kind in ("decode_only_ticks", "mixed_ticks"):
                for key in ("interval_ms", "wait_ms", "launch_ms"):
                    if key in one[kind]:
                        summary[f"{kind}.{key}"] = one[kind][key]
            rows.append(summary)
            print(f"  sweep {summary}", flush=True)
    return {"rows": rows}


SECTIONS: dict[str, Any] = {
    "decode": _decode, "decode_cprofile": _decode_cprofile, "decode_trace": _decode_trace, "serving": _serving,
    "prefill_trace": _prefill_trace, "prefill_cprofile": _prefill_cprofile, "prefix_hit": _prefix_hit,
    "serving_cprofile": _serving_cprofile, "serving_sweep": _serving_sweep,
}
"""``--sections`` by name: each ``(backend, settings, args, vocab) -> results``."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("tick_profile.json"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--trace-ticks", type=int, default=10)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--serving-requests", type=int, default=400)
    p.add_argument("--serving-input", default="128,2048")
    p.add_argument("--serving-output", default="32,512")
    p.add_argument("--max-len", type=int, default=0, help="model length (0 = 4,096; 256 with --quick)")
    p.add_argument("--prefix-len", type=int, default=1536)
    p.add_argument("--prefix-own", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--sweep-rates", default="20,40", help="serving_sweep: workload C rates")
    p.add_argument("--sweep-chunks", default="0,256,128", help="serving_sweep: MIXED_PREFILL_CHUNK_TOKENS values "
                   "(0 = PREFILL_CHUNK_TOKENS, 512, in every tick)")
    p.add_argument("--sections", default="decode,decode_cprofile,decode_trace,serving")
    args = p.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        p.error(f"unknown --sections {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.quick:
        args.rows, args.prompt_len, args.output_len, args.trace_ticks = 4, 24, 40, 4
        args.prefix_len, args.prefix_own = (1536, 64) if args.max_len >= 1600 else (32, 4)
        args.serving_requests, args.serving_input, args.serving_output, args.rate = 20, "8,40", "2,8", 50.0
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    dtype, dtype_name = (torch.bfloat16, "bfloat16") if device == "cuda" else (torch.float32, "float32")
    base = {**(dm.TINY if args.quick else dm.E2B), "max_position_embeddings": args.max_len or (256 if args.quick else 4096)}
    model = dm.custom_from_hf(dm.build_hf_model(base, device, dtype, 0))
    max_len = base["max_position_embeddings"]
    settings = _settings(device, dtype_name, max(args.rows, 64), max_len, args.rows * max_len, args.max_num_batched_tokens)
    backend = _custom_backend(model, settings)
    for part in (getattr(backend, "decoder", None), getattr(backend, "mixed", None)):
        if part is not None and getattr(part, "graphs", None) is not None:
            part.capture_all()
    vocab = base["vocab_size"]
    run_engine(backend, settings, random_prompts(2, args.prompt_len, vocab, seed=99), 4)  # warm-up
    results: dict[str, Any] = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                                        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                                        "torch": torch.__version__}}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        results[name] = SECTIONS[name](backend, settings, args, vocab)
        text = results[name]
        print(f"{name} ({time.perf_counter() - t0:.1f} s):",
              json.dumps({k: v for k, v in text.items() if k not in ("host_ops", "device_ops", "stats")})[:3000], flush=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
