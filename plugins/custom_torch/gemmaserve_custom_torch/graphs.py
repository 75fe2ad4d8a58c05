"""CUDA-graph capture/replay of a fixed-buffer forward per shape key, plus the optional torch.compile wrapper.

`StepGraphs` captures ``forward(key)`` on the first use of a key (a decode batch bucket, a prefill length
bucket): that call runs ``forward`` eagerly (its result is the call's result, and the run warms up Triton /
cuBLAS / Inductor), then the graph is recorded (recording executes nothing, so the KV pools are not
written twice) and every later call of that key is a replay. All graphs of one `StepGraphs` share one
memory pool: only one runs at a time and each one's outputs stay allocated, so they never alias. Outputs
are overwritten by the next replay of the same key.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

__all__ = ["CompileFellBack", "StepGraphs", "explain_report", "maybe_compile"]

logger = logging.getLogger(__name__)

Forward = Callable[[Any], tuple[Tensor, ...]]


class StepGraphs:
    """One CUDA graph per key of ``forward`` (which must read only fixed buffers). Not thread-safe.
    ``name`` labels the log lines (``decode``, ``prefill``)."""

    def __init__(self, forward: Forward, name: str = "decode") -> None:
        self.forward = forward
        self.name = name
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]] = {}
        self._pool: Any = None
        self.capture_seconds: dict[Any, float] = {}  # warm-up + capture wall time per key

    def has(self, key: Hashable) -> bool:
        return key in self._graphs

    def run(self, key: Hashable) -> tuple[Tensor, ...]:
        """This call's outputs for ``key``: a replay, or on first use an eager run followed by the capture."""
        entry = self._graphs.get(key)
        if entry is not None:
            entry[0].replay()
            return entry[1]
        start = time.perf_counter()
        result = self.forward(key)
        self._record(key)
        self.capture_seconds[key] = time.perf_counter() - start
        return result

    def capture(self, key: Hashable) -> None:
        """Warm up (one eager run) and capture ``key`` now; the state buffers must hold a valid call."""
        start = time.perf_counter()
        self.forward(key)
        self._record(key)
        self.capture_seconds[key] = time.perf_counter() - start

    def _record(self, key: Hashable) -> None:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = self.forward(key)
        except CompileFellBack:
            # the graph so far holds part of the compiled forward: drop it, warm the eager forward up (its Triton
            # kernels load outside the capture) and record that instead
            self.forward(key)
            self._record(key)
            return
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize()
        self._graphs[key] = (graph, outputs)
        logger.info("custom_torch: captured the %s graph of %s", self.name, key)


class CompileFellBack(RuntimeError):
    """A compiled forward failed while a CUDA graph was recording it: the recording holds part of the compiled
    forward and must be discarded (`StepGraphs` records the eager forward instead)."""


class _CompiledForward:
    """``torch.compile(fn, dynamic=False)`` that falls back to ``fn`` for good (with a warning and the traceback)
    if compiling or a compiled call raises; the failed call is retried eagerly (decode writes are idempotent),
    except while a CUDA graph records it: then `CompileFellBack` is raised so the recording is redone."""

    def __init__(self, fn: Forward) -> None:
        import torch._dynamo
        import torch._inductor.config

        config = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit"):  # one compilation per bucket
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), 64))
        # In-process kernel compilation: Inductor's subprocess worker pool failed on the H200 image
        # ("SubprocException: An exception occurred in a subprocess", 2026-11-29).
        torch._inductor.config.compile_threads = 1
        self.eager = fn
        self.error: str | None = None  # why compiling failed, if it did
        self.compiled: Forward | None = torch.compile(fn, dynamic=False)

    def __call__(self, bucket: int) -> tuple[Tensor, Tensor]:
        if self.compiled is not None:
            try:
                return self.compiled(bucket)
            except Exception as exc:
                self.compiled = None
                self.error = f"{type(exc).__name__}: {exc}"[:4000]
                capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
                logger.warning("CUSTOM_BACKEND_COMPILE: torch.compile failed%s; decoding eagerly: %s",
                               " while a CUDA graph recorded it" if capturing else "", self.error, exc_info=True)
                if capturing:
                    raise CompileFellBack(self.error) from exc
        return self.eager(bucket)


def maybe_compile(fn: Forward, enabled: bool) -> Forward:
    """``fn`` itself, or its compiled wrapper when ``enabled`` (see `_CompiledForward`)."""
    return _CompiledForward(fn) if enabled else fn


def explain_report(fn: Forward, bucket: int) -> dict[str, Any]:
    """Run ``torch._dynamo.explain`` on ``fn(bucket)`` (this executes one decode forward) and log the graph
    count, break count and breaks grouped by reason. Returns those numbers; {"error": ...} if explain fails."""
    try:
        import torch._dynamo

        out = torch._dynamo.explain(fn)(bucket)
    except Exception as exc:
        logger.warning("CUSTOM_BACKEND_EXPLAIN: torch._dynamo.explain failed: %s: %s", type(exc).__name__, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}
    reasons = Counter(str(getattr(b, "reason", b)).splitlines()[0] for b in out.break_reasons)
    report = {
        "bucket": bucket,
        "graph_count": int(out.graph_count),
        "graph_break_count": int(out.graph_break_count),
        "op_count": int(getattr(out, "op_count", -1)),
        "break_reasons": dict(reasons.most_common()),
    }
    logger.warning("CUSTOM_BACKEND_EXPLAIN (bucket %d): %d graph(s), %d break(s), %d ops; breaks by reason: %s",
                   bucket, report["graph_count"], report["graph_break_count"], report["op_count"],
                   report["break_reasons"] or "none")
    return report
