"""Unit tests of the CacheManager API that backends drive."""

from __future__ import annotations

import threading

import pytest

from gemmaserve.errors import ConfigurationError
from gemmaserve.kv import BlockWrite, CacheManager, PrefixMatch, StorePlan


def store(cm: CacheManager, tokens: list[int]) -> StorePlan:
    """begin_store + commit_store (the KV itself lives in backends; here nothing is written)."""
    plan = cm.begin_store(tokens)
    cm.commit_store(plan)
    cm.check_integrity()
    return plan


def lookup_once(cm: CacheManager, tokens: list[int]) -> PrefixMatch:
    match = cm.lookup(tokens)
    cm.release(match)
    return match


def test_empty_cache_and_empty_inputs() -> None:
    cm = CacheManager(num_blocks=4, block_size=2)
    match = cm.lookup([1, 2, 3])
    assert match == PrefixMatch(0, (), False)
    cm.release(match)
    assert cm.lookup([]) == PrefixMatch(0, (), False)
    plan = cm.begin_store([])
    assert plan.writes == [] and plan.token_ids == ()
    cm.commit_store(plan)
    stats = cm.stats()
    assert (stats.lookups, stats.lookup_tokens, stats.hit_tokens, stats.hit_rate) == (2, 3, 0, 0.0)
    cm.check_integrity()


def test_store_then_exact_full_hit_covers_the_partial_tail() -> None:
    cm = CacheManager(num_blocks=8, block_size=4)
    plan = store(cm, [1, 2, 3, 4, 5, 6])
    (full, tail) = plan.writes
    assert (full.token_start, full.token_end, tail.token_start, tail.token_end) == (0, 4, 4, 6)
    match = cm.lookup([1, 2, 3, 4, 5, 6])
    assert match == PrefixMatch(6, (full.block_id, tail.block_id), True)
    cm.release(match)
    # Any other sequence only reaches the full blocks (the tail is for the exact sequence).
    assert lookup_once(cm, [1, 2, 3, 4, 5, 7]) == PrefixMatch(4, (full.block_id,), False)
    assert lookup_once(cm, [1, 2, 3, 4, 5]) == PrefixMatch(4, (full.block_id,), False)
    assert lookup_once(cm, [1, 2, 3, 4]) == PrefixMatch(4, (full.block_id,), True)
    stats = cm.stats()
    assert (stats.full_hits, stats.stores, stats.used_blocks, stats.evictable_blocks) == (2, 1, 2, 2)
    assert stats.hit_rate == pytest.approx(18 / 21)


def test_block_aligned_sequence_has_no_tail_write() -> None:
    cm = CacheManager(num_blocks=8, block_size=2)
    plan = store(cm, [1, 2, 3, 4])
    assert [(w.token_start, w.token_end) for w in plan.writes] == [(0, 2), (2, 4)]
    assert lookup_once(cm, [1, 2, 3, 4]).is_full_hit


def test_store_reuses_the_cached_prefix_and_same_sequence_writes_nothing() -> None:
    cm = CacheManager(num_blocks=8, block_size=2)
    first = store(cm, [1, 2, 3, 4, 5])
    second = store(cm, [1, 2, 3, 4, 6, 7, 8])
    assert [(w.token_start, w.token_end) for w in second.writes] == [(4, 6), (6, 7)]
    reused = {w.block_id for w in first.writes[:2]}
    assert not reused & {w.block_id for w in second.writes}
    assert store(cm, [1, 2, 3, 4, 5]).writes == []
    assert store(cm, [1, 2, 3, 4]).writes == []
    assert cm.stats().used_blocks == 5  # 2 shared + tail [5] + [6, 7] + tail [8]
    match = cm.lookup([1, 2, 3, 4, 6, 7, 8])
    assert match.is_full_hit and match.block_ids[:2] == tuple(w.block_id for w in first.writes[:2])
    cm.release(match)


def test_concurrent_plans_for_the_same_blocks_keep_one_copy() -> None:
    cm = CacheManager(num_blocks=8, block_size=2)
    plan_a = cm.begin_store([1, 2, 3])
    plan_b = cm.begin_store([1, 2, 3])
    assert len(plan_a.writes) == len(plan_b.writes) == 2
    cm.commit_store(plan_a)
    cm.commit_store(plan_b)  # b's copies lose: freed, not cached twice
    cm.check_integrity()
    assert cm.stats().used_blocks == 2
    match = cm.lookup([1, 2, 3])
    assert match.block_ids == tuple(w.block_id for w in plan_a.writes)
    cm.release(match)


def test_pinned_blocks_survive_eviction_and_clear() -> None:
    cm = CacheManager(num_blocks=4, block_size=1)
    store(cm, [1, 2])
    match = cm.lookup([1, 2])
    assert cm.free_capacity_blocks() == 2
    plan = cm.begin_store([3, 4, 5])  # needs 3 blocks, only 2 reclaimable: covers a prefix
    assert [(w.token_start, w.token_end) for w in plan.writes] == [(0, 1), (1, 2)]
    assert not {w.block_id for w in plan.writes} & set(match.block_ids)
    cm.abort_store(plan)
    cm.clear()
    assert lookup_once(cm, [1, 2]).num_tokens == 2
    stats = cm.stats()
    assert (stats.used_blocks, stats.pinned_blocks, stats.evictable_blocks) == (2, 2, 0)
    cm.release(match)
    cm.release(match)  # idempotent
    assert cm.stats().evictable_blocks == 2
    cm.clear()
    assert cm.stats().used_blocks == 0 and cm.stats().evictions == 2
    cm.check_integrity()


