"""The few-row matmul kernels (kernels/skinny_gemm.py) against torch on CPU under ``TRITON_INTERPRET=1`` (fp32 and
fp16, tiny shapes, in a subprocess: the flag must be set before triton is imported): ``skinny_linear`` against
``F.linear``, ``skinny_geglu`` against the eager GeGLU chain, ``skinny_linear_gelu_mul`` against the eager gate
(``gelu_tanh(linear) * mul``), ``skinny_linear_residual_norm`` against the product then the residual chain (post-norm,
residual, scale, next norm), with and without split K (including slices that do not divide K and column counts that
are not a multiple of the tile), and ``lm_head_argmax`` against
``argmax(softcap(F.linear))`` including exact ties, which must go to the lowest token id; the FP8 path
(``fp8_rows.quantize_rows``: the same bytes as ``quantization.quantize_per_token``; ``skinny_linear_fp8`` against
the float64 product of the same FP8 values and scales)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from hopper_compile import compile_for_hopper, require_hopper_compiler  # noqa: E402

_SCRIPT = r"""
import json, torch
import torch.nn.functional as F
from gemmaserve_custom_torch.kernels.skinny_gemm import choose_split_k, lm_head_argmax, skinny_geglu, skinny_linear
from gemmaserve_custom_torch.kernels.skinny_gemm import skinny_linear_fp8, skinny_linear_gelu_mul
from gemmaserve_custom_torch.kernels.skinny_gemm import skinny_linear_residual_norm
from gemmaserve_custom_torch.kernels.fp8_rows import quantize_rows
from gemmaserve_custom_torch.models.quantization import quantize_per_token, quantize_weight
from gemmaserve_custom_torch.models.layers import RMSNorm, gelu_tanh
torch.manual_seed(0)
torch.set_num_threads(1)
errors, checks = {}, 0
def note(name, got, want):
    global checks
    checks += 1
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous(), (name, got.shape, want.shape)
    errors[name] = max(errors.get(name, 0.0), float((got.float() - want.float()).abs().max()))
small = dict(block_n=16, block_k=32)
for dtype in (torch.float32, torch.float16):
    for m, n, k in ((1, 40, 96), (3, 16, 64), (17, 33, 100), (40, 20, 32)):
        x = torch.randn(m, k).to(dtype)
        w = (torch.randn(n, k) * 0.2).to(dtype)
        want = F.linear(x.float(), w.float()).to(dtype)
        for split in (1, 2, 3, None):
            note(f"linear/{dtype}", skinny_linear(x, w, split_k=split, **small), want)
        gate_up = (torch.randn(2 * n, k) * 0.2).to(dtype)
        gate, up = F.linear(x.float(), gate_up.float()).to(dtype).chunk(2, dim=-1)
        want = (gelu_tanh(gate.float()).to(dtype).float() * up.float()).to(dtype)
        for split in (1, 3):
            note(f"geglu/{dtype}", skinny_geglu(x, gate_up, split_k=split, **small), want)
        strided = torch.randn(m, k + 8).to(dtype)[:, 4:4 + k]  # rows strided, last dim contiguous
        note(f"linear/{dtype}", skinny_linear(strided, w, **small), F.linear(strided.float(), w.float()).to(dtype))
        mul = torch.randn(m, n + 5).to(dtype)[:, 5:]  # the gate's other factor: strided rows, as a PLE slice
        want = (gelu_tanh(F.linear(x.float(), w.float()).to(dtype).float()).to(dtype).float() * mul.float()).to(dtype)
        for split in (1, 3, None):
            note(f"gelu_mul/{dtype}", skinny_linear_gelu_mul(x, w, mul, split_k=split, **small), want)
        for style in ("w", "one_plus_w"):  # the residual chain after the product, as fused_ops.residual_norm
            post, nxt = RMSNorm(n, 1e-6, style, dtype=dtype), RMSNorm(n, 1e-5, style, dtype=dtype)
            post.weight.data, nxt.weight.data = (torch.randn(n) * 0.5).to(dtype), (torch.randn(n) * 0.5).to(dtype)
            residual = torch.randn(m, n + 3).to(dtype)[:, 3:]
            h = F.linear(x.float(), w.float()).to(dtype)
            scale = torch.tensor([0.75]).to(dtype)
            for split in (1, 3, None):
                y, z = skinny_linear_residual_norm(x, w, residual, post.weight, post.eps, style, next_weight=nxt.weight,
                                                   next_eps=nxt.eps, split_k=split, **small)
                note(f"residual_norm/{dtype}", y, residual + post(h))
                note(f"residual_norm.next/{dtype}", z, nxt(residual + post(h)))
                y, none = skinny_linear_residual_norm(x, w, residual, post.weight, post.eps, style, scale=scale,
                                                      split_k=split, **small)
                assert none is None
                note(f"residual_norm.scale/{dtype}", y, (residual + post(h)) * scale)
