"""`DecodeStaging`: a decode-only tick's inputs staged into the fixed buffers of `ForwardBuffers` (what the
decode-only CUDA graphs read), plus the helpers of asynchronous decode and the decode bucket sizes.

Decode-only ticks (every sequence one token, all logits wanted) of ``B`` rows run at the smallest bucket
``b >= B`` of :func:`graph_buckets` (powers of two, then ``max_batch_size``). What they read:

- ``ids``, ``positions``, ``sources`` int64 ``[b]`` each, the first ``3 * b`` entries of the tick buffers'
  int64 run (``sources``: -1, or the index of the previous step's device token the row consumes instead:
  asynchronous decode, :func:`feed_previous`): rewritten every step by ONE host-to-device copy;
- block tables ``[groups, max_seqs, W]`` of their own (ticks with prompt tokens stage theirs elsewhere, so
  they leave these alone). A slot is looked at only when it now holds another row (``PagedKVCache.uid``) or
  that row's ``version`` moved, and then only what changed from the host mirror (what the device holds) is
  sent, in the same copy: the appended entries when a table only grew, else the whole row. A steady step
  copies no table entry; a row that grew by a block sends one. :meth:`DecodeStaging.invalidate` forgets the
  mirror (the next load rewrites each slot it uses whole) for an owner that rewrote the tables itself.

Padding: rows ``B .. b-1`` consume token 0 at position 0 with table ``[scratch, ...]``, so they write one K/V
into the group's scratch block and attend over it alone (finite, never read back). Write slots and
``seq_lens`` are derived on the device (inside the graph) by :meth:`DecodeStaging.step_tensors`. Entries of a
table past its row's blocks may be stale: no kernel reads past ``seq_len``. On CUDA the copy goes through
pinned memory without blocking, so staging a step never waits for the step before it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import repeat

import torch
from gemmaserve.torch_sampling import host_to_device
from torch import Tensor

from .paged_cache import PagedKVCache
from .pools import KVPools

__all__ = ["DecodeStaging", "count_fed", "feed_previous", "graph_buckets", "pick_bucket"]

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


def graph_buckets(max_batch_size: int, smallest: int = 1, factor: int = 2) -> tuple[int, ...]:
    """Batch sizes to capture: ``smallest`` times the powers of ``factor`` below ``max_batch_size``, then
    ``max_batch_size`` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = []
    size = smallest
    while size < max_batch_size:
        sizes.append(size)
        size *= factor
    sizes.append(max_batch_size)
    return tuple(sizes)


def pick_bucket(buckets: Sequence[int], batch_size: int) -> int:
    """The smallest bucket holding ``batch_size`` rows. Raises ValueError if none does."""
    for size in buckets:
        if size >= batch_size:
            return size
    raise ValueError(f"a decode batch of {batch_size} rows exceeds the largest bucket {buckets[-1]}")


