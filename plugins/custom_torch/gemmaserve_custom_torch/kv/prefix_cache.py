"""`PrefixCache`: refcounted sharing of prompt KV blocks across requests, on the core radix + exact indexes.

Radix value (one per full block k of a stored prompt, tokens [k*bs, (k+1)*bs)): a `CachedBlock` ``(full,
sliding)``: the block's full-group id and, if the storing row still held it, its sliding id (else None).
Values hash by identity, so a sliding id can be *trimmed* (None, block released) while the full one stays. Exact-index entries
(whole prompts whose length is not block-aligned) add a *tail* `CachedBlock`: private copies of the partial
last block, so an exact repeat hits every token.

Progressive caching: ``cache_prefix`` runs after every prefill chunk and indexes the full blocks computed so
far, so when the row later drops a sliding block that left its window, the cache's reference keeps it alive
(cache-only, reclaimable). Any block-aligned prefix of a prompt stays hit-able while memory allows.

A hit of ``c`` computed tokens is valid only if the sliding blocks the next query sees (positions >=
``first_visible(c)``) are all cached; the longest valid hit wins. A hit covering the whole prompt keeps
``c = len - 1`` (the last token is recomputed for its logits). An exact-index hit *takes* its tail: the entry
leaves the index and the row keeps the tail's blocks as its own (no copy), and ``store`` copies a tail again once
the row's prompt is complete. Writing into a tail the cache still held needed a copy-on-write block on top of the
blocks the row holds, one more than a request of ``len + max_tokens <`` the tail block's end reserves
(``KVAdmission``), so an admitted request could fail with the pool exhausted. A block-aligned whole-prompt hit still
copies its last (full, radix) block on write, which its reservation covers: ``len / bs + 1 <= ceil((len + m) / bs)``
blocks for any ``max_tokens`` ``m >= 1``.

Refcounts: the cache holds one reference per id in its values and tails; a row holds its own. Everything
the cache holds alone (refcount 1) is reclaimable (tails and LRU leaves, then LRU sliding trims) and nothing
else is, which is what lets admission count cached blocks as free. Eviction takes leaves, so a cache-only full
block can sit above a block a live row holds: the row then computed its own copy of that position (its hit stopped
short of it, e.g. over trimmed sliding blocks, or another row's copy was indexed first). When eviction finds nothing
it may take, ``reclaim`` repairs such blocks: the cached value takes the row's copy and the cache-only block is
freed.

KV-cache events (``set_event_observer``) follow the radix index: a block is stored while its radix node lives
(its full-group KV), whatever happens to its sliding copy; exact-index tails are never announced.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from gemmaserve.errors import KVCapacityError
from gemmaserve.kv.exact_index import ExactMatchIndex
from gemmaserve.kv.radix import RadixObserver, RadixPrefixIndex

from ..models.config import FULL, SLIDING
from .paged_cache import PagedKVCache
from .pools import KVPools

__all__ = ["CachedBlock", "PrefixCache"]

_FULL_ID, _SLIDING_ID = attrgetter("full"), attrgetter("sliding")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False, slots=True)
class CachedBlock:
    """Block ids of one cached block per group (None = not cached in that group). Hashed by identity."""

    full: int | None
    sliding: int | None

    def get(self, group: str) -> int | None:
        return self.full if group == FULL else self.sliding

    def ids(self) -> list[tuple[str, int]]:
        return [(g, b) for g, b in ((FULL, self.full), (SLIDING, self.sliding)) if b is not None]


class PrefixCache:
    """Prompt-prefix cache over ``pools``; installs itself as the pools' reclaimer. Single-threaded."""

    def __init__(self, pools: KVPools) -> None:
        self.pools = pools
        self.block_size = pools.block_size
        self.radix = RadixPrefixIndex(self.block_size)
        self.exact = ExactMatchIndex(self.block_size)
        self._values: set[CachedBlock] = set()  # every value the radix index holds
        self._trimmable: OrderedDict[int, CachedBlock] = OrderedDict()  # sliding id -> value, LRU first
        self.stats: Counter[str] = Counter()
        self._fruitless_repair: tuple[int, int] | None = None  # the state in which the last repair freed nothing
        self._indexing = 0  # lookups with a hit and cache_prefix calls so far (rows' paths and anchors move)
        pools.reclaimer = self.reclaim

    # -- lookup ------------------------------------------------------------------------------------
    def lookup(self, prompt_ids: Sequence[int]) -> tuple[PagedKVCache, int]:
        """A new row holding the longest valid cached prefix of ``prompt_ids``, and its length ``c``
        (the row covers [0, c); 0 = miss)."""
        prompt = tuple(prompt_ids)
        row = PagedKVCache(self.pools)
        values: tuple[CachedBlock, ...] = ()
        hit = 0
        entry = self.exact.get(prompt) if len(prompt) % self.block_size else None
        taken: CachedBlock | None = None
        if entry is not None and self._valid(entry.values, len(prompt) - 1):  # type: ignore[arg-type]
            values, hit = entry.values, len(prompt) - 1  # type: ignore[assignment]
            taken = entry.tail_value  # type: ignore[assignment]
        else:
            matched = self.radix.match(prompt).values
            for k in range(len(matched), 0, -1):
                c = min(k * self.block_size, len(prompt) - 1)
                if self._valid(matched, c):
                    values, hit = matched, c  # type: ignore[assignment]
                    break
        if hit > 0:
            self._indexing += 1
            row.adopt(self._tables(values, hit), hit)
            if taken is not None:  # the row's now (see the module docstring): the cache drops its references
                self.exact.pop(prompt)
                self._release(taken)
                self.stats["taken_tails"] += 1
            if hit >= self.block_size:  # the next cache_prefix resumes below the hit's full blocks
                row.indexed_last = row.cache_anchor = values[hit // self.block_size - 1]  # adopted: held
            trimmable = self._trimmable  # sliding trims go least recently used first; a hit runs this per block
            held, to_end = trimmable.get, trimmable.move_to_end
            for value in values[: _cdiv(hit, self.block_size)]:
                sliding = value.sliding
                if sliding is not None and held(sliding) is value:  # not a tail
                    to_end(sliding)
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += hit
        self.stats["lookups"] += 1
        return row, hit

    def _valid(self, values: Sequence[CachedBlock], c: int) -> bool:
        """True if ``values`` cover [0, c) in the full group and the sliding blocks a query at ``c`` sees."""
        if c <= 0 or _cdiv(c, self.block_size) > len(values):
            return False
        if SLIDING not in self.pools.groups:
            return True
        first = self.pools.geometry[SLIDING].first_visible(c) // self.block_size
        return all(values[j].sliding is not None for j in range(first, _cdiv(c, self.block_size)))

    def _tables(self, values: Sequence[CachedBlock], c: int) -> dict[str, list[int]]:
        num = _cdiv(c, self.block_size)
        tables: dict[str, list[int]] = {}
        for group in self.pools.groups:
            first = min(num, self.pools.geometry[group].first_visible(c) // self.block_size)
            ids = map(_FULL_ID if group == FULL else _SLIDING_ID, values[first:num])
            tables[group] = [-1] * first + [-1 if b is None else b for b in ids]
        return tables

    # -- store -------------------------------------------------------------------------------------
    def cache_prefix(self, prompt_ids: Sequence[int], row: PagedKVCache) -> int:
        """Index the full blocks of ``prompt_ids[:row.length]`` (after every prefill chunk, before the next
        drops sliding blocks), taking the cache's own references and re-attaching trimmed sliding ids the row
        holds. Allocates nothing; changes only ``row.indexed`` (a second call on an unchanged row is a no-op, even
        if the cache evicted some of those blocks meanwhile). Returns the number of blocks newly cached."""
        assert not row.freed and row.length <= len(prompt_ids), "cache_prefix() needs a live row of the prompt"
        num_full = row.length // self.block_size
        if row.indexed == (row.version, num_full):  # indexed already and unchanged since (store() after a chunk)
            return 0
        self._indexing += 1
        # the row's values only for the blocks the index lacks (a prefix hit's row shares the others); the walk
        # resumes at the last block indexed for this row (or its hit's), not at the root
        result = self.radix.insert(tuple(prompt_ids[: num_full * self.block_size]), lambda j: self._value_of(row, j),
                                   known=row.indexed_last)
        for value in result.new_values:
            assert isinstance(value, CachedBlock)
            for group, block in value.ids():
                self.pools.incref(group, [block])
            self._values.add(value)
            if value.sliding is not None:
                self._trimmable[value.sliding] = value
        for j, held in enumerate(result.values[: result.num_existing]):
            assert isinstance(held, CachedBlock)
            if held.sliding is not None:
                continue
            mine = self._value_of(row, j)
            if mine.sliding is not None:  # re-attach a trimmed sliding block: this row holds one for that block
                held.sliding = mine.sliding  # (its own copy or the cached one: the same tokens at the same places)
                self.pools.incref(SLIDING, [mine.sliding])
                self._trimmable[mine.sliding] = held
        self.stats["stored_blocks"] += len(result.new_values)
        row.indexed = (row.version, num_full)
        row.indexed_last = result.values[-1] if result.values else None
        for j in range(len(result.values) - 1, -1, -1):  # usually the last one: a block this row just computed
            value = result.values[j]
            assert isinstance(value, CachedBlock)
            mine = self._value_of(row, j)
            if (mine.full is not None and value.full == mine.full) or (
                    mine.sliding is not None and value.sliding == mine.sliding):
                row.cache_anchor = value  # holds a block of the row's: stays indexed while the row lives
                break
        return len(result.new_values)

    def store(self, prompt_ids: Sequence[int], row: PagedKVCache) -> int:
        """``cache_prefix`` of a complete prompt's row plus, best effort, a copy of its partial tail block.
        Returns the number of blocks newly cached. Does not change ``row``."""
        prompt = tuple(prompt_ids)
        assert row.length == len(prompt), "store() needs the row of the complete prompt"
        stored = self.cache_prefix(prompt, row)
        if len(prompt) % self.block_size and prompt not in self.exact:
            tail = self._copy_tail(row, len(prompt) // self.block_size)
            if tail is not None:
                # the copies' allocation may have reclaimed blocks of this prompt's own path that only the cache
                # held (the path was cached before, while this row computed its own): no path, no tail entry
                path = self.radix.match(prompt, touch=False).values
                if len(path) == len(prompt) // self.block_size:
                    self.exact.add(prompt, path, tail)
                else:
                    self._release(tail)
        return stored

    def _value_of(self, row: PagedKVCache, j: int) -> CachedBlock:
        full = row.tables[FULL][j] if FULL in row.tables else -1
        sliding = row.tables[SLIDING][j] if SLIDING in row.tables else -1
        return CachedBlock(full if full >= 0 else None, sliding if sliding >= 0 else None)

    def _copy_tail(self, row: PagedKVCache, j: int) -> CachedBlock | None:
        """Private copies (refcount 1, the cache's) of logical block ``j`` of every group, or None if a pool
        has no room even after reclaiming."""
        copies: dict[str, int] = {}
        try:
            for group in self.pools.groups:
                copies[group] = self.pools.allocate(group, 1)[0]  # the row holds the source meanwhile
                self.pools.copy_blocks(group, [row.tables[group][j]], [copies[group]])
        except KVCapacityError:
            for group, block in copies.items():
                self.pools.decref(group, [block])
            return None
        return CachedBlock(copies.get(FULL), copies.get(SLIDING))

    # -- reclaim -----------------------------------------------------------------------------------
    def reclaim(self, group: str, num: int) -> None:
        """Free up to ``num`` blocks of ``group`` that only the cache holds: exact tails (LRU), then LRU radix
        leaves (full group) or trimmed sliding ids (sliding group)."""
        start = self.pools.num_free(group)

        def short() -> int:
            return num - (self.pools.num_free(group) - start)

        for entry in self.exact.evict_tails(short(), self._cache_only):
            self._release(entry.tail_value)  # type: ignore[arg-type]
        if group == SLIDING:  # every cache-only sliding id is a radix value's: trimming reaches them all
            need, victims = short(), []
            for block in self._trimmable:  # least recently used first; ids a row holds are skipped
                if len(victims) >= need:
                    break
                if self.pools.refcount(SLIDING, block) == 1:
                    victims.append(block)
            for block in victims:
                self._trimmable.pop(block).sliding = None
                self.pools.decref(SLIDING, [block])
            self.stats["trimmed_sliding_blocks"] += len(victims)
            return
        repaired = False
        while short() > 0:
            evicted = self.radix.evict(short(), self._cache_only)
            if not evicted:
                if repaired or not self._repair_stranded():
                    break
                repaired = True
                continue
            self._drop_evicted(evicted)

    def _repair_state(self) -> tuple[int, int]:
        """What a repair depends on (refcounts, which only drop through ``decref``; rows' indexed paths and anchors,
        which change only in ``lookup`` / ``cache_prefix``): unchanged since a repair that freed nothing, another
        would free nothing."""
        return self.pools.releases, self._indexing

    def _own_copies(self) -> list[tuple[CachedBlock, int]]:
        """(cached value, a live row's own full block for the same position) for every indexed block a live row
        computed itself instead of sharing it (its hit stopped short of it, or it missed while another row's blocks
        were being indexed): walking up from the deepest indexed block the row holds (``cache_anchor``), which cannot
        be evicted while the row lives, so every block above a block the row holds is on a walk."""
        out: list[tuple[CachedBlock, int]] = []
        for row in self.pools.live_rows:
            assert isinstance(row, PagedKVCache)
            anchor, table = row.cache_anchor, row.tables.get(FULL)
            if anchor is None or table is None or anchor not in self.radix:
                continue
            for j, value in enumerate(self.radix.path_to(anchor)):
                assert isinstance(value, CachedBlock)
                own = table[j] if j < len(table) else -1
                if own >= 0 and value.full is not None and value.full != own:
                    out.append((value, own))
        return out

    def _repair_stranded(self) -> bool:
        """Make cache-only full blocks that sit above blocks a live row holds reclaimable: such a block's position
        is one the row computed itself (a row that shared it would hold it), so the cached value takes the row's
        copy and the cache-only block is freed. Runs when eviction finds no leaf it may take. True if it freed any."""
        if self._fruitless_repair == self._repair_state():  # nothing changed since one that freed nothing
            return False
        freed = 0
        for value, own in self._own_copies():  # value.full is set and differs from own
            old = value.full
            assert old is not None
            if self.pools.refcount(FULL, old) != 1:  # another row still reads it: not the cache's alone
                continue
            self.pools.incref(FULL, [own])
            value.full = own
            self.pools.decref(FULL, [old])
            freed += 1
        self.stats["repaired_blocks"] += freed
        self._fruitless_repair = None if freed else self._repair_state()
        return freed > 0

    def _drop_evicted(self, evicted: Sequence[object]) -> None:
        """Release radix values the index just dropped, with the exact entries over them."""
        for value in evicted:
            self._values.discard(value)  # type: ignore[arg-type]
            for entry in self.exact.remove_value(value):
                self._release(entry.tail_value)  # type: ignore[arg-type]
            self._release(value)  # type: ignore[arg-type]
            self.stats["evicted_blocks"] += 1

    def _cache_only(self, value: object) -> bool:
        assert isinstance(value, CachedBlock)
        return all(self.pools.refcount(g, b) == 1 for g, b in value.ids())

    def _release(self, value: CachedBlock | None) -> None:
        if value is None:
            return
        if value.sliding is not None:
            self._trimmable.pop(value.sliding, None)
        for group, block in value.ids():
            self.pools.decref(group, [block])

    def clear(self) -> None:
        """Drop every cache entry no live row uses (entries rows still use stay cached)."""
        for group in sorted(self.pools.groups, key=lambda g: g != SLIDING):
            if group == SLIDING:
                self.reclaim(group, self.pools.managers[group].num_blocks)
                continue
            for entry in self.exact.evict_tails(self.pools.managers[group].num_blocks, self._cache_only):
                self._release(entry.tail_value)  # type: ignore[arg-type]
            self._drop_evicted(self.radix.clear(self._cache_only))  # an emptied index is reported as cleared

    # -- KV-cache events ---------------------------------------------------------------------------
    def set_event_observer(self, observer: RadixObserver | None) -> None:
        """Report every change to the cached full blocks to ``observer`` (see ``RadixObserver``), called on the
        thread that drives this cache; blocks cached already are reported at once. None stops reporting."""
        self.radix.set_observer(observer)

    def block_paths(self) -> list[tuple[tuple[int, ...], ...]]:
        """Every cached block as its block keys from the first block down to it (exact tails excluded)."""
        return self.radix.block_paths()

    # -- accounting --------------------------------------------------------------------------------
    def references(self) -> dict[str, Counter[int]]:
        """References the cache holds, per group and block id."""
        refs: dict[str, Counter[int]] = {g: Counter() for g in self.pools.groups}
        tails = [e.tail_value for e in self.exact.entries() if e.tail_value is not None]
        for value in [*self._values, *tails]:
            for group, block in value.ids():  # type: ignore[union-attr]
                refs[group][block] += 1
        return refs

    def num_cached_blocks(self) -> dict[str, int]:
        return {group: len(counter) for group, counter in self.references().items()}

    def check_integrity(self) -> None:
        """Indexes consistent; every block's refcount == references from live rows + from the cache."""
        self.radix.check_integrity()
        self.exact.check_integrity()
        if len(self._values) != len(self.radix) or any(v not in self.radix for v in self._values):
            raise RuntimeError("PrefixCache: value set disagrees with the radix index")
        # a cache-only full block is counted as free: eviction must reach it, or the repair must (a live row below
        # it holds its own copy of that position); cache-only sliding ids are trimmed wherever they are
        repairable = {id(value) for value, _ in self._own_copies()}
        stranded = [value for value in self.radix.unreachable(self._cache_only)
                    if value.full is not None and id(value) not in repairable]  # type: ignore[union-attr]
        if stranded:
            raise RuntimeError(f"PrefixCache: {len(stranded)} cache-only blocks lie above blocks a row holds and no "
                               f"live row has its own copy of them (never reclaimable, yet counted as free), e.g. "
                               f"{stranded[0]}")
        expected = {v.sliding: v for v in self._values if v.sliding is not None}
        if dict(self._trimmable) != expected:
            raise RuntimeError("PrefixCache: trimmable sliding ids disagree with the radix values")
        refs = self.references()
        for row in list(self.pools.live_rows):
            row.check_integrity()  # type: ignore[attr-defined]
            for group, table in row.tables.items():  # type: ignore[attr-defined]
                refs[group].update(b for b in table if b >= 0)
        for group, manager in self.pools.managers.items():
            for block in range(manager.num_blocks):
                if manager.refcount(block) != refs[group][block]:
                    raise RuntimeError(
                        f"block {block} of {group} has refcount {manager.refcount(block)} but "
                        f"{refs[group][block]} holders (live rows + prefix cache): leak or double free"
                    )