def test_eviction_takes_unpinned_tails_first_then_lru_leaves() -> None:
    cm = CacheManager(num_blocks=5, block_size=2)
    store(cm, [3, 3])  # the least recently used leaf
    store(cm, [1, 1, 9])  # block [1, 1] + tail [9]
    store(cm, [2, 2])
    store(cm, [4, 4, 5, 5])  # 1 free block, needs 2: the tail goes although [3, 3] is older
    assert cm.stats().evictions == 1
    assert lookup_once(cm, [3, 3]).num_tokens == 2
    assert lookup_once(cm, [1, 1, 9]) == PrefixMatch(2, lookup_once(cm, [1, 1]).block_ids, False)
    store(cm, [6, 6])  # no tails left: the LRU leaf goes, i.e. [2, 2] (the lookups touched the rest)
    assert lookup_once(cm, [2, 2]).num_tokens == 0
    assert [lookup_once(cm, t).num_tokens for t in ([3, 3], [1, 1], [4, 4, 5, 5], [6, 6])] == [2, 2, 4, 2]
    assert cm.stats().evictions == 2


def test_no_tail_unless_every_full_block_fits() -> None:
    cm = CacheManager(num_blocks=2, block_size=2)
    plan = cm.begin_store([1, 2, 3, 4, 5, 6, 7])
    assert [(w.token_start, w.token_end) for w in plan.writes] == [(0, 2), (2, 4)]
    cm.commit_store(plan)
    assert lookup_once(cm, [1, 2, 3, 4, 5, 6, 7]).num_tokens == 4
    plan = cm.begin_store([9, 9, 9])  # evicts both LRU-leaf-first: [3,4] then [1,2]
    assert [(w.token_start, w.token_end) for w in plan.writes] == [(0, 2), (2, 3)]
    cm.commit_store(plan)
    assert lookup_once(cm, [1, 2]).num_tokens == 0
    cm.check_integrity()


def test_abort_frees_reserved_blocks_and_plans_cannot_be_reused() -> None:
    cm = CacheManager(num_blocks=4, block_size=2)
    store(cm, [1, 2])
    plan = cm.begin_store([1, 2, 3, 4, 5])
    assert cm.stats().pinned_blocks == 3  # reserved [3,4] and [5] + the pinned prefix [1,2]
    cm.abort_store(plan)
    cm.abort_store(plan)
    assert cm.stats().used_blocks == 1 and cm.stats().pinned_blocks == 0
    with pytest.raises(RuntimeError, match="not open"):
        cm.commit_store(plan)
    foreign = cm.begin_store([7, 7])
    with pytest.raises(RuntimeError, match="not open"):
        CacheManager(num_blocks=4, block_size=2).commit_store(foreign)
    cm.abort_store(foreign)
    assert lookup_once(cm, [1, 2, 3, 4]).num_tokens == 2


def test_zero_block_pool_caches_nothing() -> None:
    cm = CacheManager(num_blocks=0, block_size=4)
    plan = store(cm, [1, 2, 3, 4, 5])
    assert plan.writes == [] and lookup_once(cm, [1, 2, 3, 4, 5]).num_tokens == 0


def test_constructor_rejects_bad_sizes_with_actionable_errors() -> None:
    with pytest.raises(ConfigurationError, match="block_size must be an integer >= 1"):
        CacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ConfigurationError, match="num_blocks must be an integer >= 0"):
        CacheManager(num_blocks=-1, block_size=4)


def test_block_write_and_stats_helpers() -> None:
    assert BlockWrite(3, 4, 6).num_tokens == 2
    cm = CacheManager(num_blocks=3, block_size=2)
    stats = cm.stats()
    assert (stats.num_blocks, stats.block_size, stats.free_blocks, stats.hit_rate) == (3, 2, 3, 0.0)


def test_check_integrity_detects_a_leaked_pin() -> None:
    cm = CacheManager(num_blocks=4, block_size=2)
    store(cm, [1, 2])
    cm.lookup([1, 2])
    cm._pins.clear()  # forget the pin without unpinning: the block now has an unaccounted reference
    with pytest.raises(RuntimeError, match="refcounts disagree"):
        cm.check_integrity()


def test_concurrent_callers_keep_the_books_consistent() -> None:
    cm = CacheManager(num_blocks=16, block_size=2)
    prompts = [[i % 3, 1, 2, (i * 7) % 4, i % 2] for i in range(12)]

    def worker(offset: int) -> None:
        for step in range(60):
            tokens = prompts[(offset + step) % len(prompts)]
            match = cm.lookup(tokens)
            plan = cm.begin_store(tokens)
            if step % 3:
                cm.commit_store(plan)
            else:
                cm.abort_store(plan)
            cm.release(match)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cm.check_integrity()
    stats = cm.stats()
    assert stats.pinned_blocks == 0 and stats.lookups == 240
