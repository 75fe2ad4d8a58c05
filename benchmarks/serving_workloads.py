"""Prompt-heavy workloads of benchmarks/decode.py: the prefill compute roofline, A-long (N x 2,048-token prompts)
and C (serving with Poisson arrivals), every request through the real `gemmaserve.engine.Engine`.

- ``prefill_flops_per_token(model, fast)``: 2 x the matmul parameters a prompt token passes through (MoE: its
  top-k experts only; the LM head
  only for tokens whose logits are needed: none here), plus attention's QK^T and PV at mid-chunk context;
  with fast prefill the KV-shared tail is skipped.
- ``gemm_tflops(device)``: a bf16 8192^3 GEMM's TFLOP/s measured in the same run (the compute ceiling).
- ``run_arrivals``: requests arrive as a Poisson process at ``rate`` per second (seeded); per request TTFT,
  TPOT, and every inter-token gap (an event carrying k tokens counts k gaps of its interval / k).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from gemmaserve.engine import Engine
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings

__all__ = ["gemm_tflops", "pct", "prefill_flops_per_token", "run_arrivals"]


def prefill_flops_per_token(model: Any, *, fast: bool, context: int = 256) -> float:
    """FLOPs one prompt token costs (see the module docstring); ``context``: mean keys a query sees."""
    config = model.config
    from gemmaserve_custom_torch.mixed_step import shared_tail_start

    stop = (shared_tail_start(model) or config.num_hidden_layers) if fast else config.num_hidden_layers
    flops = 0.0
    for i, layer in enumerate(model.layers):
        if i >= stop:
            break
        flops += 2 * sum(p.numel() for p in layer.parameters() if p.dim() == 2)
        if config.moe_num_experts:  # 3-D expert weights [E, ...]: a token runs through its top-k experts only
            experts = layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel()
            flops += 2 * experts * config.moe_top_k / config.moe_num_experts
        window = config.window_for_layer(i)
        keys = min(context, window) if window else context
        flops += 4 * keys * config.num_attention_heads * config.head_dims[i]
    flops += 2 * model.per_layer_model_projection.weight.numel() if config.ple_dim else 0
    return flops


def gemm_tflops(device: str, size: int = 8192, reps: int = 10) -> float:
    """Median TFLOP/s of a bf16 ``size``^3 GEMM (CUDA events)."""
    if device != "cuda":
        return 0.0
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times[3:]) / 1e12


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``, rounded; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered))) - 1))], 3)


def run_arrivals(backend: Any, settings: CoreSettings, requests: Sequence[tuple[Sequence[int], int]], rate: float,
                 seed: int = 0) -> dict[str, Any]:
    """Submit ``requests`` = (prompt, output tokens) at Poisson ``rate`` per second to a fresh Engine (greedy,
    EOS ignored); wait for all. Returns TTFT / ITL percentiles, TPOT median, output and prefill tok/s."""
    rng = random.Random(seed)
    lock = threading.Lock()
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    last_event: dict[str, float] = {}
    gaps: list[float] = []
    tpots: list[float] = []
    errors: list[str] = []

    def on_event(event: Any) -> None:
        now = time.perf_counter()
        with lock:
            rid = event.request_id
            count = len(event.new_token_ids)
            if count:
                if rid not in first:  # tokens that came with the first arrive at once
                    first[rid] = now
                    gaps.extend([0.0] * (count - 1))
                else:
                    gaps.extend([(now - last_event[rid]) * 1e3 / count] * count)
                last_event[rid] = now
            if event.finished and event.output is not None:
                if event.output.error is not None:
                    errors.append(str(event.output.error))
                n = len(event.output.token_ids)
                if n > 1 and rid in first:
                    tpots.append((now - first[rid]) * 1e3 / (n - 1))

    engine = Engine(backend, settings)
    handles = []
    start = time.perf_counter()
    due = start
    for i, (prompt, out_len) in enumerate(requests):
        due += rng.expovariate(rate)
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        rid = f"c{i}"
        submitted[rid] = time.perf_counter()
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        handles.append(engine.submit(list(prompt), params, request_id=rid, on_event=on_event, wait_for_room=True))
    for handle in handles:
        handle.result(timeout=3600)
    wall = time.perf_counter() - start
    engine.shutdown()
    ttfts = [(first[r] - t0) * 1e3 for r, t0 in submitted.items() if r in first]
    out_tokens = sum(n for _, n in requests)
    prompt_tokens = sum(len(p) for p, _ in requests)
    return {
        "rate_per_s": rate, "requests": len(requests), "wall_s": round(wall, 2),
        "achieved_rate_per_s": round(len(requests) / wall, 2),
        "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99),
        "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99), "tpot_p50_ms": pct(tpots, 50),
        "output_tok_per_s": round(out_tokens / wall, 1), "prefill_tok_per_s": round(prompt_tokens / wall, 1),
        "errors": errors[:3],
    }
