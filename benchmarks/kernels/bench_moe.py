"""Micro-benchmark of the fused MoE experts (kernels/moe.py) against the eager expert loop, at 26B-A4B shapes.

26B-A4B's MoE block: 128 experts, top 8, hidden 2816, expert width 704, bf16 (random weights, no download).
Routing comes from a softmax + top-k over random logits (roughly uniform over experts, like a trained router
on average). Per token count T it reports the eager loop's time per call, the fused call's time (eager
launches) and, on CUDA, the fused call replayed from a CUDA graph; the max |fused - eager|; and the bytes of
the distinct experts the batch hits over the graph time (a weights-only roofline; the H200's HBM is ~4.8 TB/s).
Each timed call reuses one routing, so part of the weights can stay in L2 at small T (50 MB of L2 vs ~95 MB
of 8 experts' weights).

Usage (on a GPU machine, from the repo root):
    PYTHONPATH=plugins/custom_torch python benchmarks/kernels/bench_moe.py [--tokens 1 8 32 128 512] [--json]
Smoke mode on CPU (the Triton interpreter, tiny shapes):
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_moe.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import gemmaserve_custom_torch  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "custom_torch"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing helpers
from timing import graph_replay_ms, median_ms  # noqa: E402

from gemmaserve_custom_torch.kernels.moe import fused_experts
from gemmaserve_custom_torch.models.layers import MoEExperts

FULL = {"experts": 128, "top_k": 8, "hidden": 2816, "width": 704, "tokens": (1, 8, 32, 128, 512)}
TINY = {"experts": 8, "top_k": 2, "hidden": 32, "width": 24, "tokens": (1, 5)}


def make_inputs(experts: int, top_k: int, hidden: int, width: int, tokens: int, device: str, dtype: torch.dtype,
                seed: int = 0) -> tuple[MoEExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random expert weights (std 0.02) and a routing of ``tokens`` random tokens: (module, x, weights, ids)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    module = MoEExperts(hidden, experts, width, device=device, dtype=dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(0.02 * torch.randn(module.gate_up_proj.shape, device=device, generator=gen))
        module.down_proj.copy_(0.02 * torch.randn(module.down_proj.shape, device=device, generator=gen))
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    probs = torch.softmax(torch.randn(tokens, experts, device=device, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return module, x, weights / weights.sum(-1, keepdim=True), ids


def bench(shape: dict, tokens: int, device: str, dtype: torch.dtype, iters: int, grouping: str = "auto") -> dict:
    module, x, weights, ids = make_inputs(shape["experts"], shape["top_k"], shape["hidden"], shape["width"], tokens,
                                          device, dtype)

    def eager() -> torch.Tensor:
        return module(x, weights, ids)

    def fused() -> torch.Tensor:
        return fused_experts(x, weights, ids, module.gate_up_proj, module.down_proj, grouping=grouping)

    with torch.inference_mode():
        diff = float((fused().float() - eager().float()).abs().max())
        warmup = 3 if device == "cuda" else 0
        row = {"tokens": tokens, "experts": shape["experts"], "top_k": shape["top_k"], "hidden": shape["hidden"],
               "width": shape["width"], "dtype": str(dtype).removeprefix("torch."), "device": device,
               "grouping": grouping,
               "max_abs_diff": diff, "eager_ms": median_ms(eager, device, iters, warmup),
               "fused_ms": median_ms(fused, device, iters, warmup)}
        hit = int(torch.unique(ids).numel())  # a host read, outside the timed calls
        expert_bytes = 3 * shape["width"] * shape["hidden"] * module.down_proj.element_size()
        row["experts_hit"] = hit
        row["weight_bytes"] = hit * expert_bytes
        if device == "cuda":
            row["graph_ms"] = graph_replay_ms(fused, iters)
            row["weights_tb_per_s"] = row["weight_bytes"] / (row["graph_ms"] * 1e-3) / 1e12
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu runs the kernels in the Triton interpreter (set TRITON_INTERPRET=1)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test), not 26B-A4B's")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts T (default: 1 8 32 128 512; tiny: 1 5)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="default bfloat16 on CUDA, float32 on CPU (the interpreter is wrong for bf16)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 50; cpu 1)")
    parser.add_argument("--grouping", default="auto", choices=["auto", "kernel", "torch"],
                        help="how the pairs are grouped by expert (kernels/moe.py group_by_expert)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list (last line)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu --tiny with TRITON_INTERPRET=1 for a smoke run")
    shape = TINY if args.tiny else FULL
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    iters = args.iters or (50 if args.device == "cuda" else 1)
    token_counts = args.tokens or shape["tokens"]
    rows = [bench(shape, tokens, args.device, dtype, iters, args.grouping) for tokens in token_counts]
    for row in rows:
        graph = f"  graph {row['graph_ms']:8.3f} ms ({row['weights_tb_per_s']:.2f} TB/s of hit experts)" \
            if "graph_ms" in row else ""
        print(f"T={row['tokens']:4d}  experts hit {row['experts_hit']:3d}  eager {row['eager_ms']:8.3f} ms  "
              f"fused {row['fused_ms']:8.3f} ms{graph}  max|diff| {row['max_abs_diff']:.2e}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
