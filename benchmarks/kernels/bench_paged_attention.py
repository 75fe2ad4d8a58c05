"""GPU micro-benchmark of the Triton paged decode attention kernel at Gemma 4 E2B shapes.

E2B attention: 8 q heads, 1 kv head; sliding layers head_dim 256 with window 512, full layers
head_dim 512. Every row has the same context length; pages are a random permutation of the pool
(pages wholly out of the window are freed, -1). Time per call comes from CUDA-graph replay of a
chain of calls that cycle through several pool copies (like successive layers), so launch overhead
and L2 reuse don't flatter small shapes. Bandwidth = bytes of visible K/V read / time.

Usage (on a GPU machine, from the repo root):
    PYTHONPATH=plugins/custom_torch python benchmarks/kernels/bench_paged_attention.py
    ... --sweep          # also sweep tile/warps/stages and num_splits on a few shapes
    ... --eager          # also report eager (non-graph) time per call
"""

from __future__ import annotations

import argparse
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

from gemmaserve_custom_torch.kernels.paged_attention import (
    DecodeKernelConfig,
    default_decode_config,
    default_num_splits,
    paged_decode_attention,
)

NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 8, 1, 16
LAYERS = {"sliding-d256-w512": (256, 512), "full-d512": (512, 0)}
BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (512, 1024, 2048, 4096)
L2_FLUSH_BYTES = 256 << 20  # cycle pool copies until a chain touches this much K/V
PEAK_TBPS = 4.8  # H200 HBM3e datasheet


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_inputs(batch: int, ctx: int, head_dim: int, window: int, copies: int, dtype: torch.dtype):
    """Query, `copies` (k_pool, v_pool) pairs, block tables, seq_lens; all rows of length ctx."""
    pages_per_row = _cdiv(ctx, BLOCK_SIZE)
    first = (max(ctx - window, 0) // BLOCK_SIZE) if window else 0
    live = pages_per_row - first
    num_pages = batch * live
    tables = torch.full((batch, pages_per_row), -1, dtype=torch.int32, device="cuda")
    perm = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, live)
    tables[:, first:] = perm
    shape = (num_pages, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    pools = [
        (torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype))
        for _ in range(copies)
    ]
    query = torch.randn(batch, NUM_Q_HEADS, head_dim, device="cuda", dtype=dtype) * head_dim**-0.5
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return query, pools, tables, seq_lens


def kv_bytes(batch: int, ctx: int, head_dim: int, window: int, elem: int) -> int:
    visible = min(ctx, window) if window else ctx
    return batch * visible * NUM_KV_HEADS * head_dim * 2 * elem


def time_call(batch, ctx, head_dim, window, *, num_splits=None, config=None, eager=False, dtype=torch.bfloat16):
    """Returns (us per call via graph replay, us per call eager or None)."""
    elem = torch.finfo(dtype).bits // 8
    per_call = kv_bytes(batch, ctx, head_dim, window, elem)
    copies = max(1, min(256, _cdiv(L2_FLUSH_BYTES, per_call)))
    query, pools, tables, seq_lens = make_inputs(batch, ctx, head_dim, window, copies, dtype)
    out = torch.empty_like(query)
    chain = max(copies, 8)

    def run_chain() -> None:
        for i in range(chain):
            k, v = pools[i % copies]
            paged_decode_attention(
                query, k, v, tables, seq_lens, scale=1.0, window=window, out=out,
                num_splits=num_splits, config=config,
            )

    graph = capture_graph(run_chain)
    graph_us = triton.testing.do_bench(graph.replay, warmup=10, rep=50) * 1e3 / chain
    eager_us = None
    if eager:
        eager_us = triton.testing.do_bench(run_chain, warmup=20, rep=100) * 1e3 / chain
    return graph_us, eager_us, per_call


def main_table(args) -> None:
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"E2B: {NUM_Q_HEADS} q heads, {NUM_KV_HEADS} kv head, block {BLOCK_SIZE}, bf16; graph replay time per call")
    hdr = f"{'layer':<18} {'B':>4} {'ctx':>5} {'splits':>6} {'tile':>4} {'us/call':>9} {'GB/s':>8} {'%peak':>6}"
    if args.eager:
        hdr += f" {'eager us':>9}"
    print(hdr)
    for name, (head_dim, window) in LAYERS.items():
        cfg = default_decode_config(head_dim, BLOCK_SIZE)
        for batch in BATCHES:
            for ctx in CONTEXTS:
                if window and ctx < window:
                    continue
                splits = default_num_splits(
                    batch, NUM_KV_HEADS, _cdiv(ctx, BLOCK_SIZE), BLOCK_SIZE, window, cfg.tile_n,
                    torch.cuda.get_device_properties(0).multi_processor_count,
                )
                g_us, e_us, nbytes = time_call(batch, ctx, head_dim, window, eager=args.eager, dtype=dtype)
                gbs = nbytes / (g_us * 1e-6) / 1e9
                line = (f"{name:<18} {batch:>4} {ctx:>5} {splits:>6} {cfg.tile_n:>4} {g_us:>9.2f} "
                        f"{gbs:>8.0f} {100 * gbs / (PEAK_TBPS * 1e3):>5.0f}%")
                if e_us is not None:
                    line += f" {e_us:>9.2f}"
                print(line, flush=True)


SWEEP_CONFIGS = {
    256: [DecodeKernelConfig(t, w, st) for t, w, st in ((32, 4, 3), (32, 4, 5), (64, 4, 3), (64, 8, 3), (64, 4, 5))],
    512: [DecodeKernelConfig(t, w, st) for t, w, st in ((16, 4, 3), (32, 4, 3), (32, 4, 5), (32, 8, 3), (64, 8, 3))],
}
SWEEP_SPLITS = {1: (8, 16, 32, 64), 8: (4, 8, 16, 32), 32: (1, 2, 4, 8), 128: (1, 2, 4), 256: (1, 2)}


def sweep(args) -> None:
    """Grid over configs x num_splits at ctx 4096; prints us/call per split and the best."""
    ctx = 4096
    for name, (head_dim, window) in LAYERS.items():
        print(f"\n== sweep {name} ctx={ctx} (us/call by num_splits) ==", flush=True)
        for batch, split_list in SWEEP_SPLITS.items():
            best = None
            for cfg in SWEEP_CONFIGS[head_dim]:
                max_splits = _cdiv(window + BLOCK_SIZE - 1, cfg.tile_n) if window else 64
                cells = []
                for sp in split_list:
                    if sp > max_splits:
                        continue
                    try:
                        g_us, _, nbytes = time_call(batch, ctx, head_dim, window, num_splits=sp, config=cfg)
                    except Exception as exc:  # e.g. out of shared memory / registers
                        cells.append(f"{sp}:ERR({type(exc).__name__})")
                        continue
                    cells.append(f"{sp}:{g_us:.1f}")
                    if best is None or g_us < best[0]:
                        best = (g_us, sp, cfg, nbytes)
                print(f"  B={batch:<4} tile{cfg.tile_n} warps{cfg.num_warps} stages{cfg.num_stages}:  "
                      + "  ".join(cells), flush=True)
            g_us, sp, cfg, nbytes = best
            print(f"  BEST B={batch}: {g_us:.1f} us ({nbytes / g_us / 1e3:.0f} GB/s) splits={sp} {cfg}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also sweep configs x num_splits")
    parser.add_argument("--eager", action="store_true", help="also time eager calls")
    parser.add_argument("--no-table", action="store_true", help="skip the main table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    if not args.no_table:
        main_table(args)
    if args.sweep:
        sweep(args)


if __name__ == "__main__":
    main()
