"""Sliding window done right: out-of-window blocks are freed and sentineled, storage stays bounded on every
path, sliding layers see exactly the last W keys, and long prompts match transformers."""

from __future__ import annotations

import pytest
import torch

from fixtures_backend import FULL, SLIDING, assert_matches_hf_generate, assert_no_leaks, make_backend
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve_custom_torch.kv.pools import GroupGeometry

LONG = [(11 * i + 5) % 500 + 4 for i in range(45)]  # > 5 windows of 8


def test_window_rule_arithmetic():
    g = GroupGeometry(block_size=4, window=8)
    assert [g.first_visible(n) for n in (0, 7, 8, 20)] == [0, 0, 1, 13]
    assert [g.keep_from(n) for n in (7, 8, 9, 11, 12, 20)] == [0, 0, 0, 0, 4, 12]
    assert g.max_blocks(5) == 2 and g.max_blocks(1000) == 3  # ceil(8/4) + 1
    assert GroupGeometry(16, 512).max_blocks(10**6) == 512 // 16 + 1
    assert GroupGeometry(4, 9).max_blocks(10**6) == 4  # ceil(9/4) + 1 when bs does not divide W
    assert GroupGeometry(4, None).max_blocks(1000) == 250


def _check_window_storage(backend, row) -> None:
    geometry = backend.pools.geometry[SLIDING]
    bs, table = backend.pools.block_size, row.tables[SLIDING]
    dead = geometry.keep_from(row.length) // bs
    assert all(b == -1 for b in table[:dead]), f"out-of-window slots must be sentineled: {table}"
    assert all(b >= 0 for b in table[geometry.first_visible(row.length) // bs:])
    assert len(row.held(SLIDING)) <= geometry.max_blocks(10**9)
    assert len(row.held(FULL)) == len(row.tables[FULL]) == -(-row.length // bs)


@pytest.mark.parametrize("chunk", [3, 8, 45])
def test_prefill_frees_out_of_window_blocks_and_stays_bounded(tiny_gemma4_dir, chunk):
    backend = make_backend(tiny_gemma4_dir)
    sliding = backend.pools.managers[SLIDING]
    cap = backend.pools.geometry[SLIDING].max_blocks(10**9)
    with backend.lock:
        state = backend.prefill_lookup(LONG)
        while not state.is_complete:
            backend.prefill_chunk(state, chunk)
            _check_window_storage(backend, state.kv)
            held = set(state.kv.held(SLIDING))
            assert len(held) <= cap
            cached = set(backend.prefix_cache.references()[SLIDING])
            assert sliding.num_used == len(held | cached), "dropped blocks go to the prefix cache or the pool"
            assert all(backend.pools.refcount(SLIDING, b) == 1 for b in cached - held), "dropped = cache-only"
        backend.free_row_kv(state.kv)
        backend.prefix_cache.clear()
    assert sliding.num_used == 0, "every dropped sliding block was reclaimable"
    assert_no_leaks(backend)


def test_decode_frees_out_of_window_blocks(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    cap = backend.pools.geometry[SLIDING].max_blocks(10**9)
    with backend.lock:
        rows = [backend.prefill(p).kv for p in (LONG[:6], LONG[:17])]
        batch = backend.stack_caches_left_padded(rows)
        seen = []  # the decode-only batches the forward ran: the kernel's view of the tables
        forward_batch = backend.mixed.forward_batch
        backend.mixed.forward_batch = lambda b: seen.append(b) or forward_batch(b)
        for step in range(30):
            logits = backend.decode_step_batched(batch, logits_tokens := [7, 9])
            assert logits.shape[0] == len(logits_tokens)
            for row in batch.rows:
                _check_window_storage(backend, row)
            held = {b for row in batch.rows for b in row.held(SLIDING)}
            assert len(held) <= 2 * cap
            cached = set(backend.prefix_cache.references()[SLIDING])
            assert backend.pools.managers[SLIDING].num_used == len(held | cached), "freed blocks go back"
            assert seen[-1].decode_only
            tables = seen[-1].block_tables  # the kernel's view: sentinels in the int32 tables
            for i, row in enumerate(batch.rows):
                assert tables[SLIDING][i, : len(row.tables[SLIDING])].tolist() == row.tables[SLIDING]
                assert -1 in row.tables[SLIDING] or row.length < 16
        for i in (1, 0):
            backend.remove_row_from_cache(batch, i)
    assert_no_leaks(backend)


def test_sliding_layers_ignore_retained_keys_outside_the_window(tiny_gemma4_dir):
    """Blocks kept for prefix hits may hold keys older than the window: poisoning them changes nothing,
    poisoning an in-window key does (so the check can fail)."""
    backend = make_backend(tiny_gemma4_dir)
    prompt = LONG[:22]  # keep_from(22) = 12, first_visible(22) = 15: positions 12..14 are kept but unseen
    with backend.lock:
        row = backend.prefill(prompt).kv
        batch = backend.splice_into_batched(None, row, row.length)
        pools = backend.pools

        def decode_once():
            snapshot = {layer: (pools.k[layer].clone(), pools.v[layer].clone()) for layer in pools.k}
            length = row.length
            logits = backend.decode_step_batched(batch, [3])
            for layer, (k, v) in snapshot.items():  # roll back: same state for the next probe
                pools.k[layer].copy_(k)
                pools.v[layer].copy_(v)
            row.length = length
            row.tables = {g: t[: -(-length // pools.block_size)] for g, t in row.tables.items()}
            return logits

        clean = decode_once()
        stale = row.slots(SLIDING, 12, 15)
        for layer in backend.pools.groups[SLIDING].layers:
            pools.k[layer].view(-1, *pools.k[layer].shape[2:])[stale] = 1e4
        assert torch.equal(decode_once(), clean)
        visible = row.slots(SLIDING, 15, 16)
        for layer in backend.pools.groups[SLIDING].layers:
            pools.k[layer].view(-1, *pools.k[layer].shape[2:])[visible] = 1e4
        assert not torch.equal(decode_once(), clean)


@pytest.mark.parametrize("name", ["gemma4", "gemma3"])
def test_several_windows_long_greedy_matches_transformers(tiny_checkpoint, hf_reference, name):
    path = tiny_checkpoint(name)
    backend = make_backend(path, prefill_chunk_tokens=5)
    hf = hf_reference(path, torch.float32)
    with backend.lock:
        state = backend.prefill_lookup(LONG)
        while not state.is_complete:
            backend.prefill_chunk(state, 5)  # chunks straddle blocks and windows
        tokens = [int(state.last_logits.argmax())]
        batch = backend.splice_into_batched(None, state.kv, state.kv.length)
        for _ in range(19):
            tokens.append(int(backend.decode_step_batched(batch, [tokens[-1]]).argmax()))
        backend.remove_row_from_cache(batch, 0)
    assert_matches_hf_generate(hf, LONG, tokens)
    assert_no_leaks(backend)
