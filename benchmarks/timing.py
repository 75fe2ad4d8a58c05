"""Timing helpers the benchmark scripts share: the median time of a call, a CUDA graph of a call and its replay time,
and the device copy bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: str, iters: int, warmup: int = 2) -> float:
    """Median milliseconds per call of ``fn`` after ``warmup`` calls: CUDA events on CUDA (each call timed to its
    own completion), ``perf_counter`` elsewhere."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - began) * 1e3)
    return statistics.median(samples)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """One CUDA graph holding ``fn``, warmed up on a side stream first (compiles and allocations stay out of the
    capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_replay_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds per replay of :func:`capture_graph`'s graph of ``fn``."""
    return median_ms(capture_graph(fn).replay, "cuda", iters, warmup=3)


def copy_bandwidth(device: str, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of ``reps`` copies."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    times = sorted(times[3:])
    return 2 * src.numel() * src.element_size() / times[len(times) // 2]
