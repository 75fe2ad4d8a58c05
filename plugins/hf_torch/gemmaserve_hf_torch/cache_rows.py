"""In-flight KV of the ``hf`` backend: one request's cache (:class:`RowCache`, the backend's RowKV)
and the left-padded batch of decoding rows (:class:`BatchCache`, its BatchKV).

Both wrap an HF ``DynamicCache`` laid out by a :class:`CacheLayout` (every storing layer a plain
``DynamicLayer`` holding all positions; KV-shared layers a ``DummyLayer``).

Batch layout: storing-layer tensors are ``[rows, kv_heads, length, head_dim]``. Row ``i``'s real
tokens fill positions ``[pads[i], length)``; the ``pads[i]`` positions before them are zeros that the
attention mask hides. The next token of row ``i`` has position id ``length - pads[i]`` (its real
length), so RoPE and the sliding window (applied by cache index, and real tokens are contiguous) see
exactly what a solo run sees. Invariant: with rows present, ``min(pads) == 0`` (no common padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from gemmaserve_hf_torch.kv_cache.hf_format import CacheLayout

__all__ = ["RowCache", "BatchCache"]


class RowCache:
    """One request's KV: ``cache`` (batch 1, no padding) holds ``num_tokens`` positions.

    Owned by its PrefillState until :meth:`BatchCache.append_row` consumes it (the batch copies the
    tensors and releases the row) or the owner frees it with :meth:`release`.
    """

    def __init__(self, layout: CacheLayout, cache: DynamicCache, num_tokens: int) -> None:
        self.layout = layout
        self.cache: DynamicCache | None = cache
        self.num_tokens = num_tokens

    @classmethod
    def empty(cls, layout: CacheLayout) -> RowCache:
        return cls(layout, layout.new_cache(), 0)

    @property
    def alive(self) -> bool:
        return self.cache is not None

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) of each storing layer, [1, H, num_tokens, D]; empty list before any token."""
        if self.cache is None:
            raise RuntimeError("this row KV was already freed or spliced into a batch")
        return [] if self.num_tokens == 0 else self.layout.layer_tensors(self.cache)

    def release(self) -> None:
        """Drop the tensors. Raises RuntimeError on a second release (double free)."""
        if self.cache is None:
            raise RuntimeError("row KV freed twice (or freed after it was spliced into a batch)")
        self.cache = None

    def check_integrity(self) -> None:
        if self.cache is not None and self.num_tokens > 0:
            self.layout.check_cache(self.cache, 1, self.num_tokens)


class BatchCache:
    """The decoding rows' KV, left-padded to a common ``length`` (see the module docstring).

    Mutated in place by :meth:`append_row`, :meth:`pop_row` and by the model forward (through
    ``cache``) followed by :meth:`advance`.
    """

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.cache: DynamicCache = layout.new_cache()
        self.pads: list[int] = []
        self.length = 0
        self._set_tensors(layout.empty_tensors(0, 0))

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.pads)

    def row_length(self, index: int) -> int:
        """Real (non-padded) tokens of row ``index``."""
        return self.length - self.pads[index]

    def decode_inputs(self, input_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Model inputs for one decode step: ``input_ids`` [rows, 1], a 2-D attention mask
        [rows, length + 1] (0 on padding) and ``position_ids`` [rows, 1] (each row's real length)."""
        device = self.layout.device
        pads = torch.tensor(self.pads, dtype=torch.long, device=device)
        ids = torch.tensor(list(input_ids), dtype=torch.long, device=device)[:, None]
        mask = (torch.arange(self.length + 1, device=device)[None, :] >= pads[:, None]).long()
        positions = (self.length - pads)[:, None]
        return ids, mask, positions

    # -- row operations -------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, layout: CacheLayout, rows: Sequence[RowCache]) -> BatchCache:
        """A batch of ``rows`` in order, left-padded to the longest. Consumes (releases) the rows."""
        batch = cls(layout)
        length = max((row.num_tokens for row in rows), default=0)
        if len(rows) == 1 and length > 0:
            tensors = rows[0].tensors()  # nothing to pad: adopt the row's tensors without a copy
        else:
            tensors = layout.empty_tensors(len(rows), length)
            for index, row in enumerate(rows):
                for (keys, values), (row_keys, row_values) in zip(tensors, row.tensors()):
                    keys[index, :, length - row.num_tokens :] = row_keys[0]
                    values[index, :, length - row.num_tokens :] = row_values[0]
        batch._set_tensors(tensors)
        batch.pads = [length - row.num_tokens for row in rows]
        batch.length = length
        for row in rows:
            row.release()
        return batch

    def append_row(self, row: RowCache) -> None:
        """Add ``row`` as the last row, left-padding whichever side is shorter. Consumes ``row``;
        if this raises, neither the batch nor the row has changed."""
        row_tensors = row.tensors()
        length = max(self.length, row.num_tokens)
        grow, row_pad = length - self.length, length - row.num_tokens
        tensors = self.layout.empty_tensors(self.num_rows + 1, length)
        for (keys, values), (old_keys, old_values) in zip(tensors, self._tensors()):
            keys[:-1, :, grow:] = old_keys
            values[:-1, :, grow:] = old_values
        for (keys, values), (row_keys, row_values) in zip(tensors, row_tensors):  # no pairs for an empty row
            keys[-1, :, row_pad:] = row_keys[0]
            values[-1, :, row_pad:] = row_values[0]
        self._set_tensors(tensors)
        self.pads = [pad + grow for pad in self.pads] + [row_pad]
        self.length = length
        row.release()

    def pop_row(self, index: int) -> None:
        """Remove row ``index`` (like ``list.pop``), then trim padding every remaining row shares."""
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {index} out of range for a batch of {self.num_rows} rows")
        pads = self.pads[:index] + self.pads[index + 1 :]
        trim = min(pads) if pads else self.length
        keep = torch.tensor([i for i in range(self.num_rows) if i != index], dtype=torch.long, device=self.layout.device)
        tensors = [
            (keys[:, :, trim:].index_select(0, keep), values[:, :, trim:].index_select(0, keep))
            for keys, values in self._tensors()
        ]
        self._set_tensors(tensors)
        self.pads = [pad - trim for pad in pads]
        self.length -= trim

    def advance(self) -> None:
        """Record that a forward appended one position to every row (checked against the tensors)."""
        self.length += 1
        keys, _ = self._tensors()[0]
        assert keys.shape[2] == self.length, f"cache holds {keys.shape[2]} positions, expected {self.length}"

    # -- internals ------------------------------------------------------------------------------
    def _tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.layout.layer_tensors(self.cache)

    def _set_tensors(self, tensors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cache = self.layout.cache_from_tensors(tensors)

    def check_integrity(self) -> None:
        """Raise RuntimeError unless tensors match (rows, length), pads are in range and no padding
        is common to every row."""
        self.layout.check_cache(self.cache, self.num_rows, self.length)
        if any(not 0 <= pad <= self.length for pad in self.pads):
            raise RuntimeError(f"BatchCache: pads {self.pads} outside [0, {self.length}]")
        if self.pads and min(self.pads) != 0:
            raise RuntimeError(f"BatchCache: every row carries padding (pads {self.pads}); it should be trimmed")
        if not self.pads and self.length != 0:
            raise RuntimeError(f"BatchCache: empty batch with length {self.length}")
