"""One decode step's matmuls and residual chain, as the model runs them, with and without programmatic dependent
launch and with the projections' epilogue folds.

Issue 14 asks whether the few-row kernels (kernels/skinny_gemm.py) close the gap to the HBM roofline once each
kernel's weight loads overlap the previous kernel's tail (PDL, Hopper) and fewer kernels run per step. This times,
by CUDA-graph replay, every layer of a Gemma 4 shape in model order: qkv (from the carried input norm), o, the
post-attention residual chain (post-norm, residual add, the pre-MLP norm), gate/up + GeGLU, down, the post-MLP
residual chain, the per-layer-embedding gate (gelu times the layer's PLE input) and projection, and its residual
chain (post-norm, residual, layer scalar, the next layer's input norm). Four ways, for each row count M: cuBLAS
(``F.linear`` and the eager GeGLU; the residual chains and the gate on the Triton elementwise kernels), the Triton
few-row kernels launched normally, the same launched as programmatic dependents (the first weight tile of every
program is read before ``gdc_wait``), and that with the folds the model makes on its few-row path (the residual
chains run by the split-K reduce of o, down and the PLE projection, the gate in its projection's epilogue:
``skinny_linear_residual_norm``, ``skinny_linear_gelu_mul``). Each layer has its own weights, so nothing is served
from the L2 across layers. Reports ms per chain, kernels per chain, and the weight bandwidth against the copy
bandwidth measured in the same run, and whether the Triton forms' outputs are identical: the products are the same
sums in the same order (identical under the interpreter, tests/custom_torch/test_small_batch.py), while a folded
residual norm's sum of squares may round differently in the last bit on the GPU (Triton's reduction tree follows
each kernel's layout).

RoPE and attention are not in it (the q columns of qkv stand in for the attention output), so the figure is what
these changes can take off that part of the step, not a step time.

Usage (repo root, Hopper GPU):
    PYTHONPATH=plugins/custom_torch python benchmarks/kernels/bench_pdl.py --rows 1,8,32 --json pdl.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    import gemmaserve_custom_torch  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "custom_torch"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing helpers
from timing import copy_bandwidth, graph_replay_ms  # noqa: E402

from gemmaserve_custom_torch.kernels.fused_ops import gelu_mul, residual_norm  # noqa: E402
from gemmaserve_custom_torch.kernels.pdl import pdl_supported  # noqa: E402
from gemmaserve_custom_torch.kernels.skinny_gemm import (  # noqa: E402
    skinny_geglu,
    skinny_linear,
    skinny_linear_gelu_mul,
    skinny_linear_residual_norm,
)

#: (hidden, q heads x head dim sliding / full, kv width sliding / full, MLP width narrow / wide, layers,
#: first wide layer, full-attention period, per-layer-embedding width, first KV-shared layer) of the chained shapes.
#: KV-shared layers (E2B: the last 20, from layer 15) have no k/v projections: their qkv is q alone. A spec
#: without ``first_shared`` has none.
MODELS: dict[str, dict[str, int]] = {
    "e2b": {"hidden": 1536, "q_sliding": 2048, "q_full": 4096, "kv_sliding": 256, "kv_full": 512,
            "mlp": 6144, "mlp_wide": 12288, "layers": 35, "first_wide": 15, "period": 5, "ple": 256,
            "first_shared": 15},
}


def layer_weights(spec: dict[str, int], index: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights of layer ``index``, fused as the model holds them (qkv as one [q; k; v], q alone on a
    KV-shared layer; gate/up as one), and its norm weights and layer scalar."""
    full = (index + 1) % spec["period"] == 0
    q = spec["q_full" if full else "q_sliding"]
    shared = index >= spec.get("first_shared", spec["layers"])
    kv = 0 if shared else spec["kv_full" if full else "kv_sliding"]
    width = spec["mlp_wide" if index >= spec["first_wide"] else "mlp"]
    hidden = spec["hidden"]

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)

    return {"qkv": w(q + 2 * kv, hidden), "o": w(hidden, q), "gate_up": w(2 * width, hidden),
            "down": w(hidden, width), "ple_gate": w(spec["ple"], hidden), "ple_proj": w(hidden, spec["ple"]),
            "post_attn": norm(), "pre_ff": norm(), "post_ff": norm(), "ple_norm": norm(), "input_norm": norm(),
            "scale": torch.full((1,), 0.9, device=device, dtype=dtype)}


KINDS = ("cublas", "triton", "triton_pdl", "triton_pdl_fused")


