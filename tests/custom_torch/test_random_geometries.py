"""Greedy parity with transformers on model geometries drawn at random (hypothesis), not picked by hand: Gemma 4
(sliding/full patterns, head dims, GQA ratios, windows, KV-shared tails, PLE, double-wide MLP, K=V with a global
KV-head count, the MoE block, softcaps) and Gemma 3, each served under a random token budget, chunk size, batch
size, KV block size, mixed-chunk cap, fast prefill on or off and synchronous or asynchronous scheduling, with
staggered arrivals, shared prefixes and an exact repeat (prefix-cache hits). Every request's tokens must equal
transformers' greedy ``generate`` and no block may leak."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fixtures_backend
from fixtures_backend import assert_matches_hf_generate, assert_no_leaks, make_backend, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.engine.request import FinishReason
from gemmaserve.settings import CoreSettings

SLIDING, FULL = "sliding_attention", "full_attention"


@st.composite
def gemma4_geometry(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(2, 7))
    shared = draw(st.integers(0, layers - 2))
    owners = draw(st.lists(st.sampled_from([SLIDING, SLIDING, FULL]), min_size=layers - shared,
                           max_size=layers - shared))
    # KV-shared layers read the last storing layer of their own type: only types the storing layers have
    tail = draw(st.lists(st.sampled_from(sorted(set(owners))), min_size=shared, max_size=shared))
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0]))
    head_dim = draw(st.sampled_from([8, 16]))
    geometry: dict[str, Any] = {
        "num_hidden_layers": layers, "layer_types": owners + tail, "num_kv_shared_layers": shared,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "global_head_dim": draw(st.sampled_from([head_dim, 2 * head_dim])),
        "hidden_size": draw(st.sampled_from([32, 48])), "intermediate_size": draw(st.sampled_from([32, 48])),
        "sliding_window": draw(st.integers(2, 13)),
        # transformers' own generate fails on KV sharing without PLE (its per-layer inputs are None there)
        "hidden_size_per_layer_input": draw(st.sampled_from([8, 16] if shared else [0, 8])),
        "use_double_wide_mlp": draw(st.booleans()),
        "final_logit_softcapping": draw(st.sampled_from([None, 30.0, 4.0])),
    }
    if draw(st.booleans()):
        geometry.update(attention_k_eq_v=True, num_global_key_value_heads=draw(st.sampled_from([1, kv_heads])))
    if draw(st.integers(0, 2)) == 0:
        geometry.update(enable_moe_block=True, num_experts=draw(st.sampled_from([3, 4])),
                        top_k_experts=draw(st.sampled_from([1, 2])), moe_intermediate_size=16)
    return geometry


@st.composite
def gemma3_geometry(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(2, 6))
    heads = draw(st.sampled_from([1, 2, 4]))
    return {
        "num_hidden_layers": layers,
        "layer_types": draw(st.lists(st.sampled_from([SLIDING, SLIDING, FULL]), min_size=layers, max_size=layers)),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])),
        "head_dim": draw(st.sampled_from([8, 16, 32])), "hidden_size": draw(st.sampled_from([32, 48])),
        "intermediate_size": 48, "sliding_window": draw(st.integers(2, 11)),
        "query_pre_attn_scalar": draw(st.sampled_from([8, 24])),
        "final_logit_softcapping": draw(st.sampled_from([None, 20.0])),
    }


serving = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "max_batch_size": st.integers(1, 5),
    "prefill_chunk_tokens": st.integers(1, 12),
    "max_num_batched_tokens": st.integers(6, 32),
    "mixed_prefill_chunk_tokens": st.sampled_from([0, 1, 4]),
    "async_scheduling": st.booleans(),
    "fast_prefill": st.booleans(),
})


def _requests(seed: int) -> list[tuple[list[int], int, int]]:
    """(prompt, arrival tick, max_tokens): a shared prefix, unrelated prompts past the window, an exact repeat."""
    rng = random.Random(seed)
    base = [rng.randrange(4, 500) for _ in range(rng.randint(5, 24))]
    requests = [(base + [rng.randrange(4, 500) for _ in range(rng.randrange(0, 5))], rng.randrange(0, 6),
                 rng.randint(1, 7)) for _ in range(2)]
    requests += [([rng.randrange(4, 500) for _ in range(rng.randint(1, 40))], rng.randrange(0, 10), rng.randint(1, 8))
                 for _ in range(3)]
    requests.append((list(requests[0][0]), rng.randrange(8, 16), 3))
    return requests


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
@settings(max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_geometries_and_schedules_match_transformers(tmp_path_factory, hf_reference, monkeypatch, family,
                                                            data) -> None:
    from tiny_checkpoints import build_tiny_gemma3, build_tiny_gemma4

    geometry = data.draw(gemma4_geometry() if family == "gemma4" else gemma3_geometry(), label="geometry")
    plan = data.draw(serving, label="serving")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    build = build_tiny_gemma4 if family == "gemma4" else build_tiny_gemma3
    path = build(tmp_path_factory.mktemp("geometry"), seed=seed, **geometry)
    hf = hf_reference(path, torch.float32)
    monkeypatch.setattr(fixtures_backend, "CoreSettings",
                        functools.partial(CoreSettings, mixed_prefill_chunk_tokens=plan["mixed_prefill_chunk_tokens"]))
    backend = make_backend(path, block_size=plan["block_size"], kv_blocks=None, fast_prefill=plan["fast_prefill"])
    requests = _requests(seed)
    done = run_scheduler(backend, requests, max_batch_size=plan["max_batch_size"],
                         prefill_chunk_tokens=plan["prefill_chunk_tokens"],
                         max_num_batched_tokens=plan["max_num_batched_tokens"],
                         async_scheduling=plan["async_scheduling"])
    for rid, (prompt, _, _) in zip(sorted(done, key=lambda r: int(r[1:])), requests):
        assert done[rid].finish_reason is FinishReason.LENGTH, (rid, done[rid].error)
        assert_matches_hf_generate(hf, prompt, done[rid].output_token_ids)
    assert_no_leaks(backend)
