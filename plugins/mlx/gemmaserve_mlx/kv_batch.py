"""``KVBatch``: the KV handle of this backend, both a request's own KV (one row, during prefill) and
the decoding batch (many rows). One :class:`LayerKVCache` per KV-owning layer plus per-row lengths.

Ownership (core contract): a handle is either live, consumed (spliced into a batch: its arrays now
belong to the batch) or freed; any use after that raises RuntimeError. Rows in prefill keep every
column (the prefix store reads them all); a decoding batch drops sliding-window columns no query can
see any more (``trim_sliding``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from gemmaserve_mlx.batched_cache import ForwardContext, LayerKVCache
from gemmaserve_mlx.layout import KVLayout

__all__ = ["KVBatch"]


class KVBatch:
    """Left-padded KV of ``num_rows`` rows (see ``batched_cache`` for the column layout)."""

    def __init__(self, layout: KVLayout, lengths: Sequence[int], *, growth: int, trim_sliding: bool) -> None:
        self.layout = layout
        self.growth = growth
        self.trim_sliding = trim_sliding
        self.context = ForwardContext(list(lengths))
        self.layers = [LayerKVCache(spec.window, self.context, growth) for spec in layout.layers]
        self.status = "live"  # "live" | "consumed" | "freed" | "broken" (a forward failed midway)

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_arrays(
        cls, layout: KVLayout, arrays: Sequence[tuple[mx.array, mx.array]], length: int, *, growth: int
    ) -> KVBatch:
        """A one-row prefill KV holding ``length`` tokens: ``arrays[l]`` = (keys, values) of layer
        ``l``, each [1, kv_heads, length, dim]. Takes the arrays."""
        kv = cls(layout, [length], growth=growth, trim_sliding=False)
        for layer, (keys, values) in zip(kv.layers, arrays, strict=True):
            assert keys.shape[2] == length and values.shape[2] == length
            layer.assign(keys, values)
        return kv

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.context.lengths)

    @property
    def lengths(self) -> list[int]:
        """Real tokens per row (a copy)."""
        return list(self.context.lengths)

    def arrays(self) -> list[mx.array]:
        """Every buffer, for ``mx.eval``."""
        return [a for layer in self.layers for a in (layer.keys, layer.values) if a is not None]

    def row_columns(self, layer_index: int) -> tuple[mx.array, mx.array]:
        """A one-row prefill KV's keys and values of layer ``layer_index``, [tokens, kv_heads, dim]
        (every token is present: prefill rows are never trimmed or padded)."""
        self.require_live()
        assert self.num_rows == 1 and not self.trim_sliding
        used = self.layers[layer_index].used()
        assert used is not None and self.layers[layer_index].width == self.context.lengths[0]
        return used[0][0].transpose(1, 0, 2), used[1][0].transpose(1, 0, 2)

    # -- the forward ---------------------------------------------------------------------------------
    def begin_forward(self, num_new: int) -> list[LayerKVCache]:
        """Caches to hand to the model for ``num_new`` tokens per row (drops stale sliding columns first)."""
        self.require_live()
        if self.num_rows == 0:
            raise RuntimeError("KVBatch: forward over an empty batch")
        if self.trim_sliding:
            for layer in self.layers:
                layer.trim_window(slack=self.growth)
        return self.layers

    def end_forward(self, num_new: int) -> None:
        """The model appended ``num_new`` tokens to every row of every layer."""
        self.context.lengths = [length + num_new for length in self.context.lengths]
        self.context.refresh()

    def mark_broken(self) -> None:
        """A forward raised midway: layers may disagree, so only row removal and freeing remain allowed."""
        if self.status == "live":
            self.status = "broken"

    # -- row management ----------------------------------------------------------------------------
    def extend(self, others: Sequence[KVBatch]) -> None:
        """Append the rows of ``others`` after this batch's rows, left-padding whichever side is
        shorter, in one concatenation per layer. Consumes ``others``; mutates self."""
        self.require_live()
        for other in others:
            other.require_live()
            if other is self or other.layout is not self.layout:
                raise RuntimeError("KVBatch.extend: a batch can only take rows of other KVs of the same model")
        parts = [kv for kv in (self, *others) if kv.num_rows > 0]
        if self.trim_sliding:
            for kv in parts:
                for layer in kv.layers:
                    layer.trim_window(slack=0)
        for index, layer in enumerate(self.layers):
            columns = [kv.layers[index].used() for kv in parts]
            width = max((c[0].shape[2] for c in columns if c is not None), default=0)
            if width == 0:
                layer.assign(None, None)
                continue
            keys = [_left_pad(c, kv, index, width, 0) for c, kv in zip(columns, parts, strict=True)]
            values = [_left_pad(c, kv, index, width, 1) for c, kv in zip(columns, parts, strict=True)]
            layer.assign(mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0))
        self.context.lengths = [length for kv in parts for length in kv.context.lengths]
        self.context.refresh()
        for other in others:
            other._release("consumed")

    def pop_row(self, row: int) -> None:
        """Drop row ``row`` (like ``list.pop``) and the padding no remaining row needs."""
        if self.status not in ("live", "broken"):
            raise RuntimeError(f"KVBatch: pop_row on a {self.status} KV")
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range for a batch of {self.num_rows}")
        lengths = self.context.lengths
        keep = mx.array([i for i in range(len(lengths)) if i != row], dtype=mx.int32)
        del lengths[row]
        longest = max(lengths, default=0)
        for layer in self.layers:
            used = layer.used()
            if not lengths or used is None:
                layer.assign(None, None)
                continue
            layer.assign(used[0][keep], used[1][keep])
            if self.status == "live":
                layer.drop_leading(layer.width - longest)
        self.context.refresh()
        if not lengths and self.status == "broken":
            self.status = "live"  # nothing inconsistent is left

    def free(self) -> None:
        """Release every buffer (idempotent); a consumed KV cannot be freed by its old owner."""
        if self.status == "consumed":
            raise RuntimeError("KVBatch: freeing a KV that was spliced into a batch (the batch owns it)")
        if self.status != "freed":
            self._release("freed")

    def _release(self, status: str) -> None:
        for layer in self.layers:
            layer.assign(None, None)
        self.context.lengths = []
        self.context.refresh()
        self.status = status

    def require_live(self) -> None:
        if self.status != "live":
            raise RuntimeError(f"KVBatch: this KV handle is {self.status}; it cannot be used")

    # -- invariants --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise RuntimeError unless every layer agrees with the row lengths (see module docstring)."""
        if self.status in ("consumed", "freed"):
            if self.num_rows or any(layer.keys is not None for layer in self.layers):
                raise RuntimeError(f"KVBatch: a {self.status} KV still holds buffers")
            return
        if self.status not in ("live", "broken"):
            raise RuntimeError(f"KVBatch: unknown status {self.status!r}")
        self.context.check_integrity()
        lengths = self.context.lengths
        if self.status == "broken":
            return
        longest = max(lengths, default=0)
        widths: dict[int | None, int] = {}
        for index, (layer, spec) in enumerate(zip(self.layers, self.layout.layers, strict=True)):
            if layer.window != spec.window:
                raise RuntimeError(f"KVBatch: layer {index} window {layer.window} != layout {spec.window}")
            if widths.setdefault(layer.window, layer.width) != layer.width:
                raise RuntimeError(f"KVBatch: layers with window {layer.window} disagree on width")
            if layer.window is None or not self.trim_sliding:
                width_ok = layer.width == longest
            else:
                width_ok = min(longest, layer.window - 1) <= layer.width <= longest
            if not width_ok:
                raise RuntimeError(f"KVBatch: layer {index} width {layer.width} for rows of lengths {lengths}")
            layer.check_integrity(len(lengths), spec.kv_heads, spec.key_dim, spec.value_dim)


def _left_pad(
    columns: tuple[mx.array, mx.array] | None, kv: KVBatch, index: int, width: int, which: int
) -> mx.array:
    """Keys (which=0) or values (1) of ``kv``'s layer ``index`` padded on the left to ``width``."""
    spec = kv.layout.layers[index]
    dim = spec.key_dim if which == 0 else spec.value_dim
    if columns is None:
        return mx.zeros((kv.num_rows, spec.kv_heads, width, dim), kv.layout.dtype)
    array = columns[which]
    missing = width - array.shape[2]
    if missing == 0:
        return array
    return mx.pad(array, [(0, 0), (0, 0), (missing, 0), (0, 0)])
