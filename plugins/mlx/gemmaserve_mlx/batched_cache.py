"""One layer's KV for several rows, left-padded, speaking the cache interface mlx_lm models call.

Column space: every row's tokens are right-aligned at column ``width`` (exclusive), so a decode step
appends all rows at the same column. Row ``r`` holding ``lengths[r]`` tokens has
``pad = width - lengths[r]`` padding columns on its left; a sliding layer that dropped its oldest
columns has ``pad < 0`` (its first tokens are gone, as the window allows). Column ``c`` of row ``r``
is position ``c - pad``; attention masks are built in columns, so causality and the window are the
same for every row and only the padding differs.

mlx_lm's attention layers use, per layer: ``cache.offset`` (RoPE position of the first new token, an
int32 array [rows]), ``cache.update_and_fetch(keys, values)`` (append [rows, kv_heads, new, dim],
return every column) and ``cache.make_mask(new, window_size=...)`` (called once per layer kind before
the layers run). Offsets and lengths live in a :class:`ForwardContext` shared by all layers of one
batch and advanced by the owner after the forward, so every layer sees the same pre-step positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

__all__ = ["ForwardContext", "LayerKVCache"]


@dataclass(slots=True)
class ForwardContext:
    """Per-row token counts shared by the layer caches of one batch. Mutated only by the batch."""

    lengths: list[int]
    offset: mx.array = field(init=False)

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Rebuild ``offset`` after ``lengths`` changed."""
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def check_integrity(self) -> None:
        """Raise RuntimeError if ``offset`` is stale or a length is negative."""
        if self.offset.tolist() != self.lengths or any(length < 0 for length in self.lengths):
            raise RuntimeError(f"ForwardContext: offsets {self.offset.tolist()} != lengths {self.lengths}")


class LayerKVCache:
    """KV of one attention layer: buffers [rows, kv_heads, capacity, dim], columns [0, width) used.

    ``window`` is the sliding window (None = full attention). Buffers grow by ``growth`` columns at
    a time. Owned by a ``KVBatch``; the model mutates it only through :meth:`update_and_fetch`.
    """

    def __init__(self, window: int | None, context: ForwardContext, growth: int) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.width = 0
        self._context = context
        self._growth = growth

    # -- the interface mlx_lm's attention layers call ------------------------------------------
    @property
    def offset(self) -> mx.array:
        return self._context.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` [rows, kv_heads, new, dim] at column ``width``; return every
        used column. Mutates the buffers and ``width``."""
        start, end = self.width, self.width + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(end, keys, values)
        assert self.keys is not None and self.values is not None
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.width = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(
        self, num_new: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """Mask for ``num_new`` queries at columns [width, width + num_new): causal, within
        ``window_size`` (if given), and off the padding. Shape [rows, 1, new, width + new], or
        [new, width + new] / "causal" / None when no row is padded (mlx_lm's conventions)."""
        total = self.width + num_new
        pads = [self.width - length for length in self._context.lengths]
        padded = any(pad > 0 for pad in pads)
        window_bites = window_size is not None and any(total - 1 - max(pad, 0) >= window_size for pad in pads)
        if not (padded or window_bites or return_array):
            return "causal" if num_new > 1 else None
        columns = mx.arange(total)[None, :]
        query_columns = mx.arange(self.width, total)[:, None]
        mask = columns <= query_columns
        if window_size is not None:
            mask = mask & (columns > query_columns - window_size)
        if padded:
            visible = columns >= mx.array(pads)[:, None]
            mask = mask[None, None] & visible[:, None, None, :]
        return mask

    # -- owner-side operations (KVBatch) -------------------------------------------------------
    def used(self) -> tuple[mx.array, mx.array] | None:
        """Keys and values of the used columns, or None before the first token."""
        if self.keys is None or self.values is None or self.width == 0:
            return None
        return self.keys[..., : self.width, :], self.values[..., : self.width, :]

    def assign(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Replace the content with exactly these columns (None = empty)."""
        self.keys, self.values = keys, values
        self.width = 0 if keys is None else int(keys.shape[2])

    def drop_leading(self, num_columns: int) -> None:
        """Forget the first ``num_columns`` columns (padding no row uses, or out-of-window keys)."""
        if num_columns <= 0:
            return
        used = self.used()
        assert used is not None and num_columns <= self.width
        keys, values = used
        if num_columns == self.width:
            self.assign(None, None)
        else:
            self.assign(keys[..., num_columns:, :], values[..., num_columns:, :])

    def trim_window(self, *, slack: int) -> None:
        """Sliding layers: drop the columns no present or future query can see, once more than
        ``slack`` of them piled up (keeps ``window - 1``)."""
        if self.window is not None and self.width > self.window - 1 + slack:
            self.drop_leading(self.width - (self.window - 1))

    def check_integrity(self, num_rows: int, kv_heads: int, key_dim: int, value_dim: int) -> None:
        """Raise RuntimeError unless keys and values hold ``num_rows`` rows of the given shape and at
        least ``width`` columns (or are both absent with nothing used)."""
        if self.keys is None or self.values is None:
            if self.keys is not self.values or self.width != 0:
                raise RuntimeError(f"LayerKVCache: width {self.width} without both buffers")
            return
        for array, dim in ((self.keys, key_dim), (self.values, value_dim)):
            if (array.shape[0], array.shape[1], array.shape[3]) != (num_rows, kv_heads, dim):
                raise RuntimeError(f"LayerKVCache: buffer {tuple(array.shape)} != [{num_rows}, {kv_heads}, *, {dim}]")
            if array.shape[2] < self.width:
                raise RuntimeError(f"LayerKVCache: width {self.width} > capacity {array.shape[2]}")

    def _grow(self, end: int, keys: mx.array, values: mx.array) -> None:
        rows, heads = keys.shape[0], keys.shape[1]
        capacity = -(-end // self._growth) * self._growth
        extra_k = mx.zeros((rows, heads, capacity - self.width, keys.shape[3]), keys.dtype)
        extra_v = mx.zeros((rows, heads, capacity - self.width, values.shape[3]), values.dtype)
        used = self.used()
        if used is None:
            self.keys, self.values = extra_k, extra_v
        else:
            self.keys = mx.concatenate([used[0], extra_k], axis=2)
            self.values = mx.concatenate([used[1], extra_v], axis=2)
