"""`GraphPrefill` (cold prefill chunks over fixed, padded buffers) on CPU: the same padded forward the CUDA
graphs capture, run eagerly. It must give the paged prefill's logits and every request's greedy tokens,
write the same K/V, leave no block behind, and stay out of the way of warm rows (prefix hits, later chunks).
The CUDA-graph replay itself is checked on the GPU (tests/custom_torch/test_cuda_graphs.py)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures_backend import assert_no_leaks, make_backend, one_torch_thread, run_scheduler  # noqa: F401
from gemmaserve.errors import KVCapacityError
from gemmaserve_custom_torch.prefill_graphs import GraphPrefill, make_graph_prefill, prefill_buckets
from gemmaserve_custom_torch.settings import load_custom_settings


@given(st.integers(1, 5000))
@settings(max_examples=200)
def test_buckets_cover_every_length_with_bounded_padding(max_tokens):
    buckets = prefill_buckets(max_tokens)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == max_tokens
    for n in (1, max_tokens // 3 + 1, max_tokens):
        bucket = min(b for b in buckets if b >= n)
        assert bucket >= n and (bucket <= max(16, 2 * n) or bucket == max_tokens)
    assert all(b2 <= 2 * b1 for b1, b2 in zip(buckets, buckets[1:]) if b1 >= 16)


def test_buckets_reject_a_nonpositive_length():
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_buckets(0)


def with_graph_prefill(backend, attention="eager", max_tokens=48):
    """Attach an eager-mode GraphPrefill (what the CUDA graphs replay) to ``backend``'s runner."""
    backend.runner.graph_prefill = GraphPrefill(backend.model, backend.pools, buckets=prefill_buckets(max_tokens),
                                                attention=attention, use_graphs=False)
    return backend.runner.graph_prefill


def assert_same_visible_kv(backend_a, row_a, backend_b, row_b) -> None:
    """Both rows store the same K and V (fp32, up to summation order) at every position the next query of
    each layer sees."""
    end = row_a.length
    assert row_b.length == end
    for layer in backend_a.pools.k:
        group = backend_a.pools.group_of_layer[layer]
        first = backend_a.pools.geometry[group].first_visible(end)
        slots_a, slots_b = row_a.slots(group, first, end), row_b.slots(group, first, end)
        for pools_a, pools_b in ((backend_a.pools.k, backend_b.pools.k), (backend_a.pools.v, backend_b.pools.v)):
            a = pools_a[layer].view(-1, *pools_a[layer].shape[2:])[slots_a]
            b = pools_b[layer].view(-1, *pools_b[layer].shape[2:])[slots_b]
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_k_eq_v"])
@pytest.mark.parametrize("length", [3, 8, 17, 40])  # window 8: the chunk is shorter than / equal to / past it
def test_cold_chunk_logits_and_kv_equal_the_paged_prefill(tiny_checkpoint, name, length):
    path = tiny_checkpoint(name)
    prompt = [(7 * i + 5) % 200 + 4 for i in range(length)]
    plain, padded = make_backend(path), make_backend(path)
    graph = with_graph_prefill(padded)
    results = []
    for backend in (plain, padded):
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            backend.prefill_chunk(state, length)
            results.append((state.last_logits, state.kv))
    assert graph.chunks == 1
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    assert_same_visible_kv(plain, results[0][1], padded, results[1][1])
    for backend, (_, kv) in zip((plain, padded), results):
        backend.free_row_kv(kv)
        assert_no_leaks(backend)


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_k_eq_v"])
@pytest.mark.parametrize("start", [3, 8, 13, 21])  # window 8, block 4: before / at / past the window, unaligned
@pytest.mark.parametrize("num_new", [1, 5, 8])  # warm chunks are at most the window long
def test_warm_chunk_logits_and_kv_equal_the_paged_prefill(tiny_checkpoint, name, start, num_new):
    path = tiny_checkpoint(name)
    prompt = [(5 * i + 7) % 200 + 4 for i in range(start + num_new)]
    plain, padded = make_backend(path), make_backend(path)
    graph = with_graph_prefill(padded, max_tokens=24)
    results = []
    for backend in (plain, padded):
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            backend.prefill_chunk(state, start)
            backend.prefill_chunk(state, num_new)
            state.kv.check_integrity()  # the warm path released the out-of-window blocks after its forward
            results.append((state.last_logits, state.kv))
    assert (graph.chunks, graph.warm_chunks) == (2, 1)
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    assert_same_visible_kv(plain, results[0][1], padded, results[1][1])
    for backend, (_, kv) in zip((plain, padded), results):
        backend.free_row_kv(kv)
        assert_no_leaks(backend)


