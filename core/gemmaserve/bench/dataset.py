"""The random dataset of ``gemmaserve bench``: token-id prompts of set lengths, and arrival times."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["BenchRequest", "random_requests", "arrival_gaps"]

_LOWEST_TOKEN = 100
"""Random prompts avoid the lowest ids, where tokenizers keep special tokens."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


def random_requests(
    num: int, input_len: int, output_len: int, vocab_size: int, *, range_ratio: float = 0.0, seed: int = 0,
    token_ids: Sequence[int] | None = None,
) -> list[BenchRequest]:
    """``num`` requests with uniformly random token ids in ``[min(100, vocab/2), vocab)``, or drawn uniformly from
    ``token_ids`` when given (ids known to be in the server's vocabulary; ``vocab_size`` is then unused). With
    ``range_ratio`` r, lengths are drawn uniformly from ``[len*(1-r), len*(1+r)]`` (at least 1)."""
    if num < 1 or input_len < 1 or output_len < 1 or vocab_size < 2 or not 0.0 <= range_ratio < 1.0:
        raise ValueError("need num, input_len, output_len >= 1, vocab_size >= 2 and 0 <= range_ratio < 1")
    if token_ids is not None and not token_ids:
        raise ValueError("token_ids, when given, must not be empty")
    rng = random.Random(seed)
    low = min(_LOWEST_TOKEN, vocab_size // 2)
    pool = list(token_ids) if token_ids is not None else None

    def token() -> int:
        return rng.choice(pool) if pool is not None else rng.randrange(low, vocab_size)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        prompt_len, out_len = length(input_len), length(output_len)
        requests.append(BenchRequest([token() for _ in range(prompt_len)], out_len))
    return requests


def arrival_gaps(request_rate: float, burstiness: float = 1.0, *, seed: int = 0) -> Iterator[float]:
    """Seconds to wait before each next request: 0 for an infinite rate, else gamma-distributed
    gaps with mean ``1/request_rate`` (``burstiness`` 1 = a Poisson process; lower = burstier)."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = random.Random(seed + 1)
    while True:
        if request_rate == float("inf"):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
