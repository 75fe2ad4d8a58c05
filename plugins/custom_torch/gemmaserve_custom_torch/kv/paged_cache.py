"""`PagedKVCache`: one request's KV as block tables into the shared pools (see ``pools.py`` for the layout).

A row covers positions [0, ``length``). Per group it has a block table (logical block j -> physical id, or
-1). Full groups hold every block; sliding groups hold at most ``GroupGeometry.max_blocks`` (the window rule)
and sentinel the rest. The row owns one reference on every id in its tables and drops them in ``free_all``.

Appending ``num_new`` tokens is two steps around the forward: ``prepare_append`` frees blocks that fall out
of the window, allocates blocks for the new positions (copy-on-write for a block shared with the prefix
cache) and ``commit_append`` advances ``length``. If the forward fails in between, free the row.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import torch

from .pools import KVPools

__all__ = ["PagedKVCache", "prepare_decode_rows"]


_UIDS = itertools.count()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """Block tables + length of one request. Not thread-safe (used under the backend lock)."""

    def __init__(self, pools: KVPools) -> None:
        self.pools = pools
        self.tables: dict[str, list[int]] = {name: [] for name in pools.groups}
        self.length = 0
        self.version = 0  # bumped whenever a table changes (batched mirrors refresh on change)
        self.uid = next(_UIDS)  # unique per row for the process lifetime (unlike id(), never reused)
        self.freed = False
        self._exclusive: tuple[int, int] = (-1, -1)  # (version, logical block) last seen held by this row alone
        self._evicted: dict[str, int] = dict.fromkeys(self.tables, 0)  # per group: every entry before it is -1
        self.indexed: tuple[int, int] = (-1, 0)  # (version, full blocks) the prefix cache last indexed of this row
        self.indexed_last: object | None = None  # the prefix cache's value of a block on this row's indexed path
        self.cache_anchor: object | None = None  # the deepest such value holding a block this row holds
        pools.live_rows.add(self)

    # -- setup from the prefix cache ---------------------------------------------------------------
    def adopt(self, tables: dict[str, list[int]], length: int) -> None:
        """Start from cached blocks: take one new reference on every id of ``tables`` (which cover
        ``length`` tokens, -1 = not needed). Only on an empty row."""
        assert self.length == 0 and not any(self.tables.values()), "adopt() needs an empty row"
        for group, table in tables.items():
            assert len(table) == _cdiv(length, self.pools.block_size)
            self.pools.incref(group, [b for b in table if b >= 0])
            self.tables[group] = list(table)
        self.length = length
        self.version += 1

    # -- appending ---------------------------------------------------------------------------------
    def write_start(self, group: str, num_new: int) -> int:
        """First position of the next ``num_new`` whose K/V group ``group`` stores (sliding groups skip
        positions that are already out of the window at the end of the append)."""
        return max(self.length, self.pools.geometry[group].keep_from(self.length + num_new))

    def release_out_of_window(self, num_new: int) -> None:
        """Free (decref + sentinel) sliding blocks wholly before ``keep_from(length + num_new)``: no query of
        the coming append sees them. Callers that still need those keys gather them first."""
        for group in self.tables:
            self._evict_before(group, self.pools.geometry[group].keep_from(self.length + num_new))

    def _plan(self, num_new: int) -> dict[str, tuple[list[int], list[int]]]:
        """Per group: logical blocks to allocate, and held blocks shared with others (to copy on write)."""
        bs = self.pools.block_size
        last = _cdiv(self.length + num_new, bs)
        plan: dict[str, tuple[list[int], list[int]]] = {}
        for group, table in self.tables.items():
            first = self.write_start(group, num_new) // bs
            missing = [j for j in range(first, last) if j >= len(table) or table[j] < 0]
            shared = [j for j in range(first, min(last, len(table)))
                      if table[j] >= 0 and self.pools.refcount(group, table[j]) > 1]
            plan[group] = (missing, shared)
        return plan

    def prepare_append(self, num_new: int, *, release: bool = True) -> None:
        """Make room for positions [length, length + num_new): ``release_out_of_window`` (unless ``release``
        is False: a forward that reads the old keys from the pools calls ``release_out_of_window(0)`` after
        ``commit_append``), then allocate missing blocks and copy-on-write shared ones. Raises
        KVCapacityError (allocating nothing) if a pool cannot supply the blocks."""
        assert not self.freed and num_new > 0
        if release:
            self.release_out_of_window(num_new)
        plan = self._plan(num_new)
        for group, (missing, shared) in plan.items():
            self.pools.ensure_free(group, len(missing) + len(shared))
        last = _cdiv(self.length + num_new, self.pools.block_size)
        for group, (missing, shared) in plan.items():
            table = self.tables[group]
            if shared:
                self._copy_on_write(group, shared)
            table.extend([-1] * (last - len(table)))
            for j, block in zip(missing, self.pools.allocate(group, len(missing))):
                table[j] = block
            if missing:  # an append after a release past it (n > window): the watermark must stay below
                self._evicted[group] = min(self._evicted[group], missing[0])
        self.version += 1

    def decode_needs_nothing(self) -> bool:
        """True if appending one token changes no table: position ``length`` falls in a held block that only
        this row references, and no sliding block leaves the window (``keep_from`` moves only when
        ``length + 1`` is a multiple of the block size). Then ``prepare_append(1)`` would be a no-op and
        ``commit_append(1)`` is all the step needs. Conservative: False whenever unsure."""
        bs = self.pools.block_size
        position = self.length
        if position % bs == 0 or (position + 1) % bs == 0:
            return False
        j = position // bs
        if self._exclusive == (self.version, j):
            # Checked at this version: a held block's refcount rises only when the prefix cache stores this
            # row (prefill time, before the row decodes) or another row adopts a *cached* block.
            return True
        for group, table in self.tables.items():
            if j >= len(table) or table[j] < 0 or self.pools.refcount(group, table[j]) != 1:
                return False
        self._exclusive = (self.version, j)
        return True

    def commit_append(self, num_new: int) -> None:
        """The forward wrote the K/V of the ``num_new`` positions prepared: advance ``length``. (That the
        tables cover the new length is :meth:`check_integrity`'s job; this runs per row per decode step.)"""
        self.length += num_new

    def _evict_before(self, group: str, position: int) -> None:
        """Release the blocks wholly before ``position``; scans only past the group's eviction watermark (blocks
        are never allocated below it: appends start at ``write_start``)."""
        table = self.tables[group]
        end = min(position // self.pools.block_size, len(table))
        start = self._evicted[group]
        if end <= start:
            return
        dead = [j for j in range(start, end) if table[j] >= 0]
        self._evicted[group] = end
        if dead:
            self.pools.decref(group, [table[j] for j in dead])
            for j in dead:
                table[j] = -1
            self.version += 1

    def _copy_on_write(self, group: str, logical: list[int]) -> None:
        """Replace shared blocks by private copies: the fresh blocks are allocated while the shared ones are still
        held (``prepare_append`` made room for both), filled by one multi-tensor copy queued on the device
        (:meth:`KVPools.copy_blocks`: a full prompt hit copies its last block this way at its first step, once
        per group), then the shared ones are released. If the copy raises, the fresh blocks are freed and the row
        keeps the shared ones."""
        table = self.tables[group]
        old = [table[j] for j in logical]
        fresh = self.pools.allocate(group, len(old))
        try:
            self.pools.copy_blocks(group, old, fresh)
        except BaseException:
            self.pools.decref(group, fresh)
            raise
        self.pools.decref(group, old)
        for j, block in zip(logical, fresh):
            table[j] = block

    # -- reading -----------------------------------------------------------------------------------
    def slots(self, group: str, start: int, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Flat pool slots (block * block_size + offset, int64) of positions [start, end) in ``group``;
        every position must be held."""
        bs = self.pools.block_size
        positions = torch.arange(start, end)
        ids = torch.tensor(self.tables[group], dtype=torch.int64)[positions // bs]
        assert bool((ids >= 0).all()), f"positions [{start}, {end}) of group {group} are not all held"
        return (ids * bs + positions % bs).to(device)

    def held(self, group: str) -> list[int]:
        return [b for b in self.tables[group] if b >= 0]

    def free_all(self) -> None:
        """Drop every block reference (blocks shared with the prefix cache stay cached). Idempotent."""
        if self.freed:
            return
        for group, table in self.tables.items():
            self.pools.decref(group, [b for b in table if b >= 0])
            self.tables[group] = []
        self.freed = True
        self.version += 1
        self.pools.live_rows.discard(self)

    def check_integrity(self) -> None:
        """Tables cover ``length`` tokens; full groups hold every block; sliding groups hold every block the
        next query sees and nothing wholly before ``keep_from(length)``; every held id is referenced."""
        if self.freed:
            if any(self.tables.values()) or self in self.pools.live_rows:
                raise RuntimeError("PagedKVCache: a freed row still holds blocks or is registered")
            return
        if self not in self.pools.live_rows:
            raise RuntimeError("PagedKVCache: a live row is not registered with its pools")
        bs = self.pools.block_size
        for group, table in self.tables.items():
            geometry = self.pools.geometry[group]
            if len(table) != _cdiv(self.length, bs):
                raise RuntimeError(f"PagedKVCache: {group} table has {len(table)} blocks for {self.length} tokens")
            needed = range(geometry.first_visible(self.length) // bs, len(table))
            if any(table[j] < 0 for j in needed):
                raise RuntimeError(f"PagedKVCache: {group} lacks a block the next query needs: {table}")
            if any(b >= 0 for b in table[: geometry.keep_from(self.length) // bs]):
                raise RuntimeError(f"PagedKVCache: {group} holds an out-of-window block: {table}")
            for b in table:
                if b >= 0 and self.pools.refcount(group, b) < 1:
                    raise RuntimeError(f"PagedKVCache: {group} block {b} is held but free")


def prepare_decode_rows(pools: KVPools, rows: Sequence[PagedKVCache]) -> int:
    """Give every row the block of its next position (the one decode step of all decode drivers): rows that
    need nothing (``decode_needs_nothing``) are skipped; the others free what leaves the window, then, once
    every pool is known to supply the step's new blocks, get them (one allocation per group for the whole step;
    copy-on-write for a block shared with the prefix cache). The same effect as ``prepare_append(1)`` on each
    row, in one pass per row. Raises KVCapacityError before changing any row's blocks. Returns how many rows
    needed bookkeeping."""
    slow = list(dict.fromkeys(row for row in rows if not row.decode_needs_nothing()))  # a row listed twice: once
    if not slow:
        return 0
    bs = pools.block_size
    geometry = pools.geometry
    fresh: dict[str, list[tuple[PagedKVCache, int]]] = {group: [] for group in pools.groups}  # (row, block j)
    shared: list[tuple[PagedKVCache, str, int]] = []
    for row in slow:
        assert not row.freed
        position = row.length
        j = position // bs
        for group, table in row.tables.items():
            row._evict_before(group, geometry[group].keep_from(position + 1))
            if j >= len(table) or table[j] < 0:
                fresh[group].append((row, j))
            elif pools.refcount(group, table[j]) > 1:
                shared.append((row, group, j))
    needs = Counter({group: len(wanted) for group, wanted in fresh.items() if wanted})
    needs.update(group for _, group, _ in shared)
    for group, num in needs.items():
        pools.ensure_free(group, num)
    for group, wanted in fresh.items():
        if not wanted:
            continue
        for (row, j), block in zip(wanted, pools.allocate(group, len(wanted))):
            table = row.tables[group]
            if j >= len(table):
                table.extend([-1] * (j + 1 - len(table)))
            table[j] = block
            row.version += 1
    for row, group, j in shared:
        row._copy_on_write(group, [j])
        row.version += 1
    return len(slow)
