"""Decode at small batch on the few-row kernels (``fusion.fuse_small_batch``, ``CUSTOM_BACKEND_SKINNY_MAX_ROWS``) and
the programmatic-dependent-launch forms of the fused kernels (``kernels.pdl``, ``CUSTOM_BACKEND_PDL``).

The model-level checks run on CPU under ``TRITON_INTERPRET=1`` in a subprocess (the flag must be set before triton
is imported; fp32, tiny checkpoints); the PDL forms cannot run without a Hopper GPU, so they are compiled for sm_90
with Triton's bundled ptxas and their PTX is checked instead. The GPU run is in benchmarks/kernels/bench_pdl.py."""

from __future__ import annotations

import pytest

from hopper_compile import compile_for_hopper, require_hopper_compiler
from triton_interpret import run_interpreted

pytest.importorskip("triton")

_MODEL_SCRIPT = r"""
import json, sys, torch
import gemmaserve_custom_torch.kernels.skinny_gemm as sk
from gemmaserve_custom_torch.models import ContiguousKVContext, GemmaForCausalLM
from gemmaserve_custom_torch.models.fusion import fuse_elementwise, fuse_projections, fuse_small_batch
from gemmaserve_custom_torch.models.quantization import quantize_fp8
path, max_rows, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fp8 = len(sys.argv) > 4 and sys.argv[4] == "fp8"
torch.set_num_threads(1)
calls = {"linear": [], "geglu": [], "gelu_mul": [], "residual_norm": [], "fp8": []}
prequantized = []
def counted(name, kernel):
    def run(x, w, *args, **kw):
        calls[name].append(x.shape[0])
        if kw.get("quantized") is not None:
            q, scale = kw["quantized"]
            want = sk.quantize_rows(x)
            assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1])
            prequantized.append(x.shape[0])
        return kernel(x, w, *args, **kw)
    return run
sk.skinny_linear, sk.skinny_geglu = counted("linear", sk.skinny_linear), counted("geglu", sk.skinny_geglu)
sk.skinny_linear_gelu_mul = counted("gelu_mul", sk.skinny_linear_gelu_mul)
sk.skinny_linear_residual_norm = counted("residual_norm", sk.skinny_linear_residual_norm)
sk.skinny_fp8_linear = counted("fp8", sk.skinny_fp8_linear)
fused = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
small = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
for model in (fused, small):
    if fp8:
        quantize_fp8(model)
    fuse_projections(model)
    fuse_elementwise(model)
out = {"switched": fuse_small_batch(small, max_rows), "layers": len(small.layers)}
prompt = torch.tensor([[(7 * i + 3 * b) % 200 + 4 for i in range(9)] for b in range(batch)])
with torch.inference_mode():
    tokens, logits, prompt_calls = [], [], None
    for model in (fused, small):
        ctx, ids, got, seen = ContiguousKVContext(model.config), prompt, [], []
        for step in range(5):
            step_logits = model(ids, ctx.next_positions(batch, ids.shape[1]), ctx, logits_to_keep=1)[:, -1]
            if model is small and step == 0:
                prompt_calls = {k: len(v) for k, v in calls.items()}
            seen.append(step_logits)
            got.append(step_logits.argmax(-1).tolist())
            ids = step_logits.argmax(-1)[:, None]
        tokens.append(got)
        logits.append(torch.stack(seen))
out["max_logit_diff"] = float((logits[0] - logits[1]).abs().max())
out["row_step_diffs"] = (logits[0] - logits[1]).abs().amax(-1).flatten().tolist()  # per decode step and row
out["tokens_equal"] = tokens[0] == tokens[1]
out["prompt_calls"] = prompt_calls
out["decode_rows"] = sorted(set(sum(calls.values(), [])))
out.update({f"{name}_calls": len(rows) for name, rows in calls.items()})
out["prequantized_calls"] = len(prequantized)
out["ple"] = bool(small.config.ple_dim)
out["moe_layers"] = sum(layer.has_moe for layer in small.layers)
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_moe"])
def test_decode_rows_run_the_few_row_kernels_and_keep_the_tokens(tiny_checkpoint, name):
    """Prompt forwards (more rows than the cap) stay on cuBLAS; decode steps of a 2-row batch run every projection
    through the few-row kernels (GeGLU included, the residual chains and the PLE gate folded in) and give the fused
    model's logits up to summation order."""
    result = run_interpreted(_MODEL_SCRIPT, str(tiny_checkpoint(name)), "4", "2")
    assert result["switched"] == result["layers"]
    assert set(result["prompt_calls"].values()) == {0}, result  # 2 x 9 prompt rows > 4
    assert result["decode_rows"] == [2], result
    layers = result["layers"]
    assert result["geglu_calls"] == 4 * layers, result  # one per layer per decode step (MoE layers' dense MLP too)
    # per layer per step: o, down (but on MoE layers, whose dense MLP output joins the experts' first) and the PLE
    # projection each with the residual chain in its reduce; the PLE gate with its epilogue; q(kv) and MoE downs plain
    folded = 2 * layers - result["moe_layers"] + (layers if result["ple"] else 0)
    assert result["residual_norm_calls"] == 4 * folded, result
    assert result["gelu_mul_calls"] == (4 * layers if result["ple"] else 0), result
    assert result["linear_calls"] == 4 * (layers + result["moe_layers"]), result
    assert result["max_logit_diff"] < 1e-4, result
    assert result["tokens_equal"], result


