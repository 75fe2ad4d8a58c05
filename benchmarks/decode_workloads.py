"""Workload drivers of benchmarks/decode.py: requests through the real `gemmaserve.engine.Engine`, timed end
to end (TTFT, TPOT, output tokens/s) and per decode step (device events around ``decode_step_batched`` and,
on the graph path, around the graph replay alone)."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gemmaserve.engine import Engine
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings


class StepTimer:
    """Wraps ``owner.<name>`` (a callable taking the batch first) to record (rows, start, end) per call with
    CUDA events (host clock on CPU). ``size_of(args)`` gives the row count. Undo with :meth:`restore`."""

    def __init__(self, owner: Any, name: str, size_of: Callable[..., int], device: str) -> None:
        self.owner, self.name, self.device = owner, name, device
        self.original = getattr(owner, name)
        self.records: list[tuple[int, Any, Any]] = []
        self.size_of = size_of

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._mark()
            out = self.original(*args, **kwargs)
            self.records.append((self.size_of(*args), start, self._mark()))
            return out

        setattr(owner, name, timed)

    def _mark(self) -> Any:
        if self.device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def restore(self) -> None:
        setattr(self.owner, self.name, self.original)

    def median_ms(self, rows: int) -> float | None:
        """Median ms of the calls with exactly ``rows`` rows (None if there were none)."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        times = [s.elapsed_time(e) if self.device == "cuda" else (e - s) * 1e3
                 for n, s, e in self.records if n == rows]
        return statistics.median(times) if times else None


@dataclass
class RunResult:
    num_requests: int
    prompt_len: int
    output_len: int
    wall_s: float
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        med = (lambda xs: round(statistics.median(xs), 3) if xs else None)
        return {
            "requests": self.num_requests, "prompt_len": self.prompt_len, "output_len": self.output_len,
            "ttft_median_ms": med(self.ttft_ms), "tpot_median_ms": med(self.tpot_ms),
            "tpot_min_ms": round(min(self.tpot_ms), 3) if self.tpot_ms else None,
            "tpot_max_ms": round(max(self.tpot_ms), 3) if self.tpot_ms else None,
            "output_tok_per_s": round(self.output_tokens / self.wall_s, 1) if self.wall_s else None,
            "wall_s": round(self.wall_s, 3), "cached_tokens_median": med(self.cached_tokens),
            "errors": self.errors[:3],
        }


def random_prompts(count: int, length: int, vocab: int, seed: int, prefix: Sequence[int] = ()) -> list[list[int]]:
    """``count`` prompts of ``prefix`` + distinct random ids in [4, vocab) (no special tokens)."""
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(4, vocab) for _ in range(length)] for _ in range(count)]


def profile_engine_thread(work: Callable[[], Any]) -> tuple[Any, Any]:
    """``work()`` with cProfile enabled on every Engine thread it starts; returns (its result, the profile)."""
    import cProfile

    profile = cProfile.Profile()
    run = Engine._run

    def profiled(self: Engine) -> None:
        profile.enable()
        try:
            run(self)
        finally:
            profile.disable()

    Engine._run = profiled  # type: ignore[method-assign]
    try:
        return work(), profile
    finally:
        Engine._run = run  # type: ignore[method-assign]


def run_engine(backend: Any, settings: CoreSettings, prompts: Sequence[Sequence[int]], output_len: int,
               params: SamplingParams | None = None) -> RunResult:
    """Submit every prompt at once (``params``; default greedy, EOS ignored; one ``Engine.submit_many`` call) to a
    fresh Engine over ``backend``; wait for all."""
    result = RunResult(len(prompts), len(prompts[0]), output_len, 0.0)
    lock = threading.Lock()
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}

    def on_event(event: Any) -> None:
        now = time.perf_counter()
        with lock:
            if event.new_token_ids and event.request_id not in first:
                first[event.request_id] = now
            count = last.get(event.request_id, (0.0, 0))[1] + len(event.new_token_ids)
            last[event.request_id] = (now, count)
            if event.finished and event.output is not None:
                result.cached_tokens.append(event.cached_tokens)
                if event.output.error is not None:
                    result.errors.append(str(event.output.error))

    if params is None:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = Engine(backend, settings)
    rids = [f"r{i}" for i in range(len(prompts))]
    start = time.perf_counter()  # every request's submit time
    # one call: the engine's first tick sees every prompt (a loop of submit races the engine thread)
    handles = engine.submit_many(prompts, [params] * len(prompts), rids, [on_event] * len(prompts))
    for handle in handles:
        handle.result(timeout=3600)
    result.wall_s = time.perf_counter() - start
    engine.shutdown()
    for rid in rids:
        if rid in first:
            result.ttft_ms.append((first[rid] - start) * 1e3)
            t_last, count = last[rid]
            result.output_tokens += count
            if count > 1:
                result.tpot_ms.append((t_last - first[rid]) * 1e3 / (count - 1))
    return result
