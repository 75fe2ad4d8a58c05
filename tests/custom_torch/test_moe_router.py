"""``kernels.moe_router.route`` (the MoE router + the experts' input norm) and ``kernels.fused_ops.moe_residual_norm``
(a MoE layer's feed-forward end) against the eager modules, under ``TRITON_INTERPRET=1`` on CPU (fp32, tiny
shapes, in a subprocess: the flag must be set before triton loads), and their sm_90 builds (bf16, PDL on and off).
The whole-model check (the fused forward keeps a tiny MoE model's tokens) is test_moe_kernel.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hopper_compile import compile_for_hopper, require_hopper_compiler

_SCRIPT = r"""
import json, torch
from hypothesis import given, settings, strategies as st
from gemmaserve_custom_torch.kernels.fused_ops import moe_residual_norm
from gemmaserve_custom_torch.kernels.moe_router import route
from gemmaserve_custom_torch.models.layers import MoERouter, RMSNorm

torch.set_num_threads(1)


@settings(max_examples=12, deadline=None, database=None, derandomize=True)
@given(experts=st.integers(1, 40), hidden=st.integers(1, 150), tokens=st.integers(1, 5), data=st.data(),
       style=st.sampled_from(["w", "one_plus_w"]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def check_route(experts, hidden, tokens, data, style, seed, dtype):
    top_k = data.draw(st.integers(1, experts))
    block_e, block_k = data.draw(st.sampled_from([1, 4, 8])), data.draw(st.sampled_from([16, 64, 1024]))
    g = torch.Generator().manual_seed(seed)
    router = MoERouter(hidden, experts, top_k, 1e-6, dtype=dtype)
    norm = RMSNorm(hidden, 1e-5, style, dtype=dtype)
    with torch.no_grad():
        router.proj.weight.copy_(torch.randn(experts, hidden, generator=g) * 2)
        router.scale.copy_(torch.rand(hidden, generator=g) + 0.5)
        router.per_expert_scale.copy_(torch.rand(experts, generator=g) + 0.5)
        norm.weight.copy_(torch.randn(hidden, generator=g) * 0.1)
    x = torch.randn(tokens, hidden + 3, generator=g).to(dtype)[:, 2:hidden + 2]  # rows with a stride of their own
    with torch.no_grad():
        want_w, want_ids = router(x)
        want_normed = norm(x)
        got_w, got_ids, got_normed = route(x, router.scale, router.proj.weight, router.per_expert_scale, top_k,
                                           router.norm.eps, norm.weight, norm.eps, style, block_e=block_e,
                                           block_k=block_k)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32 and got_normed.dtype == dtype
    # the same experts in the same order (random logits: no near-ties), weights and norm to rounding (fp16: the
    # kernel rounds where the eager ops round, so the norm agrees to a unit in the last place)
    assert torch.equal(got_ids, want_ids), (got_ids, want_ids)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got_w, want_w, atol=tol, rtol=tol)
    torch.testing.assert_close(got_normed, want_normed, atol=tol, rtol=tol)


@settings(max_examples=10, deadline=None, database=None, derandomize=True)
@given(hidden=st.integers(1, 150), tokens=st.integers(1, 4), style=st.sampled_from(["w", "one_plus_w"]),
       scale=st.booleans(), nxt=st.booleans(), seed=st.integers(0, 2**16))
def check_combine(hidden, tokens, style, scale, nxt, seed):
    g = torch.Generator().manual_seed(seed)
    dense_norm, moe_norm, post, next_norm = (RMSNorm(hidden, eps, style) for eps in (1e-6, 2e-6, 1e-5, 3e-6))
    with torch.no_grad():
        for norm in (dense_norm, moe_norm, post, next_norm):
            norm.weight.copy_(torch.randn(hidden, generator=g) * 0.3)
    residual, dense, moe = (torch.randn(tokens, hidden, generator=g) for _ in range(3))
    layer_scalar = torch.rand(1, generator=g) + 0.5 if scale else None
    with torch.no_grad():
        want = residual + post(dense_norm(dense) + moe_norm(moe))
        if layer_scalar is not None:
            want = want * layer_scalar
        want_next = next_norm(want) if nxt else None
        got, got_next = moe_residual_norm(residual, dense, moe, dense_norm.weight, dense_norm.eps, moe_norm.weight,
                                          moe_norm.eps, post.weight, post.eps, style, scale=layer_scalar,
                                          next_weight=next_norm.weight if nxt else None,
                                          next_eps=next_norm.eps if nxt else None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if nxt:
        torch.testing.assert_close(got_next, want_next, atol=1e-5, rtol=1e-5)
    else:
        assert got_next is None


# a tie: two experts with identical weights get identical probabilities; the lower id is picked first
router = MoERouter(8, 4, 2, 1e-6)
with torch.no_grad():
    router.proj.weight.copy_(torch.tensor([[1.0] * 8, [3.0] * 8, [3.0] * 8, [0.0] * 8]))
_, tie_ids, _ = route(torch.ones(1, 8), router.scale, router.proj.weight, router.per_expert_scale, 2, 1e-6, None,
                      1e-6, "w")
empty = route(torch.ones(0, 8), router.scale, router.proj.weight, router.per_expert_scale, 2, 1e-6, None, 1e-6, "w")
# a NaN row: ids stay in range, its weights NaN (the eager ops give NaN weights too)
nan_w, nan_ids, _ = route(torch.full((1, 8), float("nan")), router.scale, router.proj.weight,
                          router.per_expert_scale, 2, 1e-6, None, 1e-6, "w")
assert ((nan_ids >= 0) & (nan_ids < 4)).all() and nan_w.isnan().all(), (nan_ids, nan_w)
check_route()
check_combine()
print(json.dumps({"tie": tie_ids.tolist(), "empty": [list(t.shape) for t in empty]}))
"""


def test_route_and_the_moe_residual_norm_match_the_eager_modules():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"tie": [[1, 2]], "empty": [[0, 2], [0, 2], [0, 8]]}


def test_route_refuses_shapes_it_cannot_route():
    pytest.importorskip("triton")
    import torch

    from gemmaserve_custom_torch.kernels.moe_router import route

    x, scale, expert_scale = torch.ones(2, 8), torch.ones(8), torch.ones(4)
    with pytest.raises(ValueError, match="router weight"):
        route(x, scale, torch.ones(4, 9), expert_scale, 2, 1e-6, None, 1e-6, "w")
    with pytest.raises(ValueError, match="top_k 5"):
        route(x, scale, torch.ones(4, 8), expert_scale, 5, 1e-6, None, 1e-6, "w")


@pytest.mark.parametrize("pdl", [False, True])
def test_the_router_kernels_compile_for_hopper_without_a_gpu(pdl):
    """sm_90 builds at 26B-A4B's shapes (H 2816, E 128, k 8; bf16), with and without programmatic dependent
    launch."""
    require_hopper_compiler()
    from gemmaserve_custom_torch.kernels import fused_ops, moe_router

    pdl_ops = {"PDL": "constexpr"}
    logits = {"x_ptr": "*bf16", "scale_ptr": "*bf16", "w_ptr": "*bf16", "norm_w_ptr": "*bf16", "logits_ptr": "*fp32",
              "normed_ptr": "*bf16", "stride_x": "i32", "n_cols": "i32", "num_experts": "i32", "eps_router": "fp32",
              "eps_norm": "fp32", "hidden_scale": "fp32", "ONE_PLUS": "constexpr", "HAS_NORM_W": "constexpr",
              "BLOCK": "constexpr", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr", **pdl_ops}
    top_k = {"logits_ptr": "*fp32", "expert_scale_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64",
             "num_experts": "i32", "TOP_K": "constexpr", "EXPERTS": "constexpr", "SLOTS": "constexpr", **pdl_ops}
    combine = {name: "*bf16" for name in ("res_ptr", "dense_ptr", "moe_ptr", "w_dense_ptr", "w_moe_ptr", "w_ptr",
                                          "scale_ptr", "w_next_ptr", "out_ptr", "next_ptr")}
    combine |= {"q_ptr": "*fp8e4nv", "q_scale_ptr": "*fp32", "stride_r": "i32", "stride_d": "i32", "stride_m": "i32",
                "n_cols": "i32", "eps_dense": "fp32", "eps_moe": "fp32", "eps": "fp32", "eps_next": "fp32",
                "ONE_PLUS": "constexpr", "HAS_SCALE": "constexpr", "HAS_NEXT": "constexpr", "NEXT_FP8": "constexpr",
                "BLOCK": "constexpr", **pdl_ops}
    builds = [
        (moe_router._router_logits_kernel, logits, {"ONE_PLUS": False, "HAS_NORM_W": True, "BLOCK": 4096,
                                                    "BLOCK_E": 4, "BLOCK_K": 1024}, 8),
        (moe_router._router_top_k_kernel, top_k, {"TOP_K": 8, "EXPERTS": 128, "SLOTS": 8}, 1),
        (fused_ops._moe_residual_norm_kernel, combine, {"ONE_PLUS": False, "HAS_SCALE": True, "HAS_NEXT": True,
                                                        "NEXT_FP8": True, "BLOCK": 4096}, 8),
    ]
    for kernel, signature, constexprs, warps in builds:
        ptx = compile_for_hopper(kernel, signature, {**constexprs, "PDL": pdl}, num_warps=warps,
                                 unaligned=("num_experts",))["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl, kernel


_MODEL_SCRIPT = r"""
import dataclasses, json, sys, torch
import gemmaserve_custom_torch.kernels.moe_router as moe_router
from gemmaserve_custom_torch.models import ContiguousKVContext, GemmaForCausalLM
from gemmaserve_custom_torch.models.fusion import fuse_elementwise, fuse_projections
torch.set_num_threads(1)
routed = []
real_route = moe_router.route
def counted(x, *args, **kwargs):
    routed.append(x.shape[0])
    return real_route(x, *args, **kwargs)
plain = GemmaForCausalLM.from_hf(sys.argv[1], "cpu", torch.float32)
fused = GemmaForCausalLM.from_hf(sys.argv[1], "cpu", torch.float32)
fuse_projections(fused)
fuse_elementwise(fused)
for layer in fused.layers:  # a cap of 4 rows: the 11-token prompt takes the eager router, decode rows the kernels
    layer.fused_ops = dataclasses.replace(layer.fused_ops, route=counted, route_max_rows=4)
prompt = torch.tensor([[(5 * i + 7) % 300 + 4 for i in range(11)]])
out = {}
with torch.inference_mode():
    for name, model in (("plain", plain), ("fused", fused)):
        ctx, ids, logits = ContiguousKVContext(model.config), prompt, []
        for _ in range(4):
            step = model(ids, ctx.next_positions(1, ids.shape[1]), ctx, logits_to_keep=1)[:, -1]
            logits.append(step)
            ids = step.argmax(-1)[:, None]
        out[name] = torch.stack(logits)
print(json.dumps({"diff": float((out["plain"] - out["fused"]).abs().max()), "routed_rows": sorted(set(routed)),
                  "routed": len(routed), "layers": len(fused.layers)}))
"""


def test_a_moe_model_routes_small_batches_in_the_kernels_and_larger_ones_eagerly(tiny_checkpoint):
    """Rows up to ``route_max_rows`` take the two router kernels, more take the eager router (here a cap of 4: the
    11-token prompt eagerly, the decode steps' single rows in the kernels); both give the eager model's logits."""
    from triton_interpret import run_interpreted

    result = run_interpreted(_MODEL_SCRIPT, str(tiny_checkpoint("gemma4_moe")))
    assert result["routed_rows"] == [1] and result["routed"] == 3 * result["layers"], result
    assert result["diff"] < 1e-4, result
