"""Unit tests of the two prefix indexes: RadixPrefixIndex (full blocks) and ExactMatchIndex (whole
sequences with a partial tail)."""

from __future__ import annotations

import pytest

from gemmaserve.kv import ExactMatchIndex, RadixPrefixIndex

# -- RadixPrefixIndex --------------------------------------------------------------------------


def test_match_on_empty_index_and_short_input() -> None:
    index = RadixPrefixIndex(2)
    assert index.match([]) == (0, ())
    assert index.match([1, 2, 3]) == (0, ())
    index.insert([1, 2, 3], ["a"])  # the partial block [3] is not indexed
    assert index.match([1]) == (0, ())
    assert index.match([1, 2]) == (2, ("a",))
    assert index.match([1, 2, 3, 4]) == (2, ("a",))
    assert index.num_cached_blocks == 1


def test_match_is_longest_block_aligned_prefix() -> None:
    index = RadixPrefixIndex(2)
    index.insert([1, 2, 3, 4, 5, 6], ["a", "b", "c"])
    index.insert([1, 2, 3, 5], ["x", "d"])
    assert index.match([1, 2, 3, 4, 5, 7]) == (4, ("a", "b"))
    assert index.match([1, 2, 3, 5, 5]) == (4, ("a", "d"))
    assert index.match([2, 1, 3, 4]) == (0, ())
    index.check_integrity()


def test_insert_reports_existing_new_and_duplicate_values() -> None:
    index = RadixPrefixIndex(1)
    first = index.insert([7, 8], [10, 11])
    assert (first.num_existing, first.values, first.new_values, first.duplicate_values) == (0, (10, 11), (10, 11), ())
    second = index.insert([7, 8, 9], [20, 11, 22])  # block 0 given a duplicate, block 1 its own value back
    assert second.num_existing == 2
    assert second.values == (10, 11, 22)
    assert second.new_values == (22,)
    assert second.duplicate_values == (20,)
    assert len(index) == 3 and 22 in index and 20 not in index


def test_insert_validates_and_changes_nothing_on_error() -> None:
    index = RadixPrefixIndex(2)
    index.insert([1, 2], [0])
    with pytest.raises(ValueError, match="2 values for 1 full blocks"):
        index.insert([3, 4, 5], [1, 2])
    with pytest.raises(ValueError, match="already held"):
        index.insert([3, 4, 5, 6], [1, 0])  # 0 is already cached for [1, 2]
    with pytest.raises(ValueError, match="repeated"):
        index.insert([3, 4, 5, 6], [1, 1])
    assert len(index) == 1 and index.match([3, 4]) == (0, ())
    with pytest.raises(ValueError):
        RadixPrefixIndex(0)
    index.check_integrity()


def test_evict_removes_least_recently_used_leaves_then_their_parents() -> None:
    index = RadixPrefixIndex(1)
    index.insert([1, 2, 3], ["a", "b", "c"])
    index.insert([1, 5], ["a", "e"])
    index.match([1, 2, 3])  # touches a, b, c: e is now the LRU leaf
    assert index.evict(1, lambda v: True) == ["e"]
    assert index.evict(5, lambda v: True) == ["c", "b", "a"]
    assert len(index) == 0
    index.check_integrity()


def test_evict_skips_rejected_leaves_and_keeps_their_ancestors() -> None:
    index = RadixPrefixIndex(1)
    index.insert([1, 2], ["a", "b"])
    index.insert([3], ["c"])
    pinned = {"b"}
    assert index.evict(10, lambda v: v not in pinned) == ["c"]
    assert index.match([1, 2], touch=False) == (2, ("a", "b"))
    assert index.evict(0, lambda v: True) == [] and index.evict(-1, lambda v: True) == []
    pinned.clear()
    assert index.evict(10, lambda v: v not in pinned) == ["b", "a"]


def test_unreachable_names_evictable_blocks_above_pinned_ones() -> None:
    index = RadixPrefixIndex(1)
    index.insert([1, 2, 3], ["a", "b", "c"])
    index.insert([1, 2, 4], ["a", "b", "d"])
    index.insert([5, 6], ["e", "f"])
    pinned = {"c", "e"}
    assert sorted(index.unreachable(lambda v: v not in pinned)) == ["a", "b"]  # above c; e itself is pinned
    evicted = index.clear(lambda v: v not in pinned)
    assert sorted(evicted) == ["d", "f"] and sorted(index.unreachable(lambda v: v not in pinned)) == ["a", "b"]
    assert index.unreachable(lambda v: True) == []


