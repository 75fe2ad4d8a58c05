"""The one-forward tick's supporting pieces: the token buckets of its graphs and the packed tick description."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures_backend import assert_no_leaks, make_backend, one_torch_thread  # noqa: F401
from gemmaserve_custom_torch.kv.forward_batch import ForwardBuffers, logit_buckets, pack_tick, token_buckets


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
        buffers.load(tick)  # staged twice, the second time over the first's state and through the other stager
        buffers.load_padding(48)
        t, s = tick.num_tokens, len(plan)
        sources = [(7 * j) % 5 - 1 for j in range(min(s, t))]  # the first tokens (decode rows'); -1: keep the id
        previous = torch.arange(1000, 1005)
        bucket = buffers.load(tick, sources)
        buffers.feed_previous(previous)
        view = buffers.view(bucket)
        assert bucket >= t and view.ids.shape[0] == bucket
        fed = [1000 + src if src >= 0 else int(plain.ids[j]) for j, src in enumerate(sources)]
        assert view.ids[: len(sources)].tolist() == fed
        view.ids[: len(sources)] = plain.ids[: len(sources)]  # undo the feed
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


def test_a_pool_without_headroom_falls_back_to_the_one_row_path(tiny_gemma4_dir):
    """A sliding pool of one row's window and no headroom: a chunk's tick cannot hold its old window and its
    new blocks at once, so it shrinks, and one that cannot take a token runs alone on the one-row path (which
    gathers the old window first); the prompt completes with the logits of a roomy backend."""
    import torch

    prompt = [(3 * i + 1) % 200 + 4 for i in range(20)]
    tight = make_backend(tiny_gemma4_dir, kv_blocks=None, kv_memory_gb=0.001, sliding_blocks=3)
    plain = make_backend(tiny_gemma4_dir)
    logits = []
    for backend in (plain, tight):
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            backend.prefill_chunk(state, 12)
            backend.prefill_chunk(state, 8)
            logits.append(state.last_logits.clone())
            backend.free_row_kv(state.kv)
        assert_no_leaks(backend)
    assert tight.mixed.shrunk > 0 and plain.mixed.shrunk == plain.mixed.deferred == 0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_a_chunk_no_tick_can_place_runs_on_the_one_row_path(tiny_gemma4_dir, monkeypatch):
    """When a tick cannot give a chunk even one token's blocks, the chunk runs alone on the one-row path
    within the same call, and the prompt's logits are those of the tick path."""
    import torch
    from gemmaserve.errors import KVCapacityError
    from gemmaserve_custom_torch.kv.paged_cache import PagedKVCache

    prompt = [(5 * i + 2) % 200 + 4 for i in range(14)]
    plain, starved = make_backend(tiny_gemma4_dir), make_backend(tiny_gemma4_dir)
    in_tick = {"on": False}
    original_run, original_prepare = starved.mixed.run, PagedKVCache.prepare_append

    def run(*args, **kwargs):
        in_tick["on"] = True
        try:
            return original_run(*args, **kwargs)
        finally:
            in_tick["on"] = False

    def prepare(self, num_new, *, release=True):
        if in_tick["on"]:
            raise KVCapacityError("no block for the tick (test)")
        return original_prepare(self, num_new, release=release)

    monkeypatch.setattr(starved.mixed, "run", run)
    monkeypatch.setattr(PagedKVCache, "prepare_append", prepare)
    logits = []
    for backend in (plain, starved):
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            backend.prefill_chunk(state, len(prompt))
            assert state.is_complete
            logits.append(state.last_logits.clone())
            backend.free_row_kv(state.kv)
        assert_no_leaks(backend)
    assert starved.mixed.deferred > 0 and starved.mixed.steps == 0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_default_pools_leave_room_for_a_burst_of_chunks(tiny_gemma4_dir):
    """The default sliding pool keeps one chunk of headroom per row, so a burst of MAX_BATCH_SIZE requests
    prefilled together never shrinks a chunk for lack of blocks (H200 run 10: without the headroom, workload
    B's chunks ran one by one)."""
    import random

    from gemmaserve.settings import CoreSettings
    from gemmaserve_custom_torch.backend import CustomTorchBackend
    from gemmaserve_custom_torch.kv.pools import kv_groups, plan_pool_sizes
    from gemmaserve_custom_torch.settings import load_custom_settings
    from gemmaserve_custom_torch.tokenizer import HFTokenizer

    from fixtures_backend import run_scheduler

    groups = kv_groups(make_backend(tiny_gemma4_dir).model.config)
    limits = {"max_rows": 16, "max_active_tokens": 16 * 256, "max_len": 256}
    plain = plan_pool_sizes(groups, 4, 4, 10**9, sliding_blocks=None, **limits)
    roomy = plan_pool_sizes(groups, 4, 4, 10**9, sliding_blocks=None, sliding_headroom_tokens=8, **limits)
    assert plain["sliding_attention"] == 16 * 3 and roomy["sliding_attention"] == 16 * (3 + 2)

    rows = 24
    core = CoreSettings(model=str(tiny_gemma4_dir), device="cpu", dtype="float32", kv_block_size=4,
                        max_batch_size=rows, max_active_kv_tokens=rows * 256, prefill_chunk_tokens=8)
    model = make_backend(tiny_gemma4_dir).model
    backend = CustomTorchBackend(model, HFTokenizer.from_pretrained(tiny_gemma4_dir), core, load_custom_settings())
    rng = random.Random(3)
    prefix = [rng.randrange(4, 200) for _ in range(24)]
    cold = [([rng.randrange(4, 200) for _ in range(28)], 0, 2) for _ in range(rows)]
    run_scheduler(backend, cold, max_batch_size=rows, prefill_chunk_tokens=8, max_active_kv_tokens=rows * 256)
    run_scheduler(backend, [(prefix + [5, 6, 7, 8], 0, 1)], prefill_chunk_tokens=8)
    hits = [(prefix + [rng.randrange(4, 200) for _ in range(4)], 0, 2) for _ in range(rows)]
    run_scheduler(backend, hits, max_batch_size=rows, prefill_chunk_tokens=8, max_active_kv_tokens=rows * 256)
    stats = backend.kv_stats()
    assert stats["mixed_steps"] > 0 and stats["mixed_step_shrunk_chunks"] == 0, stats
    assert stats["prefix_hits"] >= rows
    assert_no_leaks(backend)


