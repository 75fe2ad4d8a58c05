"""Does a request's greedy text depend on its batch? The default model on the CPU, hf backend, per QUANTIZATION.

Eight prompts, 48 greedy tokens each (EOS ignored): each prompt alone (``max_batch_size=1``), then all eight
submitted together (``max_batch_size=8``, prompts prefilled in ``--prefill-chunk-tokens`` chunks; 0 = the
default chunking). Reports, per quantization, how many rows differ from their solo run and at which token the
first difference is. Float32 rounding differs batched and alone by ~1e-7; int8 activations turn a rounding that
crosses a quantization boundary into a whole step (docs/reliability.md).

Usage (repo root):  .venv/bin/python benchmarks/batch_invariance.py [--prefill-chunk-tokens 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village",
           "The three laws of thermodynamics", "import numpy as np\n\n", "My favourite recipe for bread",
           "The history of the Roman empire", "In quantum mechanics, the wave function")
TOKENS = 48


def compare(path: str, quantization: str | None, chunk: int) -> dict[str, Any]:
    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    common = {"backend": "hf", "device": "cpu", "dtype": "float32", "quantization": quantization}
    with LLM(path, max_batch_size=1, **common) as llm:
        solo = [llm.generate([prompt], params)[0].token_ids for prompt in PROMPTS]
    with LLM(path, max_batch_size=len(PROMPTS), **common, **({"prefill_chunk_tokens": chunk} if chunk else {})) as llm:
        batched = [out.token_ids for out in llm.generate(list(PROMPTS), params)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(solo, batched)]
    return {"rows_differing": sum(f is not None for f in first), "first_difference_at": first,
            "tokens": len(PROMPTS) * TOKENS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-chunk-tokens", type=int, default=0, help="0 = the default chunking")
    parser.add_argument("--quantizations", default="none,int8", help="comma-separated; none = unset")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from gemmaserve.models.default_model import ensure_default_model

    path = str(ensure_default_model())
    result: dict[str, Any] = {"prefill_chunk_tokens": args.prefill_chunk_tokens}
    for name in args.quantizations.split(","):
        result[name] = compare(path, None if name == "none" else name, args.prefill_chunk_tokens)
        print(name, result[name], flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
