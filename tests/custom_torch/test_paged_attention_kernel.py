"""Tests for the Triton paged decode attention kernel and its plain-torch reference.

Three layers:
1. CPU, in process: the reference against a dense (unpaged) oracle (hypothesis), wrapper input
   validation, the split heuristic.
2. CPU, Triton interpreter: the kernel against the reference on tiny shapes. These run in ONE
   subprocess with ``TRITON_INTERPRET=1`` (the variable is read when ``@triton.jit`` runs, so setting
   it here would leak into every other Triton test of this pytest process); each case is reported
   back as JSON and checked by its own parametrized test.
3. GPU (skipped without CUDA): bf16 at Gemma 4 head dims, CUDA-graph capture/replay with changing
   lengths, and a hypothesis property test.

Every generated pool is NaN except at visible (in-window, < seq_len) positions, and block index -1
aliases a NaN block in front of the pool, so any read of a sentinel, a freed page or a stale slot
shows up as a non-finite output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import gemmaserve_custom_torch  # noqa: F401
except ImportError:  # plugin not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "custom_torch"))

from gemmaserve_custom_torch.kernels.reference import paged_decode_attention_reference

HAS_CUDA = torch.cuda.is_available()
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def needs_cuda(fn):
    """Marks a GPU test (``-m gpu``) and skips it without CUDA + triton."""
    skip = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
    return pytest.mark.gpu(skip(fn))


# ----------------------------------------------------------------------------------------------
# Case construction (shared by all layers)
# ----------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged_case(
    *,
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    spare_table_cols: int = 1,
    q_scale: float | None = None,
) -> dict[str, Any]:
    """Random decode inputs in the paged layout, plus the dense per-row K/V they were built from.

    Physical pages are a random permutation; pages wholly before the window are freed (-1 in the
    table, no data), as are table columns past each row's length. Only visible positions hold
    finite data; everything else in the pool (incl. the alias of page -1) is NaN.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = len(seq_lens)
    max_blocks = _cdiv(max(max(seq_lens), 1), block_size) + spare_table_cols
    live = []  # per row: (first kept page, number of pages)
    for n in seq_lens:
        start = max(n - window, 0) if window > 0 else 0
        live.append((start // block_size, _cdiv(n, block_size)))
    num_blocks = sum(hi - lo for lo, hi in live) + spare_blocks

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    k_store = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_store = torch.full(shape, float("nan"), dtype=dtype, device=device)
    k_pool, v_pool = k_store[1:], v_store[1:]  # page -1 -> NaN page 0 of the storage
    tables = torch.full((batch, max_blocks), -1, dtype=torch.int32, device=device)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    dense_k, dense_v = [], []
    used = 0
    for b, n in enumerate(seq_lens):
        lo, hi = live[b]
        tables[b, lo:hi] = perm[used : used + hi - lo]
        used += hi - lo
        k = randn(n, num_kv_heads, head_dim).to(dtype)
        v = randn(n, num_kv_heads, head_dim).to(dtype)
        dense_k.append(k)
        dense_v.append(v)
        start = max(n - window, 0) if window > 0 else 0
        pos = torch.arange(start, n, device=device)
        pages = tables[b, pos // block_size].long()
        k_pool[pages, pos % block_size] = k[start:]
        v_pool[pages, pos % block_size] = v[start:]
    q_scale = head_dim**-0.5 if q_scale is None else q_scale
    query = (randn(batch, num_q_heads, head_dim) * q_scale).to(dtype)
    return {
        "query": query,
        "k_pool": k_pool,
        "v_pool": v_pool,
        "block_tables": tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "dense_k": dense_k,
        "dense_v": dense_v,
    }


def dense_attention(case: dict[str, Any], *, scale: float, window: int) -> torch.Tensor:
    """Independent oracle: masked softmax attention on the contiguous per-row K/V (fp32)."""
    query = case["query"]
    batch, num_q_heads, head_dim = query.shape
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=query.device)
    for b, (k, v) in enumerate(zip(case["dense_k"], case["dense_v"])):
        n = k.shape[0]
        if n == 0:
            continue
        group = num_q_heads // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        vf = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[b].float(), kf) * scale
        visible = torch.arange(n, device=query.device) >= (n - window if window > 0 else 0)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), vf)
    return out


