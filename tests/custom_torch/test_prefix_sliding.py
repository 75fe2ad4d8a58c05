"""Prefix hits survive the sliding window. Prompt blocks are cached progressively as prefill chunks finish, so
the sliding blocks a longer prompt drops during prefill stay cached (cache-only, reclaimable) and a later
request that shares only its prefix hits them (the Workload B finding of docs/benchmarks.md). Under
sliding-pool pressure they are trimmed (LRU) and hits degrade without changing a single token."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytest

from fixtures_backend import FULL, SLIDING, assert_no_leaks, contiguous_greedy, make_backend, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.engine.request import FinishReason

W = 8  # the tiny Gemma 4's sliding window
PREFIX = [(13 * i + 7) % 500 + 4 for i in range(21)]  # shared prefix P = 21 tokens
A = PREFIX + [(7 * i + 3) % 500 + 4 for i in range(14)]  # 35 tokens > P + W
B = PREFIX + [300, 301, 302, 303, 304, 305]
_EXPECTED: dict[tuple[int, ...], list[int]] = {}


def _reference(model, prompt, num_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` run alone without any cache (unpaged reference), memoised."""
    key = (*prompt, -num_tokens)
    if key not in _EXPECTED:
        _EXPECTED[key] = contiguous_greedy(model, prompt, num_tokens)
    return _EXPECTED[key]


def _run(backend, requests, chunk, **kwargs):
    done = run_scheduler(backend, requests, prefill_chunk_tokens=chunk, **kwargs)
    for rid, (prompt, _, n) in zip(sorted(done, key=lambda r: int(r[1:])), requests):
        request = done[rid]
        assert request.finish_reason is FinishReason.LENGTH, (rid, request.finish_reason, request.error_type)
        assert request.output_token_ids == _reference(backend.model, prompt, n), rid
    return done


@pytest.mark.parametrize(
    ("block_size", "chunk", "second", "hit", "mixed"),
    [
        (4, 4, B, 20, True),  # largest block-aligned c <= P = 21
        (4, 8, B, 20, True),
        (2, 5, B, 20, True),  # chunks straddle blocks
        (4, 8, PREFIX[:20], 19, True),  # the whole prompt is cached: one token is recomputed
        (4, 16, B, 20, True),  # the one-forward tick caps chunks at W, so every sliding position is stored
        (4, 16, B, 20, False),  # so do prefill_chunks without mixed ticks (prefill-only ticks)
    ],
    ids=["bs4-chunk4", "bs4-chunk8", "bs2-chunk5", "prefix-only", "chunk-over-window", "chunk-over-window-apart"],
)
def test_prefix_of_a_longer_prompt_is_hit(tiny_gemma4_dir, block_size, chunk, second, hit, mixed):
    backend = make_backend(tiny_gemma4_dir, block_size=block_size, mixed_step=mixed)
    _run(backend, [(A, 0, 4)], chunk)
    assert len(backend.prefix_cache.references()[SLIDING]) > backend.pools.geometry[SLIDING].max_blocks(10**9)
    done = _run(backend, [(second, 0, 6)], chunk)
    assert done["r0"].cached_tokens == hit
    assert_no_leaks(backend)


