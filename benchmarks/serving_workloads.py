"""Prompt-heavy workloads of benchmarks/decode.py: the prefill compute roofline, A-long (N x 2,048-token prompts)
and C (serving with Poisson arrivals), every request through the real `gemmaserve.engine.Engine`.

- ``PrefillFlops`` / ``prefill_flops_per_token(model, fast)``: 2 x the matmul parameters a prompt token passes
  through (MoE: its top-k experts only; the LM head only for tokens whose logits are needed: none here), plus
  attention's QK^T and PV over the keys each query sees (a prompt of L tokens prefilled from position s: the
  query at position p sees min(p + 1, window) keys; without a prompt length, a fixed mean ``context``). With
  fast prefill (``fast=True``) the KV-shared tail is skipped: those are the FLOPs the forward executes; the full
  count is what a forward without fast prefill (vLLM, hf) needs for the same tokens.
- ``gemm_tflops(device)``: a bf16 8192^3 GEMM's TFLOP/s measured in the same run (the compute ceiling).
- ``serving_requests`` / ``serving_seed``: workload C's random (prompt, output length) pairs, fresh per
  (rate, repeat) and reproducible from the seed.
- ``run_arrivals``: requests arrive as a Poisson process at ``rate`` per second (seeded); the backend's prefix
  cache is cleared first (where it has one); per request TTFT from the scheduled arrival (and from the actual
  submit), TPOT, and every inter-token gap (an event carrying k tokens counts k gaps of its interval / k).
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gemmaserve.engine import Engine
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings

__all__ = ["PrefillFlops", "clear_prefix_cache", "gemm_tflops", "mean_keys", "pct", "prefill_flops_per_token",
           "run_arrivals", "serving_requests", "serving_seed"]


def mean_keys(window: int | None, start: int, length: int) -> float:
    """Mean keys per query over queries at positions ``start`` .. ``start + length - 1`` (causal; the query at
    position p sees min(p + 1, window) keys, ``window`` None = no window). ``length`` must be at least 1."""
    if length < 1:
        raise ValueError(f"mean_keys needs at least one query, got length {length}")

    def seen(n: int) -> float:  # sum of min(j, window) for j = 1 .. n
        if window is None or n <= window:
            return n * (n + 1) / 2
        return window * (window + 1) / 2 + (n - window) * window

    return (seen(start + length) - seen(start)) / length


@dataclass(frozen=True)
class PrefillFlops:
    """Per-layer prefill cost terms of one model: ``matmul[i]`` = 2 x the matmul parameters layer i applies to a
    token (MoE: top-k of the experts), ``per_key[i]`` = 4 x heads x head dim (QK^T and PV per key seen),
    ``windows[i]`` its sliding window (None = full attention), ``ple`` the per-layer-embedding projection's FLOPs
    and ``fast_stop`` the first layer fast prefill skips (the KV-shared tail; the layer count if none)."""

    matmul: tuple[float, ...]
    per_key: tuple[float, ...]
    windows: tuple[int | None, ...]
    ple: float
    fast_stop: int

    @classmethod
    def from_model(cls, model: Any) -> PrefillFlops:
        """The terms of a custom ``GemmaForCausalLM`` (call it before the backend fuses projections)."""
        from gemmaserve_custom_torch.mixed_step import shared_tail_start

        config = model.config
        matmul, per_key, windows = [], [], []
        for i, layer in enumerate(model.layers):
            flops = 2.0 * sum(p.numel() for p in layer.parameters() if p.dim() == 2)
            if config.moe_num_experts:  # 3-D expert weights [E, ...]: a token runs through its top-k experts only
                experts = layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel()
                flops += 2 * experts * config.moe_top_k / config.moe_num_experts
            matmul.append(flops)
            per_key.append(4.0 * config.num_attention_heads * config.head_dims[i])
            windows.append(config.window_for_layer(i))
        ple = 2.0 * model.per_layer_model_projection.weight.numel() if config.ple_dim else 0.0
        stop = shared_tail_start(model) or config.num_hidden_layers
        return cls(tuple(matmul), tuple(per_key), tuple(windows), ple, stop)

    def per_token(self, *, fast: bool, prompt_len: int | None = None, start: int = 0, context: int = 256) -> float:
        """Mean FLOPs per prompt token: of ``prompt_len`` tokens prefilled after ``start`` cached ones (their
        queries see the cached keys too), or, without ``prompt_len``, at a fixed mean ``context`` keys."""
        stop = self.fast_stop if fast else len(self.matmul)
        flops = self.ple
        for i in range(stop):
            window = self.windows[i]
            if prompt_len is None:
                keys = min(context, window) if window else context
            else:
                keys = mean_keys(window, start, prompt_len)
            flops += self.matmul[i] + self.per_key[i] * keys
        return flops


def prefill_flops_per_token(model: Any, *, fast: bool, context: int = 256, prompt_len: int | None = None,
                            start: int = 0) -> float:
    """FLOPs one prompt token costs (``PrefillFlops.per_token``); ``context``: mean keys a query sees when no
    ``prompt_len`` is given."""
    return PrefillFlops.from_model(model).per_token(fast=fast, prompt_len=prompt_len, start=start, context=context)


def serving_seed(base: int, rate: float, repeat: int) -> str:
    """The prompt seed of workload C's run at ``rate`` (repeat ``repeat``): distinct per (rate, repeat), the same
    in every invocation (a string seeds ``random.Random`` independently of PYTHONHASHSEED)."""
    return f"c:{base}:{rate:g}:{repeat}"


def serving_requests(count: int, inputs: tuple[int, int], outputs: tuple[int, int], vocab: int,
                     seed: int | str) -> list[tuple[list[int], int]]:
    """``count`` (prompt, output length) pairs: prompt lengths uniform in ``inputs``, ids uniform in [4, vocab),
    output lengths uniform in ``outputs`` (both ranges inclusive)."""
    rng = random.Random(seed)
    (in_lo, in_hi), (out_lo, out_hi) = inputs, outputs
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(in_lo, in_hi))], rng.randint(out_lo, out_hi))
            for _ in range(count)]


def clear_prefix_cache(backend: Any) -> bool:
    """Empty ``backend.prefix_cache`` (entries no live row uses) under the backend's lock; False when the backend
    has no such cache. Call it with no Engine running over ``backend``."""
    cache = getattr(backend, "prefix_cache", None)
    clear = getattr(cache, "clear", None)
    if not callable(clear):
        return False
    lock = getattr(backend, "lock", None)
    if lock is None:
        clear()
    else:
        with lock:
            clear()
    return True


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
    rank = math.ceil(q / 100 * len(ordered) - 1e-9)  # the smallest value with at least q % of them at or below it
    return round(ordered[min(len(ordered) - 1, max(0, rank - 1))], 3)


def run_arrivals(backend: Any, settings: CoreSettings, requests: Sequence[tuple[Sequence[int], int]], rate: float,
                 seed: int = 0, *, clear_cache: bool = True) -> dict[str, Any]:
    """Submit ``requests`` = (prompt, output tokens) at Poisson ``rate`` per second (arrival times seeded by
    ``seed``) to a fresh Engine (greedy, EOS ignored); wait for all. With ``clear_cache`` the backend's prefix
    cache is emptied first (``clear_prefix_cache``), so no prompt of an earlier run is served from it.

    Returns TTFT percentiles from each request's scheduled arrival (``ttft_*``: a submit loop running late is
    latency a user sees) and from its actual submit (``ttft_from_submit_*``), how late the submits ran
    (``submit_lag_*``), ITL percentiles, TPOT median, output and prefill tok/s over the whole wall time, the
    arrival-phase rate (requests / time of the last submit), and the prompt tokens the prefix cache served
    (``cached_prompt_tokens``: the sum over the requests' final events; ~0 for distinct random prompts)."""
    rng = random.Random(seed)
    lock = threading.Lock()
    scheduled: dict[str, float] = {}
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    last_event: dict[str, float] = {}
    gaps: list[float] = []
    tpots: list[float] = []
    errors: list[str] = []
    cached = [0, 0]  # prompt tokens served from the prefix cache, finished requests
    produced = [0]  # output tokens the finished requests got

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
            if event.finished:
                cached[0] += event.cached_tokens or 0
                cached[1] += 1
            if event.finished and event.output is not None:
                if event.output.error is not None:
                    errors.append(str(event.output.error))
                n = len(event.output.token_ids)
                produced[0] += n
                if n > 1 and rid in first:
                    tpots.append((now - first[rid]) * 1e3 / (n - 1))

    cleared = clear_prefix_cache(backend) if clear_cache else False
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
        scheduled[rid] = due
        submitted[rid] = time.perf_counter()
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        handles.append(engine.submit(list(prompt), params, request_id=rid, on_event=on_event, wait_for_room=True))
    arrivals = (max(submitted.values()) - start) if submitted else 0.0
    for handle in handles:
        handle.result(timeout=3600)
    wall = time.perf_counter() - start
    engine.shutdown()
    ttfts = [(first[r] - scheduled[r]) * 1e3 for r in scheduled if r in first]
    ttfts_submit = [(first[r] - t0) * 1e3 for r, t0 in submitted.items() if r in first]
    lags = [(submitted[r] - scheduled[r]) * 1e3 for r in scheduled]
    out_tokens = produced[0]  # what the requests got (a failed one ends short), not what they asked for
    prompt_tokens = sum(len(p) for p, _ in requests)
    return {
        "rate_per_s": rate, "requests": len(requests), "wall_s": round(wall, 2),
        "achieved_rate_per_s": round(len(requests) / wall, 2),  # the wall time includes the drain at the end
        "arrival_phase_s": round(arrivals, 3),
        "arrival_rate_per_s": round(len(requests) / arrivals, 2) if arrivals > 0 else None,
        "ttft_basis": "scheduled_arrival",
        "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99),
        "ttft_from_submit_p50_ms": pct(ttfts_submit, 50), "ttft_from_submit_p99_ms": pct(ttfts_submit, 99),
        "submit_lag_p50_ms": pct(lags, 50), "submit_lag_p99_ms": pct(lags, 99),
        "submit_lag_max_ms": round(max(lags), 3) if lags else None,
        "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99), "tpot_p50_ms": pct(tpots, 50),
        "output_tok_per_s": round(out_tokens / wall, 1),
        # the offered input load over the run (arrivals and drain), not a prefill speed: A and A-long measure that
        "input_tok_per_s": round(prompt_tokens / wall, 1),
        "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached[0], "finished_requests": cached[1],
        "prefix_cache_cleared": cleared,
        "errors": errors[:3],
    }