def _call_args(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return tuple(case[k] for k in ("query", "k_pool", "v_pool", "block_tables", "seq_lens"))


# ----------------------------------------------------------------------------------------------
# 1. CPU, in process
# ----------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _case_params(draw: st.DrawFn, max_len: int = 80, head_dims: tuple[int, ...] = (8, 16)) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    batch = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    if draw(st.booleans()):  # edge lengths
        lens[0] = draw(st.sampled_from([1, block_size, 2 * block_size]))
    window = draw(st.sampled_from([0, 0, 1, 2, block_size - 1, block_size + 3, 3 * block_size, 1000]))
    return {
        "seq_lens": lens,
        "num_q_heads": num_kv_heads * ratio,
        "num_kv_heads": num_kv_heads,
        "head_dim": draw(st.sampled_from(head_dims)),
        "block_size": block_size,
        "window": max(window, 0),
        "seed": draw(st.integers(0, 2**16)),
        "scale": draw(st.sampled_from([1.0, 0.3])),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=_case_params())
def test_reference_matches_dense_oracle(params: dict) -> None:
    scale = params.pop("scale")
    case = make_paged_case(dtype=torch.float32, **params)
    got = paged_decode_attention_reference(*_call_args(case), scale=scale, window=params["window"])
    want = dense_attention(case, scale=scale, window=params["window"])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_rejects_sentinel_inside_window() -> None:
    case = make_paged_case(
        seq_lens=[9], num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4, window=0,
        dtype=torch.float32,
    )
    case["block_tables"][0, 1] = -1
    with pytest.raises(ValueError, match="sentinel"):
        paged_decode_attention_reference(*_call_args(case), scale=1.0)


def test_reference_out_param_and_zero_length_rows() -> None:
    case = make_paged_case(
        seq_lens=[0, 5], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=2, window=0,
        dtype=torch.float16,
    )
    out = torch.full_like(case["query"], 7.0)
    res = paged_decode_attention_reference(*_call_args(case), scale=1.0, out=out)
    assert res is out
    assert (out[0] == 0).all() and torch.isfinite(out).all()


@needs_triton
@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(query=a["query"][0]), "query must be"),
        (lambda a: a.update(k_pool=a["k_pool"][0]), "k_pool must be"),
        (lambda a: a.update(v_pool=a["v_pool"][:, :, :, :4]), "v_pool shape"),
        (lambda a: a.update(query=a["query"][:, :3]), "not a multiple"),
        (lambda a: a.update(query=a["query"].double()), "dtype mismatch"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "int32"),
        (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables must be"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "int32"),
        (lambda a: a.update(window=-1), "window"),
        (lambda a: a.update(num_splits=0), "num_splits"),
        (lambda a: a.update(num_splits=257), "num_splits"),
        (lambda a: a.update(out=torch.empty(2, 4, 4)), "out must match"),
        (lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    ],
)
def test_kernel_wrapper_validation(mutate, match) -> None:
    from gemmaserve_custom_torch.kernels.paged_attention import paged_decode_attention

    case = make_paged_case(
        seq_lens=[3, 5], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, window=0,
        dtype=torch.float32,
    )
    args = dict(zip(("query", "k_pool", "v_pool", "block_tables", "seq_lens"), _call_args(case)))
    args.update(scale=1.0)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**args)


@needs_triton
def test_split_heuristic() -> None:
    from gemmaserve_custom_torch.kernels.paged_attention import default_num_splits

    # Enough programs already: no split.
    assert default_num_splits(256, 1, 256, 16, 0, 32, 132) == 1
    assert default_num_splits(64, 4, 256, 16, 0, 32, 132) == 1
    # Small batch, long full context: ~2 programs per SM, capped.
    assert default_num_splits(1, 1, 256, 16, 0, 32, 132) == 64
    assert default_num_splits(8, 1, 256, 16, 0, 32, 132) == 33
    assert default_num_splits(32, 1, 256, 16, 0, 32, 132) == 8
    assert default_num_splits(128, 1, 256, 16, 0, 32, 132) == 2
    assert default_num_splits(16, 2, 256, 16, 0, 32, 132) == 8
    # A sliding window bounds the split count (one tile each) regardless of table width.
    assert default_num_splits(1, 1, 256, 16, 512, 32, 132) == 17  # 527 keys -> 17 tiles of 32
    # Tiny contexts: never more splits than tiles.
    assert default_num_splits(1, 1, 1, 16, 0, 64, 132) == 1
    assert default_num_splits(1, 1, 8, 16, 0, 32, 132) == 4
    for batch in range(1, 300, 7):
        s = default_num_splits(batch, 1, 300, 16, 0, 32, 132)
        assert 1 <= s <= 64


