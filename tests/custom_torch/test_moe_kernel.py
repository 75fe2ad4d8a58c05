"""The fused MoE experts (kernels/moe.py) against the eager ``MoEExperts.forward`` loop, on CPU under
``TRITON_INTERPRET=1`` (fp32, plus one fp16 case; tiny shapes): fixed edge cases, a hypothesis sweep, a check
that the fused call never syncs the host, and a tiny MoE model's greedy tokens with the fused experts switched
on. The Triton runs go through subprocesses: the interpreter flag must be set before the kernels are
decorated. The bf16 and CUDA-graph checks are the GPU tests at the end (``-m gpu``, skipped without CUDA).

Tolerance: in fp32 the fused path rounds nothing the eager loop does not (each model-dtype rounding point is
kept, and fp32 rounding is the identity), but its matmuls sum the H (or I) products in another order than
``F.linear``; with values of order 1 and H, I <= 64 that moves results by a few fp32 ulps, so outputs are
compared at atol = rtol = 1e-5 (not bitwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hopper_compile import compile_for_hopper, require_hopper_compiler

pytest.importorskip("triton")

_PRELUDE = r"""
import json, sys, torch
from gemmaserve_custom_torch.kernels.moe import fused_experts, group_by_expert, max_blocks
from gemmaserve_custom_torch.models.layers import MoEExperts
torch.set_num_threads(1)

def make_case(seed, num_experts, top_k, hidden, width, tokens, dtype=torch.float32, one_expert=None, pool=None):
    gen = torch.Generator().manual_seed(seed)
    experts = MoEExperts(hidden, num_experts, width, dtype=dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(0.3 * torch.randn(experts.gate_up_proj.shape, generator=gen))
        experts.down_proj.copy_(0.3 * torch.randn(experts.down_proj.shape, generator=gen))
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    choices = pool if pool is not None else num_experts  # pool < E: experts >= pool are hit by no token
    rows = [torch.randperm(choices, generator=gen)[:top_k] for _ in range(tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    if one_expert is not None:
        ids[:, 0] = one_expert
        ids[:, 1:] = (one_expert + 1 + torch.arange(top_k - 1)) % num_experts
    weights = torch.rand(tokens, top_k, generator=gen)
    return experts, x, weights, ids

def compare(experts, x, weights, ids, **blocks):
    with torch.inference_mode():
        want = experts(x, weights, ids)  # fused is None: the eager loop
        got = fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, **blocks)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype)
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return float((got.float() - want.float()).abs().max()), float(want.float().abs().max())
"""

_CASES_SCRIPT = _PRELUDE + r"""
small = dict(block_m=16, block_n=16, block_k=16)
cases = {  # (E, k, H, I, T), extra
    "decode T=1": ((8, 2, 32, 24, 1), {}),
    "T=19 not a multiple of the block": ((4, 2, 24, 20, 19), {}),
    "H, I not multiples of the block": ((5, 3, 40, 36, 7), {}),
    "experts hit by no token": ((16, 2, 16, 16, 5), {"pool": 6}),
    "all tokens on one expert, k=1": ((6, 1, 16, 24, 21), {"one_expert": 3}),
    "all tokens' first slot on one expert, k=3": ((7, 3, 24, 16, 9), {"one_expert": 6}),
    "k = E": ((3, 3, 16, 16, 6), {}),
}
errors = {}
for name, ((E, k, H, I, T), extra) in cases.items():
    experts, x, weights, ids = make_case(len(errors), E, k, H, I, T, **extra)
    errors[name] = compare(experts, x, weights, ids, **small)
# block_m 32 (more padding per group) and the default block sizes of the GPU launch
experts, x, weights, ids = make_case(100, 5, 2, 48, 40, 23)
errors["block_m=32"] = compare(experts, x, weights, ids, block_m=32, block_n=16, block_k=16)
errors["default blocks"] = compare(experts, x, weights, ids)
# the torch-ops grouping (taken above SMALL_GROUPING_PAIRS pairs) through the whole call
errors["torch grouping"] = compare(experts, x, weights, ids, block_m=16, block_n=16, block_k=16, grouping="torch")
experts, x, weights, ids = make_case(101, 16, 2, 16, 16, 5, pool=6)
errors["torch grouping, unhit experts"] = compare(experts, x, weights, ids, block_m=16, block_n=16, block_k=16,
                                                  grouping="torch")
# fp16: every model-dtype rounding point of the eager loop is mirrored; differences come from summation order
experts, x, weights, ids = make_case(200, 6, 2, 32, 24, 9, dtype=torch.float16)
errors["fp16"] = compare(experts, x, weights, ids, **small)
# T = 0: an empty batch gives an empty output
experts, x, weights, ids = make_case(300, 4, 2, 16, 16, 0)
assert fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj).shape == (0, 16)
# the grouping itself, both methods: every pair exactly once, groups by expert in pair order, padding counted
def check_groups(ids, num_experts, block_m):
    layouts = []
    for method in ("kernel", "torch"):
        groups = group_by_expert(ids, num_experts, block_m, method)
        num_blocks = max_blocks(ids.numel(), num_experts, block_m)
        assert groups.expert_of_block.shape == groups.rows_of_block.shape == (num_blocks,)
        rows = groups.pair_of_row.view(num_blocks, block_m)
        flat, seen, layout = ids.reshape(-1), [], []
        for block, (expert, count) in enumerate(zip(groups.expert_of_block.tolist(),
                                                    groups.rows_of_block.tolist())):
            pairs = rows[block, :count].tolist()
            assert 0 <= count <= block_m and (expert == num_experts) == (count == 0), (method, expert, count)
            assert all(int(flat[p]) == expert for p in pairs) and pairs == sorted(pairs), (method, pairs)
            seen += pairs
            layout.append((expert, pairs))
        assert sorted(seen) == list(range(ids.numel())), (method, seen)
        layouts.append(layout)
    assert layouts[0] == layouts[1], layouts
    return layouts[0]

