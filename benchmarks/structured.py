"""What structured output costs (CPU): building the vocabulary, compiling a schema, the per-step mask, and the
decode slowdown of constrained rows.

- vocabulary: llguidance's tokenizer built from ``--tokenizer`` (default: the default model's, Gemma's 262,144
  tokens; converted on first use by ``make run``);
- compile: a 20-property object schema (integers, strings, enums), first time and from the cache;
- mask: per-step mask time over one constrained generation (tokens picked at random among the allowed ones);
- decode: ``--rows`` requests on the tiny random Gemma 4 (custom-cpu, fp32), each ``--tokens`` long, all
  unconstrained and then all constrained to a JSON schema that cannot end early; TPOT medians and their ratio;
- ``--e2b`` (CUDA): the same decode comparison on the custom_torch backend at Gemma 4 E2B shapes (random bf16
  weights, CUDA graphs, asynchronous decode, as benchmarks/decode.py) with the real 262,144-token vocabulary,
  plus the engine-thread time spent computing masks; with ``--trace DIR`` a torch.profiler window over steady
  unconstrained and constrained ticks (GPU idle gaps, host and device ops; Chrome traces in DIR);
- ``--mask-threads 1,2,4,0`` (alone): only ``allowed_many`` over ``--rows`` constraints per llguidance pool size
  (0 = its default), the whole call and its native part; ``--engine-mask-threads N`` (with ``--e2b``): the
  engine's pool size for the decode comparison; ``--serial-masks`` (with ``--e2b``): the masks computed before
  the row samplings are built instead of meanwhile (the A/B of the mask thread);
- ``--host-path`` (alone): the engine thread's host work of one constrained step under deferred sampling (tokens
  taken ahead, masks with the row samplings built meanwhile, masks packed), ``--rows`` requests, ``--tokens``
  steps in the engine's overlapped order and as many in the serial order, alternating; CPU only.

Usage (repo root):  PYTHONPATH=core:plugins/custom_torch:tests .venv/bin/python benchmarks/structured.py [--json out.json]
                    python benchmarks/structured.py --e2b --tokenizer DIR --json out.json   (H200, ~2 minutes)
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = (lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 4))
    return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "max_ms": round(ordered[-1] * 1e3, 4), "steps": len(values)}


def vocabulary_compile_and_mask(tokenizer_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from gemmaserve.hf_tokenizer import HFTokenizerAdapter
    from gemmaserve.structured import GrammarCompiler, StructuredOutputs

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = max(len(hf), int(getattr(hf, "vocab_size", 0) or 0))
    compiler = GrammarCompiler(HFTokenizerAdapter(hf), vocab, [hf.eos_token_id])
    start = time.perf_counter()
    compiler.warm()
    out: dict[str, Any] = {"tokenizer": str(tokenizer_dir), "vocab_size": vocab,
                           "vocabulary_build_s": round(time.perf_counter() - start, 3)}
    kinds = [{"type": "integer", "minimum": 0, "maximum": 10000}, {"type": "string", "maxLength": 24},
             {"enum": ["red", "green", "blue", "cyan"]}]
    props = {f"field_{i}": kinds[i % 3] for i in range(20)}
    spec = StructuredOutputs(json={"type": "object", "properties": props, "required": sorted(props),
                                   "additionalProperties": False})
    start = time.perf_counter()
    constraint = compiler.compile(spec)
    out["compile_20_properties_ms"] = round((time.perf_counter() - start) * 1e3, 3)
    start = time.perf_counter()
    compiler.compile(spec)
    out["compile_cached_ms"] = round((time.perf_counter() - start) * 1e3, 3)
    rng = random.Random(0)
    times = []
    while not constraint.is_complete and len(times) < 2000:
        start = time.perf_counter()
        mask = constraint.allowed()
        times.append(time.perf_counter() - start)
        allowed = [t for t in range(min(vocab, len(mask) * 8)) if mask[t >> 3] >> (t & 7) & 1]
        constraint.accept(rng.choice(allowed))
    out["mask"] = _percentiles(times)
    return out


def mask_threads(tokenizer_dir: Path, rows: int, sizes: list[int]) -> dict[str, Any]:
    """``allowed_many`` over ``rows`` constraints inside a JSON array of digits (the decode benchmark's
    schema) with llguidance executors of each size in ``sizes`` (0 = llguidance's default, 80 % of the CPUs):
    median ms per call of the whole function and of the native call alone."""
    import os

    import llguidance
    from transformers import AutoTokenizer

    import gemmaserve.structured.grammar as grammar
    from gemmaserve.hf_tokenizer import HFTokenizerAdapter
    from gemmaserve.structured import GrammarCompiler, StructuredOutputs

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = max(len(hf), int(getattr(hf, "vocab_size", 0) or 0))
    compiler = GrammarCompiler(HFTokenizerAdapter(hf), vocab, [hf.eos_token_id])
    spec = StructuredOutputs(json=_SCHEMA_DIGITS(4096))
    prefix = hf.encode('{"items":[1,2', add_special_tokens=False)
    constraints = [compiler.compile(spec) for _ in range(rows)]
    for constraint in constraints:
        for token in prefix:
            constraint.accept(token)
    saved = grammar._executor
    out: dict[str, Any] = {"rows": rows, "cpus": os.cpu_count(), "executors": []}
    try:
        for size in sizes:
            grammar._executor = llguidance.LLExecutor() if size == 0 else llguidance.LLExecutor(num_threads=size)
            native: list[float] = []
            whole: list[float] = []
            inner = grammar._executor

            class Timed:
                def unsafe_compute_mask_ptr(self, *args: Any) -> None:
                    t0 = time.perf_counter()
                    inner.unsafe_compute_mask_ptr(*args)
                    native.append(time.perf_counter() - t0)

            grammar._executor = Timed()
            for i in range(220):
                t0 = time.perf_counter()
                grammar.allowed_many(constraints)
                whole.append(time.perf_counter() - t0)
                time.sleep(0.003)  # a decode step's gap: the pool's threads go idle between calls, as in serving
            out["executors"].append({"threads": size, "allowed_many_ms": round(statistics.median(whole[20:]) * 1e3, 3),
                                     "native_ms": round(statistics.median(native[20:]) * 1e3, 3)})
    finally:
        grammar._executor = saved
    return out


def host_path(tokenizer_dir: Path, rows: int, steps: int = 40) -> dict[str, Any]:
    """The engine thread's work between reading a constrained step's tokens and launching the next sampling
    (deferred sampling, no device), in the engine's order and in the serial one it replaced, alternating steps:
    ``Request.take_ahead`` of each row's token; the masks started on the mask thread, the rows'
    ``row_sampling(ahead=1)`` built meanwhile, then waited for (``overlapped``; ``serial``: ``prepare_masks``,
    then the row samplings); the masks packed by ``torch_sampling`` (CPU tensor, no pinned memory). ``rows``
    requests inside a JSON array of digits, each step's token drawn at random among the allowed ones (outside the
    timing). Median ms per step of each part and of their sum, per order."""
    import torch
    from transformers import AutoTokenizer

    from sampling import random_allowed  # benchmarks/sampling.py

    from gemmaserve import torch_sampling
    from gemmaserve.engine.request import Request, RequestState, prepare_masks, start_masks
    from gemmaserve.hf_tokenizer import HFTokenizerAdapter
    from gemmaserve.sampling_params import SamplingParams
    from gemmaserve.structured import GrammarCompiler, StructuredOutputs

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = max(len(hf), int(getattr(hf, "vocab_size", 0) or 0))
    compiler = GrammarCompiler(HFTokenizerAdapter(hf), vocab, [hf.eos_token_id])
    spec = StructuredOutputs(json=_SCHEMA_DIGITS(4 * 2 * steps))
    requests = []
    for i in range(rows):
        request = Request(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=8 * 2 * steps, structured_outputs=spec))
        request.seed, request.constraint, request.eos_token_ids = i, compiler.compile(spec), (hf.eos_token_id,)
        request.state = RequestState.DECODING
        requests.append(request)
    rng = random.Random(1)
    prepare_masks(requests)
    samplings = [request.row_sampling() for request in requests]
    orders = ("overlapped", "serial")
    names = ("take_ahead", "masks_and_row_sampling", "pack", "total")
    parts: dict[str, dict[str, list[float]]] = {order: {name: [] for name in names} for order in orders}
    for step in range(2 * steps):
        order = orders[step % 2]
        tokens = [random_allowed(sampling.allowed, rng) for sampling in samplings]
        t0 = time.perf_counter()
        for request, token in zip(requests, tokens):
            request.take_ahead(token)
        t1 = time.perf_counter()
        if order == "overlapped":
            pending = start_masks((request, 1) for request in requests)
            samplings = [request.row_sampling(ahead=1) for request in requests]
            if pending.wait():
                raise RuntimeError("a constraint could not continue")
        else:
            prepare_masks(requests)
            samplings = [request.row_sampling(ahead=1) for request in requests]
        t2 = time.perf_counter()
        torch_sampling._packed_allowed([s.allowed for s in samplings], vocab, torch.device("cpu"))
        t3 = time.perf_counter()
        for request, token in zip(requests, tokens):
            request.append_token(token, None, request.eos_token_ids)
        for name, start, end in (("take_ahead", t0, t1), ("masks_and_row_sampling", t1, t2), ("pack", t2, t3),
                                 ("total", t0, t3)):
            parts[order][name].append(end - start)
        if any(request.is_finished for request in requests):
            raise RuntimeError(f"a constrained request ended early: {[r.error for r in requests if r.is_finished]}")
    return {"rows": rows, "steps": steps, **{order: {f"{name}_ms_p50": round(statistics.median(values) * 1e3, 3)
                                                     for name, values in parts[order].items()} for order in orders}}


def decode_overhead(rows: int, tokens: int) -> dict[str, Any]:
    from tiny_checkpoints import build_tiny_gemma4

    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams

    schema = {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
        "items": {"type": "array", "minItems": 4 * tokens, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_gemma4(Path(tmp) / "ckpt")
        llm = LLM(str(path), backend="custom-cpu", device="cpu", dtype="float32", max_batch_size=rows)
        try:
            prompts = [[5 + i % 50, 6, 7] for i in range(rows)]
            result: dict[str, Any] = {"rows": rows, "tokens": tokens}
            for label, constrained in (("warm-up", False), ("unconstrained", False), ("constrained", True),
                                       ("unconstrained_again", False), ("constrained_again", True)):
                params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True,
                                        structured_outputs={"json": schema} if constrained else None)
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - start
                tpots = [(o.metrics.finish_time - o.metrics.first_token_time) * 1e3 / (len(o.token_ids) - 1)
                         for o in outs if len(o.token_ids) > 1]
                if label != "warm-up":
                    result[label] = {"tpot_median_ms": round(statistics.median(tpots), 3), "wall_s": round(wall, 3)}
        finally:
            llm.close()
    base = statistics.fmean([result["unconstrained"]["tpot_median_ms"], result["unconstrained_again"]["tpot_median_ms"]])
    masked = statistics.fmean([result["constrained"]["tpot_median_ms"], result["constrained_again"]["tpot_median_ms"]])
    result["tpot_overhead_pct"] = round(100 * (masked / base - 1), 1)
    return result


class _FallbackCounter(logging.Handler):
    """Counts the engine's "computing them one by one" warnings (a batch of masks that failed to start)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if "one by one" in record.getMessage():
            self.count += 1
            if self.first is None:
                self.first = f"{record.getMessage()}: {record.exc_info[1]!r}" if record.exc_info else record.getMessage()


