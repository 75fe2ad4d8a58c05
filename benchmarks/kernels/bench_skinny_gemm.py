"""The few-row matmul kernels (kernels/skinny_gemm.py) against cuBLAS (``F.linear``) at Gemma 4 decode shapes.

For every projection shape of E2B, E4B and 31B and every row count M (decode batch), times one call of each
by CUDA-graph replay of a chain of calls that cycles through enough weight copies to defeat the L2 (as
successive layers would), and reports microseconds per call and the achieved weight bandwidth next to the
device-to-device copy bandwidth measured in the same run. GeGLU compares the fused kernel against
``F.linear`` over [gate; up] + the eager GeGLU chain; the LM head compares ``lm_head_argmax`` against
``F.linear`` + softcap + ``argmax``. Also sweeps ``split_k`` for one shape per kind with ``--sweep``.
``--fp8`` times the FP8 projections instead (every linear and gate/up shape as one product, as
``QUANTIZATION=fp8`` runs them): ``skinny_fp8_linear`` (Triton row quantization + ``skinny_linear_fp8``, decode's
path for at most ``CUSTOM_BACKEND_SKINNY_MAX_ROWS`` rows), the same launched as programmatic dependents on Hopper
(``skinny_pdl_us``, as the decode chain runs it), Triton quantization + ``torch._scaled_mm``
(``models.quantization.linear``, the path for more rows), the torch row quantization + ``_scaled_mm``, the Triton
row quantization alone in one pass and in two, and bf16 ``F.linear``; the bandwidth column counts one byte per FP8
weight.

Usage (repo root):
    PYTHONPATH=plugins/custom_torch python benchmarks/kernels/bench_skinny_gemm.py --json skinny.json
    ... --models e2b --rows 1,8,32 --sweep
    ... --models 31b --fp8 --rows 1,8,32,64
    TRITON_INTERPRET=1 PYTHONPATH=plugins/custom_torch python benchmarks/kernels/bench_skinny_gemm.py --tiny
        (CPU smoke run: tiny shapes, correctness only, no timing)
"""

from __future__ import annotations

import argparse
import json
import os
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

from gemmaserve_custom_torch.kernels.fp8_rows import quantize_rows  # noqa: E402
from gemmaserve_custom_torch.kernels.pdl import pdl_supported  # noqa: E402
from gemmaserve_custom_torch.kernels.skinny_gemm import (  # noqa: E402
    choose_split_k,
    lm_head_argmax,
    skinny_fp8_linear,
    skinny_geglu,
    skinny_linear,
    skinny_linear_fp8,
)
from gemmaserve_custom_torch.models.quantization import quantize_per_token, quantize_weight  # noqa: E402

# (kind, N, K) per decode projection; gate_up N is the fused [gate; up] width. From gemma4-spec.md §4.
SHAPES: dict[str, list[tuple[str, str, int, int]]] = {
    "e2b": [("qkv sliding", "linear", 2560, 1536), ("qkv full", "linear", 5120, 1536),
            ("o sliding", "linear", 1536, 2048), ("o full", "linear", 1536, 4096),
            ("gate_up 6144", "geglu", 12288, 1536), ("gate_up 12288", "geglu", 24576, 1536),
            ("down 6144", "linear", 1536, 6144), ("down 12288", "linear", 1536, 12288),
            ("ple gate", "linear", 256, 1536), ("lm head", "argmax", 262144, 1536)],
    "e4b": [("qkv sliding", "linear", 3072, 2560), ("o sliding", "linear", 2560, 2048),
            ("gate_up", "geglu", 20480, 2560), ("down", "linear", 2560, 10240), ("lm head", "argmax", 262144, 2560)],
    # 31B sliding: q 32 x 256 + k, v 16 x 256 each; full (K=V, no v_proj): q 32 x 512 + k 4 global heads x 512
    "31b": [("qkv sliding", "linear", 16384, 5376), ("qkv full", "linear", 18432, 5376),
            ("o sliding", "linear", 5376, 8192), ("o full", "linear", 5376, 16384),
            ("gate_up", "geglu", 43008, 5376), ("down", "linear", 5376, 21504), ("lm head", "argmax", 262144, 5376)],
}
TINY = [("tiny linear", "linear", 48, 96), ("tiny geglu", "geglu", 64, 64), ("tiny head", "argmax", 300, 64)]
L2_BYTES = 512 << 20  # weight copies per chain: at least this many bytes