@settings(max_examples=200, deadline=None, database=None)
@given(seqs=st.integers(1, 2000), count=st.integers(0, 2000))
def test_logit_buckets_cover_every_row_count(seqs, count) -> None:
    """``logit_buckets(seqs)``: increasing, within ``seqs``, ending at it; the bucket picked for ``count`` wanted
    rows (at most ``seqs`` of them) is the smallest that holds them."""
    from gemmaserve_custom_torch.kv.decode_state import pick_bucket

    buckets = logit_buckets(seqs)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == seqs and buckets[0] == min(16, seqs)
    count = min(count, seqs)
    rows = pick_bucket(buckets, max(count, 1))
    assert rows >= count and all(b < max(count, 1) for b in buckets if b < rows)


def test_a_bucket_picks_its_logits_rows_from_the_wanted_count(tiny_gemma4_dir) -> None:
    backend = make_backend(tiny_gemma4_dir)
    buffers = ForwardBuffers(backend.pools, max_tokens=512, max_seqs=256, width=8, block_ms=[16],
                             device=torch.device("cpu"))
    assert [buffers.logit_rows_for(512, n) for n in (0, 1, 16, 17, 64, 65, 256)] == [16, 16, 16, 64, 64, 256, 256]
    assert [buffers.logit_rows_for(48, n) for n in (3, 17, 48)] == [16, 48, 48]  # room for 48 sequences
    assert buffers.view(512, 64).logit_seqs.shape == (64,) and buffers.view(512).logit_seqs.shape == (256,)
