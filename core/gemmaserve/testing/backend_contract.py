"""Conformance tests every InferenceBackend should pass. Subclass and override the ``backend`` fixture:

    class TestMyBackend(BackendContractTests):
        @pytest.fixture
        def backend(self):
            backend = MyBackend(tiny_model_dir, "cpu")
            yield backend
            backend.close()

The fixture must give a FRESH backend per test (function scope): tests attach their own prefix cache.
Override ``make_prompts`` to pick prompts (at least three; the longest should span a few KV blocks).
Tests of the batched primitives are skipped for streaming-only backends. Greedy decoding is
compared token for token, so run these with a model/dtype whose batched decode is exact (float32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from gemmaserve.backend import InferenceBackend
from gemmaserve.errors import KVCapacityError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import RowSampling, SamplingParams
from gemmaserve.structured.grammar import mask_rows
from gemmaserve.testing.row_driver import RowPlan, drive_rows, greedy_rows, solo_greedy

__all__ = ["BackendContractTests", "run_row_ops_property"]

_TEXTS = (
    "hello there",
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten eleven twelve",
    "once upon a time a small cache remembered every block it ever saw, and it saw many",
)


class BackendContractTests:
    """Base class of the backend conformance suite (not collected itself: no ``Test`` prefix)."""

    num_decode_tokens: int = 6
    chunk_sizes: tuple[int, ...] = (1, 3, 7)
    prefix_block_size: int = 4
    prefix_num_blocks: int = 64
    expects_prefix_hits: bool = True
    """Set False for a backend without any prefix cache (the prefix test then checks tokens only)."""
    property_examples: int = 15

    @pytest.fixture
    def backend(self) -> InferenceBackend:
        raise NotImplementedError("override the `backend` fixture to return a fresh backend")

    def make_prompts(self, backend: InferenceBackend) -> list[list[int]]:
        """Prompts for the tests, shortest first: the default encodes a few English sentences."""
        return [backend.tokenizer.encode(text) for text in _TEXTS]

    # -- helpers ------------------------------------------------------------------------------------
    def _batched(self, backend: InferenceBackend) -> None:
        if not backend.capabilities.continuous_batching:
            pytest.skip("streaming-only backend: no batched primitives")

    def fresh_prefix_cache(self, backend: InferenceBackend) -> CacheManager | None:
        """Give ``backend`` an empty prefix cache: a fresh core ``CacheManager`` attached and returned for a backend
        on the core cache; None otherwise. A backend with its own prefix cache overrides this in its test class to
        empty that cache (the suite cannot reach it), or sets ``expects_prefix_hits = False`` if it has none."""
        if not backend.capabilities.uses_core_cache_manager:
            return None
        cache = CacheManager(self.prefix_num_blocks, self.prefix_block_size)
        backend.set_cache_adapter(cache)
        return cache

    def _finish(self, backend: InferenceBackend, cache: CacheManager | None = None) -> None:
        backend.check_integrity()
        if cache is not None:
            cache.check_integrity()
            assert cache.stats().pinned_blocks == 0, "the backend left prefix-cache blocks pinned"

    # -- model facts ----------------------------------------------------------------------------------
    def test_model_info_and_tokenizer(self, backend: InferenceBackend) -> None:
        info = backend.model_info
        assert info.vocab_size > 0 and info.max_model_len > 0 and info.eos_token_ids
        assert all(0 <= token < info.vocab_size for token in info.eos_token_ids)
        ids = backend.tokenizer.encode("hello world")
        assert ids and all(isinstance(t, int) and 0 <= t < info.vocab_size for t in ids)
        assert "hello" in backend.tokenizer.decode(ids)
        prompts = self.make_prompts(backend)
        assert len(prompts) >= 3 and all(prompts), "make_prompts must return at least three non-empty prompts"

    # -- prefill ------------------------------------------------------------------------------------
    def test_prefill_primitives_match_one_shot(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        backend.set_cache_adapter(None)
        with backend.lock:
            for prompt in self.make_prompts(backend):
                one_shot = backend.prefill(prompt)
                state = backend.prefill_lookup(prompt)
                backend.prefill_chunk(state, state.num_remaining)
                assert state.is_complete and state.num_computed == len(prompt)
                assert one_shot.num_prompt_tokens == len(prompt)
                assert backend.kv_length(one_shot.kv) == backend.kv_length(state.kv) == len(prompt)
                assert greedy_rows(backend, one_shot.last_logits, [0]) == greedy_rows(backend, state.last_logits, [0])
                backend.free_row_kv(one_shot.kv)
                backend.free_row_kv(state.kv)
        self._finish(backend)

    def test_chunked_prefill_matches_one_chunk(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        backend.set_cache_adapter(None)
        prompt = self.make_prompts(backend)[-1]
        with backend.lock:
            whole = backend.prefill(prompt)
            expected = greedy_rows(backend, whole.last_logits, [0])
            backend.free_row_kv(whole.kv)
            for size in self.chunk_sizes:
                state = backend.prefill_lookup(prompt)
                while not state.is_complete:
                    before = state.num_computed
                    backend.prefill_chunk(state, size)
                    assert state.num_computed == min(before + size, len(prompt)), "a chunk computes exactly its tokens"
                    assert backend.kv_length(state.kv) == state.num_computed
                assert greedy_rows(backend, state.last_logits, [0]) == expected, f"chunk size {size}"
                backend.free_row_kv(state.kv)
        self._finish(backend)

    def test_prefill_chunks_match_one_by_one(self, backend: InferenceBackend) -> None:
        """``prefill_chunks`` (what the scheduler calls each tick) advances every state by exactly its chunk
        and ends with the greedy tokens of one-shot prefills."""
        self._batched(backend)
        backend.set_cache_adapter(None)
        prompts = self.make_prompts(backend)
        size = max(self.chunk_sizes)
        with backend.lock:
            expected = _one_shot_first_tokens(backend, prompts)
            states = [backend.prefill_lookup(prompt) for prompt in prompts]
            while not all(state.is_complete for state in states):
                open_states = [state for state in states if not state.is_complete]
                before = [state.num_computed for state in open_states]
                errors = backend.prefill_chunks(open_states, [size] * len(open_states))
                assert list(errors) == [None] * len(open_states), errors
                for state, start in zip(open_states, before):
                    assert state.num_computed == min(start + size, len(state.prompt_ids)), "exactly its chunk"
                    assert backend.kv_length(state.kv) == state.num_computed
            for state, want in zip(states, expected):
                assert greedy_rows(backend, state.last_logits, [0]) == want
                backend.free_row_kv(state.kv)
        self._finish(backend)

    def test_forward_step_equals_prefill_chunks_then_decode(self, backend: InferenceBackend) -> None:
        """``forward_step`` (backends with ``mixed_step``): decoding rows keep their solo greedy tokens while
        prefill states advance by at least one and at most their chunk each tick and end with one-shot
        prefill's first token; a tick with no chunks decodes, a tick with no rows (``batch=None``, as the engine
        passes it) prefills."""
        self._batched(backend)
        if not backend.capabilities.mixed_step:
            pytest.skip("backend does not declare mixed_step")
        backend.set_cache_adapter(None)
        prompts = self.make_prompts(backend)
        decoding, prefilling = prompts[:2], prompts[2:]
        n = self.num_decode_tokens
        longest = max(len(prompt) for prompt in prefilling)
        solo = [solo_greedy(backend, prompt, max(n, longest) + 1) for prompt in decoding]  # >= 1 token a tick
        size = max(self.chunk_sizes)
        with backend.lock:
            expected = _one_shot_first_tokens(backend, prefilling)
            batch = _prefilled_batch(backend, decoding)
            got = [[] for _ in decoding]
            last = [solo[i][0] for i in range(len(decoding))]
            for i, token in enumerate(last):
                got[i].append(token)
            states = [backend.prefill_lookup(prompt) for prompt in prefilling]
            ticks = 0
            while not all(state.is_complete for state in states) or ticks < n:
                open_states = [state for state in states if not state.is_complete]
                before = [state.num_computed for state in open_states]
                out = backend.forward_step(open_states, [size] * len(open_states), batch, last)
                assert list(out.prefill_errors) == [None] * len(open_states), out.prefill_errors
                for state, start in zip(open_states, before):
                    assert start < state.num_computed <= min(start + size, len(state.prompt_ids))
                    assert backend.kv_length(state.kv) == state.num_computed
                last = greedy_rows(backend, out.decode_logits, list(range(len(decoding))))
                for i, token in enumerate(last):
                    got[i].append(token)
                ticks += 1
                assert ticks < 10_000
            assert got == [tokens[: len(got[0])] for tokens in solo]
            for state, want in zip(states, expected):
                assert greedy_rows(backend, state.last_logits, [0]) == want
                backend.free_row_kv(state.kv)
            for _ in decoding:
                backend.remove_row_from_cache(batch, 0)
            alone = backend.prefill_lookup(prefilling[0])  # ticks with no decoding rows: the engine passes None
            while not alone.is_complete:
                out = backend.forward_step([alone], [size], None, [])
                assert list(out.prefill_errors) == [None], out.prefill_errors
                assert out.decode_logits is None or len(out.decode_logits) == 0, "no rows, no decode logits"
            assert greedy_rows(backend, alone.last_logits, [0]) == expected[0]
            backend.free_row_kv(alone.kv)
        self._finish(backend)

    def test_decode_step_async_feeds_on_the_previous_step(self, backend: InferenceBackend) -> None:
        """``decode_step_async`` (every backend has it; ``async_decode`` ones overlap it): rows that name their row
        of the previous call consume the token it sampled, read only after the next step was launched; a row
        removed with a step in flight leaves the others exact; a row spliced meanwhile passes -1. Greedy tokens
        equal each prompt's solo decode."""
        self._batched(backend)
        backend.set_cache_adapter(None)
        prompts = self.make_prompts(backend)
        n = self.num_decode_tokens
        solo = [solo_greedy(backend, prompt, n + 1) for prompt in prompts]
        greedy = RowSampling(0.0, 1.0, 0, 0, 0)
        with backend.lock:
            joiner = backend.prefill(prompts[-1])  # before the first launch: a prefill is another forward
            batch = _prefilled_batch(backend, prompts[:-1])
            live = list(range(len(prompts) - 1))  # the prompt of each batch row
            got = {i: [solo[i][0]] for i in range(len(prompts))}
            pending = backend.decode_step_async(batch, [solo[i][0] for i in live], [-1] * len(live), [greedy] * len(live))
            launched = list(live)
            for step in range(1, n):
                if step == 2:  # a row leaves while its step is in flight; its launched token is dropped below
                    backend.remove_row_from_cache(batch, 0)
                    live.pop(0)
                if step == 3:  # a row joins: its first token comes from the host
                    batch = backend.splice_into_batched(batch, joiner.kv, backend.kv_length(joiner.kv))
                    live.append(len(prompts) - 1)
                sources = [launched.index(i) if i in launched else -1 for i in live]
                ids = [got[i][-1] if source < 0 else 0 for i, source in zip(live, sources)]
                following = backend.decode_step_async(batch, ids, sources, [greedy] * len(live))
                tokens = pending.result().token_ids
                assert len(tokens) == len(launched)
                for j, i in enumerate(launched):
                    if i in live:
                        got[i].append(tokens[j])
                pending, launched = following, list(live)
            tokens = pending.result().token_ids
            for j, i in enumerate(launched):
                got[i].append(tokens[j])
            for i, tokens in got.items():
                assert tokens == solo[i][: len(tokens)], f"prompt {i}"
            for _ in live:
                backend.remove_row_from_cache(batch, 0)
            if len(prompts) - 1 not in live:  # fewer than four decode steps: the joiner never joined
                backend.free_row_kv(joiner.kv)
        self._finish(backend)

    def test_abandoned_prefill_frees_everything(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        cache = self.fresh_prefix_cache(backend)
        prompt = self.make_prompts(backend)[-1]
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            backend.prefill_chunk(state, state.num_remaining)
            backend.prefill_store(state)  # cache it, then abandon a prefill that hits it
            backend.free_row_kv(state.kv)
            state = backend.prefill_lookup(prompt)
            if state.num_remaining > 1:
                backend.prefill_chunk(state, 1)
            backend.free_row_kv(state.kv)
        self._finish(backend, cache)

    # -- batch ops ---------------------------------------------------------------------------------
    def test_rows_match_solo_runs_through_splice_and_remove(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        prompts = [tuple(p) for p in self.make_prompts(backend)[:3]]
        n = self.num_decode_tokens
        solo = [solo_greedy(backend, prompt, n) for prompt in prompts]
        plan = [RowPlan(prompts[0], 0, n), RowPlan(prompts[1], 2, n - 3), RowPlan(prompts[2], 3, n)]
        got = drive_rows(backend, plan)
        assert got == [solo[0], solo[1][: n - 3], solo[2]]
        self._finish(backend)

    def test_stack_equals_successive_splices(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        plan = [RowPlan(tuple(p), 0, self.num_decode_tokens) for p in self.make_prompts(backend)[:3]]
        assert drive_rows(backend, plan, stack_initial=True) == drive_rows(backend, plan, stack_initial=False)
        self._finish(backend)

    def test_kv_length_exact(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        prompts = self.make_prompts(backend)[:3]
        with backend.lock:
            batch = _prefilled_batch(backend, prompts)
            lengths = [len(p) for p in prompts]
            assert [backend.kv_length(batch, i) for i in range(3)] == lengths
            backend.decode_step_batched(batch, [prompt[-1] for prompt in prompts])
            lengths = [n + 1 for n in lengths]
            assert [backend.kv_length(batch, i) for i in range(3)] == lengths
            backend.remove_row_from_cache(batch, 1)
            assert [backend.kv_length(batch, i) for i in range(2)] == [lengths[0], lengths[2]]
            backend.remove_row_from_cache(batch, 1)
            backend.remove_row_from_cache(batch, 0)
        self._finish(backend)

    # -- sampling -----------------------------------------------------------------------------------
    def test_sampling_depends_only_on_seed_and_step(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        prompts = self.make_prompts(backend)[:3]
        with backend.lock:
            batch = _prefilled_batch(backend, prompts)
            logits = backend.decode_step_batched(batch, [p[-1] for p in prompts])
            a, b = RowSampling(0.9, 0.95, 20, 11, 3), RowSampling(1.3, 1.0, 0, 12, 5)
            first = backend.sample(logits, [a, RowSampling(0.7, 1.0, 0, 1, 1), b]).token_ids
            again = backend.sample(logits, [a, RowSampling(1.0, 0.5, 5, 99, 7), b]).token_ids
            assert (first[0], first[2]) == (again[0], again[2]), "a row's token depends on another row's params"
            greedy = [backend.sample(logits, [RowSampling(0.0, 1.0, 0, s, s)] * 3).token_ids for s in (1, 2)]
            assert greedy[0] == greedy[1], "greedy sampling must ignore seed and step"
            seen = {backend.sample(logits, [RowSampling(100.0, 1.0, 0, s, 0)] * 3).token_ids[0] for s in range(32)}
            assert len(seen) > 1, "seeds have no effect at temperature 100"
            if backend.capabilities.logprobs:
                out = backend.sample(logits, [a, a, b], want_logprobs=True)
                assert out.logprobs is not None and len(out.logprobs) == 3
                assert all(math.isfinite(x) and x <= 1e-6 for x in out.logprobs)
            for index in (2, 1, 0):
                backend.remove_row_from_cache(batch, index)
        self._finish(backend)

    def test_sample_follows_the_sampling_definition(self, backend: InferenceBackend) -> None:
        """``sample`` implements every ``RowSampling`` field as ``gemmaserve.engine.sampling_cpu`` defines it
        (temperature, top-k, top-p, min-p, ``logit_bias``, ``banned``, the three penalties, the Gumbel draw of
        (seed, step)): on the backend's own logits each row picks the definition's token, or one whose score ties
        the definition's within float rounding; the reported logprob is the definition's."""
        self._batched(backend)
        prompts = self.make_prompts(backend)[:3]
        with backend.lock:
            batch = _prefilled_batch(backend, prompts)
            logits = backend.decode_step_batched(batch, [p[-1] for p in prompts])
            host = _host_rows(logits)
            for rows in _definition_cases(host, prompts):
                out = backend.sample(logits, rows, want_logprobs=backend.capabilities.logprobs)
                for i, row in enumerate(rows):
                    _check_definition_pick(host[i], row, out.token_ids[i],
                                           out.logprobs[i] if out.logprobs is not None else None)
            for index in (2, 1, 0):
                backend.remove_row_from_cache(batch, index)
        self._finish(backend)

    def test_allowed_token_masks_are_honoured(self, backend: InferenceBackend) -> None:
        """``capabilities.allowed_token_masks``: greedy and sampled rows only ever pick a token their
        ``RowSampling.allowed`` bitmask sets (given as the engine gives them: consecutive rows of one batched mask
        call, in the backend's ``mask_memory`` if it offers one), rows without a mask are unaffected, and a mask
        shorter than the vocabulary allows nothing past its end."""
        self._batched(backend)
        if not backend.capabilities.allowed_token_masks:
            pytest.skip("backend does not declare allowed_token_masks")
        prompts = self.make_prompts(backend)[:3]
        vocab = backend.model_info.vocab_size
        with backend.lock:
            batch = _prefilled_batch(backend, prompts)
            logits = backend.decode_step_batched(batch, [p[-1] for p in prompts])
            free = backend.sample(logits, [RowSampling(0.0, 1.0, 0, 1, 1)] * 3).token_ids
            for allowed in ({vocab - 1}, {0, vocab // 2, vocab - 1}, set(range(3, min(vocab, 11)))):
                mask = bytearray(-(-vocab // 8))
                for token in allowed:
                    mask[token >> 3] |= 1 << (token & 7)
                for temperature, seed in ((0.0, 0), (1.0, 5), (100.0, 9)):
                    views = mask_rows(2, len(mask), backend.mask_memory)  # the engine's form: a batch's rows
                    for view in views:
                        view[:] = mask
                    rows = [RowSampling(temperature, 1.0, 0, seed + i, 2, allowed=views[i]) for i in range(2)]
                    picked = backend.sample(logits, [*rows, RowSampling(0.0, 1.0, 0, 1, 1)]).token_ids
                    assert picked[0] in allowed and picked[1] in allowed, (picked, allowed)
                    assert picked[2] == free[2], "a mask on one row changed another row's token"
            short = RowSampling(0.0, 1.0, 0, 1, 1, allowed=b"\x10")  # token 4 only; nothing past byte 0
            assert backend.sample(logits, [short] * 3).token_ids == [4, 4, 4]
            for index in (2, 1, 0):
                backend.remove_row_from_cache(batch, index)
        self._finish(backend)

    def test_decode_logits_are_rows_by_vocabulary(self, backend: InferenceBackend) -> None:
        """``decode_step_batched`` returns logits ``[rows, model_info.vocab_size]`` (a padded vocabulary is cut to
        the model's: the engine trusts every sampled id to be a token), and ``sample`` picks ids inside it."""
        self._batched(backend)
        prompts = self.make_prompts(backend)[:3]
        vocab = backend.model_info.vocab_size
        with backend.lock:
            batch = _prefilled_batch(backend, prompts)
            logits = backend.decode_step_batched(batch, [p[-1] for p in prompts])
            host = _host_rows(logits)
            assert len(host) == len(prompts) and all(len(row) == vocab for row in host), (
                f"logits must be [rows, vocab_size] = [{len(prompts)}, {vocab}], got {len(host)} rows of "
                f"{sorted({len(row) for row in host})}")
            rows = [RowSampling(1.0, 1.0, 0, seed, 0) for seed in range(len(prompts))]
            out = backend.sample(logits, rows)
            assert all(0 <= token < vocab for token in out.token_ids), out.token_ids
            for index in reversed(range(len(prompts))):
                backend.remove_row_from_cache(batch, index)
        self._finish(backend)

    def test_top_logprobs_are_the_most_likely_tokens(self, backend: InferenceBackend) -> None:
        """``capabilities.top_logprobs``: with ``want_logprobs``, each row gets its ``RowSampling.top_logprobs``
        most likely (token, logprob) pairs: the definition's on the backend's own logits (same ids in the same
        order), a greedy row's token first, a row asking for none an empty list, a masked row only tokens its
        mask allows."""
        self._batched(backend)
        if not (backend.capabilities.logprobs and backend.capabilities.top_logprobs):
            pytest.skip("backend does not declare top_logprobs")
        from gemmaserve.engine.sampling_cpu import top_logprobs

        prompts = self.make_prompts(backend)[:3]
        with backend.lock:
            batch = _prefilled_batch(backend, prompts)
            logits = backend.decode_step_batched(batch, [p[-1] for p in prompts])
            mask = bytes([0b10110110])  # tokens 1, 2, 4, 5, 7
            rows = [RowSampling(0.0, 1.0, 0, 1, 1, top_logprobs=5), RowSampling(0.8, 0.9, 0, 2, 4),
                    RowSampling(1.0, 1.0, 0, 3, 2, allowed=mask, top_logprobs=8)]
            out = backend.sample(logits, rows, want_logprobs=True)
            assert out.top_logprobs is not None and len(out.top_logprobs) == 3
            host = [[float(x) for x in row] for row in _host_rows(logits)]
            for i, row in enumerate(rows):
                expected = top_logprobs(host[i], row)
                assert [t for t, _ in out.top_logprobs[i]] == [t for t, _ in expected], (i, out.top_logprobs[i])
                assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(out.top_logprobs[i], expected))
            assert out.top_logprobs[0][0][0] == out.token_ids[0] and out.top_logprobs[1] == []
            assert {t for t, _ in out.top_logprobs[2]} <= {1, 2, 4, 5, 7} and len(out.top_logprobs[2]) == 5
            for index in (2, 1, 0):
                backend.remove_row_from_cache(batch, index)
        self._finish(backend)

    # -- prefix cache -------------------------------------------------------------------------------
    def test_prefix_cache_second_pass_hits_with_same_tokens(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        prompt = self.make_prompts(backend)[-1]
        bs = self.prefix_block_size
        assert len(prompt) > 2 * bs + 1, "the longest prompt must span more than two prefix blocks"
        other = next(token for token in prompt if token != prompt[2 * bs])
        sibling = [*prompt[: 2 * bs], other, *prompt[2 * bs :]]  # same first two blocks, then diverges
        backend.set_cache_adapter(None)
        truth = [solo_greedy(backend, p, self.num_decode_tokens) for p in (prompt, sibling)]
        cache = self.fresh_prefix_cache(backend)
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            backend.free_row_kv(state.kv)
        assert state.num_cached == 0 or not self.expects_prefix_hits, (
            "a fresh prefix cache reported a hit (a backend with its own prefix cache empties it in its test class's "
            "fresh_prefix_cache)")
        first = solo_greedy(backend, prompt, self.num_decode_tokens)
        with backend.lock:
            state = backend.prefill_lookup(prompt)
            second_hit = state.num_cached
            backend.free_row_kv(state.kv)
            state = backend.prefill_lookup(sibling)
            sibling_hit = state.num_cached
            backend.free_row_kv(state.kv)
        if self.expects_prefix_hits:
            assert second_hit > 0, "second pass over the same prompt reported no prefix-cache hit"
        if cache is not None:
            assert second_hit >= len(prompt) - bs and sibling_hit == 2 * bs
        second = solo_greedy(backend, prompt, self.num_decode_tokens)
        assert first == second == truth[0]
        assert solo_greedy(backend, sibling, self.num_decode_tokens) == truth[1]
        self._finish(backend, cache)

    def test_progressive_prefix_cache_finds_blocks_after_each_chunk(self, backend: InferenceBackend) -> None:
        """``progressive_cache_block_size`` = B: the full blocks a prefill chunk computed are found by another
        prompt's lookup before the first prompt completes (the scheduler relies on it to let prompts sharing a
        prefix wait for them)."""
        block = backend.capabilities.progressive_cache_block_size
        if not block or backend.capabilities.uses_core_cache_manager:
            pytest.skip("backend does not declare progressive_cache_block_size")
        self._batched(backend)
        prompt = list(max(self.make_prompts(backend), key=len))
        done = 2 * block
        if len(prompt) < done + 2:
            pytest.skip(f"the longest prompt has fewer than {done + 2} tokens")
        vocab = backend.model_info.vocab_size
        sibling = prompt[:done] + [(prompt[done] + 1) % vocab] + prompt[done + 1:]  # shares exactly 2 blocks
        with backend.lock:
            leader = backend.prefill_lookup(prompt)
            while leader.num_computed < done:
                backend.prefill_chunk(leader, done - leader.num_computed)
            assert not leader.is_complete
            follower = backend.prefill_lookup(sibling)
            hit = follower.num_cached
            backend.free_row_kv(follower.kv)
            backend.free_row_kv(leader.kv)
        assert hit == done, f"a lookup after chunks computed {done} shared tokens found {hit}"
        self._finish(backend)

    # -- other paths ----------------------------------------------------------------------------------
    def test_generate_stream_matches_batched_greedy(self, backend: InferenceBackend) -> None:
        """``generate_stream`` as the scheduler calls it (``session_id`` keyword: the request's id)."""
        prompt = self.make_prompts(backend)[1]
        params = SamplingParams(max_tokens=self.num_decode_tokens, ignore_eos=True)
        streamed = list(backend.generate_stream(prompt, params, session_id="kit-a"))
        assert len(streamed) == self.num_decode_tokens
        assert list(backend.generate_stream(prompt, params, session_id="kit-b")) == streamed
        if backend.capabilities.continuous_batching:
            assert streamed == solo_greedy(backend, prompt, self.num_decode_tokens)
        sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=5, ignore_eos=True)
        assert list(backend.generate_stream(prompt, sampled)) == list(backend.generate_stream(prompt, sampled))
        self._finish(backend)

    def test_kv_reservation(self, backend: InferenceBackend) -> None:
        if not backend.capabilities.kv_reservation:
            pytest.skip("backend does not implement kv_reserve")
        with backend.lock:
            assert backend.kv_reserve("contract-a", 8) is True
            backend.kv_release("contract-a")
            backend.kv_release("contract-a")  # idempotent
            try:
                assert backend.kv_reserve("contract-b", 10**12) is False
            except KVCapacityError:
                pass
            backend.kv_release("contract-b")
            most = backend.max_request_tokens()
            if most is not None:  # the bound it states is the one its reservations keep
                assert most >= 1 and backend.kv_reserve("contract-most", most) is True, most
                backend.kv_release("contract-most")
                with pytest.raises(KVCapacityError):
                    backend.kv_reserve("contract-over", most + 1)
                backend.kv_release("contract-over")
        self._finish(backend)

    def test_row_ops_property(self, backend: InferenceBackend) -> None:
        self._batched(backend)
        self.fresh_prefix_cache(backend)
        run_row_ops_property(backend, max_examples=self.property_examples)


def _one_shot_first_tokens(backend: InferenceBackend, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The greedy first token of each prompt after a one-shot ``prefill`` (KV freed; ``backend.lock`` held)."""
    tokens = []
    for prompt in prompts:
        whole = backend.prefill(prompt)
        tokens.append(greedy_rows(backend, whole.last_logits, [0]))
        backend.free_row_kv(whole.kv)
    return tokens


def _host_rows(logits: object) -> list[list[float]]:
    """A backend's logits [rows, vocab] as Python lists (torch, numpy, mlx and nested lists all convert)."""
    to_list = getattr(logits, "tolist", None)
    if to_list is not None:
        detach = getattr(logits, "detach", None)
        if detach is not None:
            return detach().float().cpu().tolist()
        return to_list()
    return [list(row) for row in logits]  # type: ignore[union-attr]


def _definition_cases(host: list[list[float]], prompts: Sequence[Sequence[int]]) -> list[list[RowSampling]]:
    """Batches of three rows that each exercise part of the sampling definition on these logits: the biases,
    bans and penalties aim at each row's most likely tokens, so ignoring them changes the pick."""
    top = [sorted(range(len(row)), key=lambda t: -row[t])[:4] for row in host]
    cases: list[list[RowSampling]] = []
    for seed in (3, 11):
        cases.append([RowSampling(0.0, 1.0, 0, seed, 0, logit_bias=((top[0][3], 50.0),)),
                      RowSampling(0.0, 1.0, 0, seed, 1, banned=(top[1][0], top[1][1])),
                      RowSampling(0.0, 1.0, 0, seed, 2, repetition_penalty=50.0,
                                  prompt_tokens=frozenset({top[2][0], *prompts[2]}))])
        cases.append([RowSampling(0.0, 1.0, 0, seed, 3, presence_penalty=40.0, output_counts=((top[0][0], 1),)),
                      RowSampling(0.0, 1.0, 0, seed, 4, frequency_penalty=15.0,
                                  output_counts=((top[1][0], 3), (top[1][1], 1))),
                      RowSampling(0.0, 1.0, 0, seed, 5, repetition_penalty=0.5, frequency_penalty=-2.0,
                                  prompt_tokens=frozenset({top[2][2]}), output_counts=((top[2][3], 2),))])
        for step in range(4):
            cases.append([RowSampling(1.0, 1.0, 2, seed, step), RowSampling(0.8, 0.6, 0, seed + 1, step),
                          RowSampling(1.5, 1.0, 0, seed + 2, step, min_p=0.2)])
            cases.append([RowSampling(2.0, 0.9, 3, seed, step, logit_bias=((top[0][3], 2.0),)),
                          RowSampling(1.0, 1.0, 0, seed, step, presence_penalty=1.5,
                                      output_counts=((top[1][0], 1),)),
                          RowSampling(50.0, 1.0, 0, seed, step)])
    return cases


def _check_definition_pick(logits: list[float], row: RowSampling, token: int, logprob: float | None) -> None:
    """``token`` is the definition's pick for ``row``, or ties it within rounding (the backend's logits may
    round differently from the definition's float64, and a fused sampler adds the noise in its own order)."""
    from gemmaserve.engine.sampling_cpu import (_filtered_probs, adjust_logits, gumbel_noise, log_softmax,
                                                sample_row, sampling_seed)

    expected, expected_logprob = sample_row(logits, row, want_logprob=True)
    values = adjust_logits(logits, row) if row.adjusts_logits else logits
    if token != expected:
        assert 0 <= token < len(logits) and values[token] != -math.inf, (
            f"{row}: picked {token}, which the row's bans, biases or penalties exclude (expected {expected})")
        if row.is_greedy:
            score = {t: values[t] for t in (token, expected)}
        else:
            kept = {t for t, _ in _filtered_probs(values, row)}
            assert token in kept, f"{row}: picked {token}, outside the top-k / top-p / min-p set (expected {expected})"
            key = sampling_seed(row.seed, row.step)
            score = {t: values[t] / row.temperature + gumbel_noise(key, t) for t in (token, expected)}
        tolerance = 1e-3 * max(1.0, abs(score[expected]))
        assert score[expected] - score[token] <= tolerance, (
            f"{row}: picked {token} (score {score[token]:.6f}) where the sampling definition picks {expected} "
            f"(score {score[expected]:.6f}); see gemmaserve.engine.sampling_cpu")
    if logprob is not None:
        want = log_softmax(values)[token] if token != expected else expected_logprob
        assert want is not None and abs(logprob - want) < 1e-2 * max(1.0, abs(want)), (
            f"{row}: logprob {logprob} of token {token}, the definition's is {want}")


def _prefilled_batch(backend: InferenceBackend, prompts: Sequence[Sequence[int]]) -> Any:
    """Prefill each prompt and splice the rows, in order, into one batch (``backend.lock`` held)."""
    batch = None
    for prompt in prompts:
        result = backend.prefill(prompt)
        batch = backend.splice_into_batched(batch, result.kv, backend.kv_length(result.kv))
    return batch


def run_row_ops_property(
    backend: InferenceBackend,
    *,
    alphabet: Sequence[int] | None = None,
    max_examples: int = 25,
    max_rows: int = 4,
    max_prompt_len: int = 12,
    max_new_tokens: int = 6,
) -> None:
    """Hypothesis property: random row plans (prompts over a tiny ``alphabet`` so prefixes repeat,
    random join ticks and lengths, optionally a stacked start) keep every row's greedy tokens equal
    to its solo run and every ``kv_length`` exact; ``check_integrity`` after each example."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    if alphabet is None:
        alphabet = sorted(set(backend.tokenizer.encode("abcab", add_special_tokens=False)))[:3]
    solo: dict[tuple[int, ...], list[int]] = {}
    rows = st.builds(
        RowPlan,
        st.lists(st.sampled_from(list(alphabet)), min_size=1, max_size=max_prompt_len).map(tuple),
        st.integers(0, 5),
        st.integers(1, max_new_tokens),
    )

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(plan=st.lists(rows, min_size=1, max_size=max_rows), stack_initial=st.booleans())
    def check(plan: list[RowPlan], stack_initial: bool) -> None:
        got = drive_rows(backend, plan, stack_initial=stack_initial)
        for row, tokens in zip(plan, got):
            if row.prompt not in solo:
                solo[row.prompt] = solo_greedy(backend, row.prompt, max_new_tokens)
            assert tokens == solo[row.prompt][: row.num_tokens], f"row {row} differs from its solo run"
        backend.check_integrity()

    check()
