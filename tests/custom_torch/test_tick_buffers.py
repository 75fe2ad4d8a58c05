"""The one-forward tick's supporting pieces: the token buckets of its graphs and the packed tick description."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures_backend import assert_no_leaks, make_backend, one_torch_thread  # noqa: F401
from gemmaserve_custom_torch.kv.forward_batch import pack_tick, token_buckets


@given(st.integers(1, 20000))
@settings(max_examples=200, deadline=None)
def test_buckets_cover_every_length_with_bounded_padding(max_tokens):
    buckets = token_buckets(max_tokens)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == max_tokens
    for n in {1, max_tokens, (max_tokens + 1) // 2}:
        bucket = next(b for b in buckets if b >= n)
        assert bucket <= max(16, 2 * n)  # powers of two and 1.5x: padding at most about a third
    with pytest.raises(ValueError):
        token_buckets(0)


def test_pack_tick_describes_positions_slots_and_scratch(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir, block_size=4)
    pools, bs = backend.pools, backend.pools.block_size
    with backend.lock:
        a = backend.prefill_lookup(list(range(4, 14)))
        backend.prefill_chunk(a, 6)
        b = backend.prefill_lookup([9, 9, 9])
        a.kv.prepare_append(4, release=False)
        b.kv.prepare_append(3, release=False)
        tick = pack_tick(pools, [a.kv, b.kv], [[10, 11, 12, 13], [9, 9, 9]], [1])
        assert tick.positions == [6, 7, 8, 9, 0, 1, 2] and tick.query_start == [0, 4, 7] and tick.seq_lens == [10, 3]
        for group in pools.groups:
            expected = a.kv.slots(group, 6, 10).tolist() + b.kv.slots(group, 0, 3).tolist()
            assert tick.write_slots[group] == expected
            assert all(slot // bs != pools.scratch_block(group) for slot in expected)
        backend.free_row_kv(a.kv)
        backend.free_row_kv(b.kv)
    assert_no_leaks(backend)