class DecodeStaging:
    """Stages decode-only ticks of up to ``capacity`` rows (tables at most ``width`` blocks) into device buffers
    it does not own: ``ints`` (int64, at least ``3 * capacity`` entries: ids, positions, sources of a bucket laid
    out ``[3, bucket]``, shared with ticks that carry prompt tokens) and ``tables`` (int32 ``[groups, >= capacity,
    width]``, written by nothing else), both kept by `ForwardBuffers`.

    Mutated by :meth:`load` (host mirror and those buffers) and :meth:`invalidate`; single-threaded (under the
    backend lock)."""

    def __init__(self, pools: KVPools, ints: Tensor, tables: Tensor, capacity: int, width: int) -> None:
        if capacity < 1 or width < 1:
            raise ValueError(f"capacity and width must be >= 1, got {capacity}, {width}")
        if ints.numel() < 3 * capacity or tables.shape[1] < capacity or tables.shape[2] != width:
            raise ValueError(f"buffers {tuple(ints.shape)} / {tuple(tables.shape)} are too small for {capacity} rows")
        self.pools = pools
        self.capacity = capacity
        self.width = width
        self.device = ints.device
        self.ints = ints
        self.groups = list(pools.groups)
        self.tables = {group: tables[i] for i, group in enumerate(self.groups)}
        self._scratch = {group: [pools.scratch_block(group)] for group in self.groups}
        # host mirror: per group, each slot's table as last sent (its prefix of the device row); None = unknown
        self._mirror: dict[str, list[list[int]]] = {g: [[] for _ in range(capacity)] for g in self.groups}
        self._keys: list[tuple[int, int] | None] = [None] * capacity
        self.rows_copied = 0  # table rows rewritten on the device so far (for tests and stats)
        self.entries_copied = 0  # table entries sent to the device so far

    def invalidate(self) -> None:
        """Forget what the device tables hold (another staging rewrote them): every slot is rewritten whole by
        the next :meth:`load` that uses it."""
        self._keys = [None] * self.capacity
        for mirror in self._mirror.values():
            for i in range(self.capacity):
                mirror[i] = []

    def io(self, bucket: int) -> Tensor:
        """int64 [3, bucket]: ids, positions, sources of a ``bucket``-row step (a view of ``ints``)."""
        return self.ints[: 3 * bucket].view(3, bucket)

    def load(self, rows: Sequence[PagedKVCache], input_ids: Sequence[int], bucket: int,
             sources: Sequence[int] | None = None) -> None:
        """Stage a step of ``rows`` (row ``i`` consumes ``input_ids[i]`` at position ``rows[i].length``, or, when
        ``sources[i] >= 0``, the token :func:`feed_previous` puts there) padded to ``bucket`` rows. Rows must
        already hold the block of their new position. One host-to-device copy carries the step's ids, positions,
        sources and every table entry that changed since the slot's last step. Raises ValueError (before
        touching the buffers) if the step does not fit or a row is wider than the tables."""
        count = len(rows)
        if not count <= bucket <= self.capacity or len(input_ids) != count:
            raise ValueError(f"{count} rows / {len(input_ids)} ids do not fit bucket {bucket} of {self.capacity}")
        pad = bucket - count
        staged = array("q", input_ids)
        staged.extend(repeat(0, pad))
        staged.extend(row.length for row in rows)
        staged.extend(repeat(0, pad))
        staged.extend(sources if sources is not None else repeat(-1, count))
        staged.extend(repeat(-1, pad))
        keys = self._keys
        dirty = [i for i, row in enumerate(rows) if keys[i] != (row.uid, row.version)]
        dirty += [i for i in range(count, bucket) if keys[i] != _PAD]
        changes = [self._changes(group, rows, dirty, count) for group in self.groups] if dirty else []
        for group_changes in changes:
            for part in group_changes:
                staged.extend(part)
        on_device = self._to_device(staged)
        self.io(bucket).copy_(on_device[: 3 * bucket].view(3, bucket))
        at = 3 * bucket
        for group, (slot, column, value) in zip(self.groups, changes):
            n = len(slot)
            if n:
                part = on_device[at : at + 3 * n].view(3, n)
                self.tables[group].index_put_((part[0], part[1]), part[2].to(torch.int32))
                self.entries_copied += n
            at += 3 * n
        for i in dirty:
            keys[i] = (rows[i].uid, rows[i].version) if i < count else _PAD
        self.rows_copied += len(dirty)

    def _changes(self, group: str, rows: Sequence[PagedKVCache], dirty: list[int],
                 count: int) -> tuple[list[int], list[int], list[int]]:
        """(slots, columns, values) of the ``group`` table entries of ``dirty`` slots to rewrite on the device:
        the appended entries when the table only grew, else the whole row (the entries the device holds
        beyond the new length become -1); updates the mirror. Raises ValueError (before touching it) if a row is wider than the
        tables."""
        mirror, width = self._mirror[group], self.width
        slots: list[int] = []
        columns: list[int] = []
        values: list[int] = []
        new_tables = [rows[i].tables[group] if i < count else self._scratch[group] for i in dirty]
        for table in new_tables:
            if len(table) > width:
                raise ValueError(
                    f"a row holds {len(table)} blocks but the decode tables are {width} wide "
                    f"(MAX_MODEL_LEN / block size); the row is longer than the model length"
                )
        for i, new in zip(dirty, new_tables):
            old = mirror[i]
            n_old, n_new = len(old), len(new)
            start = n_old if n_new >= n_old and new[:n_old] == old else 0  # blocks appended: send only those
            end = max(n_old, n_new)
            slots.extend(repeat(i, end - start))
            columns.extend(range(start, end))
            values.extend(new[start:])
            values.extend(repeat(-1, end - max(start, n_new)))
            mirror[i] = list(new)
        return slots, columns, values

    def _to_device(self, staged: array) -> Tensor:
        """``staged`` (int64) on the device without waiting for queued device work (CUDA: through pinned memory
        the caching host allocator keeps until the copy ran)."""
        host = torch.frombuffer(staged, dtype=torch.int64) if len(staged) else torch.zeros(0, dtype=torch.int64)
        if self.device.type == "cuda":
            return host_to_device(host, self.device)
        return host.clone()

    def feed_previous(self, previous: Tensor, bucket: int) -> None:
        """Rows whose staged source is ``s >= 0`` consume ``previous[s]`` (the device tokens of the previous
        step) instead of their staged id: device ops only, queued before the step's forward."""
        io = self.io(bucket)
        feed_previous(io[0], io[2], previous)

    def step_tensors(self, bucket: int) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """Device-side views/derivations for a ``bucket``-row step (no host sync, graph-capturable):
        (ids int64 [b], positions int64 [b], seq_lens int32 [b], tables int32 [b, W] per group, write slots
        int64 [b] per group = the flat pool slot of each row's new token)."""
        io = self.io(bucket)
        positions = io[1]
        bs = self.pools.block_size
        tables = {group: table[:bucket] for group, table in self.tables.items()}
        blocks_at = (positions // bs)[:, None]
        offset = positions % bs
        slots = {group: table.gather(1, blocks_at)[:, 0].to(torch.int64) * bs + offset
                 for group, table in tables.items()}
        return io[0], positions, (positions + 1).to(torch.int32), tables, slots

    def check_integrity(self, rows: Sequence[PagedKVCache]) -> None:
        """Each known slot's device table starts with its host mirror; mirrors of rows whose key is current equal
        the rows' tables."""
        for group, mirror in self._mirror.items():
            device_rows = self.tables[group].cpu().tolist()
            for i, key in enumerate(self._keys):
                if key is None:
                    continue
                if i < len(rows) and key == (rows[i].uid, rows[i].version) and mirror[i] != rows[i].tables[group]:
                    raise RuntimeError(f"DecodeStaging: row {i} {group} host mirror is stale")
                if device_rows[i][: len(mirror[i])] != mirror[i]:
                    raise RuntimeError(f"DecodeStaging: row {i} {group} device table differs from the host")
