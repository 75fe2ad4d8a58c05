"""The default model's speed on this CPU: greedy decode tok/s of Gemma 3 270M for each CPU backend and dtype.

For issue "first hour without surprises" (CPU speed of the default): one request, a short prompt, ``--tokens``
greedy tokens (EOS ignored) after a warm-up, through the offline API (the engine thread, as ``make run`` uses it),
so the figure is what a user sees; TPOT is the engine's own (first token to last). The greedy text of each run is
kept, so a dtype change that changes the text shows.

The box may be shared and its speed drifts, so the variants run interleaved (every variant once per round, for
``--rounds`` rounds, each run in a fresh subprocess so none inherits another's warm caches or thread pools) and the
summary gives each variant's minimum and median tok/s over the rounds. ``auto`` as a backend or dtype is what
``make run`` gets (``BACKEND=auto``, ``DTYPE=auto``); each run records the backend and dtype it resolved to.

Usage (repo root):  .venv/bin/python benchmarks/cpu_default.py [--backends hf,custom-cpu] [--dtypes float32,bfloat16]
                    [--quantizations none,int8,demo] [--tokens 64] [--rounds 3] [--threads 1,2]
                    [--profile-steps 20] [--json out.json]
                    .venv/bin/python benchmarks/cpu_default.py --kernels [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"


class StepProfiler:
    """Wraps the backend's ``decode_step_batched`` so that ``torch.profiler`` records ``steps`` decode steps on
    the thread that runs them (the engine's own thread: the profiler records only the thread that started it)."""

    def __init__(self, step: Any, steps: int) -> None:
        import torch

        self.step, self.steps, self.calls = step, steps, 0
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.calls == 0:
            self.profiler.__enter__()
        try:
            return self.step(*args, **kwargs)
        finally:
            self.calls += 1
            if self.calls == self.steps:
                self.profiler.__exit__(None, None, None)

    def top_ops(self, count: int = 15) -> list[dict[str, Any]]:
        """The ``count`` ops with the most self CPU time, per decode step."""
        events = sorted(self.profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
        return [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / self.steps, 2),
                 "calls_per_step": round(e.count / self.steps, 1)} for e in events]


def measure(path: str, backend: str, dtype: str, tokens: int, profile_steps: int = 0,
            quantization: str = "none") -> dict[str, Any]:
    """One run in this process: load, warm up (8 tokens), then time ``tokens`` greedy tokens; with
    ``profile_steps``, profile that many decode steps after the timed run (on the engine thread).
    ``quantization``: QUANTIZATION (``none`` = unset; ``demo`` = what ``gemmaserve demo`` picks)."""
    from gemmaserve import LLM
    from gemmaserve.cli import demo_quantization
    from gemmaserve.sampling_params import SamplingParams
    from gemmaserve.settings import load_settings

    resolved = quantization
    if quantization == "demo":
        resolved = demo_quantization(load_settings(backend=backend, device="cpu", dtype=dtype)) or "none"
    llm = LLM(path, backend=backend, device="cpu", dtype=dtype, max_batch_size=1,
              quantization=None if resolved == "none" else resolved)
    profile: list[dict[str, Any]] = []
    try:
        info, backend_class = llm.engine.backend.model_info, type(llm.engine.backend).__name__
        llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        out = llm.generate([PROMPT], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))[0]
        wall = time.perf_counter() - start
        if profile_steps:
            target = llm.engine.backend
            profiler = target.decode_step_batched = StepProfiler(target.decode_step_batched, profile_steps)
            llm.generate([PROMPT], SamplingParams(max_tokens=profile_steps + 1, temperature=0.0, ignore_eos=True))
            profile = profiler.top_ops()
    finally:
        llm.close()
    metrics = out.metrics
    tpot = None
    if metrics is not None and metrics.first_token_time is not None and metrics.finish_time is not None:
        tpot = (metrics.finish_time - metrics.first_token_time) / (len(out.token_ids) - 1)
    row = {"backend": backend, "dtype": dtype, "quantization": quantization, "resolved_quantization": resolved,
           "resolved_backend": backend_class,
           "resolved_dtype": info.dtype,
           "tokens": len(out.token_ids), "tok_per_s": round(tokens / wall, 2),
           "tpot_ms": round(tpot * 1e3, 2) if tpot else None, "text": out.text}
    return row | ({"profile": profile} if profile else {})


def cpu_info() -> dict[str, Any]:
    """What decides CPU matmul speed here: torch's vector capability and the bf16 / AMX instructions."""
    import torch

    return {"cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_tile": torch.cpu._is_amx_tile_supported()}


