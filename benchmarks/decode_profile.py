"""Diagnostics of benchmarks/decode.py (CUDA; the decode-step profile also runs on the CPU, without kernels):
a torch.profiler split of one decode step, which SDPA kernels accept the prefill shapes (head dims 256 and 512,
explicit mask), and torch.compile on/off."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from decode_workloads import random_prompts, run_engine

MATMUL, MATMUL_REDUCE = "matmul", "matmul split-K reduce"
#: custom_torch's Triton kernels by name (gemmaserve_custom_torch/kernels/), matched before the library patterns:
#: the matmul-like ones (few-row projections incl. FP8 and GeGLU, the MoE expert GEMMs, the router logits, the
#: LM head with a fused argmax) and the reductions that finish a matmul (skinny_gemm's split-K partial sums,
#: with the residual / norm epilogue folded into one of them; the MoE sum of a token's top-k expert outputs).
_TRITON_KERNELS = {
    MATMUL: ("_skinny_kernel", "_gate_up_geglu_kernel", "_down_weighted_kernel", "_router_logits_kernel",
             "_argmax_kernel"),
    MATMUL_REDUCE: ("_reduce_kernel", "_reduce_residual_norm_kernel", "_sum_slots_kernel"),
}
#: library kernels by substring: cuBLAS's split-K reduce, the GEMM / GEMV kernels (cuBLAS, cuBLASLt, CUTLASS), the rest
_CATEGORIES = (
    (MATMUL_REDUCE, ("splitkreduce",)),
    (MATMUL, ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("attention", ("_paged_decode", "_combine_splits", "_ragged")),
    ("kv_write", ("index_copy", "index_put", "scatter")),
    ("reduce/argmax/norm", ("reduce", "argmax", "norm")),
)


def _category(name: str) -> str:
    """The time category of a device kernel ``name`` (the profiler's kernel name)."""
    for category, names in _TRITON_KERNELS.items():
        if any(name == key or name.startswith(key + "_") for key in names):  # older Triton: a signature suffix
            return category
    low = name.lower()
    for category, keys in _CATEGORIES:
        if any(key in low for key in keys):
            return category
    return "elementwise/other"


def matmul_bandwidth(summary: dict[str, Any], weight_bytes: int, copy_bandwidth: float) -> dict[str, Any]:
    """Achieved weight bandwidth of a profiled decode step: ``weight_bytes`` (the decode roofline's matmul weight
    bytes of the step, ``Roofline.step_weight_bytes``) over the matmul kernels' device time, with and without
    the split-K reductions that finish them, and its % of ``copy_bandwidth`` (bytes/s, measured in the same run;
    issue 14's target: >= 75 % at N = 1). Empty when the profile holds no matmul time (CPU)."""
    times = summary.get("by_category_us", {})
    matmul = times.get(MATMUL, 0.0)
    if not matmul:
        return {}
    out: dict[str, Any] = {"matmul_weight_bytes": weight_bytes}
    for suffix, us in (("", matmul + times.get(MATMUL_REDUCE, 0.0)), ("_excl_reduce", matmul)):
        achieved = weight_bytes / (us * 1e-6)
        out[f"matmul_us{suffix}"] = round(us, 1)
        out[f"matmul_achieved_tbps{suffix}"] = round(achieved / 1e12, 3)
        share = round(100 * achieved / copy_bandwidth, 1) if copy_bandwidth else None
        out[f"matmul_pct_of_copy_bandwidth{suffix}"] = share
    return out


def _kernel_summary(prof: Any) -> dict[str, Any]:
    """Kernel count and device time by category from a finished torch.profiler run."""
    times: defaultdict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    names: defaultdict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in event.name.lower() or "memset" in event.name.lower():
            counts["memcpy/memset"] += 1
            continue
        us = float(getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0))
        category = _category(event.name)
        times[category] += us
        counts[category] += 1
        names[event.name[:80]] += us
    total = sum(times.values())
    return {"kernels": sum(v for k, v in counts.items() if k != "memcpy/memset"), "kernel_time_us": round(total, 1),
            "by_category_us": {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])},
            "count_by_category": dict(counts), "top_kernels_us": {k: round(v, 1) for k, v in
                                                                  sorted(names.items(), key=lambda kv: -kv[1])[:8]}}