def test_a_warm_chunk_without_spare_blocks_runs_eagerly(tiny_gemma4_dir):
    """A warm chunk briefly holds the sliding blocks its first queries read; with a pool that has no room
    for them the chunk falls back to the paged prefill (which frees first) and gives the same logits."""
    prompt = [(3 * i + 1) % 200 + 4 for i in range(20)]
    plain = make_backend(tiny_gemma4_dir, kv_blocks=None, kv_memory_gb=None, sliding_blocks=3)
    tight = make_backend(tiny_gemma4_dir, kv_blocks=None, kv_memory_gb=None, sliding_blocks=3)
    graph = with_graph_prefill(tight)
    logits = []
    for backend in (plain, tight):
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            backend.prefill_chunk(state, 12)
            backend.prefill_chunk(state, 8)
            logits.append(state.last_logits)
            backend.free_row_kv(state.kv)
        assert_no_leaks(backend)
    assert (graph.chunks, graph.warm_chunks) == (1, 0)  # the cold chunk only
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [24, 8])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_scheduler_tokens_are_unchanged_with_graph_prefill(tiny_gemma4_dir, attention, chunk):
    """Joins, leaves, repeated prompts (prefix hits: warm chunks), prompts of several chunks (cold first
    chunk; later ones warm when no longer than the window, else paged): every request's greedy tokens equal
    the plain backend's."""
    rng = random.Random(4)
    base = [rng.randrange(4, 200) for _ in range(30)]
    requests = [(base, 0, 12), (base, 3, 12), (base[:20] + [9, 9], 4, 10)]
    requests += [([rng.randrange(4, 200) for _ in range(rng.randrange(1, 60))], rng.randrange(0, 12),
                  rng.randrange(1, 20)) for _ in range(10)]
    plain = make_backend(tiny_gemma4_dir, prefill_attention=attention)
    padded = make_backend(tiny_gemma4_dir, prefill_attention=attention, mixed_step=False)
    graph = with_graph_prefill(padded, attention=attention, max_tokens=24)
    got = [{rid: r.output_token_ids for rid, r in run_scheduler(b, requests, prefill_chunk_tokens=chunk).items()}
           for b in (plain, padded)]
    assert got[1] == got[0]
    assert graph.chunks > graph.warm_chunks > 0
    assert padded.kv_stats()["prefix_hits"] >= 1
    for backend in (plain, padded):
        assert_no_leaks(backend)