def _ours_and_theirs(kind: str, cap: float | None) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    if kind == "linear":
        return skinny_linear, F.linear
    if kind == "geglu":
        def eager_geglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(x, w).chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        return skinny_geglu, eager_geglu

    def eager_argmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, w)
        return (torch.tanh(logits / cap) * cap if cap else logits).argmax(dim=-1)
    return (lambda x, w: lm_head_argmax(x, w, cap)), eager_argmax


def _graph_time_us(fn: Callable[[torch.Tensor, torch.Tensor], Any], x: torch.Tensor, weights: list[torch.Tensor],
                   repeats: int = 20) -> float:
    """Microseconds per call: one CUDA graph calls ``fn`` once per weight copy; its replay timed ``repeats`` times."""
    return graph_replay_ms(lambda: [fn(x, w) for w in weights], repeats) * 1e3 / len(weights)


def bench(models: list[str], rows: list[int], sweep: bool, cap: float) -> dict[str, Any]:
    dtype = torch.bfloat16
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_tbps": copy_bandwidth("cuda") / 1e12,
                              "rows": []}
    for model in models:
        for name, kind, n, k in SHAPES[model]:
            bytes_per_copy = n * k * 2
            copies = max(2, -(-L2_BYTES // bytes_per_copy))
            weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
            ours, theirs = _ours_and_theirs(kind, cap)
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                t_ours = _graph_time_us(ours, x, weights)
                t_theirs = _graph_time_us(theirs, x, weights)
                row = {"model": model, "shape": name, "kind": kind, "m": m, "n": n, "k": k,
                       "split_k": choose_split_k(m, n, k) if kind != "argmax" else 1,
                       "ours_us": round(t_ours, 2), "cublas_us": round(t_theirs, 2),
                       "ours_tbps": round(bytes_per_copy / (t_ours * 1e-6) / 1e12, 3),
                       "cublas_tbps": round(bytes_per_copy / (t_theirs * 1e-6) / 1e12, 3)}
                if sweep and kind != "argmax" and m in (1, 32):
                    fn = skinny_linear if kind == "linear" else skinny_geglu
                    row["split_sweep_us"] = {s: round(_graph_time_us(lambda a, b, s=s: fn(a, b, split_k=s), x,
                                                                     weights), 2) for s in (1, 2, 4, 8, 16)}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            del weights
            torch.cuda.empty_cache()
    return result


def _fp8_paths() -> dict[str, Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
    def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype):
        return torch._scaled_mm(xq, w[0].t(), scale_a=xs, scale_b=w[1].view(1, -1), out_dtype=dtype)

    paths = {
        "skinny_us": lambda x, w: skinny_fp8_linear(x, w[0], w[1]),
        "torch_quant_scaled_mm_us": lambda x, w: scaled_mm(*quantize_per_token(x), w, x.dtype),
        "triton_quant_scaled_mm_us": lambda x, w: scaled_mm(*quantize_rows(x), w, x.dtype),
        "quantize_one_pass_us": lambda x, w: quantize_rows(x),
        "quantize_two_pass_us": lambda x, w: quantize_rows(x, block=1024),
    }
    if pdl_supported("cuda"):  # the decode chain's form: both kernels programmatic dependents
        paths["skinny_pdl_us"] = lambda x, w: skinny_fp8_linear(x, w[0], w[1], pdl=True)
    return paths


def bench_fp8(models: list[str], rows: list[int]) -> dict[str, Any]:
    """µs per FP8 product (weights quantized per output row) by path, and bf16 ``F.linear`` beside them."""
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_tbps": copy_bandwidth("cuda") / 1e12,
                              "fp8": True, "rows": []}
    for model in models:
        for name, kind, n, k in SHAPES[model]:
            if kind == "argmax":
                continue  # the LM head stays in the model dtype under QUANTIZATION=fp8
            copies = max(2, -(-L2_BYTES // (n * k)))
            bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            weights = [quantize_weight(w) for w in bf16]
            bf16 = bf16[: max(2, -(-L2_BYTES // (n * k * 2)))]
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row: dict[str, Any] = {"model": model, "shape": name, "m": m, "n": n, "k": k,
                                       "split_k": choose_split_k(m, n, k)}
                for label, fn in _fp8_paths().items():
                    row[label] = round(_graph_time_us(fn, x, weights), 2)
                row["bf16_linear_us"] = round(_graph_time_us(F.linear, x, bf16), 2)
                row["skinny_tbps"] = round(n * k / (row["skinny_us"] * 1e-6) / 1e12, 3)
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            del weights, bf16
            torch.cuda.empty_cache()
    return result


def smoke() -> dict[str, Any]:
    """Tiny shapes on the CPU (TRITON_INTERPRET=1): each kernel's output against its eager counterpart."""
    torch.manual_seed(0)
    out: dict[str, Any] = {"rows": []}
    for name, kind, n, k in TINY:
        w = torch.randn(n, k) * 0.2
        ours, theirs = _ours_and_theirs(kind, 30.0)
        for m in (1, 5, 20):
            x = torch.randn(m, k)
            got, want = ours(x, w), theirs(x, w)
            error = float((got.float() - want.float()).abs().max()) if kind != "argmax" else float((got != want).sum())
            out["rows"].append({"shape": name, "m": m, "error": error})
    for m in (1, 5, 20):  # the FP8 path against the fp32 product of the same FP8 values and scales
        x, (wq, ws) = torch.randn(m, 96), quantize_weight(torch.randn(48, 96) * 0.2)
        xq, xs = quantize_rows(x)
        want = (xq.double() @ wq.double().T) * xs.double() * ws.double()[None]
        got = skinny_linear_fp8(xq, xs, wq, ws, torch.float32)
        out["rows"].append({"shape": "tiny fp8 linear", "m": m, "error": float((got.double() - want).abs().max())})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="e2b,e4b,31b", help="comma-separated: e2b, e4b, 31b")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="decode batch sizes M")
    parser.add_argument("--softcap", type=float, default=None, help="final logit softcap of the LM head rows "
                        "(default 30)")
    parser.add_argument("--sweep", action="store_true", help="also time split_k 1..16 at M = 1 and 32")
    parser.add_argument("--fp8", action="store_true", help="time the FP8 projection paths instead")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (needs TRITON_INTERPRET=1)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.fp8 and (args.sweep or args.tiny or args.softcap is not None):
        parser.error("--fp8 times the FP8 projections only: --sweep, --softcap and --tiny apply to the bf16 kernels")
    if args.tiny and args.softcap is not None:
        parser.error("--tiny checks the kernels at a fixed softcap of 30; --softcap applies to the timed run")
    softcap = 30.0 if args.softcap is None else args.softcap
    if args.tiny:
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--tiny on a machine without CUDA needs TRITON_INTERPRET=1 (set before triton is imported)")
        result = smoke()
    else:
        if not torch.cuda.is_available():
            parser.error("timing needs a CUDA device; use --tiny (with TRITON_INTERPRET=1) for the CPU smoke run")
        models = [m for m in args.models.split(",") if m]
        unknown = sorted(set(models) - set(SHAPES))
        if unknown:
            parser.error(f"unknown --models {unknown}; choose from {sorted(SHAPES)}")
        sizes = [int(r) for r in args.rows.split(",") if r]
        result = bench_fp8(models, sizes) if args.fp8 else bench(models, sizes, args.sweep, softcap)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text if args.tiny else f"copy bandwidth {result['copy_tbps']:.2f} TB/s")


if __name__ == "__main__":
    main()