@pytest.mark.parametrize("name", ["gemma4", "gemma4_moe"])
def test_fp8_decode_rows_run_the_few_row_fp8_path_and_keep_the_tokens(tiny_checkpoint, name):
    """With FP8 weights (``quantize_fp8``) every decode projection of a 2-row batch runs ``skinny_fp8_linear``
    (rows quantized, then the FP8 product) instead of ``quantization.linear``'s ``_scaled_mm``, the model-dtype
    kernels and folds none; the logits are the FP8 model's up to summation order (the same quantized values)."""
    result = run_interpreted(_MODEL_SCRIPT, str(tiny_checkpoint(name)), "4", "2", "fp8")
    assert set(result["prompt_calls"].values()) == {0}, result
    assert result["decode_rows"] == [2], result
    layers = result["layers"]
    # per layer per step: q(kv), o, gate/up, down, and with per-layer inputs their gate and projection
    assert result["fp8_calls"] == 4 * layers * (6 if result["ple"] else 4), result
    # gate/up (the pre-FF norm) and every layer's q(kv) but the first (the previous layer's last norm) read rows the
    # residual kernel quantized as it wrote them (the same bytes as quantize_rows: checked in the script)
    assert result["prequantized_calls"] == 4 * (2 * layers - 1), result
    assert result["linear_calls"] == result["geglu_calls"] == result["residual_norm_calls"] == 0, result
    assert result["gelu_mul_calls"] == 0, result
    # the same quantized values give the same logits up to summation order; but a normed row the two models round
    # one way and the other (summation order, which differs between CPUs) can sit on an FP8 rounding midpoint and
    # quantize one step apart: that row's logits (and its later steps') then move by ~0.1. Most row-steps agree.
    diffs = result["row_step_diffs"]
    assert sum(d < 1e-3 for d in diffs) >= 0.7 * len(diffs) and max(diffs) < 0.5, result
    assert result["tokens_equal"], result


def test_a_cap_of_zero_runs_nothing_on_the_few_row_kernels(tiny_checkpoint):
    result = run_interpreted(_MODEL_SCRIPT, str(tiny_checkpoint("gemma4")), "0", "1")
    assert result["decode_rows"] == [], result
    assert result["max_logit_diff"] == 0.0 and result["tokens_equal"], result


