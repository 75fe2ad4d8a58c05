"""The default model's speed on this CPU: greedy decode tok/s of Gemma 3 270M for each CPU backend and dtype.

For issue "first hour without surprises" (CPU speed of the default): one request, a short prompt, ``--tokens``
greedy tokens (EOS ignored) after a warm-up, through the offline API (the engine thread, as ``make run`` uses it),
so the figure is what a user sees; TPOT is the engine's own (first token to last). The greedy text of each run is
kept, so a dtype change that changes the text shows.

Usage (repo root):  .venv/bin/python benchmarks/cpu_default.py [--backends hf,custom-cpu] [--dtypes float32,bfloat16]
                    [--tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"


def measure(path: str, backend: str, dtype: str, tokens: int) -> dict[str, Any]:
    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams

    llm = LLM(path, backend=backend, device="cpu", dtype=dtype, max_batch_size=1)
    try:
        llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        out = llm.generate([PROMPT], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))[0]
        wall = time.perf_counter() - start
    finally:
        llm.close()
    metrics = out.metrics
    tpot = None
    if metrics is not None and metrics.first_token_time is not None and metrics.finish_time is not None:
        tpot = (metrics.finish_time - metrics.first_token_time) / (len(out.token_ids) - 1)
    return {"backend": backend, "dtype": dtype, "tokens": len(out.token_ids), "tok_per_s": round(tokens / wall, 2),
            "tpot_ms": round(tpot * 1e3, 2) if tpot else None, "text": out.text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="hf,custom-cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import os

    import torch

    from gemmaserve.models.default_model import ensure_default_model

    path = str(ensure_default_model())
    rows = []
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            row = measure(path, backend, dtype, args.tokens)
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "runs": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
