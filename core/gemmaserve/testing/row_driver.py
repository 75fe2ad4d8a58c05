"""Drive a backend's batch primitives directly (no scheduler): solo runs and interleaved row plans.

Helpers shared by :mod:`gemmaserve.testing.backend_contract` and backend authors' own tests. Every
function takes ``backend.lock`` itself and leaves no KV behind, even when an assertion fails.
All decoding is greedy, so results are comparable across batch layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gemmaserve.sampling_params import RowSampling

if TYPE_CHECKING:
    from gemmaserve.backend import InferenceBackend

__all__ = ["RowPlan", "greedy_rows", "solo_greedy", "drive_rows"]


@dataclass(frozen=True, slots=True)
class RowPlan:
    """A row that joins the batch at tick ``join_tick`` and leaves after ``num_tokens`` tokens."""

    prompt: tuple[int, ...]
    join_tick: int
    num_tokens: int


def greedy_rows(backend: InferenceBackend, logits: Any, steps: Sequence[int]) -> list[int]:
    """Greedy token of each logits row (``steps[i]`` is row i's step; greedy ignores it)."""
    return backend.sample(logits, [RowSampling(0.0, 1.0, 0, 0, step) for step in steps]).token_ids


def solo_greedy(backend: InferenceBackend, prompt: Sequence[int], num_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` alone in a batch of one: prefill, splice, decode, remove."""
    return drive_rows(backend, [RowPlan(tuple(prompt), 0, num_tokens)])[0]


def drive_rows(backend: InferenceBackend, plan: Sequence[RowPlan], *, stack_initial: bool = False) -> list[list[int]]:
    """Run every planned row through one batch; returns each row's greedy tokens.

    Each tick: rows due to join are prefilled (``backend.prefill``, so the prefix cache is used),
    sampled once and spliced (or, with ``stack_initial``, the tick-0 rows are joined with one
    ``stack_caches_left_padded``); rows that have all their tokens are removed, wherever they sit;
    then one ``decode_step_batched`` runs over the rest. Asserts every row's ``kv_length`` each tick.
    """
    tokens: list[list[int]] = [[] for _ in plan]
    pending = sorted(range(len(plan)), key=lambda i: (plan[i].join_tick, i))
    live: list[int] = []  # plan indices, in batch row order
    loose: dict[int, Any] = {}  # prefilled row KVs not in the batch yet
    batch: Any = None
    tick = 0
    with backend.lock:
        try:
            while pending or live:
                for i in [i for i in pending if plan[i].join_tick <= tick]:
                    pending.remove(i)
                    result = backend.prefill(plan[i].prompt)
                    loose[i] = result.kv
                    assert backend.kv_length(result.kv) == len(plan[i].prompt), "kv_length after prefill"
                    tokens[i].append(greedy_rows(backend, result.last_logits, [0])[0])
                if stack_initial and batch is None and loose:
                    batch = backend.stack_caches_left_padded(list(loose.values()))
                    live.extend(loose)
                    loose.clear()
                for i in list(loose):
                    batch = backend.splice_into_batched(batch, loose[i], backend.kv_length(loose[i]))
                    live.append(i)
                    del loose[i]
                for position in reversed(range(len(live))):
                    if len(tokens[live[position]]) >= plan[live[position]].num_tokens:
                        backend.remove_row_from_cache(batch, position)
                        live.pop(position)
                for position, i in enumerate(live):
                    expected = len(plan[i].prompt) + len(tokens[i]) - 1
                    actual = backend.kv_length(batch, position)
                    assert actual == expected, f"tick {tick}: row {position} kv_length {actual} != {expected}"
                if live:
                    logits = backend.decode_step_batched(batch, [tokens[i][-1] for i in live])
                    sampled = greedy_rows(backend, logits, [len(tokens[i]) for i in live])
                    assert len(sampled) == len(live), "one sampled token per row"
                    for i, token in zip(live, sampled):
                        tokens[i].append(token)
                tick += 1
        finally:
            for kv in loose.values():
                backend.free_row_kv(kv)
            for position in reversed(range(len(live))):
                backend.remove_row_from_cache(batch, position)
    return tokens
