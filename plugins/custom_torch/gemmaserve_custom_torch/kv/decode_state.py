"""`BatchedDecodeState`: the decode step's inputs in fixed device buffers (what a CUDA graph reads).

Buffers (``R`` = capacity rows = the largest bucket, ``W`` = table width = blocks of the longest row):

- ``ids`` int64 ``[R]`` (token each row consumes), ``positions`` int64 ``[R]`` (its position) and ``sources``
  int64 ``[R]`` (-1, or the row of the previous step whose device token it consumes instead: asynchronous
  decode, :meth:`BatchedDecodeState.feed_previous`): rewritten every step by one H2D copy of ``[3, bucket]``;
- ``tables[group]`` int32 ``[R, W]``: block table per group. A device row is rewritten only when its slot
  now holds another row (``PagedKVCache.uid``) or that row's ``version`` moved, so a steady step copies
  nothing (a row changes tables once per block, every ``block_size`` steps).

Padding: rows ``B .. bucket-1`` of a step consume token 0 at position 0 with table ``[scratch, -1, ...]``,
so they write one K/V into the group's scratch block and attend over it alone (finite, never read back).
Write slots and ``seq_lens`` are derived on the device (inside the graph) by :meth:`step_tensors`.
On CUDA every host-to-device copy goes through pinned memory without blocking, so staging a step never waits
for the step before it (asynchronous decode launches a step while the previous one runs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .paged_cache import PagedKVCache
from .pools import KVPools

__all__ = ["BatchedDecodeState", "count_fed", "feed_previous", "graph_buckets", "pick_bucket"]

_PAD = (-1, -1)  # slot key of a padding row


def count_fed(sources: Sequence[int] | None, previous: Tensor | None, num_rows: int) -> int:
    """How many of ``num_rows`` rows consume a token of ``previous`` (``sources[i] >= 0``). Raises ValueError
    if ``sources`` does not name one entry per row and only rows of ``previous``."""
    if sources is None:
        return 0
    fed = sum(source >= 0 for source in sources)
    if fed and (previous is None or len(sources) != num_rows or max(sources) >= len(previous)):
        raise ValueError(f"row sources {list(sources)} do not index the previous step's "
                         f"{0 if previous is None else len(previous)} tokens")
    return fed


def feed_previous(ids: Tensor, sources: Tensor, previous: Tensor) -> None:
    """Asynchronous decode's one device gather: ``ids[i] = previous[sources[i]]`` where ``sources[i] >= 0``
    (the previous step's sampled tokens, not read by the host), unchanged elsewhere. In place, no host sync."""
    ids.copy_(torch.where(sources >= 0, previous.index_select(0, sources.clamp(min=0)), ids))


def graph_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes to capture: powers of two below ``max_batch_size``, then ``max_batch_size`` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch_size)
    return tuple(sizes)


def pick_bucket(buckets: Sequence[int], batch_size: int) -> int:
    """The smallest bucket holding ``batch_size`` rows. Raises ValueError if none does."""
    for size in buckets:
        if size >= batch_size:
            return size
    raise ValueError(f"a decode batch of {batch_size} rows exceeds the largest bucket {buckets[-1]}")


