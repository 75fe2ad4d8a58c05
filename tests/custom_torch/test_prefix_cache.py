"""Prefix cache: reuse without recompute (reported hits), identical tokens, full hits that recompute only
the last token (copy-on-write), sliding-window-aware hit validity, eviction and trimming under pressure."""

from __future__ import annotations

import pytest
import torch

from fixtures_backend import FULL, SLIDING, assert_no_leaks, contiguous_greedy, make_backend
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.testing.row_driver import solo_greedy

BASE = [(13 * i + 7) % 500 + 4 for i in range(40)]


def _solo(backend, prompt, n=6):
    return solo_greedy(backend, prompt, n)


@pytest.mark.parametrize("length", [24, 27, 25], ids=["aligned", "tail", "tail-of-one"])
def test_full_hit_recomputes_only_the_last_token(tiny_gemma4_dir, length):
    backend = make_backend(tiny_gemma4_dir)
    prompt = BASE[:length]
    expected = contiguous_greedy(backend.model, prompt, 6)
    assert _solo(backend, prompt) == expected
    cached = {g: sorted(c) for g, c in backend.prefix_cache.references().items()}
    snapshot = {layer: k.clone() for layer, k in backend.pools.k.items()}
    with backend.lock:
        state = backend.prefill_lookup(prompt)
        assert state.num_cached == state.num_computed == length - 1 == backend.last_cache_hit_tokens
        assert state.num_remaining == 1
        backend.free_row_kv(state.kv)
    assert _solo(backend, prompt) == expected  # decodes into copies, never into the cached blocks
    for layer, k in backend.pools.k.items():
        group = backend.pools.group_of_layer[layer]
        assert torch.equal(k[cached[group]], snapshot[layer][cached[group]]), "a cached block was written"
    assert_no_leaks(backend)


