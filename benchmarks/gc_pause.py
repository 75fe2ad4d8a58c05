"""How long a full cyclic garbage collection takes with the prefix cache's bookkeeping alive (CPU, no model).

Fills a ``RadixPrefixIndex`` with ``--blocks`` cached blocks (random 16-token blocks, 64 per prompt, each valued by a
custom_torch ``CachedBlock`` as the custom backend's cache holds them), after freezing everything alive before (as
``engine.freeze_startup_objects`` does), then times ``gc.collect(2)``. docs/reliability.md ("Known gaps") quotes it::

    PYTHONPATH=core:plugins/custom_torch python benchmarks/gc_pause.py --blocks 27000,340000
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from gemmaserve.kv.radix import RadixPrefixIndex
from gemmaserve_custom_torch.kv.prefix_cache import CachedBlock

BLOCK_TOKENS = 16
BLOCKS_PER_PROMPT = 64


def full_collection_ms(blocks: int, repeats: int = 3, seed: int = 0) -> dict[str, object]:
    """Median and all ``repeats`` times of ``gc.collect(2)`` with ``blocks`` cached blocks indexed."""
    gc.collect()
    gc.freeze()
    try:
        index = RadixPrefixIndex(BLOCK_TOKENS)
        rng = random.Random(seed)
        for start in range(0, blocks, BLOCKS_PER_PROMPT):
            count = min(BLOCKS_PER_PROMPT, blocks - start)
            tokens = [rng.randrange(262_144) for _ in range(BLOCK_TOKENS * count)]
            index.insert(tokens, [CachedBlock(full=start + i, sliding=start + i) for i in range(count)])
        tracked = len(gc.get_objects())
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            gc.collect(2)
            times.append((time.perf_counter() - began) * 1e3)
        del index
        return {"blocks": blocks, "tracked_objects": tracked, "gen2_ms_median": round(statistics.median(times), 1),
                "gen2_ms": [round(t, 1) for t in times]}
    finally:
        gc.unfreeze()
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="27000,340000", help="comma-separated cached block counts")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [full_collection_ms(int(n), args.repeats) for n in args.blocks.split(",") if n]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