def kernel_timings(path: str, rounds: int) -> dict[str, Any]:
    """What a decode step is made of, interleaved over ``rounds``: the tied LM head as one [1, 640] x [640, 262144]
    matvec in float32, bfloat16, float16 and fbgemm's dynamic int8 (``quantized::linear_dynamic``, per-row int8
    weights), and a 512-token prefill through transformers in float32 and bfloat16. Minimum and median ms."""
    import torch
    from transformers import AutoModelForCausalLM

    models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, name)).eval()
              for name in ("float32", "bfloat16")}
    head = models["float32"].get_output_embeddings().weight.detach()
    hidden = torch.randn(1, head.shape[1]) * 4
    scales = (head.abs().amax(1) / 127).clamp(min=1e-12).double()
    int8 = torch.quantize_per_channel(head, scales, torch.zeros(head.shape[0], dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(int8, None)
    heads = {name: head.to(getattr(torch, name)) for name in ("float32", "bfloat16", "float16")}
    prompt = torch.randint(10, 20000, (1, 512))
    cases: dict[str, Any] = {
        **{f"lm_head_{name}": (lambda w=w: torch.nn.functional.linear(hidden.to(w.dtype), w))
           for name, w in heads.items()},
        "lm_head_int8_dynamic": lambda: torch.ops.quantized.linear_dynamic(hidden, packed, True),
        **{f"prefill_512_{name}": (lambda m=m: m(input_ids=prompt, logits_to_keep=1)) for name, m in models.items()},
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for call in cases.values():
            call()  # warm-up
        for _ in range(rounds):
            for name, call in cases.items():
                start = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"ms_min": round(min(v), 2), "ms_median": round(statistics.median(v), 2)}
            for name, v in times.items()}


def run_child(backend: str, dtype: str, tokens: int, threads: int | None, profile_steps: int,
              quantization: str) -> dict[str, Any]:
    """One :func:`measure` in a fresh interpreter (``--child``); its JSON row."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, __file__, "--child", "--backends", backend, "--dtypes", dtype, "--tokens", str(tokens),
           "--profile-steps", str(profile_steps), "--quantizations", quantization]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{backend}/{dtype}/{quantization} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["threads"] = threads
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="hf,custom-cpu", help="comma-separated; auto = what make run picks")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; auto = DTYPE=auto")
    parser.add_argument("--quantizations", default="none",
                        help="comma-separated QUANTIZATION values: none (unset), int8, demo (what `gemmaserve demo` "
                        "= make run picks)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each variant once per round)")
    parser.add_argument("--threads", default="", help="comma-separated OMP_NUM_THREADS values to vary (default: unset)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after each timed run, profile this many decode steps on the engine thread (top ops)")
    parser.add_argument("--kernels", action="store_true",
                        help="instead: time the LM head per weight format and a 512-token prefill per dtype")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from gemmaserve.models.default_model import ensure_default_model

    path = str(ensure_default_model())
    if args.child:
        print(json.dumps(measure(path, args.backends, args.dtypes, args.tokens, args.profile_steps,
                                 args.quantizations)), flush=True)
        return
    if args.kernels:
        result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), **cpu_info(),
                  "kernels": kernel_timings(path, args.rounds)}
        print(json.dumps(result, indent=2), flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return
    threads: list[int | None] = [int(t) for t in args.threads.split(",") if t] or [None]
    variants = [(b, d, t, q) for b in args.backends.split(",") for d in args.dtypes.split(",") for t in threads
                for q in args.quantizations.split(",")]
    rows = []
    for round_index in range(args.rounds):
        for backend, dtype, n, quantization in variants:
            row = run_child(backend, dtype, args.tokens, n, args.profile_steps, quantization) | {"round": round_index}
            print(json.dumps({k: v for k, v in row.items() if k not in ("text", "profile")}), flush=True)
            rows.append(row)
    summary = []
    for backend, dtype, n, quantization in variants:
        mine = [r for r in rows if (r["backend"], r["dtype"], r["threads"], r["quantization"])
                == (backend, dtype, n, quantization)]
        speeds = [r["tok_per_s"] for r in mine]
        summary.append({"backend": backend, "dtype": dtype, "threads": n, "quantization": quantization,
                        "resolved_quantization": mine[0]["resolved_quantization"],
                        "resolved_backend": mine[0]["resolved_backend"],
                        "resolved_dtype": mine[0]["resolved_dtype"],
                        "tok_per_s_min": min(speeds), "tok_per_s_median": round(statistics.median(speeds), 2),
                        "tok_per_s_max": max(speeds), "same_text_every_round": len({r["text"] for r in mine}) == 1})
        print(json.dumps(summary[-1]), flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "prompt": PROMPT,
              **cpu_info(), "summary": summary, "runs": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