def chain(layers: list[dict[str, torch.Tensor]], x: torch.Tensor, ple: torch.Tensor,
          kind: str) -> Callable[[], list[torch.Tensor]]:
    """Every layer's matmuls and residual chain in model order (see the module docstring), from hidden ``x`` [M, H]
    (taken as already normed for layer 0) and the PLE inputs ``ple`` [M, layers, P]; each product reads the
    previous one's output (the real data dependence), so PDL's waits are exercised. ``kind``: one of KINDS. Returns
    each layer's residual stream and the last carried norm."""
    pdl = kind.startswith("triton_pdl")
    fused = kind == "triton_pdl_fused"
    eps = 1e-6

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(a, w) if kind == "cublas" else skinny_linear(a, w, pdl=pdl)

    def geglu(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if kind == "cublas":
            gate, up = F.linear(a, w).chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        return skinny_geglu(a, w, pdl=pdl)

    def project_residual(a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor,
                         **chain_args: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fused:
            return skinny_linear_residual_norm(a, w, residual, norm, eps, "w", pdl=pdl, **chain_args)
        return residual_norm(residual, linear(a, w), norm, eps, "w", pdl=pdl, **chain_args)

    def run() -> list[torch.Tensor]:
        residual, normed = x, x
        outs = []
        for index, layer in enumerate(layers):
            qkv = linear(normed, layer["qkv"])
            attention = qkv[:, : layer["o"].shape[1]]  # the q columns stand in for the attention output
            residual, normed = project_residual(attention, layer["o"], residual, layer["post_attn"],
                                                next_weight=layer["pre_ff"], next_eps=eps)
            residual, _ = project_residual(geglu(normed, layer["gate_up"]), layer["down"], residual, layer["post_ff"])
            layer_ple = ple[:, index]
            gated = (skinny_linear_gelu_mul(residual, layer["ple_gate"], layer_ple, pdl=pdl) if fused
                     else gelu_mul(linear(residual, layer["ple_gate"]), layer_ple, pdl=pdl))
            residual, normed = project_residual(gated, layer["ple_proj"], residual, layer["ple_norm"],
                                                scale=layer["scale"], next_weight=layer["input_norm"], next_eps=eps)
            outs.append(residual)
        outs.append(normed)
        return outs

    return run


def kernels_per_call(fn: Callable[[], object]) -> int:
    """CUDA kernels one call of ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def run(model: str, rows: list[int], iters: int) -> dict[str, Any]:
    device, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    spec = MODELS[model]
    layers = [layer_weights(spec, i, device, dtype) for i in range(spec["layers"])]
    weight_bytes = sum(w.numel() * w.element_size() for layer in layers for w in layer.values() if w.dim() == 2)
    bandwidth = copy_bandwidth(device)
    results: dict[str, Any] = {"model": model, "device": torch.cuda.get_device_name(), "weight_gb": weight_bytes / 1e9,
                               "copy_tb_s": bandwidth / 1e12, "pdl_supported": pdl_supported(device), "rows": {}}
    kinds = [kind for kind in KINDS if pdl_supported(device) or not kind.startswith("triton_pdl")]
    for m in rows:
        x = torch.randn(m, spec["hidden"], device=device, dtype=dtype)
        ple = torch.randn(m, spec["layers"], spec["ple"], device=device, dtype=dtype)
        row: dict[str, Any] = {}
        outputs = {}
        for kind in kinds:
            fn = chain(layers, x, ple, kind)
            ms = graph_replay_ms(fn, iters)
            outputs[kind] = [t.clone() for t in fn()]
            row[kind] = {"ms": round(ms, 4), "kernels": kernels_per_call(fn),
                         "weight_tb_s": round(weight_bytes / (ms * 1e-3) / 1e12, 3),
                         "of_copy_bandwidth": round(weight_bytes / (ms * 1e-3) / bandwidth, 3)}
        for kind in kinds[2:]:  # the Triton forms compute the same sums in the same order
            row[f"{kind}_outputs_identical"] = all(torch.equal(a, b) for a, b in zip(outputs["triton"], outputs[kind]))
        last = outputs["cublas"][-1].float()
        row["triton_vs_cublas_max_rel"] = float((outputs["triton"][-1].float() - last).abs().max()
                                                / last.abs().max().clamp_min(1e-6))
        results["rows"][m] = row
        print(f"{model} M={m}: " + ", ".join(f"{k} {v['ms']:.3f} ms ({v['kernels']} kernels, "
                                             f"{v['of_copy_bandwidth']:.0%} of copy)" for k, v in row.items()
                                             if isinstance(v, dict))
              + "".join(f", {k}: {v}" for k, v in row.items() if k.endswith("_identical")), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="e2b")
    parser.add_argument("--rows", default="1,8,32", help="row counts M (decode batch sizes)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise SystemExit(f"--rows needs positive row counts; got {args.rows!r}")
    if args.iters < 1:
        raise SystemExit(f"--iters must be at least 1; got {args.iters}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl.py needs a CUDA device (programmatic dependent launch: compute capability 9+)")
    results = run(args.model, rows, args.iters)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