def test_shared_prefix_reuses_blocks_and_gives_identical_tokens(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    first = BASE[:21]
    second = BASE[:20] + [300, 301, 302, 303, 304, 305, 306]  # shares 5 full blocks, diverges inside the 6th
    _solo(backend, first)
    with backend.lock:
        state = backend.prefill_lookup(second)
        assert state.num_cached == 20 and backend.last_cache_hit_tokens == 20
        row = state.kv
        shared = row.tables[FULL][:5]
        assert all(backend.pools.refcount(FULL, b) == 2 for b in shared), "row + cache share the blocks"
        while not state.is_complete:
            backend.prefill_chunk(state, 3)
        tokens = [int(state.last_logits.argmax())]
        batch = backend.splice_into_batched(None, row, row.length)
        for _ in range(5):
            tokens.append(int(backend.decode_step_batched(batch, [tokens[-1]]).argmax()))
        backend.remove_row_from_cache(batch, 0)
        assert all(backend.pools.refcount(FULL, b) == 1 for b in shared), "cached blocks stay cached"
    assert tokens == contiguous_greedy(backend.model, second, 6)
    assert backend.kv_stats()["prefix_hit_tokens"] == 20
    assert_no_leaks(backend)


def test_hit_needs_the_sliding_window_before_it(tiny_gemma4_dir):
    """A hit is valid only where the sliding window before it is stored. A long prompt asked in ONE chunk
    (> W) is prefilled in ticks of at most W tokens, each caching its blocks before the next releases them,
    so a prompt sharing just its first blocks reuses them; one extending the whole prompt reuses all of it.
    A hit whose window was trimmed: see test_prefix_sliding.py."""
    backend = make_backend(tiny_gemma4_dir)
    _solo(backend, BASE)  # 40 tokens in one prefill_chunk call: five ticks of 8
    geometry = backend.pools.geometry[SLIDING]
    with backend.lock:
        short = BASE[:12] + [400, 401, 402]
        state = backend.prefill_lookup(short)
        assert state.num_cached == 12, "every block-aligned prefix of a ticked prompt keeps its sliding window"
        backend.free_row_kv(state.kv)
        longer = BASE + [410, 411, 412, 413, 414]
        state = backend.prefill_lookup(longer)
        assert state.num_cached == 40
        assert all(b >= 0 for b in state.kv.tables[SLIDING][geometry.first_visible(40) // 4 :])
        backend.free_row_kv(state.kv)
    for prompt in (short, longer):
        assert _solo(backend, prompt) == contiguous_greedy(backend.model, prompt, 6)
    assert_no_leaks(backend)


def test_eviction_and_sliding_trims_under_pressure(tiny_gemma4_dir):
    """Pools too small to keep everything cached: the cache gives blocks back (LRU leaves, tails, sliding
    trims) and every request still gets exactly its solo tokens."""
    backend = make_backend(tiny_gemma4_dir, kv_blocks=16, sliding_blocks=9)
    assert backend.pools.managers[SLIDING].num_blocks == 9 and backend.pools.managers[FULL].num_blocks == 23
    others = [[(17 * i + 3 * j) % 500 + 4 for i in range(19)] for j in range(1, 5)]
    prompts = [BASE[:18], BASE[:23], *others[:2], BASE[:26], *others[2:], BASE[:18], others[3][:17]]
    for prompt in prompts:
        assert _solo(backend, prompt) == contiguous_greedy(backend.model, prompt, 6), prompt
        backend.check_integrity()
    stats = backend.prefix_cache.stats
    assert stats["evicted_blocks"] > 0 and stats["trimmed_sliding_blocks"] > 0, dict(stats)
    assert stats["hits"] > 0
    assert_no_leaks(backend)


def test_clear_drops_everything_not_in_use(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    for prompt in (BASE[:9], BASE[:30], BASE[5:19]):
        _solo(backend, prompt)
    with backend.lock:
        live = backend.prefill(BASE[:30]).kv
        backend.prefix_cache.clear()
        backend.check_integrity()
        assert backend.pools.managers[FULL].num_used == len(live.held(FULL)), "only the live row's blocks remain"
        in_use = set(live.held(FULL))
        backend.free_row_kv(live)
        assert set(backend.prefix_cache.references()[FULL]) <= in_use, "only blocks in use stayed cached"
        backend.prefix_cache.clear()
    assert all(m.num_used == 0 for m in backend.pools.managers.values())
    assert_no_leaks(backend)


def test_indexing_resumes_below_the_blocks_already_indexed(tiny_gemma4_dir, monkeypatch):
    """A prefix hit's row, chunk after chunk, is indexed from the last block indexed for it (its hit's, then its
    own): the index walks only the new blocks, and the cache ends exactly as a walk from the root leaves it
    (same block paths, references and integrity)."""
    prompts = [BASE[:20] + [300 + i, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311] for i in range(3)]

    def run(resume: bool) -> tuple[list, dict, list]:
        backend = make_backend(tiny_gemma4_dir)
        _solo(backend, BASE[:21])
        insert, knowns = backend.prefix_cache.radix.insert, []

        def recording_insert(tokens, values, *, known=None):
            knowns.append(known)
            return insert(tokens, values, known=known if resume else None)

        monkeypatch.setattr(backend.prefix_cache.radix, "insert", recording_insert)
        for prompt in prompts:
            assert _solo(backend, prompt) == contiguous_greedy(backend.model, prompt, 6)
        backend.prefix_cache.check_integrity()
        assert_no_leaks(backend)
        references = {g: sorted(c.values()) for g, c in backend.prefix_cache.references().items()}
        return sorted(backend.prefix_cache.block_paths()), references, knowns

    paths, references, knowns = run(resume=True)
    assert (paths, references) == run(resume=False)[:2]
    assert any(known is not None for known in knowns), "no insert resumed below a known block"


def test_a_tail_copy_that_reclaims_the_prompts_own_path_is_given_back(tiny_gemma4_dir):
    """A prompt whose path the cache already held (cache-only blocks) while its row computed its own: copying its
    partial tail block can reclaim part of that path. The tail then has nothing to hang on: it is released (it
    used to raise in the exact index, fail the request and leak both copies)."""
    from gemmaserve.errors import KVCapacityError

    backend = make_backend(tiny_gemma4_dir, kv_blocks=18, block_size=2)

    def prompt_of(family: int, length: int) -> list[int]:
        return [(family * 97 + 13 * i) % 400 + 4 for i in range(length)]

    rows = []
    with backend.lock:
        for family, length in ((1, 4), (1, 17), (0, 23), (0, 9)):  # rows held: the pools are under pressure
            try:
                rows.append(backend.prefill(prompt_of(family, length)).kv)
            except KVCapacityError:
                continue
            backend.check_integrity()
        for row in rows:
            backend.free_row_kv(row)
    assert_no_leaks(backend)
    with backend.lock:
        backend.prefix_cache.clear()
    assert all(m.num_used == 0 for m in backend.pools.managers.values())


def test_cache_only_blocks_above_a_rows_own_blocks_are_reclaimed(tmp_path):
    """A cached prompt whose sliding blocks were trimmed is no valid hit for a longer prompt over it, so that row
    computes its own blocks where the index already has cache-only ones, and indexes its next block below them:
    they are never a leaf while it lives, yet admission counts them as free. Reclaim repairs them (the index takes
    the row's copies); before, the request failed with KVCapacityError (pools: 2 sliding, 22 full)."""
    from gemmaserve.engine.request import FinishReason
    from gemmaserve_custom_torch.models import GemmaForCausalLM
    from tiny_checkpoints import build_tiny_gemma3

    from fixtures_backend import run_scheduler

    path = build_tiny_gemma3(tmp_path / "g3", seed=3, num_hidden_layers=2, layer_types=[SLIDING, FULL],
                             sliding_window=2, hidden_size=16, intermediate_size=16, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=8)
    backend = make_backend(path, block_size=2, kv_blocks=12, max_batch_size=1, prefill_chunk_tokens=4)
    prompt = list(range(10, 34))  # 12 blocks of 2
    done = run_scheduler(backend, [(prompt, 0, 2), ([40, 41, 42, 43, 44, 45], 30, 2), ([*prompt, 7], 60, 8)],
                         max_batch_size=1, prefill_chunk_tokens=4, max_num_batched_tokens=8)
    assert [r.finish_reason for r in done.values()] == [FinishReason.LENGTH] * 3, [r.error for r in done.values()]
    model = GemmaForCausalLM.from_hf(path, "cpu", torch.float32)
    assert list(done["r2"].output_token_ids) == contiguous_greedy(model, [*prompt, 7], 8)
    assert backend.prefix_cache.stats["repaired_blocks"] > 0
    assert_no_leaks(backend)


def test_cache_only_blocks_above_another_rows_blocks_are_repaired_when_reclaiming(tiny_gemma4_dir):
    """Two rows miss on the same prefix and compute it each; the first one's copy is indexed and the second row
    indexes its next block below it. Once the first row is freed its copy is cache-only (counted as free) above a
    block a live row holds: reclaim gives the index the live row's copy and frees the other."""
    backend = make_backend(tiny_gemma4_dir)
    shared = [(13 * i + 7) % 500 + 4 for i in range(16)]  # 4 blocks of 4
    first, second = [*shared, *range(300, 312)], [*shared, 400, 401, 402, 403, 404]
    cache, bs = backend.prefix_cache, backend.pools.block_size
    with backend.lock:
        s0, s1 = backend.prefill_lookup(first), backend.prefill_lookup(second)
        assert s0.num_cached == s1.num_cached == 0
        backend.prefill_chunk(s0, 16)
        backend.prefill_chunk(s1, 16)  # its own copy of the shared blocks: the index keeps s0's
        backend.prefill_chunk(s0, 12)
        backend.prefill_chunk(s1, 5)  # its fifth block goes below s0's four
        backend.free_row_kv(s0.kv)
        backend.check_integrity()  # stranded, but s1 holds its own copies: repairable
        assert len([v for v in cache.radix.unreachable(cache._cache_only) if v.full is not None]) == 4
        cache.reclaim(FULL, backend.pools.managers[FULL].num_blocks)
        assert cache.stats["repaired_blocks"] == 4
        assert [v for v in cache.radix.unreachable(cache._cache_only) if v.full is not None] == []
        path = cache.radix.path_to(s1.kv.indexed_last)
        assert [v.full for v in path] == s1.kv.tables[FULL][: len(second) // bs]
        backend.check_integrity()
        hit = backend.prefill_lookup([*shared, 1, 2])
        assert hit.num_cached == 16  # the repaired blocks still serve the prefix
        backend.free_row_kv(hit.kv)
        backend.free_row_kv(s1.kv)
    assert_no_leaks(backend)


def test_the_repair_walks_from_a_block_the_row_holds(tiny_gemma4_dir):
    """The walk that finds stranded blocks starts at the deepest indexed block the row holds (``cache_anchor``),
    not at the last one it indexed: that one can be another row's copy, evicted once that row is gone, and the
    blocks above it would be missed."""
    backend = make_backend(tiny_gemma4_dir)
    cache = backend.prefix_cache
    prompt = [(13 * i + 7) % 500 + 4 for i in range(12)]
    with backend.lock:
        d, r = backend.prefill_lookup(prompt), backend.prefill_lookup([*prompt, 99])
        backend.prefill_chunk(d, 4)  # block 0: d's
        backend.prefill_chunk(r, 8)  # block 1: r's own, below d's block 0
        backend.prefill_chunk(d, 8)  # block 2: d's
        backend.prefill_chunk(r, 4)  # r's last indexed block is d's block 2
        assert r.kv.indexed_last.full != r.kv.tables[FULL][2]
        backend.free_row_kv(d.kv)
        backend.check_integrity()
        x = backend.prefill_lookup([*prompt[:4], 77])  # shares d's block 0: nothing to repair while it lives
        assert x.num_cached == 4
        cache.reclaim(FULL, backend.pools.managers[FULL].num_blocks)
        assert cache.stats["repaired_blocks"] == 0
        backend.free_row_kv(x.kv)
        y = backend.prefill_lookup([450, 451, 452])  # as many rows as before, but block 0 is cache-only now
        cache.reclaim(FULL, backend.pools.managers[FULL].num_blocks)  # the fruitless repair is not remembered
        assert cache.stats["repaired_blocks"] == 1
        assert [v for v in cache.radix.unreachable(cache._cache_only) if v.full is not None] == []
        backend.check_integrity()
        backend.free_row_kv(y.kv)
        backend.free_row_kv(r.kv)
    assert_no_leaks(backend)


def test_a_recomputed_prefix_gives_its_sliding_blocks_back_to_the_cache(tiny_gemma4_dir):
    """A prompt whose cached sliding blocks were trimmed is computed again by the next request over it; that
    request's sliding blocks are attached to the cached path, so the one after it hits the whole prefix."""
    backend = make_backend(tiny_gemma4_dir)
    cache = backend.prefix_cache
    base = [(13 * i + 7) % 500 + 4 for i in range(40)]
    solo_greedy(backend, base, 2)
    with backend.lock:
        cache.reclaim(SLIDING, backend.pools.managers[SLIDING].num_blocks)  # trim every cache-only sliding block
        state = backend.prefill_lookup([*base, 401, 402, 403])
        assert state.num_cached == 0
        backend.free_row_kv(state.kv)
    solo_greedy(backend, [*base, 401, 402, 403], 2)
    with backend.lock:
        state = backend.prefill_lookup([*base, 501, 502, 503])
        assert state.num_cached == 40
        backend.free_row_kv(state.kv)
    assert_no_leaks(backend)
