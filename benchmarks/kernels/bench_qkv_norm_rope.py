"""GPU micro-benchmark of ``fused_ops.qkv_norm_rope`` (a KV-storing layer's q/k/v norms, RoPE and v norm in one launch)
at E2B shapes, over the tokens a program takes (``rows_per_program``) and the token count.

E2B: 8 q heads and 1 kv head, head_dim 256 (sliding) and 512 (full), q/k/v normed. Time per call from CUDA-graph
replay of a chain of calls over several input copies; bandwidth counts the q/k/v read and written once
(cos/sin rows and weights are left out). The default choice (``qkv_rows_per_program``) is marked.

Usage (GPU, repo root):
    PYTHONPATH=plugins/custom_torch python benchmarks/kernels/bench_qkv_norm_rope.py --json qkv.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:
    import gemmaserve_custom_torch  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "custom_torch"))

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing helpers
from timing import capture_graph  # noqa: E402

from gemmaserve_custom_torch.kernels.fused_ops import qkv_norm_rope, qkv_rows_per_program  # noqa: E402

Q_HEADS, KV_HEADS = 8, 1


def time_call(tokens: int, dim: int, rows: int, copies: int = 8) -> float:
    width = (Q_HEADS + 2 * KV_HEADS) * dim
    inputs = [torch.randn(1, tokens, width, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    cos = torch.randn(1, tokens, dim, device="cuda", dtype=torch.bfloat16)
    sin = torch.randn_like(cos)
    q_w = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    k_w = torch.randn_like(q_w)

    def chain() -> None:
        for qkv in inputs:
            qkv_norm_rope(qkv, Q_HEADS, KV_HEADS, q_w, k_w, 1e-6, "w", cos, sin, v_norm=True, rows_per_program=rows)

    graph = capture_graph(chain)
    return triton.testing.do_bench(graph.replay, warmup=5, rep=40) * 1e3 / copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,32,256,1024,8192")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    out = []
    for dim in (256, 512):
        for tokens in map(int, args.tokens.split(",")):
            for rows in map(int, args.rows.split(",")):
                us = time_call(tokens, dim, rows)
                nbytes = 2 * tokens * (Q_HEADS + 2 * KV_HEADS) * dim * 2
                row = {"dim": dim, "tokens": tokens, "rows_per_program": rows, "default": rows ==
                       qkv_rows_per_program(tokens, dim), "us": round(us, 2), "tbps": round(nbytes / us / 1e6, 3)}
                out.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
