"""Unit tests of the reference-counted block allocator."""

from __future__ import annotations

import pytest

from gemmaserve.kv import BlockManager, BlockRefError, OutOfBlocksError


def test_allocate_hands_out_distinct_blocks_with_one_reference() -> None:
    bm = BlockManager(4)
    block_ids = bm.allocate(3)
    assert sorted(block_ids) == sorted(set(block_ids)) and all(0 <= b < 4 for b in block_ids)
    assert [bm.refcount(b) for b in block_ids] == [1, 1, 1]
    assert (bm.num_used, bm.num_free) == (3, 1)
    bm.check_integrity()


def test_allocate_zero_and_capacity_checks() -> None:
    bm = BlockManager(2)
    assert bm.allocate(0) == [] and bm.num_free == 2
    assert bm.can_allocate(2) and not bm.can_allocate(3) and not bm.can_allocate(-1)
    with pytest.raises(OutOfBlocksError, match="need 3 KV blocks but only 2 of 2 are free"):
        bm.allocate(3)
    with pytest.raises(ValueError):
        bm.allocate(-1)
    assert bm.num_free == 2
    assert isinstance(OutOfBlocksError("x"), RuntimeError)


def test_shared_block_is_freed_by_its_last_reference_only() -> None:
    bm = BlockManager(3)
    a, b = bm.allocate(2)
    bm.incref([a, a])
    assert bm.refcount(a) == 3
    assert bm.decref([a, b]) == [b]
    assert bm.decref([a]) == []
    assert bm.decref([a]) == [a]
    assert bm.num_free == 3
    bm.check_integrity()


def test_freed_blocks_are_reused_first_freed_first() -> None:
    bm = BlockManager(3)
    a, b, c = bm.allocate(3)
    bm.decref([b])
    bm.decref([a])
    assert bm.allocate(2) == [b, a]


def test_misuse_raises_and_changes_nothing() -> None:
    bm = BlockManager(3)
    a, b = bm.allocate(2)
    with pytest.raises(BlockRefError, match="holds 1 reference"):
        bm.decref([b, a, a])  # a would go negative: nothing may be applied, not even b
    assert (bm.refcount(a), bm.refcount(b)) == (1, 1)
    free_block = next(x for x in range(3) if bm.refcount(x) == 0)
    with pytest.raises(BlockRefError, match="incref of free block"):
        bm.incref([a, free_block])
    assert bm.refcount(a) == 1
    with pytest.raises(BlockRefError, match="not in"):
        bm.refcount(3)
    with pytest.raises(BlockRefError):
        bm.decref([-1])
    for bad in (True, 3, -1, 1.0, "0"):  # ids that are not block numbers, on both paths, before any change
        with pytest.raises(BlockRefError, match="not in"):
            bm.incref([a, bad])
        with pytest.raises(BlockRefError, match="not in"):
            bm.decref([a, bad])
    assert (bm.refcount(a), bm.refcount(b)) == (1, 1)
    bm.check_integrity()


def test_constructor_validates() -> None:
    assert BlockManager(0).allocate(0) == []
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError):
            BlockManager(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda bm: bm._free.append(bm._free[0]), "duplicate"),
        (lambda bm: bm._free.popleft(), "leaked"),
        (lambda bm: bm._refcounts.__setitem__(bm._free[0], 2), "free-but-referenced"),
        (lambda bm: bm._refcounts.__setitem__(next(b for b in range(4) if b not in bm._free), -1), "negative"),
    ],
)
def test_check_integrity_detects_corruption(corrupt, message) -> None:  # type: ignore[no-untyped-def]
    bm = BlockManager(4)
    bm.allocate(1)
    bm.check_integrity()
    corrupt(bm)
    with pytest.raises(RuntimeError, match=message):
        bm.check_integrity()
