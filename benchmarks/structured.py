"""What structured output costs (CPU): building the vocabulary, compiling a schema, the per-step mask, and the
decode slowdown of constrained rows.

- vocabulary: llguidance's tokenizer built from ``--tokenizer`` (default: the default model's, Gemma's 262,144
  tokens; converted on first use by ``make run``);
- compile: a 20-property object schema (integers, strings, enums), first time and from the cache;
- mask: per-step mask time over one constrained generation (tokens picked at random among the allowed ones);
- decode: ``--rows`` requests on the tiny random Gemma 4 (custom-cpu, fp32), each ``--tokens`` long, all
  unconstrained and then all constrained to a JSON schema that cannot end early; TPOT medians and their ratio.

Usage (repo root):  PYTHONPATH=core:plugins/custom_torch:tests .venv/bin/python benchmarks/structured.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = (lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 4))
    return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "max_ms": round(ordered[-1] * 1e3, 4), "steps": len(values)}


def vocabulary_compile_and_mask(tokenizer_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from gemmaserve.hf_tokenizer import HFTokenizerAdapter
    from gemmaserve.structured import GrammarCompiler, StructuredOutputs

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = max(len(hf), int(getattr(hf, "vocab_size", 0) or 0))
    compiler = GrammarCompiler(HFTokenizerAdapter(hf), vocab, [hf.eos_token_id])
    start = time.perf_counter()
    compiler.warm()
    out: dict[str, Any] = {"tokenizer": str(tokenizer_dir), "vocab_size": vocab,
                           "vocabulary_build_s": round(time.perf_counter() - start, 3)}
    kinds = [{"type": "integer", "minimum": 0, "maximum": 10000}, {"type": "string", "maxLength": 24},
             {"enum": ["red", "green", "blue", "cyan"]}]
    props = {f"field_{i}": kinds[i % 3] for i in range(20)}
    spec = StructuredOutputs(json={"type": "object", "properties": props, "required": sorted(props),
                                   "additionalProperties": False})
    start = time.perf_counter()
    constraint = compiler.compile(spec)
    out["compile_20_properties_ms"] = round((time.perf_counter() - start) * 1e3, 3)
    start = time.perf_counter()
    compiler.compile(spec)
    out["compile_cached_ms"] = round((time.perf_counter() - start) * 1e3, 3)
    rng = random.Random(0)
    times = []
    while not constraint.is_complete and len(times) < 2000:
        start = time.perf_counter()
        mask = constraint.allowed()
        times.append(time.perf_counter() - start)
        allowed = [t for t in range(min(vocab, len(mask) * 8)) if mask[t >> 3] >> (t & 7) & 1]
        constraint.accept(rng.choice(allowed))
    out["mask"] = _percentiles(times)
    return out


def decode_overhead(rows: int, tokens: int) -> dict[str, Any]:
    from tiny_checkpoints import build_tiny_gemma4

    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams

    schema = {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
        "items": {"type": "array", "minItems": 4 * tokens, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_gemma4(Path(tmp) / "ckpt")
        llm = LLM(str(path), backend="custom-cpu", device="cpu", dtype="float32", max_batch_size=rows)
        try:
            prompts = [[5 + i % 50, 6, 7] for i in range(rows)]
            result: dict[str, Any] = {"rows": rows, "tokens": tokens}
            for label, constrained in (("warm-up", False), ("unconstrained", False), ("constrained", True),
                                       ("unconstrained_again", False), ("constrained_again", True)):
                params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True,
                                        structured_outputs={"json": schema} if constrained else None)
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - start
                tpots = [(o.metrics.finish_time - o.metrics.first_token_time) * 1e3 / (len(o.token_ids) - 1)
                         for o in outs if len(o.token_ids) > 1]
                if label != "warm-up":
                    result[label] = {"tpot_median_ms": round(statistics.median(tpots), 3), "wall_s": round(wall, 3)}
        finally:
            llm.close()
    base = statistics.fmean([result["unconstrained"]["tpot_median_ms"], result["unconstrained_again"]["tpot_median_ms"]])
    masked = statistics.fmean([result["constrained"]["tpot_median_ms"], result["constrained_again"]["tpot_median_ms"]])
    result["tpot_overhead_pct"] = round(100 * (masked / base - 1), 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Hugging Face tokenizer folder")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    if args.tokenizer is None:
        from gemmaserve.models.default_model import ensure_default_model

        args.tokenizer = ensure_default_model()
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "vocabulary": vocabulary_compile_and_mask(args.tokenizer),
               "decode": decode_overhead(args.rows, args.tokens)}
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