_SCHEMA_DIGITS = (lambda count: {"type": "object", "additionalProperties": False, "required": ["items"],
                                  "properties": {"items": {"type": "array", "minItems": count,
                                                           "items": {"type": "integer", "minimum": 0, "maximum": 9}}}})


def decode_overhead_e2b(rows: int, tokens: int, tokenizer_dir: Path, quick: bool = False,
                        trace_dir: Path | None = None, profile_engine: bool = False, profile_top: int = 40,
                        ) -> dict[str, Any]:
    """Unconstrained vs constrained decode at E2B shapes on CUDA, every request sampled (temperature 1, seeded)
    so the only difference is the constraint; the constrained rows give up the launch-ahead of asynchronous
    decode (their next mask needs the token just sampled), which the TPOT ratio includes. ``quick``: the toy
    E2B config (with the full vocabulary) on the CPU, to check the path. ``trace_dir``: one more unconstrained
    and one more constrained run, each with a torch.profiler window of steady decode ticks (GPU idle gaps, host
    and device ops; Chrome traces written there)."""
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import decode_model as dm
    from decode import _custom_backend, _settings
    from decode_workloads import profile_engine_thread, random_prompts, run_engine
    from tick_profile import TickRecorder, _summary, trace_ticks

    import gemmaserve.engine.request as request_module
    import gemmaserve.structured.grammar as grammar_module
    from gemmaserve.hf_tokenizer import HFTokenizerAdapter
    from gemmaserve.sampling_params import SamplingParams

    start = time.perf_counter()
    base = {**dm.TINY, "vocab_size": dm.E2B["vocab_size"], "vocab_size_per_layer_input": dm.E2B["vocab_size"],
            "max_position_embeddings": 512} if quick else dm.E2B
    device, dtype = ("cpu", "float32") if quick else ("cuda", "bfloat16")
    model = dm.custom_from_hf(dm.build_hf_model(base, device, getattr(torch, dtype), seed=0))
    settings = _settings(device, dtype, rows, base["max_position_embeddings"], rows * base["max_position_embeddings"])
    tokenizer = HFTokenizerAdapter(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    backend = _custom_backend(model, settings, tokenizer=tokenizer)
    if backend.mixed.graphs is not None:
        backend.mixed.capture_all()
    result: dict[str, Any] = {"rows": rows, "tokens": tokens, "prompt_len": 128, "async_scheduling":
                              settings.async_scheduling, "build_s": round(time.perf_counter() - start, 1)}
    # per batch of masks: engine-thread time starting it plus time blocked waiting for it (``spent``, every batch);
    # for the batches handed to the mask thread (the deferred decode tick's) also apart: starting (grammar.start_masks:
    # the buffer, the hand-over), waiting (PendingMasks.wait: the rest of the native call, the per-row checks) and
    # the mask thread's own time (the native call). Batches computed on the engine thread (overlap=False: a mixed
    # tick's prepare_masks) count in ``spent`` only.
    spent: list[float] = []
    started: list[float] = []
    waited: list[float] = []
    native: list[float] = []
    original_start, original_wait = request_module.grammar_start_masks, request_module.PendingMasks.wait
    original_compute = grammar_module.MaskBatch._compute

    handed_over: set[Any] = set()  # the batches computed on the mask thread (held until their wait)

    def timed_start(*args: Any, **kwargs: Any) -> Any:  # the engine passes overlap=: forward every argument
        t0 = time.perf_counter()
        try:
            return original_start(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)
            if kwargs.get("overlap", True):
                started.append(spent[-1])

    def timed_wait(self: Any) -> Any:
        overlapped = self._batch is not None and self._batch in handed_over
        handed_over.discard(self._batch)  # (a batch holds its masks' buffer)
        t0 = time.perf_counter()
        try:
            return original_wait(self)
        finally:
            if self._todo:
                elapsed = time.perf_counter() - t0
                spent[-1] += elapsed
                if overlapped:
                    waited.append(elapsed)

    def timed_compute(self: Any) -> None:
        on_mask_thread = threading.current_thread().name == grammar_module.MASK_THREAD_NAME
        if on_mask_thread:
            handed_over.add(self)
        t0 = time.perf_counter()
        try:
            original_compute(self)
        finally:
            if on_mask_thread:
                native.append(time.perf_counter() - t0)

    request_module.grammar_start_masks = timed_start
    request_module.PendingMasks.wait = timed_wait  # type: ignore[method-assign]
    grammar_module.MaskBatch._compute = timed_compute  # type: ignore[method-assign]
    fallbacks = _FallbackCounter()  # a batch of masks that failed is computed row by row: not what this measures
    request_module.logger.addHandler(fallbacks)
    try:
        for number, (label, constrained, temperature) in enumerate((
                ("warm-up", True, 1.0), ("greedy", False, 0.0), ("unconstrained", False, 1.0),
                ("constrained", True, 1.0), ("unconstrained_again", False, 1.0), ("constrained_again", True, 1.0))):
            # prompts of its own per pass: one set for all of them hit the prefix cache after the warm-up, unevenly
            prompts = random_prompts(rows, 128, base["vocab_size"], seed=5 + number)
            params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=1, ignore_eos=True,
                                    structured_outputs={"json": _SCHEMA_DIGITS(4 * tokens)} if constrained else None)
            for times in (spent, started, waited, native, handed_over):
                times.clear()
            recorder = TickRecorder(backend)
            try:
                run = run_engine(backend, settings, prompts, tokens, params).summary()
            finally:
                recorder.restore()
            if fallbacks.count:
                raise RuntimeError(f"{fallbacks.count} batches of masks failed and were computed row by row during "
                                   f"the {label!r} pass (first: {fallbacks.first}); its figures would not measure the "
                                   "engine's batched mask path")
            if label != "warm-up":
                result[label] = {key: run[key] for key in ("tpot_median_ms", "ttft_median_ms", "output_tok_per_s",
                                                           "wall_s", "errors")}
                # steady decode ticks: interval, host time of the launch (the deferred masks included) and the
                # time blocked on the previous step's tokens (the device being the longer side)
                steady = [t for t in recorder.intervals() if t["prompt_tokens"] == 0 and t["rows"] >= rows]
                result[label]["steady_ticks"] = _summary(steady[3:-3] if len(steady) > 12 else steady)
                if constrained and spent:
                    result[label]["mask_calls"] = len(spent)
                    result[label]["mask_ms_median"] = round(statistics.median(spent) * 1e3, 3)
                    for name, times in (("mask_start", started), ("mask_wait", waited), ("mask_native", native)):
                        if times:
                            result[label][f"{name}_ms_median"] = round(statistics.median(times) * 1e3, 3)
        if trace_dir is not None:
            for number, (label, constrained) in enumerate((("unconstrained", False), ("constrained", True))):
                params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True,
                                        structured_outputs={"json": _SCHEMA_DIGITS(4 * tokens)} if constrained else None)
                prompts = random_prompts(rows, 128, base["vocab_size"], seed=20 + number)  # fresh, as above
                result[f"trace_{label}"] = trace_ticks(
                    backend, settings, lambda params=params, prompts=prompts: run_engine(
                        backend, settings, prompts, tokens, params),
                    first=tokens // 2, ticks=8, trace_path=trace_dir / f"structured_trace_{label}.json")
        if profile_engine:
            for number, (label, constrained) in enumerate((("unconstrained", False), ("constrained", True))):
                spec = {"json": _SCHEMA_DIGITS(4 * tokens)} if constrained else None
                params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True,
                                        structured_outputs=spec)
                prompts = random_prompts(rows, 128, base["vocab_size"], seed=30 + number)  # fresh, as above
                run, profile = profile_engine_thread(
                    lambda params=params, prompts=prompts: run_engine(backend, settings, prompts, tokens, params))
                result[f"engine_profile_{label}"] = {"tpot_median_ms": run.summary()["tpot_median_ms"],
                                                     **_top_functions(profile, tokens, profile_top)}
    finally:
        request_module.logger.removeHandler(fallbacks)
        request_module.grammar_start_masks = original_start
        request_module.PendingMasks.wait = original_wait  # type: ignore[method-assign]
        grammar_module.MaskBatch._compute = original_compute  # type: ignore[method-assign]
        backend.close()
    base = statistics.fmean([result["unconstrained"]["tpot_median_ms"], result["unconstrained_again"]["tpot_median_ms"]])
    masked = statistics.fmean([result["constrained"]["tpot_median_ms"], result["constrained_again"]["tpot_median_ms"]])
    result["tpot_overhead_pct"] = round(100 * (masked / base - 1), 1)
    return result