# ----------------------------------------------------------------------------------------------
# 2. CPU, Triton interpreter (one subprocess for all cases)
# ----------------------------------------------------------------------------------------------

_TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 4e-2}  # bf16: interpreter store truncates



def _case(case_id: str, lens: list[int], h: tuple[int, int], d: int, bs: int, w: int, dt: str, splits, **extra):
    """One interpreter case. h: (q heads, kv heads); w: window; splits: int or None (heuristic);
    extra: tile (tile_n override), strided (q/out as slices), qs (query scale)."""
    return case_id, dict(lens=lens, h=h, d=d, bs=bs, w=w, dt=dt, splits=splits, **extra)


INTERPRETER_CASES: list[tuple[str, dict[str, Any]]] = [
    _case("f32-mha-d16-bs2-full", [1, 2, 7, 12], (2, 2), 16, 2, 0, "float32", 1),
    _case("f32-mha-d16-bs2-full-split3", [1, 2, 7, 40], (2, 2), 16, 2, 0, "float32", 3, tile=16),
    _case("f32-gqa2-d32-bs4-full-tile16", [1, 8, 23, 40], (4, 2), 32, 4, 0, "float32", 1, tile=16),
    _case("f32-gqa4-d32-bs8-win3", [5, 16, 64, 77], (4, 1), 32, 8, 3, "float32", 1),
    _case("f32-gqa4-d32-bs8-win3-split4", [5, 16, 64, 77], (4, 1), 32, 8, 3, "float32", 4, tile=16),
    _case("f32-gqa4-d16-bs16-win20-split2", [1, 16, 48, 90], (8, 2), 16, 16, 20, "float32", 2, tile=16),
    _case("f32-win-larger-than-len", [3, 33], (4, 2), 16, 4, 1000, "float32", 2, tile=16),
    _case("f32-empty-splits-and-zero-len", [0, 1, 4, 70], (4, 2), 16, 4, 0, "float32", 8, tile=16),
    _case("f32-many-splits-win", [0, 3, 33, 200], (4, 2), 32, 8, 40, "float32", 37, tile=16),
    _case("f32-nonpow2-headdim", [6, 19], (4, 2), 24, 4, 7, "float32", 2, tile=16),
    _case("f32-strided-q-out", [2, 31, 9], (4, 1), 32, 4, 0, "float32", 2, tile=16, strided=True),
    _case("f32-default-config-and-splits", [1, 64, 130], (4, 2), 32, 8, 0, "float32", None),
    _case("f16-gqa2-d32-bs4-win10", [3, 12, 50, 33], (4, 2), 32, 4, 10, "float16", 1),
    _case("f16-gqa4-d16-bs16-full-split3", [1, 32, 100], (4, 1), 16, 16, 0, "float16", 3, tile=16),
    _case("f16-gqa8-d16-bs4-win24-split2", [1, 24, 57], (8, 1), 16, 4, 24, "float16", 2, tile=16),
    _case("f16-mha-d32-bs2-win1-split2", [2, 9, 30], (2, 2), 32, 2, 1, "float16", 2, tile=16),
    _case("f16-gqa2-d16-bs8-win12-split3-peaky", [8, 24, 61], (4, 2), 16, 8, 12, "float16", 3, tile=16, qs=2.0),
    _case("bf16-upcast-gqa4-d32-bs4-win9-split2", [4, 21], (4, 1), 32, 4, 9, "bfloat16", 2, tile=16),
]