ties = {"checked": 0}
for dtype in (torch.float32, torch.float16):
    for m, vocab, k, cap in ((1, 200, 48, None), (5, 77, 40, 30.0), (18, 130, 64, 4.0)):
        x = torch.randn(m, k).to(dtype)
        w = (torch.randn(vocab, k) * 0.3).to(dtype)
        w[vocab - 3] = w[vocab // 2]  # a duplicate row: exact ties wherever that row wins
        w[vocab - 1] = w[vocab // 2]
        x[0] = w[vocab // 2].float().to(dtype) * 4  # row 0's winner is the duplicated token
        logits = F.linear(x.float(), w.float()).to(dtype)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        want = logits.argmax(dim=-1)
        got = lm_head_argmax(x, w, cap, block_n=32, block_k=32)
        assert got.dtype == torch.int64 and got.shape == (m,)
        # fp32 summation order may move a near-tie; then both logits must be (near-)equal
        for row in range(m):
            if int(got[row]) != int(want[row]):
                gap = float((logits[row, want[row]] - logits[row, got[row]]).abs())
                assert gap < (1e-5 if dtype == torch.float32 else 2e-2), (dtype, row, int(got[row]), int(want[row]), gap)
        assert int(got[0]) == vocab // 2, (dtype, int(got[0]))
        ties["checked"] += 1
fp8 = {"rows": 0, "products": 0}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for m, k in ((1, 48), (4, 1000), (3, 2100), (2, 7)):
        x = (torch.randn(m, k) * torch.logspace(-5, 3, m)[:, None]).to(dtype)
        x[0, :5] = 0.0
        if m > 2:
            x[2] = 0.0  # an all-zero row: the minimum scale, zeros
        want_q, want_scale = quantize_per_token(x)
        for block in (256, None):  # two passes over 256-value pieces; the whole row in one pass
            q, scale = quantize_rows(x, block=block)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale), \
                (dtype, m, k, block)
        fp8["rows"] += m
for out_dtype in (torch.float32, torch.float16):
    for m, n, k in ((1, 40, 96), (5, 33, 200), (18, 16, 64)):
        xq, x_scale = quantize_rows(torch.randn(m, k))
        wq, w_scale = quantize_weight(torch.randn(n, k) * 0.1)
        want = (xq.double() @ wq.double().T) * x_scale.double() * w_scale.double()[None]
        for split in (1, 3, None):
            got = skinny_linear_fp8(xq, x_scale, wq, w_scale, out_dtype, split_k=split, **small)
            note(f"fp8/{out_dtype}", got, want.to(out_dtype))
            fp8["products"] += 1
assert choose_split_k(1, 262144, 1536) == 1 and choose_split_k(1, 1536, 12288) > 1 and choose_split_k(64, 64, 64) == 1
print(json.dumps({"errors": errors, "checks": checks, "ties": ties["checked"], "fp8": fp8}))
"""


def test_skinny_kernels_match_torch_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["checks"] == 2 * 4 * (4 + 2 + 1 + 3 + 2 * 3 * 3) + 18 and result["ties"] == 6, result
    assert result["fp8"] == {"rows": 3 * 10, "products": 18}, result
    for name, error in result["errors"].items():
        # fp32: summation order only; fp16: one rounding step of outputs of magnitude up to ~10 (the norm: its
        # rounded output may differ by one step where the two sums of squares differ in the last bit)
        assert error < (2e-5 if "float32" in name else 1.6e-2 if "norm" not in name else 3e-2), (name, error)


def test_the_kernel_benchmark_smoke_run_agrees_with_torch(tmp_path):
    """benchmarks/kernels/bench_skinny_gemm.py --tiny (the CPU mode of the H200 benchmark) runs end to end."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "kernels", "bench_skinny_gemm.py"), "--tiny",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12 and all(row["error"] < 1e-4 for row in rows), rows


def test_the_kernels_compile_for_hopper_without_a_gpu():
    """The real compiler path (Triton -> PTX -> cubin for sm_90 with Triton's bundled ptxas), which the
    interpreter never takes: bf16 at the decode row blocks 16 and 64 with and without split K and the GeGLU and
    gate (gelu times a tensor) epilogues, the reductions (incl. the one running the residual chain), and the
    LM-head argmax with its softcap; fp32 with IEEE dots; FP8 operands widened to bf16 or dotted as FP8 (e4m3
    tensor cores from 64-row blocks, a hardware conversion below) with the scale epilogue, and the FP8 row
    quantization; the programmatic-dependent-launch forms (bf16, native FP8 and the row quantization) carry the
    grid-dependency instructions and nothing else does. Pointers and sizes carry the 16-divisibility E2B's shapes
    give the launcher, so the bf16 K loops become tensor-core dots."""
    require_hopper_compiler()
    import triton.language as tl

    from gemmaserve_custom_torch.kernels import skinny_gemm as sk
    from gemmaserve_custom_torch.kernels.fp8_rows import _one_pass_warps as one_pass_warps
    from gemmaserve_custom_torch.kernels.fp8_rows import _quantize_rows_kernel as quantize_rows_kernel

    builds = []
    for dtype, precision, row_blocks in (("bf16", "tf32", (16, 64)), ("fp32", "ieee", (16,))):
        for block_m in row_blocks:
            for geglu, gelu_mul in ((False, False), (True, False), (False, True)):
                for split in (False, True):
                    for pdl in (False, True) if dtype == "bf16" else (False,):
                        builds.append((sk._skinny_kernel, _skinny_signature(dtype, dtype),
                                       {"GEGLU": geglu, "GELU_MUL": gelu_mul, "SPLIT": split, "SCALED": False,
                                        "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128, "PRECISION": precision,
                                        "WIDEN": None, "PDL": pdl}, dtype))
            builds.append((sk._argmax_kernel, {
                "x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "best_ptr": "*fp32", "index_ptr": "*i32", "m": "i32",
                "n": "i32", "k": "i32", "stride_xm": "i32", "stride_wn": "i32", "softcap": "fp32",
                "HAS_CAP": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                "PRECISION": "constexpr"},
                {"HAS_CAP": True, "BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 128, "PRECISION": precision}, dtype))
        for geglu, gelu_mul, scaled, pdl in (((False, False, False, False), (True, False, False, False),
                                              (False, True, False, True), (False, False, True, False),
                                              (True, False, False, True)) if dtype == "bf16" else ()):
            builds.append((sk._reduce_kernel, {"part_ptr": "*fp32", "out_ptr": f"*{dtype}", "x_scale_ptr": "*fp32",
                                               "w_scale_ptr": "*fp32", "mul_ptr": f"*{dtype}", "m": "i32",
                                               "n_out": "i32", "slices": "i32", "stride_mul": "i32",
                                               "GEGLU": "constexpr", "GELU_MUL": "constexpr", "SCALED": "constexpr",
                                               "BLOCK": "constexpr", "PDL": "constexpr"},
                           {"GEGLU": geglu, "GELU_MUL": gelu_mul, "SCALED": scaled, "BLOCK": 256, "PDL": pdl},
                           dtype))
        for pdl in (False, True) if dtype == "bf16" else ():  # the split-K reduce running the residual chain
            builds.append((sk._reduce_residual_norm_kernel, {
                "part_ptr": "*fp32", **{name: f"*{dtype}" for name in (
                    "res_ptr", "norm_ptr", "scale_ptr", "next_norm_ptr", "out_ptr", "next_ptr")},
                "m": "i32", "n_out": "i32", "slices": "i32", "stride_r": "i32", "eps": "fp32", "eps_next": "fp32",
                "ONE_PLUS": "constexpr", "HAS_SCALE": "constexpr", "HAS_NEXT": "constexpr", "BLOCK": "constexpr",
                "PDL": "constexpr"},
                {"ONE_PLUS": False, "HAS_SCALE": True, "HAS_NEXT": True, "BLOCK": 2048, "PDL": pdl}, dtype))
    for block_m in (16, 64):  # FP8 operands, widened to bf16 in software or dotted as FP8; the scales in the epilogue
        for split in (False, True):
            for widen, pdl in ((tl.bfloat16, False), (None, False), (None, True)):
                builds.append((sk._skinny_kernel, _skinny_signature("fp8e4nv", "bf16"),
                               {"GEGLU": False, "GELU_MUL": False, "SPLIT": split, "SCALED": True, "BLOCK_M": block_m,
                                "BLOCK_N": 64, "BLOCK_K": 128, "PRECISION": "tf32", "WIDEN": widen, "PDL": pdl},
                               "fp8" if widen is not None else "fp8_native"))
    # the row quantization: two passes at 1,024; one pass at the widths and warps the launcher gives 31B's rows
    # (5,376 -> 8,192 at 8 warps, 21,504 -> 32,768 at 16) and a short row (2,048 at 4)
    for dtype, pdl, block in (("bf16", False, 0), ("fp16", False, 0), ("fp32", False, 0), ("bf16", True, 0),
                              ("bf16", True, 32768), ("bf16", False, 8192), ("fp32", False, 2048)):
        builds.append((quantize_rows_kernel, {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                                              "k": "i32", "stride_xm": "i32", "BLOCK": "constexpr",
                                              "ONE_PASS": "constexpr", "PDL": "constexpr"},
                       {"BLOCK": block or 1024, "ONE_PASS": bool(block), "PDL": pdl}, "quantize",
                       one_pass_warps(block) if block else 4))
    for kernel, signature, constexprs, dtype, *warps in builds:
        asm = compile_for_hopper(kernel, signature, constexprs, unaligned=("m", "slices"),
                                 num_warps=warps[0] if warps else 4)
        if dtype in ("bf16", "fp8", "fp8_native") and "BLOCK_K" in constexprs:
            assert "mma" in asm["ptx"], (kernel, constexprs)  # tensor-core dots
        if dtype == "fp8_native":  # e4m3 tensor cores from 64-row blocks, one hardware conversion to f16 below
            wanted = ("mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" if constexprs["BLOCK_M"] == 64
                      else "cvt.rn.f16x2.e4m3x2")
            assert wanted in asm["ptx"], constexprs
        if dtype == "quantize":  # the FP8 cast only narrows values already on the e4m3 grid
            assert "e4m3" in asm["ptx"], constexprs
        # a programmatic dependent waits for the previous grid and releases the next one; nothing else does
        assert ("griddepcontrol.wait" in asm["ptx"]) == bool(constexprs.get("PDL")), constexprs
        assert ("griddepcontrol.launch_dependents" in asm["ptx"]) == bool(constexprs.get("PDL")), constexprs


def _skinny_signature(operands: str, out: str) -> dict[str, str]:
    return {"x_ptr": f"*{operands}", "w_ptr": f"*{operands}", "out_ptr": f"*{out}", "part_ptr": "*fp32",
            "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "mul_ptr": f"*{out}", "m": "i32", "n_out": "i32",
            "k": "i32", "k_per_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_mul": "i32",
            "up_offset": "i32", "GEGLU": "constexpr", "GELU_MUL": "constexpr", "SPLIT": "constexpr",
            "SCALED": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
            "PRECISION": "constexpr", "WIDEN": "constexpr", "PDL": "constexpr"}

