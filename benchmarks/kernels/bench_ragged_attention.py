"""GPU micro-benchmark of the Triton ragged paged attention kernel (kernels/ragged_attention.py) at E2B shapes.

E2B attention: 8 q heads, 1 kv head, block 16; sliding layers head_dim 256 with window 512, full layers head_dim
512. Batches (the ticks that carry prompt tokens):

- ``prefill``: 16 fresh 512-token prompts (workload A's prompt tick at the 8,192-token budget);
- ``chunk@1024``: 16 512-token chunks at 1,024 tokens of context each (the middle of long prompts);
- ``mixed``: 32 decode rows at 1,024 tokens of context and one fresh 512-token chunk (workload C's tick).

Time per call comes from CUDA-graph replay of a chain of calls cycling through pool copies (as successive layers
would); TFLOP/s counts the visible (causal, windowed) query-key pairs: 4 x heads x head_dim FLOPs each. With
``--sweep`` every (block_m, tile_n, warps, stages) of a small grid is timed per batch and layer; the default
configuration (``default_ragged_config``) is marked. ``--sdpa`` adds torch's SDPA over the same prefill as dense
causal attention (a reference of what a flash kernel reaches; no paging, no window).

Usage (GPU, repo root):
    PYTHONPATH=plugins/custom_torch python benchmarks/kernels/bench_ragged_attention.py --sweep --json ragged.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

try:
    import gemmaserve_custom_torch  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "custom_torch"))

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing helpers
from timing import capture_graph  # noqa: E402

from gemmaserve_custom_torch.kernels.ragged_attention import (  # noqa: E402
    RaggedKernelConfig,
    default_ragged_config,
    query_tiles,
    ragged_paged_attention,
)

Q_HEADS, KV_HEADS, BLOCK_SIZE = 8, 1, 16
LAYERS = {"sliding-d256-w512": (256, 512), "full-d512": (512, 0)}
BATCHES = {  # name: [(queries, context before the tick)] per sequence
    "prefill": [(512, 0)] * 16,
    "chunk@1024": [(512, 1024)] * 16,
    "mixed": [(1, 1024)] * 32 + [(512, 0)],
}
L2_FLUSH_BYTES = 256 << 20


def sweep_configs(head_dim: int) -> list[RaggedKernelConfig]:
    if head_dim <= 256:
        grid = itertools.product((8, 16), (32, 64), (4, 8), (2, 3))
    else:
        grid = itertools.product((4, 8), (16, 32, 64), (4, 8), (1, 2))
    return [RaggedKernelConfig(*c) for c in grid]


def make_batch(seqs: list[tuple[int, int]], head_dim: int, copies: int) -> dict[str, Any]:
    """Pools holding every sequence's context and fresh keys (pages a random permutation), its block tables,
    query_start / seq_lens, the queries."""
    lens = [before + n for n, before in seqs]
    pages = [-(-length // BLOCK_SIZE) for length in lens]
    width = max(pages)
    perm = torch.randperm(sum(pages), dtype=torch.int32)
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    at = 0
    for i, count in enumerate(pages):
        tables[i, :count] = perm[at : at + count]
        at += count
    shape = (sum(pages), BLOCK_SIZE, KV_HEADS, head_dim)
    pools = [(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
              torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    starts = [0]
    for n, _ in seqs:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], Q_HEADS, head_dim, device="cuda", dtype=torch.bfloat16) * head_dim**-0.5
    return {"pools": pools, "tables": tables.cuda(), "q": q,
            "query_start": torch.tensor(starts, dtype=torch.int32, device="cuda"),
            "seq_lens": torch.tensor(lens, dtype=torch.int32, device="cuda"), "query_lens": [n for n, _ in seqs]}


def visible_pairs(seqs: list[tuple[int, int]], window: int) -> int:
    total = 0
    for n, before in seqs:
        for p in range(before, before + n):
            total += min(p + 1, window) if window else p + 1
    return total


def time_config(batch: dict[str, Any], window: int, config: RaggedKernelConfig) -> float:
    """Microseconds per call (graph replay of a chain over the pool copies)."""
    seqs, firsts = query_tiles(batch["query_lens"], config.block_m)
    tiles = tuple(torch.tensor(values, dtype=torch.int32, device="cuda") for values in (seqs, firsts, [len(seqs)]))
    out = torch.empty_like(batch["q"])
    pools = batch["pools"]
    chain = max(len(pools), 8)

    def run_chain() -> None:
        for i in range(chain):
            k, v = pools[i % len(pools)]
            ragged_paged_attention(batch["q"], k, v, batch["tables"], batch["query_start"], batch["seq_lens"],
                                   scale=1.0, window=window, tiles=tiles, out=out, config=config)

    graph = capture_graph(run_chain)
    return triton.testing.do_bench(graph.replay, warmup=5, rep=40) * 1e3 / chain


def sdpa_reference(head_dim: int, seqs: int = 16, n: int = 512) -> float | None:
    """Microseconds of torch SDPA over ``seqs`` dense causal ``n``-token sequences (GQA expanded), or None."""
    q = torch.randn(seqs, Q_HEADS, n, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seqs, 1, n, head_dim, device="cuda", dtype=torch.bfloat16)
    k = k.expand(seqs, Q_HEADS, n, head_dim).contiguous()
    v = torch.randn_like(k)
    try:
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)  # noqa: E731
        fn()
        return triton.testing.do_bench(fn, warmup=5, rep=40) * 1e3
    except RuntimeError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time the grid of configurations")
    parser.add_argument("--sdpa", action="store_true", help="also time torch SDPA on the dense prefill")
    parser.add_argument("--batches", default=",".join(BATCHES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    unknown = sorted(set(args.batches.split(",")) - set(BATCHES))
    if unknown:
        parser.error(f"unknown --batches {', '.join(unknown)}; choose from {', '.join(BATCHES)}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    rows: list[dict[str, Any]] = []
    for layer, (head_dim, window) in LAYERS.items():
        default = default_ragged_config(head_dim, Q_HEADS // KV_HEADS, BLOCK_SIZE)
        configs = [default] + [c for c in sweep_configs(head_dim) if c != default] if args.sweep else [default]
        for name in args.batches.split(","):
            seqs = BATCHES[name]
            kv_bytes = sum(-(-(b + n) // BLOCK_SIZE) for n, b in seqs) * BLOCK_SIZE * head_dim * 4
            batch = make_batch(seqs, head_dim, max(1, min(32, L2_FLUSH_BYTES // kv_bytes)))
            flops = 4 * Q_HEADS * head_dim * visible_pairs(seqs, window)
            best = None
            for config in configs:
                try:
                    us = time_config(batch, window, config)
                except Exception as exc:  # out of shared memory / registers for this grid point
                    print(f"  {layer} {name} {config}: {type(exc).__name__}", flush=True)
                    continue
                row = {"layer": layer, "batch": name, "default": config == default, **config.__dict__,
                       "us": round(us, 2), "tflops": round(flops / us / 1e6, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if best is None or us < best["us"]:
                    best = row
            if best is not None:
                print(f"BEST {layer} {name}: {json.dumps(best)}", flush=True)
            del batch
        if args.sdpa:
            us = sdpa_reference(head_dim)
            flops = 4 * Q_HEADS * head_dim * visible_pairs(BATCHES["prefill"], 0)
            row = {"layer": layer, "batch": "prefill (dense causal, SDPA)", "us": us and round(us, 2),
                   "tflops": us and round(flops / us / 1e6, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
