"""One decode step's matmuls, chained as the model runs them, with and without programmatic dependent launch.

Issue 14 asks whether the few-row kernels (kernels/skinny_gemm.py) close the gap to the HBM roofline once each
kernel's weight loads overlap the previous kernel's tail (PDL, Hopper). This times, by CUDA-graph replay, the
projections of every layer of a Gemma 4 shape in model order (the input RMSNorm, qkv, o, gate/up + GeGLU, down,
the per-layer embedding gate) for each row count M, four ways: cuBLAS (``F.linear`` and the eager GeGLU), the
Triton kernels launched normally, the Triton kernels launched as programmatic dependents (the first weight tile of
every program is read before ``gdc_wait``), and that with the input norm folded into the qkv kernel's prologue
(``skinny_linear(..., norm=)``). Each layer has its own weights, so nothing is served from the L2 across
layers. Reports ms per chain, kernels per chain, and the weight bandwidth against the copy bandwidth measured in
the same run; the two Triton forms must give identical outputs (same products, same order).

Only the matmuls and the input norms are timed: RoPE, attention and the residual chain are not in it, so the figure
is the ceiling of what PDL can take off that part of the step, not a step time.

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

from gemmaserve_custom_torch.kernels.pdl import pdl_supported  # noqa: E402
from gemmaserve_custom_torch.kernels.rms_norm import rms_norm  # noqa: E402
from gemmaserve_custom_torch.kernels.skinny_gemm import skinny_geglu, skinny_linear  # noqa: E402

#: (hidden, q heads x head dim sliding / full, kv width sliding / full, MLP width narrow / wide, layers,
#: first wide layer, full-attention period, per-layer-embedding width) of the chained shapes.
MODELS: dict[str, dict[str, int]] = {
    "e2b": {"hidden": 1536, "q_sliding": 2048, "q_full": 4096, "kv_sliding": 256, "kv_full": 512,
            "mlp": 6144, "mlp_wide": 12288, "layers": 35, "first_wide": 15, "period": 5, "ple": 256},
}


def layer_weights(spec: dict[str, int], index: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights of layer ``index``, fused as the model holds them (qkv as one [q; k; v], gate/up as one)."""
    full = (index + 1) % spec["period"] == 0
    q = spec["q_full" if full else "q_sliding"]
    kv = spec["kv_full" if full else "kv_sliding"]
    width = spec["mlp_wide" if index >= spec["first_wide"] else "mlp"]
    hidden = spec["hidden"]

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5

    return {"qkv": w(q + 2 * kv, hidden), "o": w(hidden, q), "gate_up": w(2 * width, hidden),
            "down": w(hidden, width), "ple_gate": w(spec["ple"], hidden),
            "input_norm": 1.0 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)}


def chain(layers: list[dict[str, torch.Tensor]], x: torch.Tensor, kind: str) -> Callable[[], list[torch.Tensor]]:
    """The step's matmuls in model order, each layer's input RMSNorm before its qkv (the Triton norm kernel, as
    the model runs it); each product reads a slice of the previous one as its input (the real data dependence), so
    PDL's wait is exercised. ``kind``: "cublas", "triton", "triton_pdl", or "triton_pdl_norm" (the norm folded
    into the qkv kernel's prologue: one launch fewer per layer)."""
    pdl = kind.startswith("triton_pdl")

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(a, w) if kind == "cublas" else skinny_linear(a, w, pdl=pdl)

    def geglu(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if kind == "cublas":
            gate, up = F.linear(a, w).chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        return skinny_geglu(a, w, pdl=pdl)

    def run() -> list[torch.Tensor]:
        h = x
        outs = []
        for layer in layers:
            if kind == "triton_pdl_norm":
                qkv = skinny_linear(h, layer["qkv"], pdl=True, norm=(layer["input_norm"], 1e-6, "w"))
            else:
                qkv = linear(rms_norm(h, layer["input_norm"], 1e-6, "w", pdl=pdl), layer["qkv"])
            h = linear(qkv[:, : layer["o"].shape[1]], layer["o"])  # the q columns stand in for attention
            mlp = geglu(h, layer["gate_up"])
            h = linear(mlp, layer["down"])
            outs.append(linear(h, layer["ple_gate"]))
        outs.append(h)
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
    kinds = ["cublas", "triton"] + (["triton_pdl", "triton_pdl_norm"] if pdl_supported(device) else [])
    for m in rows:
        x = torch.randn(m, spec["hidden"], device=device, dtype=dtype)
        row: dict[str, Any] = {}
        outputs = {}
        for kind in kinds:
            fn = chain(layers, x, kind)
            ms = graph_replay_ms(fn, iters)
            outputs[kind] = [t.clone() for t in fn()]
            row[kind] = {"ms": round(ms, 4), "kernels": kernels_per_call(fn),
                         "weight_tb_s": round(weight_bytes / (ms * 1e-3) / 1e12, 3),
                         "of_copy_bandwidth": round(weight_bytes / (ms * 1e-3) / bandwidth, 3)}
        if "triton_pdl" in outputs:
            row["pdl_outputs_identical"] = all(torch.equal(a, b) for a, b in zip(outputs["triton"],
                                                                                  outputs["triton_pdl"]))
            last = outputs["triton_pdl"][-1].float()
            row["norm_fold_vs_pdl_max_rel"] = float((outputs["triton_pdl_norm"][-1].float() - last).abs().max()
                                                    / last.abs().max().clamp_min(1e-6))
        last = outputs["cublas"][-1].float()
        row["triton_vs_cublas_max_rel"] = float((outputs["triton"][-1].float() - last).abs().max()
                                                / last.abs().max().clamp_min(1e-6))
        results["rows"][m] = row
        print(f"{model} M={m}: " + ", ".join(f"{k} {v['ms']:.3f} ms ({v['kernels']} kernels, "
                                             f"{v['of_copy_bandwidth']:.0%} of copy)" for k, v in row.items()
                                             if isinstance(v, dict))
              + (f", PDL outputs identical: {row.get('pdl_outputs_identical')}" if "triton_pdl" in row else ""),
              flush=True)
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
