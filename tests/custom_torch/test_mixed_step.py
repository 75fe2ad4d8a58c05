"""The one-forward tick of custom_torch (`forward_step` over `MixedStep`): greedy parity with transformers under
small token budgets and staggered arrivals on every tiny topology, fast prefill (KV-shared tail narrowed)
against the full computation, bitwise prefill on the portable path, and failure behaviour."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures_backend import assert_matches_hf_generate, assert_no_leaks, make_backend, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.backend import PrefillState
from gemmaserve.engine.request import FinishReason
from gemmaserve_custom_torch.mixed_step import shared_tail_start

TOPOLOGIES = ["gemma4", "gemma3", "gemma4_k_eq_v", "gemma4_moe"]


def _requests(seed: int) -> list[tuple[list[int], int, int]]:
    """(prompt, arrival tick, max_tokens): past-the-window prompts, a shared prefix (hits), short ones."""
    rng = random.Random(seed)
    base = [rng.randrange(4, 400) for _ in range(21)]
    requests = [(base + [rng.randrange(4, 400) for _ in range(rng.randrange(0, 6))], rng.randrange(0, 8), 6)
                for _ in range(3)]
    requests += [([rng.randrange(4, 400) for _ in range(rng.randrange(1, 45))], rng.randrange(0, 10),
                  rng.randrange(1, 9)) for _ in range(6)]
    return requests


@pytest.mark.parametrize("fast_prefill", [True, False], ids=["fast-prefill", "full-prefill"])
@pytest.mark.parametrize("name", TOPOLOGIES)
def test_staggered_requests_under_a_small_budget_match_transformers(tiny_checkpoint, hf_reference, name,
                                                                    fast_prefill):
    path = tiny_checkpoint(name)
    backend = make_backend(path, fast_prefill=fast_prefill)
    assert backend.capabilities.mixed_step
    hf = hf_reference(path, torch.float32)
    requests = _requests(11)
    done = run_scheduler(backend, requests, max_batch_size=4, prefill_chunk_tokens=8, max_num_batched_tokens=12)
    for rid, (prompt, _, n) in zip(sorted(done, key=lambda r: int(r[1:])), requests):
        assert done[rid].finish_reason is FinishReason.LENGTH, (rid, done[rid].error)
        assert_matches_hf_generate(hf, prompt, done[rid].output_token_ids)
    stats = backend.kv_stats()
    assert stats["mixed_steps"] > 0 and stats["prefix_hits"] >= 1
    assert_no_leaks(backend)


def _one_tick(backend, prompts, decode_prompt):
    """A decoding row (``decode_prompt`` prefilled, one token fed) plus one chunk of each prompt, in one
    forward_step. Returns (decode logits, states)."""
    with backend.lock:
        decoding = backend.prefill(decode_prompt)
        batch = backend.splice_into_batched(None, decoding.kv, backend.kv_length(decoding.kv))
        states = [backend.prefill_lookup(p) for p in prompts]
        out = backend.forward_step(states, [len(p) for p in prompts], batch, [7])
    assert out.prefill_errors == [None] * len(prompts)
    return out.decode_logits.clone(), states, batch


@pytest.mark.parametrize("name", ["gemma4", "gemma4_k_eq_v"])
def test_fast_prefill_keeps_stored_kv_and_tokens(tiny_checkpoint, name):
    """Narrowing the KV-shared tail changes neither the stored K/V (bitwise) nor the logits that are kept (fp32:
    equal up to summation order, same argmax)."""
    path = tiny_checkpoint(name)
    fast, full = make_backend(path, fast_prefill=True), make_backend(path, fast_prefill=False)
    assert fast.mixed.narrow_layer == shared_tail_start(fast.model) is not None and full.mixed.narrow_layer is None
    prompts = [[(3 * i + j) % 300 + 4 for i in range(n)] for j, n in enumerate([5, 8, 1, 7])]
    results = [_one_tick(b, prompts, [9, 10, 11, 12, 13]) for b in (fast, full)]
    (dec_a, states_a, batch_a), (dec_b, states_b, batch_b) = results
    torch.testing.assert_close(dec_a, dec_b, atol=1e-5, rtol=1e-5)
    assert torch.equal(dec_a.argmax(-1), dec_b.argmax(-1))
    for a, b in zip(states_a, states_b):
        assert a.is_complete and b.is_complete
        torch.testing.assert_close(a.last_logits, b.last_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.last_logits.argmax(-1), b.last_logits.argmax(-1))
        for layer in fast.pools.k:  # stored K/V: bit for bit
            group = fast.pools.group_of_layer[layer]
            sa, sb = a.kv.slots(group, 0, a.kv.length), b.kv.slots(group, 0, b.kv.length)
            for pa, pb in ((fast.pools.k, full.pools.k), (fast.pools.v, full.pools.v)):
                assert torch.equal(pa[layer].view(-1, *pa[layer].shape[2:])[sa],
                                   pb[layer].view(-1, *pb[layer].shape[2:])[sb])
    for backend, states, batch in ((fast, states_a, batch_a), (full, states_b, batch_b)):
        with backend.lock:
            for state in states:
                backend.free_row_kv(state.kv)
            backend.remove_row_from_cache(batch, 0)
        assert_no_leaks(backend)


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_k_eq_v"])
def test_portable_prefill_is_bitwise_the_one_row_path_and_close_to_transformers(tiny_checkpoint, hf_reference, name):
    """fp32, eager reference attention, full prefill: a prompt alone in the one-forward tick gives the logits of
    the one-row paged prefill bit for bit (each sequence attends with transformers' eager op sequence over
    the same keys); packed with other prompts (other matmul shapes) it agrees to fp32 rounding, and both
    agree with transformers."""
    path = tiny_checkpoint(name)
    mixed = make_backend(path, fast_prefill=False, prefill_chunk_tokens=64)
    one_row = make_backend(path, prefill_chunk_tokens=64)  # its one-row eager path, driven directly below
    hf = hf_reference(path, torch.float32)
    prompts = [[(5 * i + j) % 300 + 4 for i in range(n)] for j, n in enumerate([6, 3, 8])]  # within the window
    with mixed.lock, one_row.lock:
        alone = [mixed.prefill_lookup(p) for p in prompts]
        for state, prompt in zip(alone, prompts):
            assert mixed.forward_step([state], [len(prompt)], None, []).prefill_errors == [None]
        packed = [mixed.prefill_lookup(p) for p in prompts]
        assert mixed.forward_step(packed, [len(p) for p in prompts], None, []).prefill_errors == [None] * 3
        plain = [one_row.prefill_lookup(p) for p in prompts]
        for state, prompt in zip(plain, prompts):
            one_row._prefill_alone(state, len(prompt))  # PagedRunner.prefill: the one-row fallback
    for prompt, state, other, reference in zip(prompts, alone, packed, plain):
        assert torch.equal(state.last_logits, reference.last_logits), prompt
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
        torch.testing.assert_close(state.last_logits[0], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(other.last_logits[0], ref, atol=1e-5, rtol=1e-5)
    for backend, states in ((mixed, alone + packed), (one_row, plain)):
        with backend.lock:
            for state in states:
                backend.free_row_kv(state.kv)
        assert_no_leaks(backend)


def test_chunks_are_capped_at_the_window_and_the_rest_follows_next_tick(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    window = backend.model.config.sliding_window
    prompt = [(7 * i) % 300 + 4 for i in range(3 * window + 2)]
    with backend.lock:
        state = backend.prefill_lookup(prompt)
        backend.forward_step([state], [len(prompt)], None, [])
        assert state.num_computed == window and not state.is_complete
        while not state.is_complete:
            backend.forward_step([state], [len(prompt)], None, [])
        backend.free_row_kv(state.kv)
    assert_no_leaks(backend)


def test_a_raising_forward_leaves_every_row_as_it_was(tiny_gemma4_dir, monkeypatch):
    """If the one forward raises, decode rows and chunk rows keep their lengths (the scheduler retries them
    alone); the tokens of every request still equal an undisturbed run."""
    requests = _requests(3)
    plain = run_scheduler(make_backend(tiny_gemma4_dir), requests, max_batch_size=3, max_num_batched_tokens=10)
    backend = make_backend(tiny_gemma4_dir)
    original, calls = backend.mixed.run, {"n": 0}

    def raising(decode_rows, decode_ids, chunks, *feed):
        calls["n"] += 1
        if calls["n"] == 2:
            before = [row.length for row in decode_rows] + [row.length for row, _, _ in chunks]
            backend.model.forward_hidden = boom
            try:
                return original(decode_rows, decode_ids, chunks, *feed)
            finally:
                del backend.model.forward_hidden  # the class method again
                after = [row.length for row in decode_rows] + [row.length for row, _, _ in chunks]
                assert after == before
        return original(decode_rows, decode_ids, chunks, *feed)

    def boom(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(backend.mixed, "run", raising)
    done = run_scheduler(backend, requests, max_batch_size=3, max_num_batched_tokens=10)
    assert calls["n"] > 2
    assert {r: q.output_token_ids for r, q in done.items()} == {r: q.output_token_ids for r, q in plain.items()}
    assert backend.kv_stats()["mixed_steps"] > 0
    assert_no_leaks(backend)


def test_a_short_pool_shrinks_chunks_instead_of_failing(tiny_gemma4_dir):
    """Sliding pool with no headroom: chunks are halved until their old window fits, requests complete."""
    backend = make_backend(tiny_gemma4_dir, sliding_blocks=9, kv_blocks=None, kv_memory_gb=0.001)
    requests = [([(11 * i + j) % 300 + 4 for i in range(30)], 0, 3) for j in range(3)]
    done = run_scheduler(backend, requests, max_batch_size=3, prefill_chunk_tokens=8)
    reference = run_scheduler(make_backend(tiny_gemma4_dir), requests, max_batch_size=3, prefill_chunk_tokens=8)
    assert all(r.finish_reason is FinishReason.LENGTH for r in done.values())
    assert {r: q.output_token_ids for r, q in done.items()} == {r: q.output_token_ids for r, q in reference.items()}
    assert backend.kv_stats()["mixed_step_shrunk_chunks"] > 0
    assert_no_leaks(backend)


def test_states_must_match_sizes(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    with backend.lock, pytest.raises(ValueError, match="chunk sizes"):
        backend.forward_step([PrefillState((5, 6), None)], [], None, [])


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_moe"])
def test_fixed_buffer_ticks_give_the_unpadded_tokens(tiny_checkpoint, name):
    """The padded forwards of the fixed buffers (what the CUDA graphs replay: buckets, padding tokens and
    sequences, padded logits rows) give every request the tokens of the unpadded eager ticks; a tick larger
    than the buffers runs eagerly."""
    from gemmaserve_custom_torch.mixed_step import MixedStep

    path = tiny_checkpoint(name)
    requests = _requests(5)
    plain = make_backend(path)
    padded = make_backend(path)
    padded.mixed = MixedStep(padded.model, padded.pools, "reference", fixed_buffers=True, max_tokens=24,
                             max_seqs=4, width=64)
    kwargs = dict(max_batch_size=4, prefill_chunk_tokens=8, max_num_batched_tokens=24)
    got = [{r: q.output_token_ids for r, q in run_scheduler(b, requests, **kwargs).items()} for b in (plain, padded)]
    assert got[1] == got[0]
    assert padded.mixed.steps > 0 and padded.mixed.eager_steps == 0
    with padded.lock:  # 2 x 8 + 2 x 6 = 28 tokens > the 24-token buffers: eager, same logits as alone
        prompts = [[(3 * i + j) % 200 + 4 for i in range(n)] for j, n in enumerate([8, 8, 6, 6])]
        states = [padded.prefill_lookup(p) for p in prompts]
        padded.forward_step(states, [len(p) for p in prompts], None, [])
        assert padded.mixed.eager_steps == 1 and all(state.is_complete for state in states)
        alone = [plain.prefill_lookup(p) for p in prompts]
        for state, prompt in zip(alone, prompts):
            plain.forward_step([state], [len(prompt)], None, [])
        for a, b in zip(states, alone):
            torch.testing.assert_close(a.last_logits, b.last_logits, atol=1e-5, rtol=1e-5)
        for state in states:
            padded.free_row_kv(state.kv)
        for state in alone:
            plain.free_row_kv(state.kv)
    for backend in (plain, padded):
        assert_no_leaks(backend)


S_, F_ = "sliding_attention", "full_attention"
UNSEEN = {  # geometries no other test uses: other windows, layer patterns, GQA ratios, shared-layer counts
    "w5-gqa4-shared2": {"sliding_window": 5, "num_attention_heads": 4, "num_key_value_heads": 1,
                        "layer_types": [S_, S_, S_, F_, S_, F_, S_], "num_hidden_layers": 7,
                        "num_kv_shared_layers": 2},
    "w12-mha-shared4": {"sliding_window": 12, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
                        "global_head_dim": 64, "layer_types": [S_, F_] * 4, "num_hidden_layers": 8,
                        "num_kv_shared_layers": 4, "use_double_wide_mlp": False},
    "w3-noshare-k=v": {"sliding_window": 3, "num_kv_shared_layers": 0, "attention_k_eq_v": True,
                       "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 0},
}


@pytest.fixture(scope="module")
def unseen_checkpoint(tmp_path_factory):
    from tiny_checkpoints import build_tiny_gemma4

    root = tmp_path_factory.mktemp("unseen")
    return lambda name: build_tiny_gemma4(root / name, seed=7, **UNSEEN[name]) if not (root / name).exists() else root / name


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("name", list(UNSEEN))
def test_unseen_geometries_under_a_small_budget_match_transformers(unseen_checkpoint, hf_reference, name, block_size):
    """Staggered requests (past several windows, shared prefixes) under a 10-token budget on geometries built
    only here: every request's greedy tokens equal transformers' generate."""
    path = unseen_checkpoint(name)
    backend = make_backend(path, block_size=block_size, kv_blocks=400)
    hf = hf_reference(path, torch.float32)
    requests = _requests(17 + block_size)
    done = run_scheduler(backend, requests, max_batch_size=3, prefill_chunk_tokens=6, max_num_batched_tokens=10)
    for rid, (prompt, _, n) in zip(sorted(done, key=lambda r: int(r[1:])), requests):
        assert done[rid].finish_reason is FinishReason.LENGTH, (rid, done[rid].error)
        assert_matches_hf_generate(hf, prompt, done[rid].output_token_ids)
    assert_no_leaks(backend)


def test_a_decoding_stream_gets_a_token_every_tick_while_long_prompts_prefill(tiny_gemma4_dir):
    from gemmaserve.engine.request import Request
    from gemmaserve.engine.scheduler import ContinuousBatchScheduler
    from gemmaserve.sampling_params import SamplingParams
    from gemmaserve.settings import CoreSettings

    backend = make_backend(tiny_gemma4_dir, kv_blocks=400)
    settings = CoreSettings(max_batch_size=8, prefill_chunk_tokens=8, max_num_batched_tokens=16,
                            max_active_kv_tokens=100_000)
    sched = ContinuousBatchScheduler(backend, settings)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    sched.add_request(Request("stream", (5, 6, 7), params))
    got = {"stream": 0}

    def tick() -> None:
        for event in sched.step():
            got[event.request_id] = got.get(event.request_id, 0) + len(event.new_token_ids)

    tick()
    for i in range(5):  # a burst of 60-token prompts: 5 x 60 = 300 prompt tokens through a 16-token budget
        sched.add_request(Request(f"burst{i}", tuple((11 * j + i) % 300 + 4 for j in range(60)),
                                  SamplingParams(max_tokens=2, ignore_eos=True)))
    for _ in range(20):
        before = got["stream"]
        tick()
        assert got["stream"] == before + 1, "the decoding stream stalled during the burst's prefill"
    while sched.has_work:
        tick()
    assert all(got[f"burst{i}"] == 2 for i in range(5))
    assert_no_leaks(backend)
