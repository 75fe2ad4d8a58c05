"""The decoding rows: the scheduler's request list kept aligned with the backend's batched KV.

Row ``i`` of the backend batch belongs to ``rows[i]``; ``remove`` behaves like ``list.pop`` on both.
A :class:`RowBatch` owns the batch (and so every spliced row KV); it is used by the scheduler's
driving thread only, with ``backend.lock`` held.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from gemmaserve.engine.request import prepare_masks

if TYPE_CHECKING:
    from gemmaserve.backend import BatchKV, InferenceBackend, Logits, RowKV, SampledTokens
    from gemmaserve.engine.request import Request

__all__ = ["RowBatch"]

logger = logging.getLogger(__name__)


class RowBatch:
    """Requests in decode order plus the backend ``BatchKV`` holding their KV (None when empty)."""

    def __init__(self, backend: InferenceBackend) -> None:
        self.backend = backend
        self.rows: list[Request] = []
        self.batch: BatchKV | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def splice(self, request: Request, kv: RowKV) -> None:
        """Append ``request`` as the last row; takes ownership of ``kv``. If the backend raises, the
        row is not added and ``kv`` is still the caller's to free."""
        self.batch = self.backend.splice_into_batched(self.batch, kv, self.backend.kv_length(kv))
        self.rows.append(request)

    def remove(self, index: int) -> Request:
        """Drop row ``index`` from both lists and free its KV. If the backend raises, the row is gone
        from ``rows`` but the batch may be misaligned: the caller must ``drop_all``."""
        request = self.rows.pop(index)
        self.backend.remove_row_from_cache(self.batch, index)
        if not self.rows:
            self.batch = None
        return request

    def decode(self) -> SampledTokens:
        """One ``decode_step_batched`` over every row (each consumes its last token), then sample.
        Raises whatever the backend raises, or RuntimeError if it returns the wrong row count."""
        assert self.rows and self.batch is not None
        input_ids = [request.output_token_ids[-1] for request in self.rows]
        return self.sample(self.backend.decode_step_batched(self.batch, input_ids))

    def sample(self, logits: Logits) -> SampledTokens:
        """One token per row from ``logits`` [rows, vocab] (each row's own seed and step). Raises
        RuntimeError if the backend returns the wrong row count."""
        prepare_masks(self.rows, self.backend.mask_memory)
        sampling = [request.row_sampling() for request in self.rows]
        want_logprobs = any(request.want_logprobs for request in self.rows)
        sampled = self.backend.sample(logits, sampling, want_logprobs=want_logprobs)
        if len(sampled.token_ids) != len(self.rows):
            raise RuntimeError(f"backend sampled {len(sampled.token_ids)} tokens for {len(self.rows)} rows")
        if want_logprobs and (sampled.logprobs is None or len(sampled.logprobs) != len(self.rows)):
            raise RuntimeError("backend did not return one logprob per row although logprobs were requested")
        return sampled

    def drop_all(self) -> list[Request]:
        """Remove every row (last first) and forget the batch; returns the dropped requests. If the
        backend refuses a removal (e.g. after a failed decode), the rest of the batch is abandoned
        to the garbage collector so the scheduler can keep serving."""
        dropped, batch = list(self.rows), self.batch
        self.rows.clear()
        self.batch = None
        for index in reversed(range(len(dropped))):
            try:
                self.backend.remove_row_from_cache(batch, index)
            except Exception:
                logger.exception("could not free batch row %d; abandoning the rest of the batch", index)
                break
        return dropped

    def check_integrity(self, ahead: Collection[Request] = ()) -> None:
        """Row ``i``'s KV must hold its prompt plus every generated token but the last (not fed yet), plus one
        for a row in ``ahead`` (a launched step fed it a token that is not appended yet)."""
        if (self.batch is None) != (not self.rows):
            raise RuntimeError(f"batch is {'missing' if self.batch is None else 'present'} with {len(self.rows)} rows")
        launched = {id(request) for request in ahead}
        for index, request in enumerate(self.rows):
            expected = request.num_prompt_tokens + len(request.output_token_ids) - 1 + (id(request) in launched)
            actual = self.backend.kv_length(self.batch, index)
            if actual != expected:
                raise RuntimeError(f"row {index} ({request.request_id}) holds {actual} KV tokens, expected {expected}")
