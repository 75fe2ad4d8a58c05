"""Ragged paged attention: the Triton kernel (under TRITON_INTERPRET=1 on CPU, natively on CUDA) against the
plain-torch reference, over random block tables, query lengths (decode rows included), windows, GQA and head
dims; the reference against a dense causal attention."""

from __future__ import annotations

import os
import random

import pytest
import torch

from gemmaserve_custom_torch.kernels.ragged_reference import ragged_paged_attention_reference
from gemmaserve_custom_torch.models.attention_context import build_attention_mask, eager_attention

ON_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _kernel():
    if not (ON_CUDA or INTERPRET):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    from gemmaserve_custom_torch.kernels.ragged_attention import ragged_paged_attention

    return ragged_paged_attention


def random_batch(seed: int, *, heads: int, kv_heads: int, dim: int, block_size: int, window: int,
                 dtype: torch.dtype, device: str, max_ctx: int = 40, sequences: int = 4):
    """Pools with random K/V, S sequences of random context and query lengths (1 = decode row), tables that
    scatter each sequence over random physical blocks, sentinel (-1) blocks wholly before the window."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ctxs = [rng.randint(1, max_ctx) for _ in range(sequences)]
    qlens = [rng.choice([1, 1, rng.randint(1, c)]) if c > 1 else 1 for c in ctxs]
    width = max(-(-c // block_size) for c in ctxs)
    num_blocks = sequences * width + 3
    k_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.full((sequences, width), -1, dtype=torch.int32)
    for s, (ctx, n) in enumerate(zip(ctxs, qlens)):
        first_needed = max(0, ctx - n - window + 1) if window else 0
        for j in range(-(-ctx // block_size)):
            if (j + 1) * block_size > first_needed:
                tables[s, j] = free.pop()
    total = sum(qlens)
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q), to(k_pool), to(v_pool), to(tables), to(torch.tensor(starts, dtype=torch.int32)),
            to(torch.tensor(ctxs, dtype=torch.int32)))


CASES = [  # heads, kv_heads, dim, block_size, window
    (2, 1, 16, 4, 0), (4, 2, 32, 4, 5), (8, 1, 16, 8, 0), (3, 3, 16, 2, 7), (8, 2, 64, 16, 12), (1, 1, 32, 4, 1),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference_fp32(case: tuple[int, int, int, int, int], seed: int) -> None:
    kernel = _kernel()
    heads, kv_heads, dim, block_size, window = case
    device = "cuda" if ON_CUDA else "cpu"
    args = random_batch(seed, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, window=window,
                        dtype=torch.float32, device=device)
    ref = ragged_paged_attention_reference(*args, scale=dim**-0.5, window=window)
    out = kernel(*args, scale=dim**-0.5, window=window)
    torch.testing.assert_close(out, ref, atol=2e-5 if not ON_CUDA else 1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_kernel_with_split_keys_matches_reference_fp32(case: tuple[int, int, int, int, int], splits: int) -> None:
    """Key ranges walked by several programs and merged by the combine kernel (short ranges included: splits
    that a tile does not need are skipped by both kernels)."""
    kernel = _kernel()
    heads, kv_heads, dim, block_size, window = case
    device = "cuda" if ON_CUDA else "cpu"
    for seed in (3, 4):
        args = random_batch(seed, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, window=window,
                            dtype=torch.float32, device=device, max_ctx=70)
        ref = ragged_paged_attention_reference(*args, scale=dim**-0.5, window=window)
        out = kernel(*args, scale=dim**-0.5, window=window, num_splits=splits)
        torch.testing.assert_close(out, ref, atol=2e-5 if not ON_CUDA else 1e-4, rtol=1e-4)


def test_split_rule_spreads_few_long_tiles_and_leaves_big_ticks_alone() -> None:
    pytest.importorskip("triton")
    from gemmaserve_custom_torch.kernels.ragged_attention import ragged_num_splits

    # E2B's full layers (D = 512, 8 q heads on 1 kv head: 32 rows a tile, 32-key steps), 4,096-key tables
    few, per = ragged_num_splits(num_tiles=200, num_kv_heads=1, rows=32, dim_pad=512, max_keys=4096, tile_n=32)
    assert few > 1 and per * 32 >= 256
    big, _ = ragged_num_splits(num_tiles=2200, num_kv_heads=1, rows=32, dim_pad=512, max_keys=4096, tile_n=32)
    assert big == 1, "a big prefill tick fills the GPU without splits"
    short, _ = ragged_num_splits(num_tiles=20, num_kv_heads=1, rows=32, dim_pad=512, max_keys=200, tile_n=32)
    assert short == 1, "ranges shorter than a split's minimum are not split"


@pytest.mark.skipif(not ON_CUDA, reason="bf16 at model head dims on the GPU")
@pytest.mark.parametrize("dim,window", [(256, 512), (512, 0), (256, 0)])
def test_kernel_bf16_model_head_dims_on_gpu(dim: int, window: int) -> None:
    kernel = _kernel()
    for seed in range(4):
        args = random_batch(seed, heads=8, kv_heads=1, dim=dim, block_size=16, window=window,
                            dtype=torch.bfloat16, device="cuda", max_ctx=1500, sequences=6)
        ref = ragged_paged_attention_reference(*(a.float() if a.is_floating_point() else a for a in args),
                                               scale=1.0, window=window)
        for splits in (None, 1, 4):
            out = kernel(*args, scale=1.0, window=window, num_splits=splits)
            torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_padded_tile_map_programs_exit() -> None:
    kernel = _kernel()
    from gemmaserve_custom_torch.kernels.ragged_attention import query_tiles, ragged_block_m

    device = "cuda" if ON_CUDA else "cpu"
    q, k_pool, v_pool, tables, starts, ctxs = random_batch(5, heads=2, kv_heads=1, dim=16, block_size=4, window=0,
                                                           dtype=torch.float32, device=device)
    seqs, firsts = query_tiles((starts[1:] - starts[:-1]).tolist(), ragged_block_m(16, 2))
    pad = 5
    tiles = (torch.tensor(seqs + [0] * pad, dtype=torch.int32, device=device),
             torch.tensor(firsts + [0] * pad, dtype=torch.int32, device=device),
             torch.tensor([len(seqs)], dtype=torch.int32, device=device))
    padded_q = torch.cat([q, torch.randn(3, *q.shape[1:], device=device)])  # 3 padding tokens, in no tile
    ref = ragged_paged_attention_reference(q, k_pool, v_pool, tables, starts, ctxs, scale=0.25)
    for splits in (1, 3):
        out = kernel(padded_q, k_pool, v_pool, tables, starts, ctxs, scale=0.25, tiles=tiles, num_splits=splits)
        torch.testing.assert_close(out[: q.shape[0]], ref, atol=2e-5, rtol=1e-4)
        assert not out[q.shape[0]:].any(), "padding tokens come out as zeros"


@pytest.mark.parametrize("window", [0, 3])
def test_reference_matches_dense_causal_attention(window: int) -> None:
    """One sequence whose table is the identity: the reference equals masked attention over contiguous K/V."""
    gen = torch.Generator().manual_seed(7)
    ctx, n, block_size, dim = 11, 5, 4, 8
    k = torch.randn(ctx, 2, dim, generator=gen)
    v = torch.randn(ctx, 2, dim, generator=gen)
    q = torch.randn(n, 4, dim, generator=gen)
    blocks = -(-ctx // block_size)
    pad = blocks * block_size - ctx
    k_pool = torch.cat([k, torch.zeros(pad, 2, dim)]).view(blocks, block_size, 2, dim)
    v_pool = torch.cat([v, torch.zeros(pad, 2, dim)]).view(blocks, block_size, 2, dim)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    out = ragged_paged_attention_reference(q, k_pool, v_pool, tables, torch.tensor([0, n]), torch.tensor([ctx]),
                                           scale=0.5, window=window)
    mask = build_attention_mask(torch.arange(ctx - n, ctx), torch.arange(ctx), window or None)
    dense = eager_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None].contiguous(),
                            v.transpose(0, 1)[None].contiguous(), mask, 0.5)[0].transpose(0, 1)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(ON_CUDA or INTERPRET, reason="the kernel tests above already ran natively or interpreted")
def test_kernel_tests_pass_under_the_interpreter() -> None:
    """CI has no GPU: rerun this module's kernel tests in a subprocess with TRITON_INTERPRET=1 (the variable
    is read when ``@triton.jit`` runs, so it cannot be flipped in this process)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "(kernel or split) and not interpreter and not gpu"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-2000:]
