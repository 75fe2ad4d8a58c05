"""FP8 vs model-dtype agreement of the custom_torch backend on one checkpoint: greedy first-divergence statistics over
N prompts and the logit error at each prompt's last position (issue 18 item 3).

Runs the engine twice over the same prompts: QUANTIZATION unset (weights in DTYPE), then QUANTIZATION=fp8 (or the
FP8 checkpoint given by --fp8-model, e.g. a compressed-tensors one). Prompts are built from fixed templates, so runs
are comparable. Prints a summary and writes all figures as JSON.

Usage (repo root):  python benchmarks/fp8_agreement.py --model /path/to/checkpoint --json fp8.json
                    [--device cuda --dtype bfloat16] [--prompts 64] [--max-tokens 32] [--fp8-model /path/to/fp8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

_SUBJECTS = ["France", "the Moon", "photosynthesis", "a prime number", "the Roman Empire", "Python lists", "jazz",
             "the water cycle", "gravity", "a haiku", "the stock market", "volcanoes", "chess openings", "DNA",
             "the Pacific Ocean", "machine learning"]
_TEMPLATES = ["Tell me one fact about {}.", "Explain {} to a child in two sentences.", "Write a short poem about {}.",
              "What is the most surprising thing about {}?"]


def prompts(count: int) -> list[str]:
    """``count`` distinct prompts (templates × subjects, cycled with a numbered suffix past 64)."""
    base = [t.format(s) for t in _TEMPLATES for s in _SUBJECTS]
    return [base[i % len(base)] + ("" if i < len(base) else f" ({i // len(base) + 1})") for i in range(count)]


def run(model: str, quantization: str | None, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Greedy token ids per prompt and the last-position logits [N, V] (fp32, CPU) of one engine."""
    from gemmaserve import LLM, SamplingParams

    started = time.perf_counter()
    with LLM(model, backend=args.backend, device=args.device, dtype=args.dtype, quantization=quantization) as llm:
        backend = llm.engine.backend
        ids = [backend.tokenizer.encode(text) for text in texts]
        logits = []
        for prompt in ids:  # the prompt's last-position logits, through the backend's own prefill
            state = backend.prefill_lookup(prompt)
            backend.prefill_chunk(state, len(prompt))
            logits.append(state.last_logits.reshape(-1).float().cpu())
            backend.free_row_kv(state.kv)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        tokens = [list(out.token_ids) for out in llm.generate(ids, params)]
    return {"tokens": tokens, "logits": torch.stack(logits), "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the model-dtype checkpoint folder")
    p.add_argument("--fp8-model", default=None, help="an FP8 (compressed-tensors) checkpoint of the same model; "
                   "unset: --model with QUANTIZATION=fp8")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=Path("fp8_agreement.json"))
    args = p.parse_args(argv)
    texts = prompts(args.prompts)
    reference = run(args.model, None, texts, args)
    fp8 = run(args.fp8_model or args.model, None if args.fp8_model else "fp8", texts, args)
    diverge = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
               for x, y in zip(reference["tokens"], fp8["tokens"])]
    delta = fp8["logits"] - reference["logits"]
    top_match = (fp8["logits"].argmax(-1) == reference["logits"].argmax(-1)).float().mean().item()
    result = {
        "model": args.model, "fp8_model": args.fp8_model, "device": args.device, "dtype": args.dtype,
        "prompts": args.prompts, "max_tokens": args.max_tokens,
        "identical_sequences": sum(d == args.max_tokens for d in diverge),
        "first_divergence": {"min": min(diverge), "median": statistics.median(diverge),
                             "mean": round(statistics.mean(diverge), 2), "per_prompt": diverge},
        "first_token_agreement": round(top_match, 4),
        "logit_error": {"max_abs": round(delta.abs().max().item(), 4),
                        "mean_abs": round(delta.abs().mean().item(), 5),
                        "relative_l2": round((delta.norm() / reference["logits"].norm()).item(), 5),
                        "max_abs_reference_logit": round(reference["logits"].abs().max().item(), 3)},
        "seconds": {"reference": round(reference["seconds"], 1), "fp8": round(fp8["seconds"], 1)},
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "first_divergence"} |
                     {"first_divergence": {k: v for k, v in result["first_divergence"].items() if k != "per_prompt"}},
                     indent=2))
    return result


if __name__ == "__main__":
    main()