def _run_interpreter_case(params: dict[str, Any], seed: int) -> dict[str, Any]:
    """Runs one case under the interpreter (called in the worker subprocess)."""
    from gemmaserve_custom_torch.kernels.paged_attention import (
        DecodeKernelConfig,
        paged_decode_attention,
    )

    dtype = getattr(torch, params["dt"])
    num_q_heads, num_kv_heads = params["h"]
    window, scale = params["w"], 0.7
    case = make_paged_case(
        seq_lens=params["lens"], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=params["d"], block_size=params["bs"], window=window, dtype=dtype, seed=seed,
        q_scale=params.get("qs"),
    )
    query, k_pool, v_pool, tables, lens = _call_args(case)
    out = None
    if params.get("strided"):  # q / out as head slices of wider tensors (e.g. fused qkv)
        wide = torch.randn(query.shape[0], num_q_heads + 3, query.shape[2]).to(dtype)
        wide[:, 1 : 1 + num_q_heads] = query
        query = wide[:, 1 : 1 + num_q_heads]
        out = torch.full((query.shape[0], num_q_heads + 2, query.shape[2]), float("nan"), dtype=dtype)[:, 2:]
    config = DecodeKernelConfig(tile_n=params["tile"]) if params.get("tile") else None
    got = paged_decode_attention(
        query, k_pool, v_pool, tables, lens, scale=scale, window=window, out=out,
        num_splits=params["splits"], config=config,
    )
    if out is not None:
        assert got is out
    want = paged_decode_attention_reference(query, k_pool, v_pool, tables, lens, scale=scale, window=window)
    err = (got.float() - want.float()).abs().max().item()
    return {"finite": bool(torch.isfinite(got).all()), "max_err": err, "dtype": str(got.dtype)}