def test_match_without_touch_leaves_lru_order_alone() -> None:
    index = RadixPrefixIndex(1)
    index.insert([1], ["old"])
    index.insert([2], ["new"])
    index.match([1], touch=False)
    assert index.evict(1, lambda v: True) == ["old"]
    index.match([2])
    index.insert([3], ["newer"])
    assert index.evict(1, lambda v: True) == ["new"]


def test_radix_check_integrity_detects_corruption() -> None:
    index = RadixPrefixIndex(2)
    index.insert([1, 2, 3, 4], ["a", "b"])
    index.check_integrity()
    index._leaves.clear()
    with pytest.raises(RuntimeError, match="leaf set"):
        index.check_integrity()
    index = RadixPrefixIndex(2)
    index.insert([1, 2], ["a"])
    del index._by_value["a"]
    with pytest.raises(RuntimeError, match="value map"):
        index.check_integrity()


# -- ExactMatchIndex ---------------------------------------------------------------------------


def test_exact_get_add_and_values() -> None:
    index = ExactMatchIndex(2)
    assert index.get([1, 2, 3]) is None
    assert index.add([1, 2, 3], ["p"], "t") is True
    assert index.add((1, 2, 3), ["p"], "other") is False  # already recorded: unchanged
    entry = index.get([1, 2, 3])
    assert entry is not None and entry.values == ("p", "t") and entry.token_ids == (1, 2, 3)
    assert index.get([1, 2]) is None and index.get([1, 2, 3, 4]) is None
    assert index.add([5, 6], ["q"], None) and index.get([5, 6]).values == ("q",)  # type: ignore[union-attr]
    assert [1, 2, 3] in index and (9,) not in index
    assert (len(index), index.num_tails) == (2, 1)
    index.check_integrity()


def test_exact_add_validates_shape_and_tail_ownership() -> None:
    index = ExactMatchIndex(2)
    with pytest.raises(ValueError, match="path values"):
        index.add([1, 2, 3], [], "t")
    with pytest.raises(ValueError, match="tail value is required"):
        index.add([1, 2, 3], ["p"], None)
    with pytest.raises(ValueError, match="tail value is required"):
        index.add([1, 2], ["p"], "t")
    index.add([1, 2, 3], ["p"], "t")
    with pytest.raises(ValueError, match="already referenced"):
        index.add([1, 2, 4], ["p"], "t")
    with pytest.raises(ValueError, match="already referenced"):
        index.add([1, 2, 4], ["p"], "p")
    with pytest.raises(ValueError, match="another entry's tail"):
        index.add([7, 8, 9], ["t"], "u")
    assert len(index) == 1
    index.check_integrity()


def test_exact_remove_value_drops_every_entry_through_it() -> None:
    index = ExactMatchIndex(1)
    index.add([1, 2], ["a", "b"], None)
    index.add([1, 3], ["a", "c"], None)
    index.add([4], ["d"], None)
    removed = index.remove_value("a")
    assert sorted(e.token_ids for e in removed) == [(1, 2), (1, 3)]
    assert index.remove_value("a") == [] and len(index) == 1
    index = ExactMatchIndex(2)
    index.add([1, 2, 3], ["p"], "t")
    assert [e.tail_value for e in index.remove_value("t")] == ["t"]
    index.check_integrity()


def test_exact_pop_hands_the_entry_and_its_tail_over() -> None:
    index = ExactMatchIndex(2)
    index.add([1, 2, 3], ["p"], "t")
    index.add([1, 2, 4], ["p"], "u")
    entry = index.pop([1, 2, 3])
    assert entry is not None and entry.tail_value == "t" and [1, 2, 3] not in index
    assert index.pop((1, 2, 3)) is None and index.remove_value("t") == [] and index.num_tails == 1
    assert index.add([1, 2, 3], ["p"], "t")  # the tail is free to be recorded again
    index.check_integrity()


def test_exact_evict_tails_is_lru_and_skips_rejected() -> None:
    index = ExactMatchIndex(2)
    index.add([1, 2, 3], ["p"], "t1")
    index.add([4], [], "t2")
    index.add([5, 6], ["q"], None)  # no tail: never a candidate
    index.add([7], [], "t3")
    index.get([1, 2, 3])  # t1 becomes the most recently used
    evicted = index.evict_tails(2, lambda tail: tail != "t2")
    assert [e.tail_value for e in evicted] == ["t3", "t1"]
    assert index.evict_tails(0, lambda tail: True) == []
    assert [e.token_ids for e in index.entries()] == [(4,), (5, 6)]
    index.check_integrity()


def test_exact_check_integrity_detects_corruption() -> None:
    index = ExactMatchIndex(2)
    index.add([1, 2, 3], ["p"], "t")
    index._tails.clear()
    with pytest.raises(RuntimeError, match="reverse maps"):
        index.check_integrity()