layout = check_groups(torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]]), num_experts=5, block_m=16)
assert [e for e, _ in layout] == [0, 1, 2, 3, 5], layout  # expert 4: no pair; (10 + 5 * 15) // 16 = 5 blocks
gen = torch.Generator().manual_seed(5)
check_groups(torch.randint(0, 3, (40, 1), generator=gen), num_experts=7, block_m=16)  # groups over 2 blocks
check_groups(torch.stack([torch.randperm(130, generator=gen)[:4] for _ in range(300)]), 130, 16)  # chunks > 1
print(json.dumps(errors))
"""

_HYPOTHESIS_SCRIPT = _PRELUDE + r"""
from hypothesis import given, settings, strategies as st

checked = []

@settings(max_examples=10, deadline=None, database=None, derandomize=True)
@given(num_experts=st.integers(1, 9), top_k=st.integers(1, 4), hidden=st.integers(1, 40), width=st.integers(1, 40),
       tokens=st.integers(1, 20), seed=st.integers(0, 2**16), block_m=st.sampled_from([16, 32]),
       grouping=st.sampled_from(["kernel", "torch"]))
def check(num_experts, top_k, hidden, width, tokens, seed, block_m, grouping):
    top_k = min(top_k, num_experts)
    experts, x, weights, ids = make_case(seed, num_experts, top_k, hidden, width, tokens)
    compare(experts, x, weights, ids, block_m=block_m, block_n=16, block_k=16, grouping=grouping)
    checked.append((num_experts, top_k, hidden, width, tokens))

check()
print(json.dumps({"examples": len(checked)}))
"""

_NO_SYNC_SCRIPT = _PRELUDE + r"""
def refuse(name):
    def raise_(*args, **kwargs):
        raise AssertionError(f"host sync: {name}")
    return raise_

getitem = torch.Tensor.__getitem__

def getitem_no_mask(self, index):
    parts = index if isinstance(index, tuple) else (index,)
    if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
        raise AssertionError("host sync: boolean-mask indexing")
    return getitem(self, index)