def profile_decode_step(backend: Any, settings: Any, rows: int, prompt_len: int, roof: Any = None,
                        bandwidth: float = 0.0) -> dict[str, Any]:
    """Profile one decode tick of ``rows`` live requests run eagerly (the tick graphs switched off for it) and a
    later one replaying its graph: the 4th and 7th ticks after the first tick that launched no prompt tokens.
    Returns kernel counts and time splits plus each tick's wall time, decode rows and prompt tokens (``tick_rows``,
    ``tick_prompt_tokens``) and, given the decode ``roof`` (``decode_model.Roofline``) and the copy ``bandwidth``
    (bytes/s), the matmuls' achieved weight bandwidth (:func:`matmul_bandwidth`). Raises RuntimeError if a profiled
    tick did not hold every row alone (run 30's "256-row" profile, with too few output tokens, held fewer). Ticks
    are found by the engine's own tick boundaries (``tick_profile.TickRecorder``), so this follows whatever forward
    the backend runs."""
    from tick_profile import TickRecorder  # imports decode.py: not at module level

    mixed = backend.mixed
    labels = {3: "eager_step", 6: "graph_replay_step"}  # ticks after the first decode-only one
    out: dict[str, Any] = {"rows": rows}
    live: dict[str, Any] = {}
    first_decode: list[int] = []  # the number of the first tick that launched decode rows and no prompt tokens
    cuda = torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def finish() -> None:
        sync()
        live["prof"].stop()
        wall = (time.perf_counter() - live["start"]) * 1e3
        if "graphs" in live:
            mixed.graphs = live["graphs"]
        tick = rec.ticks[live["index"]]
        summary = _kernel_summary(live["prof"])
        if roof is not None:
            summary.update(matmul_bandwidth(summary, roof.step_weight_bytes(rows), bandwidth))
        out[live["label"]] = {"wall_ms_under_profiler": round(wall, 3), "tick_rows": tick["rows"],
                              "tick_prompt_tokens": tick["prompt_tokens"], **summary}
        live.clear()

    def on_tick(n: int) -> None:  # tick number n (from 1) starts; rec.ticks[n - 2] is the one that just ended
        if live:
            finish()
        if not first_decode and n >= 2 and rec.ticks[n - 2]["rows"] and not rec.ticks[n - 2]["prompt_tokens"]:
            first_decode.append(n - 1)
        label = labels.get(n - first_decode[0]) if first_decode else None
        if label is not None:
            live["label"], live["index"] = label, n - 1
            if label == "eager_step":
                live["graphs"], mixed.graphs = mixed.graphs, None
            sync()
            live["prof"] = torch.profiler.profile(activities=acts)
            live["prof"].start()
            live["start"] = time.perf_counter()

    rec = TickRecorder(backend, on_tick)
    # every request outlives the profiled ticks: the first prompts prefilled decode from the second tick on
    prompt_ticks = -(-rows * prompt_len // max(1, settings.max_num_batched_tokens - rows))
    try:
        run_engine(backend, settings, random_prompts(rows, prompt_len, backend.model_info.vocab_size, seed=5),
                   2 * prompt_ticks + max(labels) + 8)
    finally:
        rec.restore()
        if live:
            finish()
    missing = [label for label in labels.values() if label not in out]
    if missing:
        raise RuntimeError(f"profile_decode_step: no tick profiled for {missing} (the run had {len(rec.ticks)} ticks)")
    for label in labels.values():
        got = out[label]
        if got["tick_rows"] != rows or got["tick_prompt_tokens"]:
            raise RuntimeError(f"profile_decode_step: the {label} tick held {got['tick_rows']} of {rows} rows and "
                               f"{got['tick_prompt_tokens']} prompt tokens; it would not profile a {rows}-row step")
    return out


def sdpa_backends(device: str, dtype: torch.dtype, queries: int = 512, keys: int = 1024) -> dict[str, Any]:
    """Which torch SDPA kernels run prefill-shaped attention (8 heads, explicit bool mask, head dim 256 / 512),
    their time, and the max error against fp32 math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, Any] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for head_dim in (256, 512):
        q = torch.randn(1, 8, queries, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(1, 8, keys, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(1, 8, keys, head_dim, device=device, dtype=dtype, generator=gen)
        qpos = torch.arange(keys - queries, keys, device=device)
        mask = torch.arange(keys, device=device)[None, :] <= qpos[:, None]
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=1.0)
        for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
            name = f"d{head_dim}/{'default' if backend is None else backend.name}"
            try:
                ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
                with ctx:
                    fn = (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0))
                    got = fn()
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(10):
                        fn()
                    end.record()
                    end.synchronize()
                out[name] = {"ok": True, "ms": round(start.elapsed_time(end) / 10, 4),
                             "max_err": round(float((got.float() - ref).abs().max()), 5)}
            except Exception as exc:  # a backend that refuses these shapes
                out[name] = {"ok": False, "why": str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}
    return out


def compile_on_off(make_backend: Callable[..., Any], model: Any, settings: Any, args: Any, roof: Any,
                   bandwidth: float, workload: Callable[..., list[dict[str, Any]]], plain: Any) -> dict[str, Any]:
    """Workload A at N = args.compile_size (64 output tokens) without and with CUSTOM_BACKEND_COMPILE=1; the
    compiled graph of that bucket is captured before timing (its compile time is reported separately)."""
    n = args.compile_size
    off = workload(plain, settings, [n], args, roof, bandwidth, 64, "custom")
    compiled = make_backend(model, settings, compile=True, graph_capture="lazy")
    mixed = compiled.mixed
    bucket = next(b for b in mixed.buffers.decode_buckets if b >= n)
    start = time.perf_counter()
    with torch.inference_mode():
        mixed.buffers.decode.load([], [], bucket)
        explain = mixed.run_explain(bucket)
        explain_s = time.perf_counter() - start
        mixed.graphs.capture((bucket, True, bucket))
    compile_s = time.perf_counter() - start - explain_s
    on = workload(compiled, settings, [n], args, roof, bandwidth, 64, "custom+compile")
    compiled.close()
    return {"N": n, "off": off[0], "on": on[0], "explain": explain, "explain_s": round(explain_s, 1),
            "compile_and_capture_s": round(compile_s, 1), "compiled": mixed._decode_forward.compiled is not None,
            "compile_error": mixed._decode_forward.error}


def profile_prefill(backend: Any, prompt_len: int, repeats: int = 5, seed: int = 4242) -> dict[str, Any]:
    """Wall time of ``repeats`` one-request prefills of distinct random ``prompt_len``-token prompts (lookup +
    chunks + store, synchronized), then one more under torch.profiler: kernel count and device time, i.e.
    how much of a prefill is GPU work and how much is host dispatch."""
    vocab = backend.model_info.vocab_size
    chunk = 512

    def prefill(prompt: list[int]) -> None:
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            while not state.is_complete:
                backend.prefill_chunk(state, chunk)
            backend.prefill_store(state)
            backend.free_row_kv(state.kv)

    prompts = random_prompts(repeats + 3, prompt_len, vocab, seed=seed)  # distinct: no prefix hits
    for prompt in prompts[:2]:
        prefill(prompt)
    walls = []
    for prompt in prompts[2:-1]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        prefill(prompt)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        prefill(prompts[-1])
        torch.cuda.synchronize()
    cpu_ops = Counter()
    cpu_us: defaultdict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith("aten::"):
            cpu_ops[event.name] += 1
            cpu_us[event.name] += float(getattr(event, "self_cpu_time_total", 0.0))
    return {"prompt_len": prompt_len, "wall_ms": [round(w, 2) for w in walls],
            "wall_ms_median": round(sorted(walls)[len(walls) // 2], 2), **_kernel_summary(prof),
            "aten_calls": sum(cpu_ops.values()),
            "top_aten_self_cpu_us": {k: round(v, 1) for k, v in sorted(cpu_us.items(), key=lambda kv: -kv[1])[:10]}}


def profile_prefill_paths(backend: Any, prompt_len: int) -> dict[str, Any]:
    """:func:`profile_prefill` through the backend as configured (prefill-only ticks, CUDA graphs per token
    bucket) and on the one-row eager fallback path (`PagedRunner.prefill`)."""
    out = {"configured": profile_prefill(backend, prompt_len)}

    def one_row(state: Any, num: int) -> None:
        backend._prefill_alone(state, min(num, state.num_remaining))

    backend.prefill_chunk = one_row
    try:
        out["one_row_eager"] = profile_prefill(backend, prompt_len, seed=4343)
    finally:
        del backend.prefill_chunk  # the class method again
    return out


def profile_mixed_tick(backend: Any, chunks: int = 16, chunk_len: int = 512, seed: int = 4343) -> dict[str, Any]:
    """One tick of ``chunks`` cold ``chunk_len``-token chunks through ``forward_step``: wall time of the graph
    replay (after a first, capturing tick of the same bucket) with CUDA events and host clock, and a
    torch.profiler kernel split of the same tick run eagerly (graphs and buffers switched off)."""
    mixed = backend.mixed
    vocab = backend.model_info.vocab_size
    out: dict[str, Any] = {"chunks": chunks, "chunk_len": chunk_len, "tokens": chunks * chunk_len}

    def tick(split: dict[str, list[float]] | None = None) -> float:
        prompts = random_prompts(chunks, chunk_len, vocab, seed=seed + tick.calls)
        tick.calls += 1
        with backend.lock:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            states = [backend.prefill_lookup(p) for p in prompts]
            t1 = time.perf_counter()
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record()
            backend.forward_step(states, [chunk_len] * chunks, None, [])
            last.record()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            for state in states:
                backend.free_row_kv(state.kv)
        if split is not None:
            for key, value in (("lookups_ms", t1 - t0), ("forward_step_host_ms", t2 - t1),
                               ("wait_after_return_ms", t3 - t2)):
                split.setdefault(key, []).append(value * 1e3)
            split.setdefault("forward_step_gpu_ms", []).append(first.elapsed_time(last))
        return (t3 - t1) * 1e3

    tick.calls = 0  # type: ignore[attr-defined]
    tick()  # capture
    split: dict[str, list[float]] = {}
    out["graph_tick_ms"] = sorted(tick(split) for _ in range(5))[2]
    out["graph_tick_split_ms"] = {key: round(sorted(values)[2], 3) for key, values in split.items()}
    buffers, graphs = mixed.buffers, mixed.graphs
    mixed.buffers = mixed.graphs = None
    try:
        out["eager_tick_ms"] = tick()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            tick()
        out["eager_kernels"] = _kernel_summary(prof)
    finally:
        mixed.buffers, mixed.graphs = buffers, graphs
    return out


def profile_decode_with_chunk(backend: Any, rows: int = 32, context: int = 1024,
                              chunk_lens: tuple[int, ...] = (0, 128, 256, 512), seed: int = 5151, roof: Any = None,
                              bandwidth: float = 0.0) -> dict[str, Any]:
    """Workload C's mixed tick in isolation: ``rows`` decoding rows at ``context`` tokens plus one cold prompt
    chunk of each length in ``chunk_lens`` (0 = a decode-only tick), through ``forward_step`` as the engine runs
    it (graph replay after a capturing first tick). Reports the median device time (CUDA events) and host time
    of 7 ticks per length, and a torch.profiler kernel split of the largest chunk's tick run eagerly (with the
    decode ``roof`` and copy ``bandwidth``: the decode-only tick's :func:`matmul_bandwidth`). The rows grow by one
    token per tick; every chunk's KV is freed after its tick."""
    mixed = backend.mixed
    vocab = backend.model_info.vocab_size
    out: dict[str, Any] = {"rows": rows, "context": context}
    with backend.lock:
        batched = None
        for prompt in random_prompts(rows, context, vocab, seed=seed):
            state = backend.prefill_lookup(prompt)
            while not state.is_complete:
                before = state.num_computed
                backend.forward_step([state], [state.num_remaining], None, [])
                if state.num_computed == before:
                    raise RuntimeError(f"no KV room for {rows} rows of {context} tokens: run with a larger --sizes")
            batched = backend.splice_into_batched(batched, state.kv, backend.kv_length(state.kv))
    calls = [0]

    def tick(chunk_len: int) -> tuple[float, float]:
        prompts = random_prompts(1, chunk_len, vocab, seed=seed + 1 + calls[0]) if chunk_len else []
        calls[0] += 1
        with backend.lock:
            states = [backend.prefill_lookup(p) for p in prompts]
            torch.cuda.synchronize()
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            first.record()
            backend.forward_step(states, [chunk_len] * len(states), batched, [7] * rows)
            last.record()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            for state in states:
                backend.free_row_kv(state.kv)
        return first.elapsed_time(last), host * 1e3

    ticks: dict[str, Any] = {}
    for chunk_len in chunk_lens:
        tick(chunk_len)  # capture / warm the bucket
        runs = [tick(chunk_len) for _ in range(7)]
        ticks[str(chunk_len)] = {"gpu_ms": round(statistics.median(r[0] for r in runs), 3),
                                 "host_ms": round(statistics.median(r[1] for r in runs), 3)}
    def decode_only() -> float:
        with backend.lock:
            torch.cuda.synchronize()
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record()
            backend.decode_step_batched(batched, [7] * rows)
            last.record()
            torch.cuda.synchronize()
        return first.elapsed_time(last)

    decode_only()
    ticks["decode_step_batched"] = {"gpu_ms": round(statistics.median(decode_only() for _ in range(7)), 3)}
    out["ticks"] = ticks
    buffers, graphs = mixed.buffers, mixed.graphs
    mixed.buffers = mixed.graphs = None
    try:
        for chunk_len in (chunk_lens[0], chunk_lens[-1]):
            tick(chunk_len)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                tick(chunk_len)
            summary = _kernel_summary(prof)
            if roof is not None and not chunk_len:  # decode rows only: the step reads the decode weights once
                summary.update(matmul_bandwidth(summary, roof.step_weight_bytes(rows), bandwidth))
            out[f"eager_kernels_chunk{chunk_len}"] = summary
    finally:
        mixed.buffers, mixed.graphs = buffers, graphs
        with backend.lock:
            for _ in range(rows):
                backend.remove_row_from_cache(batched, 0)
    return out
