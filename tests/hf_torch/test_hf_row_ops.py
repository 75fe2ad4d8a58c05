"""Hypothesis: random sequences of prefill (chunked, with prefix-cache hits) / splice / stack /
decode / remove over rows of random lengths keep every row's logits equal to a solo, cache-free
forward over that row's tokens, and every ``kv_length`` exact."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve_hf_torch.backend import HFTorchBackend

ALPHABET = [10, 11, 12, 300]  # few symbols, so prompts share prefixes and hit the prefix cache
ATOL = 1e-4

prompts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=20)  # window is 8: many exceed it
operations = st.lists(
    st.one_of(
        st.tuples(st.just("splice"), prompts, st.integers(1, 7)),
        st.tuples(st.just("stack"), st.lists(st.tuples(prompts, st.integers(1, 7)), min_size=1, max_size=3)),
        st.tuples(st.just("decode"), st.lists(st.integers(3, 511), min_size=4, max_size=4)),
        st.tuples(st.just("remove"), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=10,
)


def _solo_logits(backend: HFTorchBackend, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.inference_mode():
        return backend.loaded.model(input_ids=ids, use_cache=False).logits[0, -1].float()


def _prefill(backend: HFTorchBackend, prompt: list[int], chunk: int) -> Any:
    state = backend.prefill_lookup(prompt)
    assert backend.kv_length(state.kv) == state.num_cached == backend.last_cache_hit_tokens
    while not state.is_complete:
        backend.prefill_chunk(state, chunk)
        assert backend.kv_length(state.kv) == state.num_computed
    backend.prefill_store(state)
    torch.testing.assert_close(state.last_logits[0].float(), _solo_logits(backend, prompt), atol=ATOL, rtol=0)
    return state.kv


def _run(backend: HFTorchBackend, ops: list[tuple[Any, ...]]) -> None:
    rows: list[list[int]] = []  # tokens whose KV each batch row holds, in row order
    batch = None
    try:
        for op in ops:
            if op[0] == "splice":
                kv = _prefill(backend, op[1], op[2])
                batch = backend.splice_into_batched(batch, kv, backend.kv_length(kv))
                rows.append(list(op[1]))
            elif op[0] == "stack" and batch is None:
                kvs = [_prefill(backend, prompt, chunk) for prompt, chunk in op[1]]
                batch = backend.stack_caches_left_padded(kvs)
                rows = [list(prompt) for prompt, _ in op[1]]
            elif op[0] == "decode" and rows:
                fed = (op[1] * len(rows))[: len(rows)]
                logits = backend.decode_step_batched(batch, fed)
                assert tuple(logits.shape) == (len(rows), backend.model_info.vocab_size)
                for index, token in enumerate(fed):
                    rows[index].append(token)
                    torch.testing.assert_close(logits[index].float(), _solo_logits(backend, rows[index]), atol=ATOL, rtol=0)
            elif op[0] == "remove" and rows:
                index = op[1] % len(rows)
                backend.remove_row_from_cache(batch, index)
                rows.pop(index)
            assert [backend.kv_length(batch, i) for i in range(len(rows))] == [len(r) for r in rows]
            backend.check_integrity()
    finally:
        for index in reversed(range(len(rows))):
            backend.remove_row_from_cache(batch, index)


def _property(backend: HFTorchBackend, examples: int) -> None:
    backend.set_cache_adapter(CacheManager(num_blocks=24, block_size=4))

    # No shrink phase: each example runs dozens of forwards, so shrinking a failure would take minutes;
    # the (short) failing operation list is printed as is.
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )
    @given(ops=operations)
    def check(ops: list[tuple[Any, ...]]) -> None:
        with backend.lock:
            _run(backend, ops)
        assert backend.num_live_rows == 0

    check()


def test_row_ops_keep_logits_exact_gemma4(gemma4_backend: HFTorchBackend) -> None:
    _property(gemma4_backend, examples=30)


def test_row_ops_keep_logits_exact_llama(llama_backend: HFTorchBackend) -> None:
    _property(llama_backend, examples=15)
