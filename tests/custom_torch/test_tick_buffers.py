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


@settings(max_examples=40, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 8), st.booleans()), min_size=1, max_size=5))
def test_padded_buffers_hold_the_unpadded_batch_and_inert_padding(tiny_gemma4_dir, plan):
    """For any tick (rows of any length, chunks of any size, any logits wanted): the fixed buffers' padded view
    holds the unpadded batch in its first entries; padding tokens write the scratch blocks, padding sequences
    are empty, the tile map covers exactly the real queries, padded logits rows name an empty sequence."""
    import torch
    from gemmaserve_custom_torch.kv.forward_batch import ForwardBuffers, build_forward_batch

    backend = make_backend(tiny_gemma4_dir, block_size=4, kv_blocks=400)
    pools, bs = backend.pools, backend.pools.block_size
    buffers = ForwardBuffers(pools, max_tokens=48, max_seqs=6, width=64, block_ms=[16, 32], device=torch.device("cpu"))
    with backend.lock:
        states = [backend.prefill_lookup([(5 * i + j) % 200 + 4 for i in range(before + n)])
                  for j, (before, n, _) in enumerate(plan)]
        for state, (before, n, _) in zip(states, plan):
            if before:
                backend.prefill_chunk(state, before)
            state.kv.prepare_append(n, release=False)
        wanted = [j for j, (_, _, want) in enumerate(plan) if want]
        tick = pack_tick(pools, [s.kv for s in states], [s.prompt_ids[b : b + n] for s, (b, n, _) in zip(states, plan)],
                         wanted)
        plain = build_forward_batch(pools, tick, torch.device("cpu"), [16, 32])
        bucket = buffers.load(tick)
        view = buffers.view(bucket)
        t, s = tick.num_tokens, len(plan)
        assert bucket >= t and view.ids.shape[0] == bucket
        for name in ("ids", "positions"):
            assert torch.equal(getattr(view, name)[:t], getattr(plain, name))
        assert torch.equal(view.query_start[: s + 1], plain.query_start) and bool((view.query_start[s:] == t).all())
        assert torch.equal(view.seq_lens[:s], plain.seq_lens) and not view.seq_lens[s:].any()
        for group in pools.groups:
            assert torch.equal(view.write_slots[group][:t], plain.write_slots[group])
            assert bool((view.write_slots[group][t:] // bs == pools.scratch_block(group)).all())
            width = plain.block_tables[group].shape[1]
            assert torch.equal(view.block_tables[group][:s, :width], plain.block_tables[group])
        assert view.logit_seqs[: len(wanted)].tolist() == wanted
        pad = view.logit_seqs[len(wanted):]
        assert not pad.numel() or s == buffers.seqs_of(bucket) or bool((view.seq_lens[pad] == 0).all())
        for bm in (16, 32):
            tile_seq, tile_q0, count = view.tiles[bm]
            real = int(count[0])
            assert real == plain.tiles[bm][0].numel()
            assert torch.equal(tile_seq[:real], plain.tiles[bm][0]) and torch.equal(tile_q0[:real], plain.tiles[bm][1])
        for state in states:
            backend.free_row_kv(state.kv)
    assert_no_leaks(backend)