class BatchedDecodeState:
    """Fixed buffers for up to ``capacity`` rows whose tables have at most ``width`` blocks.

    Mutated by :meth:`load` (host mirror and device buffers); single-threaded (under the backend lock).
    Device buffers keep their addresses for the object's lifetime (graphs may capture them)."""

    def __init__(self, pools: KVPools, capacity: int, width: int) -> None:
        if capacity < 1 or width < 1:
            raise ValueError(f"capacity and width must be >= 1, got {capacity}, {width}")
        self.pools = pools
        self.capacity = capacity
        self.width = width
        device = next(iter(pools.k.values())).device
        self.device = device
        self.io = torch.zeros((3, capacity), dtype=torch.int64, device=device)  # ids, positions, sources
        self.ids, self.positions, self.sources = self.io[0], self.io[1], self.io[2]
        self._host_tables: dict[str, Tensor] = {}
        self.tables: dict[str, Tensor] = {}
        for group in pools.groups:
            host = torch.full((capacity, width), -1, dtype=torch.int32)
            host[:, 0] = pools.scratch_block(group)
            self._host_tables[group] = host
            self.tables[group] = host.to(device)
        self._keys: list[tuple[int, int]] = [_PAD] * capacity
        self.rows_copied = 0  # table rows sent to the device so far (for tests and stats)

    def load(self, rows: Sequence[PagedKVCache], input_ids: Sequence[int], bucket: int,
             sources: Sequence[int] | None = None) -> None:
        """Stage a step of ``rows`` (row ``i`` consumes ``input_ids[i]`` at position ``rows[i].length``, or, when
        ``sources[i] >= 0``, the token :meth:`feed_previous` puts there) padded to ``bucket`` rows. Rows must
        already hold the block of their new position."""
        count = len(rows)
        if not count <= bucket <= self.capacity or len(input_ids) != count:
            raise ValueError(f"{count} rows / {len(input_ids)} ids do not fit bucket {bucket} of {self.capacity}")
        pad = bucket - count
        staged = torch.tensor([[*input_ids, *([0] * pad)], [row.length for row in rows] + [0] * pad,
                               [*(sources if sources is not None else [-1] * count), *([-1] * pad)]],
                              dtype=torch.int64)
        self._to_device(self.io[:, :bucket], staged)
        dirty = [i for i, row in enumerate(rows) if self._keys[i] != (row.uid, row.version)]
        dirty += [i for i in range(count, bucket) if self._keys[i] != _PAD]
        if not dirty:
            return
        width = self.width
        for group, host in self._host_tables.items():
            scratch = [self.pools.scratch_block(group)]
            lines = []
            for i in dirty:
                table = rows[i].tables[group] if i < count else scratch
                if len(table) > width:
                    raise ValueError(
                        f"a row holds {len(table)} blocks but the decode tables are {width} wide "
                        f"(MAX_MODEL_LEN / block size); the row is longer than the model length"
                    )
                lines.append(table + [-1] * (width - len(table)))
            host[dirty] = torch.tensor(lines, dtype=torch.int32)  # one conversion for every dirty row
            self._copy_rows(group, dirty)
        for i in dirty:
            self._keys[i] = (rows[i].uid, rows[i].version) if i < count else _PAD
        self.rows_copied += len(dirty)

    def _copy_rows(self, group: str, dirty: list[int]) -> None:
        host, device_table = self._host_tables[group], self.tables[group]
        lo, hi = dirty[0], dirty[-1] + 1
        if hi - lo <= 2 * len(dirty):  # dense enough: one contiguous copy
            self._to_device(device_table[lo:hi], host[lo:hi])
            return
        index = torch.tensor(dirty, dtype=torch.int64)
        lines = torch.empty((len(dirty), host.shape[1]), dtype=host.dtype, device=self.device)
        self._to_device(lines, host[index])
        on_device = torch.empty(len(dirty), dtype=torch.int64, device=self.device)
        self._to_device(on_device, index)
        device_table.index_copy_(0, on_device, lines)

    def _to_device(self, target: Tensor, host: Tensor) -> None:
        """Copy ``host`` into the device tensor ``target`` without waiting for queued device work (CUDA: via
        pinned memory the caching host allocator keeps until the copy ran)."""
        if self.device.type == "cuda":
            target.copy_(host.pin_memory(), non_blocking=True)
        else:
            target.copy_(host)

    def feed_previous(self, previous: Tensor, bucket: int) -> None:
        """Rows whose staged source is ``s >= 0`` consume ``previous[s]`` (the device tokens of the previous
        step) instead of their staged id: device ops only, queued before the step's forward."""
        feed_previous(self.ids[:bucket], self.sources[:bucket], previous)

    def step_tensors(self, bucket: int) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """Device-side views/derivations for a ``bucket``-row step (no host sync, graph-capturable):
        (positions int64 [b], seq_lens int32 [b], tables int32 [b, W] per group, write slots int64 [b] per
        group = the flat pool slot of each row's new token)."""
        positions = self.positions[:bucket]
        bs = self.pools.block_size
        tables = {group: table[:bucket] for group, table in self.tables.items()}
        blocks_at = (positions // bs)[:, None]
        offset = positions % bs
        slots = {group: table.gather(1, blocks_at)[:, 0].to(torch.int64) * bs + offset
                 for group, table in tables.items()}
        return positions, (positions + 1).to(torch.int32), tables, slots

    def check_integrity(self, rows: Sequence[PagedKVCache]) -> None:
        """Device tables equal their host mirrors; mirrors of rows whose key is current equal the rows' tables."""
        for group, host in self._host_tables.items():
            device_rows = self.tables[group].cpu()
            for i, key in enumerate(self._keys):
                if i < len(rows) and key == (rows[i].uid, rows[i].version):
                    table = rows[i].tables[group]
                    if host[i, : len(table)].tolist() != table:
                        raise RuntimeError(f"BatchedDecodeState: row {i} {group} host mirror is stale")
                if not torch.equal(device_rows[i], host[i]):
                    raise RuntimeError(f"BatchedDecodeState: row {i} {group} device table differs from the host")