def _interpreter_supports_runtime_loops() -> str | None:
    """None if this triton's interpreter runs a loop with loaded (runtime) bounds, else why not.

    Seen failing: triton 3.6 with numpy >= 2.5 ("only 0-dimensional arrays can be converted to
    Python scalars", the interpreter's ``int()`` of a 1-element array); triton 3.7.1 is fine.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(n_ptr, out_ptr):
        n = tl.load(n_ptr)
        acc = 0
        for i in range(tl.maximum(n - 3, 0), n):
            acc += i
        tl.store(out_ptr, acc)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _probe[(1,)](torch.tensor([5], dtype=torch.int32), out)
    except Exception as exc:
        import numpy

        return f"triton {triton.__version__} / numpy {numpy.__version__} interpreter: {type(exc).__name__}: {exc}"
    return None if int(out) == 2 + 3 + 4 else f"interpreter probe returned {int(out)}"


def _interpreter_worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    unsupported = _interpreter_supports_runtime_loops()
    if unsupported is not None:
        print("@@RESULTS@@" + json.dumps({"__unsupported__": unsupported}))
        return
    results = {}
    for i, (case_id, params) in enumerate(INTERPRETER_CASES):
        try:
            results[case_id] = _run_interpreter_case(params, seed=1000 + i)
        except Exception as exc:  # reported per case
            tb = traceback.format_exc(limit=-4)
            results[case_id] = {"error": f"{type(exc).__name__}: {exc}\n{tb}"}
    print("@@RESULTS@@" + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    import gemmaserve_custom_torch.kernels as kernels_pkg

    plugin_root = str(Path(kernels_pkg.__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (plugin_root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--interpreter-worker"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    marker = "@@RESULTS@@"
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(marker)), None)
    if proc.returncode != 0 or line is None:
        pytest.fail(f"interpreter worker failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(line[len(marker) :])


@needs_triton
@pytest.mark.parametrize("case_id", [c[0] for c in INTERPRETER_CASES])
def test_kernel_matches_reference_interpreter(interpreter_results: dict[str, Any], case_id: str) -> None:
    if "__unsupported__" in interpreter_results:
        pytest.skip(interpreter_results["__unsupported__"])
    res = interpreter_results[case_id]
    assert "error" not in res, res.get("error")
    params = dict(INTERPRETER_CASES)[case_id]
    assert res["finite"], "kernel output has NaN/inf: a sentinel, freed page or stale slot was read"
    assert res["dtype"] == f"torch.{params['dt']}"
    assert res["max_err"] <= _TOL[params["dt"]], res


# ----------------------------------------------------------------------------------------------
# 3. GPU
# ----------------------------------------------------------------------------------------------


def _gpu_lens(batch: int, max_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    edge = [1, max_len, 16 * max(1, max_len // 32), 513]
    for i, n in enumerate(edge[: max(0, batch - 2)]):
        lens[i] = min(n, max_len)
    return lens


def _assert_close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), "non-finite output: a sentinel/freed/stale KV slot was read"
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("heads", [(8, 1), (8, 2)], ids=["gqa8-1", "gqa8-2"])
@pytest.mark.parametrize("window", [0, 512])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_bf16_gemma_shapes(head_dim: int, heads: tuple[int, int], window: int, num_splits) -> None:
    from gemmaserve_custom_torch.kernels.paged_attention import paged_decode_attention

    num_q_heads, num_kv_heads = heads
    lens = _gpu_lens(6, 4096, seed=head_dim + window + num_kv_heads)
    case = make_paged_case(
        seq_lens=lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=16, window=window, dtype=torch.bfloat16, device="cuda", seed=7, spare_table_cols=3,
    )
    got = paged_decode_attention(*_call_args(case), scale=1.0, window=window, num_splits=num_splits)
    want = paged_decode_attention_reference(*_call_args(case), scale=1.0, window=window)
    _assert_close_bf16(got, want)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes(dtype: torch.dtype) -> None:
    from gemmaserve_custom_torch.kernels.paged_attention import paged_decode_attention

    case = make_paged_case(
        seq_lens=[1, 77, 300, 1024], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
        window=100, dtype=dtype, device="cuda", seed=3,
    )
    want = paged_decode_attention_reference(*_call_args(case), scale=1.0, window=100)
    for splits in (1, 4):
        got = paged_decode_attention(*_call_args(case), scale=1.0, window=100, num_splits=splits)
        assert torch.isfinite(got).all()
        tol = 2e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_cuda
@pytest.mark.parametrize("window", [0, 512])
def test_gpu_cuda_graph_replay_with_changing_lengths(window: int) -> None:
    """Capture once at fixed shapes, then replay with new seq_lens / block tables / queries."""
    from gemmaserve_custom_torch.kernels.paged_attention import paged_decode_attention

    max_len, head_dim = 2048, 256
    layouts = [
        [1, 17, 2048, 640],
        [513, 16, 1, 1999],
        [2048, 2047, 512, 33],
        [7, 1024, 1500, 64],
    ]
    cases = [
        make_paged_case(
            seq_lens=lens, num_q_heads=8, num_kv_heads=1, head_dim=head_dim, block_size=16,
            window=window, dtype=torch.bfloat16, device="cuda", seed=11 + i,
            spare_table_cols=_cdiv(max_len, 16) + 1 - _cdiv(max(lens), 16),
        )
        for i, lens in enumerate(layouts)
    ]
    # One shared pool big enough for every layout (each case built its own: pad to the largest).
    num_pool = max(c["k_pool"].shape[0] for c in cases)

    def padded(pool: torch.Tensor) -> torch.Tensor:
        full = torch.full((num_pool + 1,) + tuple(pool.shape[1:]), float("nan"), dtype=pool.dtype, device="cuda")
        full[1 : 1 + pool.shape[0]] = pool
        return full

    static_q = cases[0]["query"].clone()
    static_tables = cases[0]["block_tables"].clone()
    static_lens = cases[0]["seq_lens"].clone()
    k_store, v_store = padded(cases[0]["k_pool"]), padded(cases[0]["v_pool"])
    static_out = torch.empty_like(static_q)

    def step() -> None:
        paged_decode_attention(
            static_q, k_store[1:], v_store[1:], static_tables, static_lens, scale=1.0,
            window=window, out=static_out,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile + warm up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for case in cases[1:] + cases[:1]:
        k_store.copy_(padded(case["k_pool"]))
        v_store.copy_(padded(case["v_pool"]))
        static_q.copy_(case["query"])
        static_tables.copy_(case["block_tables"])
        static_lens.copy_(case["seq_lens"])
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = paged_decode_attention_reference(*_call_args(case), scale=1.0, window=window)
        _assert_close_bf16(static_out, want)


@needs_cuda
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=_case_params(max_len=700, head_dims=(64, 256)),
    num_splits=st.sampled_from([None, 1, 2, 5, 16]),
)
def test_gpu_property_random_tables(params: dict, num_splits) -> None:
    from gemmaserve_custom_torch.kernels.paged_attention import paged_decode_attention

    scale = params.pop("scale")
    params["block_size"] = 16 if params["block_size"] < 4 else params["block_size"]
    case = make_paged_case(dtype=torch.bfloat16, device="cuda", **params)
    window = params["window"]
    got = paged_decode_attention(*_call_args(case), scale=scale, window=window, num_splits=num_splits)
    want = dense_attention(case, scale=scale, window=window)
    _assert_close_bf16(got, want)


if __name__ == "__main__" and "--interpreter-worker" in sys.argv:
    _interpreter_worker()
