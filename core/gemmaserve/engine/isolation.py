"""Decode-failure isolation: when a batched decode step raises, retry that step for each row alone.

The scheduler first drops the failed batch, freeing its KV (the backend contract does not promise
that a batch is still usable after a failed step). Then, for each row, :func:`retry_row_alone`:

1. rebuilds the KV of the row's context minus the token being fed (prompt + output[:-1]) by
   prefill (the prefix cache covers the prompt);
2. runs ``decode_step_batched`` on a one-row batch feeding that token and samples the next token:
   the same step, through the same decode path, without the other rows;
3. rebuilds the KV once more, now with the fed token, so the row can join a fresh batch (the
   contract has no way to move a row from one batch to another).

A row whose solo step raises fails with its own error; the others carry on with the token their
solo step produced, exactly as if the batched step had succeeded. That costs about two prefills of
each row's context, so a request is retried at most :data:`MAX_ROW_RETRIES` times in its life: a
decode that keeps failing for every row ends in errors instead of endless recomputation.

Everything here runs on the engine thread with ``backend.lock`` held.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gemmaserve.engine.request import sampled_token

if TYPE_CHECKING:
    from gemmaserve.backend import InferenceBackend, RowKV
    from gemmaserve.engine.request import Request

__all__ = ["MAX_ROW_RETRIES", "RowRetry", "prefill_kv", "retry_row_alone"]

logger = logging.getLogger(__name__)

MAX_ROW_RETRIES = 3
"""How many failed batched decode steps one request survives (each costs it a solo retry)."""


@dataclass(frozen=True, slots=True)
class RowRetry:
    """A successful solo retry: the step's token (and logprob), and the row's rebuilt KV covering
    prompt + every output token but the new one. The caller owns ``kv`` (splice it or free it)."""

    token_id: int
    logprob: float | None
    kv: RowKV
    top: list[tuple[int, float]] = field(default_factory=list)


def prefill_kv(backend: InferenceBackend, token_ids: Sequence[int], chunk_tokens: int) -> RowKV:
    """A fresh row KV holding ``token_ids`` (prefilled in chunks of ``chunk_tokens``, hitting the prefix cache;
    no ``prefill_store`` is called, though a backend whose cache indexes blocks as they are computed, such as
    custom_torch's, caches them anyway). On an exception nothing stays allocated."""
    state = backend.prefill_lookup(token_ids)
    try:
        while not state.is_complete:
            before = state.num_computed
            backend.prefill_chunk(state, min(chunk_tokens, state.num_remaining))
            if state.num_computed <= before and not state.is_complete:
                raise RuntimeError(f"prefill made no progress at {before}/{len(token_ids)} tokens")
    except BaseException:
        backend.free_row_kv(state.kv)
        raise
    return state.kv


def retry_row_alone(backend: InferenceBackend, request: Request, chunk_tokens: int) -> RowRetry:
    """Redo ``request``'s failed decode step without the other rows (steps 1-3 of the module
    docstring). Raises whatever the backend raises; on an exception nothing stays allocated."""
    assert request.output_token_ids, "a decoding row has fed at least its first token"
    context = (*request.prompt_token_ids, *request.output_token_ids)
    kv = prefill_kv(backend, context[:-1], chunk_tokens)
    try:
        batch = backend.splice_into_batched(None, kv, backend.kv_length(kv))
    except BaseException:
        backend.free_row_kv(kv)
        raise
    try:
        logits = backend.decode_step_batched(batch, [context[-1]])
        sampled = backend.sample(logits, [request.row_sampling()], want_logprobs=request.want_logprobs)
    finally:
        _free_solo_batch(backend, batch, request.request_id)
    if len(sampled.token_ids) != 1:
        raise RuntimeError(f"backend sampled {len(sampled.token_ids)} tokens for one row")
    token, logprob, top = sampled_token(sampled, 0)
    return RowRetry(token, logprob, prefill_kv(backend, context, chunk_tokens), top)


def _free_solo_batch(backend: InferenceBackend, batch: object, request_id: str) -> None:
    try:
        backend.remove_row_from_cache(batch, 0)
    except Exception:  # the retry's own outcome matters more; a leak here is the backend's bug
        logger.exception("could not free the one-row retry batch of request %s", request_id)