def test_which_chunks_apply(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    graph = with_graph_prefill(backend, max_tokens=16)
    assert graph.max_warm_tokens == 8  # the window
    with backend.lock:
        state = backend.prefill_lookup(list(range(4, 40)))
        assert graph.applies(state.kv, 16) and not graph.applies(state.kv, 17) and not graph.applies(state.kv, 0)
        backend.prefill_chunk(state, 16)
        assert graph.applies(state.kv, 8) and not graph.applies(state.kv, 9)  # warm: at most the window
        while not state.is_complete:
            backend.prefill_chunk(state, 16)
        assert (graph.chunks, graph.warm_chunks) == (2, 1)  # 16 cold, 16 paged (> window), 4 warm
        backend.free_row_kv(state.kv)
    small = GraphPrefill(backend.model, backend.pools, buckets=(8,), attention="eager", use_graphs=False,
                         max_keys=32)
    row = backend.prefill([5, 6, 7]).kv
    with backend.lock:
        assert small.applies(row, 8)
        row.length = 40  # (only the length matters to applies) the full group would need 48 keys > 32
        assert not small.applies(row, 8)
        row.length = 3
        backend.free_row_kv(row)


def test_make_graph_prefill_is_cuda_only_and_can_be_disabled(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    assert backend.graph_prefill is None and backend.runner.graph_prefill is None  # CPU
    for enabled in (True, False):
        custom = load_custom_settings(prefill_graph=enabled)
        assert make_graph_prefill(backend.model, backend.pools, custom, "eager", 512) is None


def test_prefill_graph_setting_reads_the_environment(monkeypatch):
    monkeypatch.setenv("CUSTOM_BACKEND_PREFILL_GRAPH", "0")
    assert load_custom_settings().prefill_graph is False


# -- batched prefill (several rows' chunks in one forward) ----------------------------------------------------
def test_batched_prefill_plans_sub_batches_within_the_token_budget(tiny_gemma4_dir):
    from gemmaserve_custom_torch.batched_prefill import BatchedPrefill

    backend = make_backend(tiny_gemma4_dir)
    batched = BatchedPrefill(backend.model, backend.pools, "eager", max_tokens=16)
    assert batched.max_chunk == 8  # the window
    assert BatchedPrefill(backend.model, backend.pools, "eager", max_chunk=5).max_chunk == 5
    row = backend.prefill([5, 6, 7]).kv
    with backend.lock:
        assert batched.applies(row, 8) and not batched.applies(row, 9) and not batched.applies(row, 0)
        backend.free_row_kv(row)
    assert batched.plan([8, 8, 1, 4, 4, 4, 4, 8]) == [[0, 1], [2, 3, 4, 5], [6, 7]]
    assert batched.plan([]) == []
    narrow = BatchedPrefill(backend.model, backend.pools, "eager", max_tokens=64, max_keys=20, max_batch_keys=40)
    assert narrow.plan([2, 2, 2, 2], keys=[10, 10, 20, 5]) == [[0, 1], [2, 3]]  # rows x widest keys <= 40
    with pytest.raises(ValueError, match="min_rows"):
        BatchedPrefill(backend.model, backend.pools, "eager", min_rows=1)


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_k_eq_v", "gemma4_moe"])
def test_batched_chunks_equal_one_by_one_prefill(tiny_checkpoint, name):
    """Rows of mixed starts (cold, warm, past the window) and chunk sizes in one forward: logits and the
    K/V each row keeps equal the one-row paged prefill; integrity holds and nothing leaks."""
    path = tiny_checkpoint(name)
    rng = random.Random(1)
    plan = [(0, 8), (0, 3), (5, 8), (13, 1), (21, 6), (8, 8)]  # (tokens before, chunk)
    prompts = [[rng.randrange(4, 200) for _ in range(a + b)] for a, b in plan]
    plain, batched = make_backend(path), make_backend(path, batched_prefill="on")
    assert plain.batched_prefill is None and batched.batched_prefill is not None
    states = {}
    for backend in (plain, batched):
        with backend.lock:
            states[backend] = [backend.prefill_lookup(p) for p in prompts]
            for state, (before, _) in zip(states[backend], plan):
                if before:
                    backend.prefill_chunk(state, before)
            backend.prefill_chunks(states[backend], [chunk for _, chunk in plan])
            backend.check_integrity()
    assert batched.batched_prefill.batches == 1 and batched.batched_prefill.rows == len(plan)
    for mine, theirs in zip(states[batched], states[plain]):
        assert mine.is_complete and theirs.is_complete
        torch.testing.assert_close(mine.last_logits, theirs.last_logits, atol=1e-4, rtol=1e-4)
        assert_same_visible_kv(plain, theirs.kv, batched, mine.kv)
    for backend in (plain, batched):
        with backend.lock:
            for state in states[backend]:
                backend.free_row_kv(state.kv)
        assert_no_leaks(backend)


def test_scheduler_tokens_are_unchanged_with_batched_prefill(tiny_gemma4_dir):
    """A burst of requests (shared prefixes, repeats, chunks past the window) through the scheduler: batched
    prefill plus the eager-mode graph prefill give every request the plain backend's greedy tokens."""
    rng = random.Random(6)
    base = [rng.randrange(4, 200) for _ in range(26)]
    requests = [(base + [rng.randrange(4, 200) for _ in range(rng.randrange(1, 9))], rng.randrange(0, 3), 8)
                for _ in range(8)]
    requests += [([rng.randrange(4, 200) for _ in range(rng.randrange(1, 40))], rng.randrange(0, 6),
                  rng.randrange(1, 12)) for _ in range(10)]
    plain = make_backend(tiny_gemma4_dir, mixed_step=False)
    fast = make_backend(tiny_gemma4_dir, batched_prefill="on", mixed_step=False)
    with_graph_prefill(fast, max_tokens=8)
    got = [{rid: r.output_token_ids for rid, r in run_scheduler(b, requests, prefill_chunk_tokens=8).items()}
           for b in (plain, fast)]
    assert got[1] == got[0]
    assert fast.batched_prefill.batches > 0 and fast.kv_stats()["prefix_hits"] > 0
    for backend in (plain, fast):
        assert_no_leaks(backend)


def test_a_batch_without_blocks_falls_back_to_one_by_one(tiny_gemma4_dir, monkeypatch):
    """When a batched forward raises (here: the pools cannot hold its extra blocks), its rows run one by
    one and still complete."""
    prompts = [[(3 * i + j) % 200 + 4 for j in range(6)] for i in range(5)]
    backend = make_backend(tiny_gemma4_dir, batched_prefill="on")

    def no_room(*args, **kwargs):
        raise KVCapacityError("no room for the batch")

    monkeypatch.setattr(backend.batched_prefill, "prefill", no_room)
    with backend.lock:
        states = [backend.prefill_lookup(p) for p in prompts]
        assert backend.prefill_chunks(states, [6] * len(states)) == [None] * len(states)
        assert all(state.is_complete for state in states) and backend.batched_prefill.fallbacks == 1
        for state in states:
            backend.free_row_kv(state.kv)
    assert_no_leaks(backend)


@pytest.mark.parametrize("mixed", [False, True], ids=["batched-prefill", "one-forward-tick"])
def test_default_pools_leave_room_for_a_burst_of_batched_chunks(tiny_gemma4_dir, mixed):
    """With fixed-buffer prefill on, the default sliding pool keeps one chunk of headroom per row, so a burst
    of MAX_BATCH_SIZE requests prefilled together never falls back for lack of blocks (H200 run 10: without
    the headroom, workload B's batches fell back to one-by-one eager chunks and took 2.4 s instead of ~0.2 s)."""
    from gemmaserve.settings import CoreSettings
    from gemmaserve_custom_torch.backend import CustomTorchBackend
    from gemmaserve_custom_torch.tokenizer import HFTokenizer
    from gemmaserve_custom_torch.kv.pools import kv_groups, plan_pool_sizes

    groups = kv_groups(make_backend(tiny_gemma4_dir).model.config)
    plain = plan_pool_sizes(groups, 4, 4, 10**9, sliding_blocks=None, max_rows=16)
    roomy = plan_pool_sizes(groups, 4, 4, 10**9, sliding_blocks=None, max_rows=16, sliding_headroom_tokens=8)
    assert plain["sliding_attention"] == 16 * 3 and roomy["sliding_attention"] == 16 * (3 + 2)

    rows = 24
    core = CoreSettings(model=str(tiny_gemma4_dir), device="cpu", dtype="float32", kv_block_size=4,
                        max_batch_size=rows, max_active_kv_tokens=rows * 256, prefill_chunk_tokens=8)
    backend = make_backend(tiny_gemma4_dir)  # (for its model)
    backend = CustomTorchBackend(backend.model, HFTokenizer.from_pretrained(tiny_gemma4_dir), core,
                                 load_custom_settings(batched_prefill="off" if mixed else "on", mixed_step=mixed))
    rng = random.Random(3)
    prefix = [rng.randrange(4, 200) for _ in range(24)]
    cold = [([rng.randrange(4, 200) for _ in range(28)], 0, 2) for _ in range(rows)]
    run_scheduler(backend, cold, max_batch_size=rows, prefill_chunk_tokens=8, max_active_kv_tokens=rows * 256)
    run_scheduler(backend, [(prefix + [5, 6, 7, 8], 0, 1)], prefill_chunk_tokens=8)
    hits = [(prefix + [rng.randrange(4, 200) for _ in range(4)], 0, 2) for _ in range(rows)]
    run_scheduler(backend, hits, max_batch_size=rows, prefill_chunk_tokens=8, max_active_kv_tokens=rows * 256)
    stats = backend.kv_stats()
    if mixed:
        assert stats["mixed_steps"] > 0 and stats["mixed_step_deferred_chunks"] == 0, stats
    else:
        assert stats["prefill_batches"] > 0 and stats["prefill_batch_fallbacks"] == 0, stats
    assert stats["prefix_hits"] >= rows
    assert_no_leaks(backend)


def test_warm_graph_shapes_are_capped(tiny_gemma4_dir):
    """Past ``max_warm_graphs`` warm shapes, new shapes run the padded forward without a graph."""
    backend = make_backend(tiny_gemma4_dir)
    graph = GraphPrefill(backend.model, backend.pools, buckets=prefill_buckets(16), attention="eager",
                         use_graphs=False, max_warm_graphs=2)
    backend.runner.graph_prefill = graph
    replayed: list[tuple] = []

    class RecordingGraphs:  # stands in for StepGraphs (no CUDA here): records which shapes it would serve
        def run(self, key):
            replayed.append(key)
            return graph._forward(key)

    graph.graphs = RecordingGraphs()
    with backend.lock:
        for start in (3, 20, 40, 60):  # different full-group key counts: different warm shapes
            state = backend.prefill_lookup([(7 * i + start) % 200 + 4 for i in range(start + 8)])
            backend.prefill_chunk(state, start)
            backend.prefill_chunk(state, 8)
            assert state.is_complete
            backend.free_row_kv(state.kv)
    warm = [key for key in replayed if key[0] == "warm"]
    assert graph.warm_chunks == 4 and len(set(warm)) == 2 == len(warm)
    assert_no_leaks(backend)