def test_cancelled_prefill_leaves_its_completed_blocks_cached(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    with backend.lock:
        state = backend.prefill_lookup(A)
        for _ in range(6):  # 24 of 35 tokens; the row has dropped the sliding blocks of positions < 16
            backend.prefill_chunk(state, 4)
        assert state.kv.tables[SLIDING][:4] == [-1] * 4
        backend.free_row_kv(state.kv)  # cancelled mid-prefill: no prefill_store
        backend.check_integrity()
    done = _run(backend, [(B, 0, 6)], 4)
    assert done["r0"].cached_tokens == 20
    assert_no_leaks(backend)


def test_reclaim_never_takes_what_a_live_row_holds(tiny_gemma4_dir):
    """Mid-prefill, reclaiming everything drops only cache-only blocks; the row finishes with its tokens."""
    backend = make_backend(tiny_gemma4_dir)
    with backend.lock:
        state = backend.prefill_lookup(A)
        for _ in range(6):
            backend.prefill_chunk(state, 4)
        row = state.kv
        held = {g: list(row.held(g)) for g in (FULL, SLIDING)}
        for group in (SLIDING, FULL):
            backend.prefix_cache.reclaim(group, 10**6)
        backend.check_integrity()
        assert backend.prefix_cache.stats["trimmed_sliding_blocks"] >= 4, "the dropped sliding blocks went"
        assert {g: list(row.held(g)) for g in held} == held
        assert all(backend.pools.refcount(g, b) >= 1 for g, ids in held.items() for b in ids)
        cached = backend.prefix_cache.references()
        assert set(cached[FULL]) == set(held[FULL][:6]), "full blocks the row holds stay cached"
        while not state.is_complete:
            backend.prefill_chunk(state, 4)
        tokens = [int(state.last_logits.argmax())]
        batch = backend.splice_into_batched(None, row, row.length)
        for _ in range(5):
            tokens.append(int(backend.decode_step_batched(batch, [tokens[-1]]).argmax()))
        backend.remove_row_from_cache(batch, 0)
    assert tokens == _reference(backend.model, A, 6)
    assert_no_leaks(backend)


@pytest.mark.parametrize("sliding_blocks", [24, 6], ids=["roomy", "tiny-sliding-pool"])
def test_tiny_sliding_pool_trims_and_hits_degrade_gracefully(tiny_gemma4_dir, sliding_blocks):
    """A, then an unrelated D churning the sliding pool, then B: with room B hits the full prefix; with a
    6-block sliding pool (two rows' worth) A's early sliding blocks were trimmed, B hits less (or nothing),
    tokens are identical and no admitted request fails. Then everything again, concurrently."""
    backend = make_backend(tiny_gemma4_dir, kv_blocks=60, sliding_blocks=sliding_blocks, max_batch_size=2)
    other = [(17 * i + 5) % 500 + 4 for i in range(30)]
    _run(backend, [(A, 0, 4)], 4)
    _run(backend, [(other, 0, 8)], 4)
    hit = _run(backend, [(B, 0, 6)], 4)["r0"].cached_tokens
    stats = backend.prefix_cache.stats
    if sliding_blocks == 24:
        assert hit == 20 and stats["trimmed_sliding_blocks"] == 0
    else:
        assert hit < 20 and stats["trimmed_sliding_blocks"] > 0, (hit, dict(stats))
    backend.check_integrity()
    mixed = [(A, 0, 5), (other, 0, 7), (B, 3, 6), (PREFIX + [9, 8, 7], 5, 4), (PREFIX[:12] + other[:9], 6, 3)]
    _run(backend, mixed, 4, max_batch_size=2)
    assert_no_leaks(backend)


_PREFIXES = [[(31 * i + 17 * k) % 500 + 4 for i in range(24)] for k in range(2)]


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(
        st.tuples(
            st.integers(0, 1), st.integers(0, 24), st.integers(0, 14), st.integers(0, 12), st.integers(1, 5)
        ).filter(lambda r: r[1] + r[2] > 0),
        min_size=2, max_size=5,
    ),
    block_size=st.sampled_from([2, 4]),
    chunk=st.sampled_from([3, 4, 8, 13]),
    sliding_blocks=st.sampled_from([None, 6, 10]),
    max_batch_size=st.integers(1, 3),
)
def test_random_shared_prefix_workloads_match_solo_runs(
    tiny_gemma4_dir, requests, block_size, chunk, sliding_blocks, max_batch_size
):
    """Prefix + own text, random arrivals, chunk sizes and pool sizes through ContinuousBatchScheduler:
    integrity every tick (inside run_scheduler), solo tokens for every request, nothing leaked."""
    backend = make_backend(tiny_gemma4_dir, block_size=block_size, kv_blocks=64, sliding_blocks=sliding_blocks,
                           max_batch_size=max_batch_size)
    work = [
        (_PREFIXES[p][:n] + [(11 * i + 29 * r) % 500 + 4 for i in range(own)], tick, max_tokens)
        for r, (p, n, own, tick, max_tokens) in enumerate(requests)
    ]
    _run(backend, work, chunk, max_batch_size=max_batch_size)
    assert_no_leaks(backend)