def test_the_elementwise_and_norm_kernels_compile_as_programmatic_dependents():
    """The PDL forms (sm_90, bundled ptxas) wait for the previous grid and release the next one; the plain forms
    carry neither instruction."""
    require_hopper_compiler()
    from gemmaserve_custom_torch.kernels import fused_ops, paged_attention, rms_norm

    builds = []
    for pdl in (False, True):
        builds.append((rms_norm._rms_norm_kernel, {
            "x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "inner": "i32", "stride_xm": "i32",
            "stride_xk": "i32", "n_cols": "i32", "eps": "fp32", "HAS_WEIGHT": "constexpr", "ONE_PLUS": "constexpr",
            "BLOCK": "constexpr", "PDL": "constexpr"},
            {"HAS_WEIGHT": True, "ONE_PLUS": False, "BLOCK": 256, "PDL": pdl}))
        builds.append((fused_ops._norm_rope_kernel, {
            "x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16",
            "heads": "i32", "stride_xt": "i32", "stride_xh": "i32", "half": "i32", "eps": "fp32",
            "HAS_WEIGHT": "constexpr", "ONE_PLUS": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"},
            {"HAS_WEIGHT": True, "ONE_PLUS": False, "BLOCK": 128, "PDL": pdl}))
        builds.append((fused_ops._rope_tables_kernel, {
            "pos_ptr": "*i64", "inv_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "half": "i32",
            "BLOCK": "constexpr", "PDL": "constexpr"}, {"BLOCK": 128, "PDL": pdl}))
        builds.append((fused_ops._ple_inputs_kernel, {
            "proj_ptr": "*bf16", "token_ptr": "*bf16", "ids_ptr": "*i64", "table_scale_ptr": "*bf16", "w_ptr": "*bf16",
            "out_ptr": "*bf16", "num_rows": "i32", "layers": "i32", "dim": "i32", "eps": "fp32", "proj_scale": "fp32",
            "out_scale": "fp32", "ONE_PLUS": "constexpr", "LOOKUP": "constexpr", "BLOCK": "constexpr",
            "ROWS": "constexpr", "PDL": "constexpr"},
            {"ONE_PLUS": False, "LOOKUP": pdl, "BLOCK": 256, "ROWS": 1 if pdl else 8, "PDL": pdl}))
        builds.append((fused_ops._qkv_norm_rope_kernel, {
            "x_ptr": "*bf16", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
            "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "slots_ptr": "*i64", "q_heads": "i32",
            "kv_heads": "i32", "num_tokens": "i32", "stride_xt": "i32", "v_col": "i32", "half": "i32", "eps": "fp32",
            "ONE_PLUS": "constexpr", "V_MODE": "constexpr", "TO_CACHE": "constexpr", "BLOCK": "constexpr",
            "ROWS": "constexpr", "PDL": "constexpr"},
            {"ONE_PLUS": False, "V_MODE": 1 + pdl, "TO_CACHE": pdl, "BLOCK": 128, "ROWS": 1 if pdl else 8,
             "PDL": pdl}))
        builds.append((fused_ops._residual_norm_kernel, {
            "res_ptr": "*bf16", "h_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*bf16", "w_next_ptr": "*bf16",
            "out_ptr": "*bf16", "next_ptr": "*bf16", "q_ptr": "*fp8e4nv", "q_scale_ptr": "*fp32", "stride_r": "i32",
            "stride_h": "i32", "n_cols": "i32", "eps": "fp32", "eps_next": "fp32", "ONE_PLUS": "constexpr",
            "HAS_SCALE": "constexpr", "HAS_NEXT": "constexpr", "NEXT_FP8": "constexpr", "BLOCK": "constexpr",
            "PDL": "constexpr"},
            {"ONE_PLUS": False, "HAS_SCALE": True, "HAS_NEXT": True, "NEXT_FP8": pdl, "BLOCK": 2048, "PDL": pdl}))
        builds.append((fused_ops._gelu_mul_kernel, {
            "a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "stride_a": "i32", "stride_b": "i32",
            "n_cols": "i32", "BLOCK": "constexpr", "PDL": "constexpr"}, {"BLOCK": 1024, "PDL": pdl}))
        builds.append((paged_attention._combine_splits_kernel, {
            "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", "num_splits": "i32",
            "stride_ob": "i32", "stride_oh": "i32", "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr",
            "SPLIT_PAD": "constexpr", "PDL": "constexpr"}, {"HEAD_DIM": 256, "BLOCK_D": 256, "SPLIT_PAD": 8, "PDL": pdl}))
        builds.append((paged_attention._paged_decode_kernel, {
            "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
            "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32", "window": "i32",
            "max_blocks": "i32", "num_splits": "i32", **{name: "i32" for name in (
                "stride_qb", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
                "stride_vh", "stride_btb", "stride_ob", "stride_oh")},
            **{name: "constexpr" for name in ("GROUP", "GROUP_PAD", "HEAD_DIM", "DIM_PAD", "BLOCK_SIZE", "TILE_N",
                                              "SPLIT", "UPCAST", "DOT_PRECISION", "PDL")}},
            {"GROUP": 8, "GROUP_PAD": 8, "HEAD_DIM": 256, "DIM_PAD": 256, "BLOCK_SIZE": 16, "TILE_N": 64,
             "SPLIT": True, "UPCAST": False, "DOT_PRECISION": "tf32", "PDL": pdl}))
    for kernel, signature, constexprs in builds:
        ptx = compile_for_hopper(kernel, signature, constexprs)["ptx"]
        assert ("griddepcontrol.wait" in ptx) == constexprs["PDL"], (kernel, constexprs)
        assert ("griddepcontrol.launch_dependents" in ptx) == constexprs["PDL"], (kernel, constexprs)


def test_the_settings_are_refused_where_they_cannot_run(tiny_checkpoint, monkeypatch):
    """On the CPU (no CUDA, no fusion) and under tensor parallel the two settings name what is missing; the removed
    CUSTOM_BACKEND_IN_PLACE_REDUCE (slower on an H100, run 29) is refused as a variable that names no setting."""
    import torch

    from gemmaserve.errors import ConfigurationError
    from gemmaserve.settings import CoreSettings
    from gemmaserve_custom_torch.backend import (
        CustomTorchBackend,
        small_batch_plan,
        check_tensor_parallel_settings,
    )
    from gemmaserve_custom_torch.models import GemmaForCausalLM
    from gemmaserve_custom_torch.settings import load_custom_settings
    from gemmaserve_custom_torch.tokenizer import HFTokenizer

    path = tiny_checkpoint("gemma4")
    core = CoreSettings(model=str(path), device="cpu", dtype="float32", max_batch_size=2, max_active_kv_tokens=4096)
    for custom in ({"skinny_max_rows": 8}, {"pdl": True}):
        with pytest.raises(ConfigurationError, match="need a CUDA device, triton and fusion"):
            CustomTorchBackend(GemmaForCausalLM.from_hf(path, "cpu", torch.float32), HFTokenizer.from_pretrained(path),
                               core, load_custom_settings(kv_blocks=64, **custom))
        with pytest.raises(ConfigurationError, match="SKINNY_MAX_ROWS / CUSTOM_BACKEND_PDL"):
            check_tensor_parallel_settings(load_custom_settings(cuda_graph=False, **custom), "cpu")
    monkeypatch.setenv("CUSTOM_BACKEND_IN_PLACE_REDUCE", "1")
    with pytest.raises(ConfigurationError, match="CUSTOM_BACKEND_IN_PLACE_REDUCE is not a setting"):
        load_custom_settings()
    monkeypatch.delenv("CUSTOM_BACKEND_IN_PLACE_REDUCE")
    with pytest.raises(ConfigurationError, match="SKINNY_MAX_ROWS"):
        load_custom_settings(skinny_max_rows=65)
    with pytest.raises(ConfigurationError, match="not supported under CUSTOM_BACKEND_COMPILE=1"):
        small_batch_plan(load_custom_settings(skinny_max_rows=8, compile=True), torch.device("cpu"), True)
    with pytest.raises(ConfigurationError, match="not supported under tensor parallel"):
        small_batch_plan(load_custom_settings(pdl=True), torch.device("cpu"), True, tensor_parallel=True)
    # unset or 0: whatever the load can run, never a refusal (here: nothing)
    cpu = torch.device("cpu")
    for custom in ({}, {"skinny_max_rows": 0, "pdl": False}, {"compile": True}):
        assert small_batch_plan(load_custom_settings(**custom), cpu, True) == (0, False)
    assert small_batch_plan(load_custom_settings(), cpu, True, tensor_parallel=True) == (0, False)


def test_unset_settings_take_what_a_cuda_load_can_run(monkeypatch):
    """Unset: the few-row cap AUTO_SKINNY_MAX_ROWS and PDL exactly where the GPU is Hopper or newer; 0 / off and a
    load without fusion get neither; PDL asked of an older GPU is refused naming its compute capability."""
    import torch

    import gemmaserve_custom_torch.backend as backend
    import gemmaserve_custom_torch.kernels.pdl as pdl
    from gemmaserve.errors import ConfigurationError
    from gemmaserve_custom_torch.settings import load_custom_settings

    monkeypatch.setattr(backend, "HAS_TRITON", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    for hopper in (False, True):
        monkeypatch.setattr(pdl, "pdl_supported", lambda device, hopper=hopper: hopper)
        assert backend.small_batch_plan(load_custom_settings(), cuda, True) == (backend.AUTO_SKINNY_MAX_ROWS, hopper)
        assert backend.small_batch_plan(load_custom_settings(skinny_max_rows=8), cuda, True) == (8, hopper)
        assert backend.small_batch_plan(load_custom_settings(skinny_max_rows=0, pdl=False), cuda, True) == (0, False)
        assert backend.small_batch_plan(load_custom_settings(), cuda, False) == (0, False)  # fusion off
        # a dense model with FP8 weights leaves PDL off unless asked (31B FP8 was slower with it, runs 30-31)
        assert backend.small_batch_plan(load_custom_settings(), cuda, True, dense_fp8=True) == (32, False)
        if hopper:  # asked for, it is on
            assert backend.small_batch_plan(load_custom_settings(pdl=True), cuda, True, dense_fp8=True) == (32, True)
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: False)
    with pytest.raises(ConfigurationError, match="compute capability 9.0 or newer .* has 8.0"):
        backend.small_batch_plan(load_custom_settings(pdl=True), cuda, True)


_CHAIN_SCRIPT = r"""
import json, sys, torch
sys.path[:0] = [sys.argv[1] + "/kernels", sys.argv[1]]  # benchmarks/kernels/bench_pdl.py and its timing helpers
import bench_pdl
import gemmaserve_custom_torch.kernels.fused_ops as fused_ops
import gemmaserve_custom_torch.kernels.skinny_gemm as skinny_gemm
fused_ops.launch_options = skinny_gemm.launch_options = lambda pdl: {}  # no PDL under the interpreter: same sums
torch.manual_seed(0)
spec = {"hidden": 32, "q_sliding": 32, "q_full": 64, "kv_sliding": 16, "kv_full": 32, "mlp": 64, "mlp_wide": 96,
        "layers": 3, "first_wide": 2, "period": 2, "ple": 16}
layers = [bench_pdl.layer_weights(spec, i, "cpu", torch.float32) for i in range(spec["layers"])]
x, ple = torch.randn(3, spec["hidden"]), torch.randn(3, spec["layers"], spec["ple"])
outs = {kind: bench_pdl.chain(layers, x, ple, kind)() for kind in bench_pdl.KINDS}
print(json.dumps({"identical": {kind: all(torch.equal(a, b) for a, b in zip(outs["triton"], outs[kind]))
                                for kind in bench_pdl.KINDS[1:]},
                  "vs_cublas": max(float((a - b).abs().max()) for a, b in zip(outs["cublas"], outs["triton"]))}))
"""


def test_the_benchmark_chain_folds_change_no_bit():
    """bench_pdl's chain (fp32, interpreter, PDL launch flags dropped): the folded form (residual chains in the
    split-K reduce, the PLE gate in its epilogue) gives the plain Triton chain's outputs bit for bit, as the GPU
    run asserts; cuBLAS's up to summation order."""
    from pathlib import Path

    result = run_interpreted(_CHAIN_SCRIPT, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    assert all(result["identical"].values()), result
    assert result["vs_cublas"] < 1e-4, result


_FP8_ROWS_SCRIPT = r"""
import json, torch
from gemmaserve_custom_torch.kernels.fp8_rows import quantize_rows
from gemmaserve_custom_torch.kernels.fused_ops import moe_residual_norm, residual_norm
torch.manual_seed(0)
checked = 0
for dtype in (torch.float32, torch.float16):
    for shape in ((3, 48), (2, 3, 100), (1, 1, 64)):
        k = shape[-1]
        residual, h, moe = (4 * torch.randn(shape).to(dtype) for _ in range(3))
        w, w_next, w_moe, w_dense = (torch.randn(k).to(dtype) for _ in range(4))
        scale = torch.tensor([0.75]).to(dtype)
        for style in ("w", "one_plus_w"):
            runs = [lambda fp8: residual_norm(residual, h, w, 1e-6, style, scale=scale, next_weight=w_next,
                                              next_eps=1e-5, next_fp8=fp8),
                    lambda fp8: moe_residual_norm(residual, h, moe, w_dense, 1e-6, w_moe, 2e-6, w, 1e-6, style,
                                                  next_weight=w_next, next_eps=1e-5, next_fp8=fp8)]
            for run in runs:
                out, nxt = run(True)
                plain_out, plain_next = run(False)
                assert torch.equal(out, plain_out) and torch.equal(nxt, plain_next)
                assert not hasattr(plain_next, "fp8_rows")
                q, q_scale = nxt.fp8_rows
                want_q, want_scale = quantize_rows(nxt.reshape(-1, k))
                assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape, (q.dtype, q.shape)
                assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (dtype, shape, style)
                assert q_scale.shape == want_scale.shape and torch.equal(q_scale, want_scale)
                checked += 1
print(json.dumps({"checked": checked}))
"""


def test_residual_kernels_quantize_their_next_norm_as_quantize_rows_does():
    """``next_fp8``: the next norm's output carries FP8 rows with ``quantize_rows``' bytes and scales (fp32 and fp16,
    widths that are not powers of two, leading dims), and nothing else the kernels write changes."""
    result = run_interpreted(_FP8_ROWS_SCRIPT)
    assert result == {"checked": 2 * 3 * 2 * 2}
