"""The core prefix cache that backends drive: which KV block holds which tokens (IDs only).

A backend keeps KV tensors in a pool of ``num_blocks`` blocks of ``block_size`` tokens and asks this
class which blocks to read (``lookup``) and which to fill (``begin_store`` / ``commit_store``):

    match = cm.lookup(prompt)              # blocks pinned until cm.release(match)
    ... copy KV of match.block_ids (covering prompt[:match.num_tokens]) into the request ...
    cm.release(match)
    plan = cm.begin_store(prompt)          # reserves blocks for the parts not cached yet
    ... write KV of prompt[w.token_start:w.token_end] into block w.block_id for w in plan.writes ...
    cm.commit_store(plan)                  # or cm.abort_store(plan)

Full blocks live in a :class:`RadixPrefixIndex` (block-aligned prefix hits); a stored sequence whose
length is not block-aligned also gets its partial last block (the *tail*) in an
:class:`ExactMatchIndex`, so repeating it exactly hits every token.

    ┌───────────────────────────────────────────────────────────────────────────┐
    │ refcount(b) = [b is cached: a radix node or an exact-index tail]          │
    │             + number of live PrefixMatch pins listing b                   │
    │             + number of open StorePlans pinning b (their cached prefix)   │
    │             + [b is reserved for an open StorePlan's writes]              │
    │ A cached block with refcount 1 is *evictable*; nothing else is.           │
    └───────────────────────────────────────────────────────────────────────────┘

Eviction (only when ``begin_store`` runs out of free blocks, or on ``clear``): LRU exact-index tails
first, since a tail block saves fewer than ``block_size`` tokens of recompute and only for an exact
repeat; then LRU radix leaves, repeatedly. Every public method takes an internal lock.

KV-cache events (``set_event_observer``) report the radix index's full blocks only: tails are never
announced, as vLLM announces only full blocks.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gemmaserve.errors import ConfigurationError
from gemmaserve.kv.block_manager import BlockManager
from gemmaserve.kv.exact_index import ExactMatchIndex
from gemmaserve.kv.radix import RadixObserver, RadixPrefixIndex

__all__ = ["PrefixMatch", "BlockWrite", "StorePlan", "CacheStats", "CacheManager"]

_HANDLES = itertools.count(1)  # process-wide, so a match/plan from another CacheManager never aliases


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of :meth:`CacheManager.lookup`: ``block_ids`` cover ``token_ids[:num_tokens]`` in order
    (block k holds tokens ``[k*bs, (k+1)*bs)``; a full hit's last block may hold fewer). The blocks
    stay pinned until :meth:`CacheManager.release`."""

    num_tokens: int
    block_ids: tuple[int, ...]
    is_full_hit: bool
    _pin: int = field(default=0, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """Write the KV of tokens ``[token_start, token_end)`` into block ``block_id`` (from slot 0)."""

    block_id: int
    token_start: int
    token_end: int

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(slots=True)
class StorePlan:
    """Blocks reserved by :meth:`CacheManager.begin_store`; only blocks not cached yet are listed.

    Writes are in token order and block-aligned; only the last may be partial (the tail). An empty
    ``writes`` means nothing to write (already cached, or no room). Must end in ``commit_store`` or
    ``abort_store``.
    """

    token_ids: tuple[int, ...]
    writes: list[BlockWrite]
    _plan_id: int = field(default=0, repr=False)


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Snapshot of pool usage and cumulative counters. ``pinned_blocks`` = used blocks that eviction
    cannot reclaim (pinned by a match or held by an open plan) = ``used_blocks - evictable_blocks``;
    ``evictions`` counts cached blocks dropped from the indexes."""

    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    evictable_blocks: int
    pinned_blocks: int
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    full_hits: int
    stores: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens served from the cache (0.0 before any lookup)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass(frozen=True, slots=True)
class _OpenPlan:
    token_ids: tuple[int, ...]
    prefix: tuple[int, ...]  # cached radix path the plan extends
    held: tuple[int, ...]  # cached blocks pinned for the plan: prefix (+ the existing exact tail)
    new_full: tuple[int, ...]  # reserved, written by the caller: full blocks after the prefix
    tail: int | None  # reserved, written by the caller: the partial last block


class CacheManager:
    """Prefix cache over a pool of ``num_blocks`` KV blocks; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigurationError(f"prefix cache num_blocks must be an integer >= 0, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigurationError(f"KV block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lock = threading.Lock()
        self._blocks = BlockManager(num_blocks)
        self._radix = RadixPrefixIndex(block_size)
        self._exact = ExactMatchIndex(block_size)
        self._cached: set[int] = set()
        self._num_evictable = 0
        self._pins: dict[int, tuple[int, ...]] = {}
        self._plans: dict[int, _OpenPlan] = {}
        self._counters = Counter[str]()

    # -- lookups --------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``: an exact full hit (may end in a partial tail block),
        else the radix's block-aligned prefix. Pins the returned blocks; records hit stats."""
        tokens = tuple(token_ids)
        with self._lock:
            match = self._radix.match(tokens)
            block_ids, num_tokens = match.values, match.num_tokens
            if num_tokens < len(tokens) and len(tokens) - num_tokens < self.block_size:
                entry = self._exact.get(tokens)
                if entry is not None:
                    assert entry.path_values == block_ids, "exact entry disagrees with its radix path"
                    block_ids, num_tokens = entry.values, len(tokens)
            is_full_hit = bool(tokens) and num_tokens == len(tokens)
            self._counters.update(
                lookups=1, lookup_tokens=len(tokens), hit_tokens=num_tokens, full_hits=int(is_full_hit)
            )
            pin = 0
            if block_ids:
                pin = next(_HANDLES)
                self._hold(block_ids)
                self._pins[pin] = block_ids
            return PrefixMatch(num_tokens, block_ids, is_full_hit, _pin=pin)

    def release(self, match: PrefixMatch) -> None:
        """Unpin ``match``'s blocks. Releasing the same match again (or an empty match) is a no-op."""
        with self._lock:
            block_ids = self._pins.pop(match._pin, None)
            if block_ids is not None:
                self._drop(block_ids)

    # -- stores ---------------------------------------------------------------------------------
    def begin_store(self, token_ids: Sequence[int]) -> StorePlan:
        """Reserve blocks for the parts of ``token_ids`` not cached yet (see :class:`StorePlan`).

        The cached prefix the plan extends is pinned until commit/abort. Evicts LRU unpinned blocks if
        the free pool is short; if still short, the plan covers only a prefix of the missing full
        blocks (possibly none), and the tail is planned only when every full block is covered.
        """
        tokens = tuple(token_ids)
        bs = self.block_size
        num_full, remainder = divmod(len(tokens), bs)
        with self._lock:
            prefix = self._radix.match(tokens).values
            held, want_tail = prefix, remainder > 0
            if want_tail and len(prefix) == num_full:
                entry = self._exact.get(tokens)
                if entry is not None:
                    held, want_tail = entry.values, False
            self._hold(held)
            want_full = num_full - len(prefix)
            shortfall = want_full + int(want_tail) - self._blocks.num_free
            if shortfall > 0:
                self._evict(shortfall)
            num_new_full = min(want_full, self._blocks.num_free)
            # A short plan took every free block, so the tail comes only once every full block fits.
            with_tail = want_tail and self._blocks.num_free > num_new_full
            new = self._blocks.allocate(num_new_full + int(with_tail))
            new_full, tail = tuple(new[:num_new_full]), (new[-1] if with_tail else None)
            first = len(prefix)
            writes = [BlockWrite(b, (first + i) * bs, (first + i + 1) * bs) for i, b in enumerate(new_full)]
            if tail is not None:
                writes.append(BlockWrite(tail, num_full * bs, len(tokens)))
            plan_id = next(_HANDLES)
            self._plans[plan_id] = _OpenPlan(tokens, prefix, held, new_full, tail)
            return StorePlan(tokens, writes, _plan_id=plan_id)

    def commit_store(self, plan: StorePlan) -> None:
        """The caller has written every ``plan.writes``: make them visible to lookups and unpin the
        plan's prefix. Blocks another plan cached meanwhile win; this plan's copies are freed.
        Raises RuntimeError if ``plan`` is not open (already committed or aborted, or foreign)."""
        with self._lock:
            record = self._plans.pop(plan._plan_id, None)
            if record is None:
                raise RuntimeError("commit_store: plan is not open (already committed/aborted, or foreign)")
            path = record.prefix + record.new_full
            result = self._radix.insert(record.token_ids[: len(path) * self.block_size], path)
            for block_id in result.new_values:
                self._cache_add(block_id)
            self._drop(result.duplicate_values)
            if record.tail is not None:
                if self._exact.add(record.token_ids, result.values, record.tail):
                    self._cache_add(record.tail)
                else:
                    self._drop((record.tail,))
            self._drop(record.held)
            self._counters["stores"] += 1

    def abort_store(self, plan: StorePlan) -> None:
        """Free the plan's reserved blocks and unpin its prefix. No-op if the plan is not open."""
        with self._lock:
            record = self._plans.pop(plan._plan_id, None)
            if record is not None:
                reserved = record.new_full if record.tail is None else (*record.new_full, record.tail)
                self._drop(reserved)
                self._drop(record.held)

    # -- capacity -------------------------------------------------------------------------------
    def free_capacity_blocks(self) -> int:
        """Blocks a store could get now: free + evictable."""
        with self._lock:
            return self._blocks.num_free + self._num_evictable

    def stats(self) -> CacheStats:
        with self._lock:
            used = self._blocks.num_used
            return CacheStats(
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                used_blocks=used,
                free_blocks=self._blocks.num_free,
                evictable_blocks=self._num_evictable,
                pinned_blocks=used - self._num_evictable,
                **{name: self._counters[name] for name in _COUNTERS},
            )

    def clear(self) -> None:
        """Drop every evictable entry; pinned blocks (and exact entries over them) stay."""
        with self._lock:
            self._evict(self.num_blocks, clearing=True)

    # -- KV-cache events ------------------------------------------------------------------------
    def set_event_observer(self, observer: RadixObserver | None) -> None:
        """Report every change to the cached full blocks to ``observer`` (see :class:`RadixObserver`), called
        with this manager's lock held; blocks cached already are reported at once. None stops reporting."""
        with self._lock:
            self._radix.set_observer(observer)

    def block_paths(self) -> list[tuple[tuple[int, ...], ...]]:
        """Every cached full block as its block keys from the first block down to it (tails excluded)."""
        with self._lock:
            return self._radix.block_paths()

    # -- internals (lock held) ------------------------------------------------------------------
    def _hold(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._blocks.incref((block_id,))
            if block_id in self._cached and self._blocks.refcount(block_id) == 2:
                self._num_evictable -= 1

    def _drop(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._blocks.decref((block_id,))
            if block_id in self._cached and self._blocks.refcount(block_id) == 1:
                self._num_evictable += 1

    def _cache_add(self, block_id: int) -> None:
        """A reserved block (its one reference) becomes the cache's."""
        assert block_id not in self._cached
        self._cached.add(block_id)
        if self._blocks.refcount(block_id) == 1:
            self._num_evictable += 1

    def _cache_remove(self, block_id: int) -> None:
        """Drop the cache's reference (frees the block unless still pinned)."""
        self._cached.remove(block_id)
        if self._blocks.refcount(block_id) == 1:
            self._num_evictable -= 1
        self._blocks.decref((block_id,))
        self._counters["evictions"] += 1

    def _evict(self, num_blocks: int, *, clearing: bool = False) -> None:
        """Free up to ``num_blocks`` blocks: LRU unpinned exact tails first, then LRU radix leaves.
        ``clearing``: every unpinned entry goes (the radix's ``clear``, which reports an emptied index as such)."""
        target_free = self._blocks.num_free + num_blocks

        def can_evict(block_id: int) -> bool:
            return self._blocks.refcount(block_id) == 1

        for entry in self._exact.evict_tails(num_blocks, can_evict):
            self._cache_remove(entry.tail_value)
        if clearing:
            evicted = self._radix.clear(can_evict)
        else:
            evicted = self._radix.evict(target_free - self._blocks.num_free, can_evict)
        for block_id in evicted:
            for entry in self._exact.remove_value(block_id):
                if entry.tail_value is not None:
                    self._cache_remove(entry.tail_value)
            self._cache_remove(block_id)

    def check_integrity(self) -> None:
        """Raise RuntimeError unless the pools and indexes agree with the refcount formula in the
        module docstring, cached = radix values + exact tails, and every exact entry's path is its
        radix path."""
        with self._lock:
            self._blocks.check_integrity()
            self._radix.check_integrity()
            self._exact.check_integrity()
            entries = list(self._exact.entries())
            tails = {entry.tail_value for entry in entries if entry.tail_value is not None}
            if len(self._cached) != len(self._radix) + len(tails) or any(
                (b in self._radix) == (b in tails) for b in self._cached
            ):
                raise RuntimeError("CacheManager: cached set != radix blocks + exact tails")
            for entry in entries:
                if self._radix.match(entry.token_ids, touch=False).values != entry.path_values:
                    raise RuntimeError("CacheManager: exact entry outlived (or disagrees with) its radix path")
            expected = Counter(self._cached)
            reserved: list[int] = []
            for block_ids in self._pins.values():
                expected.update(block_ids)
            for record in self._plans.values():
                expected.update(record.held)
                reserved.extend(record.new_full if record.tail is None else (*record.new_full, record.tail))
            expected.update(reserved)
            if not self._cached.isdisjoint(reserved) or len(set(reserved)) != len(reserved):
                raise RuntimeError("CacheManager: a reserved block is cached or reserved twice")
            wrong = [b for b in range(self.num_blocks) if self._blocks.refcount(b) != expected[b]]
            if wrong:
                raise RuntimeError(f"CacheManager: refcounts disagree with holders for blocks {wrong}")
            evictable = sum(1 for b in self._cached if self._blocks.refcount(b) == 1)
            if evictable != self._num_evictable:
                raise RuntimeError(f"CacheManager: evictable count {self._num_evictable} != actual {evictable}")


_COUNTERS = ("lookups", "lookup_tokens", "hit_tokens", "full_hits", "stores", "evictions")