experts, x, weights, ids = make_case(7, 6, 2, 24, 20, 11)
with torch.inference_mode():
    want = experts(x, weights, ids)
    patched = {"tolist": torch.Tensor.tolist, "item": torch.Tensor.item, "nonzero": torch.Tensor.nonzero,
               "__bool__": torch.Tensor.__bool__, "__getitem__": torch.Tensor.__getitem__}
    functions = {"nonzero": torch.nonzero, "bincount": torch.bincount, "unique": torch.unique,
                 "masked_select": torch.masked_select, "where": torch.where}
    for name in ("tolist", "item", "nonzero", "__bool__"):
        setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
    torch.Tensor.__getitem__ = getitem_no_mask
    for name in functions:
        setattr(torch, name, refuse(f"torch.{name}"))
    try:
        got = fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, block_m=16, block_n=16,
                           block_k=16)
        got_torch_grouping = fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, block_m=16,
                                           block_n=16, block_k=16, grouping="torch")
        experts.fused = fused_experts  # and through the module: TRITON_INTERPRET=1 routes CPU inputs to it
        via_module = experts(x, weights, ids)
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)
        for name, original in functions.items():
            setattr(torch, name, original)
    # the eager loop does sync: the patch is live (this must raise)
    torch.Tensor.tolist = refuse("Tensor.tolist")
    experts.fused = None
    try:
        experts(x, weights, ids)
        raise SystemExit("the patched tolist did not fire on the eager loop")
    except AssertionError:
        pass
    finally:
        torch.Tensor.tolist = patched["tolist"]
torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
assert torch.equal(got_torch_grouping, got)
torch.testing.assert_close(via_module, want, atol=1e-5, rtol=1e-5)  # default (64) blocks through the module

# every aten op the call dispatches: none reads a device value on the host (item / bool / int all dispatch
# _local_scalar_dense; nonzero, masked_select, unique and bincount size their output from data)
from torch.utils._python_dispatch import TorchDispatchMode

class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

syncing = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "_unique", "_unique2", "unique_dim",
           "unique_consecutive", "bincount", "item", "is_nonzero", "equal"}
with torch.no_grad():  # (under inference_mode some composite ops are logged before they decompose)
    with OpLog() as fused_ops:
        for grouping in ("kernel", "torch"):
            fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, grouping=grouping)
    with OpLog() as eager_ops:
        experts(x, weights, ids)
assert not fused_ops.ops & syncing, fused_ops.ops & syncing
assert "_local_scalar_dense" in eager_ops.ops and "nonzero" in eager_ops.ops, eager_ops.ops  # the log sees syncs
print(json.dumps({"ok": True}))
"""

_MODEL_SCRIPT = r"""
import json, sys, torch
from gemmaserve_custom_torch.kernels.moe import fused_experts
from gemmaserve_custom_torch.models import ContiguousKVContext, GemmaForCausalLM
from gemmaserve_custom_torch.models.fusion import fuse_elementwise, fuse_moe, fuse_projections, moe_is_fused
path, everything = sys.argv[1], sys.argv[2] == "all"
torch.set_num_threads(1)
plain = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
fused = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
calls = []

def counted(*args, **kwargs):
    calls.append(args[0].shape[0])
    return fused_experts(*args, **kwargs)

assert not moe_is_fused(fused)
switched = fuse_moe(fused)
assert moe_is_fused(fused) and fuse_moe(fused) == switched  # idempotent
for layer in fused.layers:
    layer.experts.fused = counted
if everything:
    fuse_projections(fused)
    fuse_elementwise(fused)
