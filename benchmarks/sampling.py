"""What sampling costs on the device: ``sample_on_device`` (core/gemmaserve/torch_sampling.py) over
``[rows, vocab]`` logits per sampling configuration on its torch path (``<config>_ms``), the fused Triton pass
(core/gemmaserve/triton_sampling.py) beside it for the configurations it takes (``<config>_fused_ms``, on CUDA
with triton; ``<config>_fused_same``: whether its tokens are the torch path's; ``temperature_kernel_ms``: its
two kernels alone, inputs already on the device; with ``--blocks``, also at those block sizes), the
full-vocabulary sort it does in each key dtype, and (with ``--tokenizer``) structured output's per-step masks
for a batch, one by one and in one parallel call.

Usage (repo root):  PYTHONPATH=core:tests python benchmarks/sampling.py [--device cuda] [--blocks 256,1024]
                    [--tokenizer DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gemmaserve.sampling_params import RowSampling
from gemmaserve.torch_sampling import sample_on_device

from timing import median_ms


def _timed(fn: Any, device: str, repeat: int) -> float:
    """Median ms of ``fn()`` over ``repeat`` calls (CUDA events on CUDA), after two warm-up calls."""
    return round(median_ms(fn, device, repeat), 4)


def sampling_costs(device: str, vocab: int, sizes: list[int], repeat: int,
                   blocks: Sequence[int] = (), fused: bool | None = None) -> list[dict[str, Any]]:
    """One dict per row count (printed as it comes); ``fused``: time the fused pass too (default: on CUDA with
    triton)."""
    rng = random.Random(0)
    mask = bytes(rng.getrandbits(8) & rng.getrandbits(8) & rng.getrandbits(8) for _ in range(vocab // 8))
    configs = {
        "greedy": dict(temperature=0.0, top_p=1.0, top_k=0),
        "temperature": dict(temperature=1.0, top_p=1.0, top_k=0),
        "top_p": dict(temperature=0.8, top_p=0.95, top_k=0),
        "top_k": dict(temperature=0.8, top_p=1.0, top_k=50),
        "constrained": dict(temperature=1.0, top_p=1.0, top_k=0, allowed=mask),
        "greedy_constrained": dict(temperature=0.0, top_p=1.0, top_k=0, allowed=mask),
    }
    if fused is None:
        fused = device == "cuda" and importlib.util.find_spec("triton") is not None
    out = []
    for rows in sizes:
        logits = (torch.randn(rows, vocab, device=device) * 3).to(torch.bfloat16)
        row: dict[str, Any] = {"rows": rows, "vocab": vocab}
        for name, kw in configs.items():
            samplings = [RowSampling(seed=i, step=3, **kw) for i in range(rows)]
            row[f"{name}_ms"] = _timed(lambda: sample_on_device(logits, samplings, fused=False), device, repeat)
            if fused and name in ("temperature", "constrained", "greedy_constrained"):
                row[f"{name}_fused_ms"] = _timed(lambda: sample_on_device(logits, samplings), device, repeat)
                row[f"{name}_fused_same"] = bool(torch.equal(sample_on_device(logits, samplings)[0],
                                                             sample_on_device(logits, samplings, fused=False)[0]))
        if fused:  # the two kernels alone, inputs already on the device (the rest is the host's row handling)
            from gemmaserve.triton_sampling import gumbel_argmax
            temps = torch.ones(rows, dtype=torch.float64, device=device)
            seeds = torch.arange(rows, dtype=torch.int64, device=device)
            row["temperature_kernel_ms"] = _timed(lambda: gumbel_argmax(logits, temps, seeds), device, repeat)
            for block in blocks:
                row[f"temperature_kernel_ms_block{block}"] = _timed(
                    lambda: gumbel_argmax(logits, temps, seeds, block=block), device, repeat)
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            keys = logits.to(dtype)
            row[f"sort_{str(dtype).split('.')[-1]}_ms"] = _timed(
                lambda: torch.sort(keys, dim=-1, descending=True, stable=True), device, repeat)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def random_allowed(mask: bytes, rng: random.Random) -> int:
    """A token the mask allows, picked at random (a random non-zero byte, then a random set bit in it: the
    regex scan runs at C speed, where unpacking 262,144 bits per row in Python would dominate the walk)."""
    offsets = [m.start() for m in re.finditer(rb"[^\x00]", mask)]
    at = rng.choice(offsets)
    bits = [b for b in range(8) if mask[at] >> b & 1]
    return 8 * at + rng.choice(bits)


def mask_costs(tokenizer_dir: Path, rows: int, steps: int) -> dict[str, Any]:
    """Per-step mask time of ``rows`` JSON constraints walked at random: one by one vs allowed_many."""
    from transformers import AutoTokenizer

    from gemmaserve.hf_tokenizer import HFTokenizerAdapter
    from gemmaserve.structured import GrammarCompiler, StructuredOutputs
    from gemmaserve.structured.grammar import allowed_many

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = max(len(hf), int(getattr(hf, "vocab_size", 0) or 0))
    compiler = GrammarCompiler(HFTokenizerAdapter(hf), vocab, [hf.eos_token_id])
    schema = {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
        "items": {"type": "array", "minItems": 4 * steps, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}
    constraints = [compiler.compile(StructuredOutputs(json=schema)) for _ in range(rows)]
    rng = random.Random(1)
    serial, together = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        masks = [c.allowed() for c in constraints]
        t1 = time.perf_counter()
        allowed_many(constraints)
        together.append(time.perf_counter() - t1)
        serial.append(t1 - t0)
        for constraint, mask in zip(constraints, masks):
            constraint.accept(random_allowed(mask, rng))
    med = (lambda xs: round(statistics.median(xs) * 1e3, 3))
    return {"rows": rows, "steps": steps, "serial_ms_p50": med(serial), "allowed_many_ms_p50": med(together),
            "allowed_many_ms_max": round(max(together) * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--sizes", default="1,64,256")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--blocks", default="", help="also time the fused kernels at these block sizes (ids per "
                        "program; default: triton_sampling.choose_block)")
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device,
                               "sampling": sampling_costs(args.device, args.vocab,
                                                          [int(x) for x in args.sizes.split(",")], args.repeat,
                                                          [int(x) for x in args.blocks.split(",") if x])}
    if args.tokenizer is not None:
        results["masks"] = mask_costs(args.tokenizer, 64, 32)
        print(json.dumps(results["masks"]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