def _top_functions(profile: Any, tokens: int, count: int = 40) -> dict[str, Any]:
    """cProfile's top ``count`` functions by own and by cumulative time, in ms per decode tick (``tokens`` ticks)."""
    import pstats

    stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, ...)}

    def table(column: int) -> list[list[Any]]:
        ranked = sorted(stats.items(), key=lambda item: -item[1][column])[:count]
        return [[f"{Path(key[0]).name}:{key[1]}({key[2]})", calls, round(own * 1e3 / tokens, 4),
                 round(cumulative * 1e3 / tokens, 4)] for key, (_, calls, own, cumulative, _) in ranked]

    return {"columns": ["function", "calls", "own_ms_per_tick", "cumulative_ms_per_tick"],
            "by_own_time": table(2), "by_cumulative_time": table(3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Hugging Face tokenizer folder")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per request (decode sections) or steps (--host-path); default 32")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--e2b", action="store_true", help="also the decode comparison at E2B shapes (CUDA)")
    parser.add_argument("--quick", action="store_true", help="with --e2b: toy shapes on the CPU (checks the path)")
    parser.add_argument("--e2b-only", action="store_true", help="with --e2b: skip the CPU sections")
    parser.add_argument("--mask-threads", default="",
                        help="only the mask micro-benchmark: llguidance executor sizes, e.g. 1,2,4,0 (0 = default)")
    parser.add_argument("--host-path", action="store_true",
                        help="only the CPU micro-benchmark of a constrained step's host work (deferred sampling)")
    parser.add_argument("--engine-mask-threads", type=int, default=0,
                        help="with --e2b: the engine's llguidance pool size (0 = llguidance's default)")
    parser.add_argument("--serial-masks", action="store_true",
                        help="with --e2b: the engine computes a deferred tick's masks before building its row "
                             "samplings (the order before the mask thread), for an A/B against the default")
    parser.add_argument("--trace", type=Path, default=None,
                        help="with --e2b: a folder for torch.profiler traces of steady decode ticks, "
                             "unconstrained and constrained")
    parser.add_argument("--profile-engine", action="store_true",
                        help="with --e2b: one more unconstrained and constrained run with cProfile on the engine "
                             "thread (top functions in ms per tick)")
    args = parser.parse_args()
    if (args.quick or args.e2b_only or args.trace or args.profile_engine) and not args.e2b:
        parser.error("--quick, --e2b-only, --trace and --profile-engine apply to the --e2b section; add --e2b")
    if (args.engine_mask_threads or args.serial_masks) and not args.e2b:
        parser.error("--engine-mask-threads and --serial-masks apply to the --e2b section; add --e2b")
    if args.engine_mask_threads < 0:
        parser.error("--engine-mask-threads must be >= 0")
    if args.mask_threads and args.e2b:
        parser.error("--mask-threads runs only the mask micro-benchmark; run --e2b in another call")
    if args.host_path and (args.e2b or args.mask_threads):
        parser.error("--host-path runs only the host-path micro-benchmark; run --e2b / --mask-threads in another call")
    if args.mask_threads and args.tokens is not None:
        parser.error("--mask-threads times a fixed walk; --tokens applies to the decode sections and --host-path")
    args.tokens = 32 if args.tokens is None else args.tokens
    if args.tokens < 1 or args.rows < 1:
        parser.error(f"--tokens and --rows must be at least 1, got {args.tokens} and {args.rows}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    if args.tokenizer is None:
        from gemmaserve.models.default_model import ensure_default_model

        args.tokenizer = ensure_default_model()
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.host_path or args.mask_threads:
        if args.host_path:
            results["host_path"] = host_path(args.tokenizer, args.rows, args.tokens)
        else:
            results["mask_threads"] = mask_threads(args.tokenizer, args.rows,
                                                   [int(x) for x in args.mask_threads.split(",")])
        print(json.dumps(results, indent=2))
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        return
    if not (args.e2b and args.e2b_only):
        results.update(vocabulary=vocabulary_compile_and_mask(args.tokenizer),
                       decode=decode_overhead(args.rows, args.tokens))
    if args.e2b:
        if args.engine_mask_threads:
            import llguidance

            from gemmaserve.structured import grammar

            grammar._executor = llguidance.LLExecutor(num_threads=args.engine_mask_threads)
            results["engine_mask_threads"] = args.engine_mask_threads
        if args.serial_masks:
            import functools

            from gemmaserve.engine import scheduler as scheduler_module

            scheduler_module.start_masks = functools.partial(scheduler_module.start_masks, overlap=False)
            results["serial_masks"] = True
        results["decode_e2b"] = decode_overhead_e2b(args.rows, args.tokens, args.tokenizer, quick=args.quick,
                                                    trace_dir=args.trace, profile_engine=args.profile_engine)
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