out = {"switched": switched, "layers": len(fused.layers)}
prompt = torch.tensor([[(7 * i + 3) % 500 + 4 for i in range(11)]])
with torch.inference_mode():
    logits = []
    for model in (plain, fused):
        ctx = ContiguousKVContext(model.config)
        logits.append(model(prompt, ctx.next_positions(1, prompt.shape[1]), ctx))
    out["max_logit_diff"] = float((logits[0] - logits[1]).abs().max())
    tokens = []
    for model in (plain, fused):
        ctx, ids, got = ContiguousKVContext(model.config), prompt, []
        for _ in range(5):
            step = model(ids, ctx.next_positions(1, ids.shape[1]), ctx, logits_to_keep=1)
            got.append(int(step[0, -1].argmax()))
            ids = torch.tensor([[got[-1]]])
        tokens.append(got)
out["tokens"] = tokens
out["fused_calls"] = len(calls)
print(json.dumps(out))
"""

# A MoE shape of this test's own: 5 experts, top 3, expert width 20 (not a multiple of the kernel's blocks)
MOE_SHAPE = {"num_experts": 5, "top_k_experts": 3, "moe_intermediate_size": 20, "num_hidden_layers": 3,
             "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}


def _interpret(script: str, *args: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_checkpoints import build_tiny_gemma4_moe

    return build_tiny_gemma4_moe(tmp_path_factory.mktemp("moe_kernel") / "ckpt", **MOE_SHAPE)


def test_fused_experts_match_the_eager_loop_on_edge_cases():
    errors = _interpret(_CASES_SCRIPT)  # fp32 cases assert_close(1e-5) inside the script
    assert len(errors) == 12, errors
    error, scale = errors["fp16"]
    assert error <= 2e-3 * max(scale, 1.0), errors  # fp16: about one rounding step of outputs of size ~scale


def test_fused_experts_match_the_eager_loop_over_random_shapes():
    assert _interpret(_HYPOTHESIS_SCRIPT) == {"examples": 10}


def test_fused_experts_never_sync_the_host():
    """tolist / item / nonzero / bool() / boolean masks / bincount (syncs on CUDA) / unique / where all raise
    while the fused experts run (the eager loop, patched the same way, does raise), and no aten op the call
    dispatches reads device data on the host (the eager loop's do: _local_scalar_dense, nonzero)."""
    assert _interpret(_NO_SYNC_SCRIPT) == {"ok": True}


@pytest.mark.parametrize("module", ["moe.py", "moe_router.py"])
def test_fused_module_names_no_host_syncing_op(module):
    """Structural backstop for the patched run: the MoE kernels' code (not its docstrings) never names an op
    that reads device values on the host."""
    import ast

    import gemmaserve_custom_torch.kernels as kernels_pkg

    source = (Path(kernels_pkg.__file__).parent / module).read_text()
    names = {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}
    names |= {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
    forbidden = {"tolist", "item", "nonzero", "bincount", "unique", "masked_select", "cpu", "numpy", "synchronize"}
    assert not names & forbidden, names & forbidden


@pytest.mark.parametrize("fusion", ["moe", "all"])
def test_a_moe_model_on_the_fused_experts_keeps_its_tokens(tiny_moe_dir, hf_reference, fusion):
    """Greedy tokens (prefill + 4 decode steps) of a tiny MoE model with the fused experts are those of the
    eager experts and of transformers' fp32 eager ``generate``, with only the experts fused and with every
    fusion (projections, elementwise chains) on as well."""
    result = _interpret(_MODEL_SCRIPT, str(tiny_moe_dir), fusion)
    assert result["switched"] == result["layers"] == 3
    assert result["fused_calls"] == 3 * 6  # every MoE layer, every forward (1 prefill + 5 decode)
    assert result["max_logit_diff"] < 1e-4, result
    assert result["tokens"][0] == result["tokens"][1], result
    prompt = torch.tensor([[(7 * i + 3) % 500 + 4 for i in range(11)]])
    with torch.inference_mode():
        out = hf_reference(tiny_moe_dir, torch.float32).generate(prompt, max_new_tokens=5, do_sample=False)
    assert out[0, prompt.shape[1]:].tolist() == result["tokens"][1]


def _hopper_kernels(dtype: str, blocks: tuple[int, int, int], fp8: bool = False,
                    fp8_dot: bool = False, pdl: bool = False) -> list[tuple[object, dict, dict]]:
    """(kernel, signature, constexprs) of the four launches of ``fused_experts`` (26B-A4B's E 128, k 8) for one
    dtype / block shape; ``fp8``: float8_e4m3fn expert weights with fp32 scales and FP8 input rows (widened to
    ``dtype`` for the dots, or FP8 tensor-core dots with ``fp8_dot``); ``pdl``: the programmatic-dependent forms."""
    from gemmaserve_custom_torch.kernels import moe

    block_m, block_n, block_k = blocks
    tiles = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
             "PRECISION": "ieee" if dtype == "fp32" else "tf32", "FP8": fp8, "FP8_DOT": fp8_dot}
    weight = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"} if fp8 else {"w_ptr": f"*{dtype}", "w_scale_ptr": f"*{dtype}"}
    rows = "*fp8e4nv" if fp8 else f"*{dtype}"
    row_scale = "*fp32" if fp8 else f"*{dtype}"
    gemm = {"pair_of_row_ptr": "*i32", "expert_of_block_ptr": "*i32", "rows_of_block_ptr": "*i32"}
    sizes = {"hidden": "i32", "width": "i32", "num_experts": "i32"}
    constexpr = dict.fromkeys(tiles, "constexpr")
    launches = [
        (moe._group_pairs_kernel,
         {"ids_ptr": "*i64", **gemm, "num_pairs": "i32", "num_blocks": "i32", "num_experts": "i32",
          "BLOCK_M": "constexpr", "EXPERTS": "constexpr", "CHUNK": "constexpr"},
         {"BLOCK_M": block_m, "EXPERTS": 128, "CHUNK": 32}),
        (moe._gate_up_geglu_kernel,
         {"x_ptr": rows, "x_scale_ptr": row_scale, **weight, **gemm, "out_ptr": f"*{dtype}", "stride_x": "i32", **sizes,
          "TOP_K": "constexpr", **constexpr}, {"TOP_K": 8, **tiles}),
        (moe._down_weighted_kernel,
         {"h_ptr": rows, "h_scale_ptr": row_scale, **weight, **gemm, "routing_ptr": "*fp32", "out_ptr": f"*{dtype}",
          **sizes, **constexpr}, tiles),
        (moe._sum_slots_kernel,
         {"pair_out_ptr": f"*{dtype}", "ids_ptr": "*i64", "out_ptr": f"*{dtype}", "hidden": "i32",
          "num_experts": "i32", "TOP_K": "constexpr", "SLOTS": "constexpr", "BLOCK": "constexpr"},
         {"TOP_K": 8, "SLOTS": 8, "BLOCK": 1024}),
    ]
    return [(kernel, {**signature, "PDL": "constexpr"}, {**constexprs, "PDL": pdl})
            for kernel, signature, constexprs in launches]


def test_the_kernels_compile_for_hopper_without_a_gpu():
    """The real compiler path (Triton -> PTX -> cubin for sm_90, with Triton's bundled ptxas), which the
    interpreter never takes: bf16 at the decode (16) and prefill (32, 64) row blocks, fp32 with IEEE dots, and
    the FP8-weight variants (float8_e4m3fn weights, per-row FP8 inputs), and the programmatic-dependent forms
    (``fused_experts(..., pdl=True)``), which alone wait for the previous grid and release the next one.
    Pointers and sizes carry the 16-divisibility the launcher sees at 26B-A4B shapes (H 2816, I 704); with it
    the bf16 GEMMs' K loops are software-pipelined (cp.async) into tensor-core dots."""
    require_hopper_compiler()
    builds = [("bf16", (16, 32, 64), False, False), ("bf16", (32, 64, 64), False, False),
              ("bf16", (64, 64, 64), False, False), ("fp32", (16, 32, 64), False, False),
              ("bf16", (16, 32, 64), True, False), ("fp32", (16, 32, 64), True, False),
              ("bf16", (16, 32, 64), True, True), ("bf16", (64, 64, 64), True, True), ("fp32", (16, 32, 64), True, True)]
    builds = [(*build, False) for build in builds] + [("bf16", (16, 32, 64), False, False, True),
                                                      ("bf16", (16, 32, 64), True, True, True)]
    for dtype, blocks, fp8, fp8_dot, pdl in builds:
        for kernel, signature, constexprs in _hopper_kernels(dtype, blocks, fp8, fp8_dot, pdl):
            ptx = compile_for_hopper(kernel, signature, constexprs, unaligned=("num_experts",))["ptx"]
            assert ("griddepcontrol.wait" in ptx) == pdl, (kernel, pdl)
            assert ("griddepcontrol.launch_dependents" in ptx) == pdl, (kernel, pdl)
            if (dtype == "bf16" or fp8_dot) and "BLOCK_K" in constexprs:
                assert "mma" in ptx and "cp.async" in ptx, (kernel, blocks)  # pipelined tensor-core dots
                if fp8_dot:
                    assert "e4m3" in ptx, (kernel, blocks)  # FP8 operands in the MMA


def test_the_eager_loop_stays_the_cpu_default_outside_the_interpreter():
    """A fused callable set on MoEExperts is ignored for CPU inputs unless TRITON_INTERPRET=1 (then tests only)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs under the Triton interpreter")
    from gemmaserve_custom_torch.models.layers import MoEExperts

    experts = MoEExperts(8, 3, 4)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)

    def never(*args: object) -> torch.Tensor:
        raise AssertionError("fused experts used on a CPU input")

    x, weights, ids = torch.randn(2, 8), torch.rand(2, 2), torch.tensor([[0, 2], [1, 0]])
    want = experts(x, weights, ids)
    experts.fused = never
    assert torch.equal(experts(x, weights, ids), want)


def test_bench_moe_smoke():
    """benchmarks/kernels/bench_moe.py end to end in its tiny CPU mode (the interpreter)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_moe.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--tiny", "--json"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rows and all(row["max_abs_diff"] < 1e-4 and row["fused_ms"] > 0 and row["eager_ms"] > 0 for row in rows)


# ---- GPU (bf16, CUDA graphs) ------------------------------------------------------------------------------------

_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_case(num_experts: int, top_k: int, hidden: int, width: int, tokens: int, seed: int):
    from gemmaserve_custom_torch.models.layers import MoEExperts

    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts = MoEExperts(hidden, num_experts, width, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(0.05 * torch.randn(experts.gate_up_proj.shape, device="cuda", generator=gen))
        experts.down_proj.copy_(0.05 * torch.randn(experts.down_proj.shape, device="cuda", generator=gen))
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, num_experts, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return experts, x, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_gpu_bf16_fused_experts_within_bf16_noise(tokens):
    """bf16 fused vs the bf16 eager loop, both refereed by fp32 eager on the same (bf16-valued) weights: the
    fused error vs fp32 stays within twice the eager loop's own (plus a few bf16 ulps of the output)."""
    from gemmaserve_custom_torch.kernels.moe import fused_experts
    from gemmaserve_custom_torch.models.layers import MoEExperts

    experts, x, weights, ids = _gpu_case(32, 4, 512, 192, tokens, seed=tokens)
    reference = MoEExperts(512, 32, 192, device="cuda", dtype=torch.float32)
    reference.load_state_dict({k: v.float() for k, v in experts.state_dict().items()})
    with torch.inference_mode():
        eager = experts(x, weights, ids).float()
        truth = reference(x.float(), weights, ids)
        fused = fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj).float()
    eager_err = float((eager - truth).abs().max())
    fused_err = float((fused - truth).abs().max())
    ulp = float(truth.abs().max()) * 2**-7
    assert fused_err <= 2 * eager_err + 2 * ulp, (fused_err, eager_err, ulp)


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_pdl_fused_experts_equal_the_plain_launches(fp8):
    """``fused_experts(..., pdl=True)`` (each launch a programmatic dependent, Hopper) gives the plain launches'
    output bit for bit, inside a CUDA graph too: every kernel waits for its predecessor before reading."""
    from gemmaserve_custom_torch.kernels.moe import fused_experts
    from gemmaserve_custom_torch.kernels.pdl import pdl_supported
    from gemmaserve_custom_torch.models.quantization import quantize_weight

    if not pdl_supported("cuda"):
        pytest.skip("programmatic dependent launch needs compute capability 9")
    experts, x, weights, ids = _gpu_case(32, 4, 512, 192, 7, seed=3)
    gate_up, down, scales = experts.gate_up_proj, experts.down_proj, (None, None)
    if fp8:
        (gate_up, gate_up_scale), (down, down_scale) = quantize_weight(gate_up), quantize_weight(down)
        scales = (gate_up_scale, down_scale)

    def run(pdl: bool) -> torch.Tensor:
        return fused_experts(x, weights, ids, gate_up, down, *scales, pdl=pdl)

    with torch.inference_mode():
        plain = run(False)
        assert torch.equal(run(True), plain)
        run(True)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run(True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, plain)


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("grouping", ["kernel", "torch"])
def test_gpu_fused_experts_run_without_sync_and_replay_in_a_cuda_graph(grouping):
    """No host sync (sync debug mode "error"), and a CUDA graph captured on one routing replays others exactly,
    with either grouping of the pairs."""
    from gemmaserve_custom_torch.kernels.moe import fused_experts

    experts, x, weights, ids = _gpu_case(16, 4, 256, 128, 24, seed=1)

    def run() -> torch.Tensor:
        return fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, grouping=grouping)

    with torch.inference_mode():
        run()  # compile the kernels outside the checks
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for seed in (2, 3, 4):
            _, new_x, new_weights, new_ids = _gpu_case(16, 4, 256, 128, 24, seed=seed)
            if seed == 4:
                new_ids = torch.zeros_like(new_ids) + torch.arange(4, device="cuda")  # every token on experts 0-3
            x.copy_(new_x)
            weights.copy_(new_weights)
            ids.copy_(new_ids)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, run())
            torch.testing.assert_close(out.float(), experts(x, weights, ids).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@_GPU
def test_gpu_moe_backend_fuses_the_experts_and_captures_graphs(tiny_moe_dir):
    """On CUDA with the default settings a MoE model gets the fused experts and the decode / tick graphs."""
    from gemmaserve.settings import CoreSettings
    from gemmaserve_custom_torch.backend import CustomTorchBackend
    from gemmaserve_custom_torch.models import GemmaForCausalLM
    from gemmaserve_custom_torch.models.fusion import moe_is_fused
    from gemmaserve_custom_torch.settings import load_custom_settings
    from gemmaserve_custom_torch.tokenizer import HFTokenizer

    model = GemmaForCausalLM.from_hf(tiny_moe_dir, "cuda", torch.bfloat16)
    core = CoreSettings(model=str(tiny_moe_dir), device="cuda", dtype="bfloat16", kv_block_size=16,
                        max_batch_size=4, max_active_kv_tokens=10_000, prefill_chunk_tokens=16)
    backend = CustomTorchBackend(model, HFTokenizer.from_pretrained(tiny_moe_dir), core,
                                 load_custom_settings(kv_blocks=64))
    assert moe_is_fused(backend.model) and backend.mixed.graphs is not None
    from fixtures_backend import assert_no_leaks, run_scheduler

    requests = [([(5 * i + 9) % 500 + 4 for i in range(length)], tick, 12) for tick, length in enumerate((3, 29, 9))]
    finished = run_scheduler(backend, requests, max_batch_size=4)
    assert all(len(request.output_token_ids) == 12 for request in finished.values())
    captured = backend.mixed.graphs.capture_seconds
    assert any(key[1] for key in captured) and not all(key[1] for key in captured)  # decode-only and mixed
    assert_no_leaks(backend)
