"""The reference backend: conformance kit, KV sensitivity of the toy model, sampler semantics."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from gemmaserve.backend import InferenceBackend
from gemmaserve.engine.sampling_cpu import log_softmax, sample_row, sample_rows
from gemmaserve.errors import KVCapacityError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import RowSampling, SamplingParams
from gemmaserve.testing import BackendContractTests, ReferenceBackend, RowPlan, drive_rows, solo_greedy
from gemmaserve.testing.reference_backend import InjectedFault
from gemmaserve.testing.reference_model import EOS_ID, CharTokenizer, KVEntry, next_token_logits


class TestReferenceBackendContract(BackendContractTests):
    @pytest.fixture
    def backend(self) -> InferenceBackend:
        return ReferenceBackend()


class TestStreamingOnlyReferenceContract(BackendContractTests):
    """The same kit against the streaming-only mode: batched-primitive tests skip themselves."""

    @pytest.fixture
    def backend(self) -> InferenceBackend:
        return ReferenceBackend(streaming_only=True)


class TestMixedStepReferenceContract(BackendContractTests):
    """The kit against one-call ticks (``forward_step``) whose chunks the backend caps at 2 tokens."""

    property_examples = 5

    @pytest.fixture
    def backend(self) -> InferenceBackend:
        return ReferenceBackend(mixed_step=True, max_step_chunk=2)


class TestReservingReferenceContract(BackendContractTests):
    property_examples = 5

    @pytest.fixture
    def backend(self) -> InferenceBackend:
        return ReferenceBackend(kv_capacity_tokens=300)


class _BrokenSplice(ReferenceBackend):
    """Counts padding as real tokens when it computes positions: the kind of bug the kit must catch."""

    def decode_step_batched(self, batched, input_ids):  # type: ignore[no-untyped-def]
        for index in range(len(batched.lengths)):
            batched.lengths[index] = len(batched.rows[index])
        return super().decode_step_batched(batched, input_ids)


def test_the_kit_catches_a_padding_bug() -> None:
    backend = _BrokenSplice()
    prompts = [tuple(backend.tokenizer.encode(t)) for t in ("hi", "a much longer prompt here")]
    solo = [solo_greedy(backend, p, 4) for p in prompts]
    assert drive_rows(ReferenceBackend(), [RowPlan(p, 0, 4) for p in prompts]) == solo
    with pytest.raises(AssertionError):
        assert drive_rows(backend, [RowPlan(p, 0, 4) for p in prompts]) == solo


@pytest.mark.parametrize("field,ignored", [
    ("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("min_p", 0.0),
    ("banned", ()), ("logit_bias", ()), ("top_k", 0), ("top_p", 1.0), ("step", 0)])
def test_the_kit_catches_a_sampler_that_ignores_a_field(field: str, ignored: object) -> None:
    """A backend whose ``sample`` drops one ``RowSampling`` field fails the kit's sampling-definition check."""
    import dataclasses

    class _Ignoring(ReferenceBackend):
        def sample(self, logits, rows, *, want_logprobs=False):  # type: ignore[no-untyped-def]
            rows = [dataclasses.replace(row, **{field: ignored}) for row in rows]
            return super().sample(logits, rows, want_logprobs=want_logprobs)

    kit = TestReferenceBackendContract()
    kit.test_sample_follows_the_sampling_definition(ReferenceBackend())
    with pytest.raises(AssertionError):
        kit.test_sample_follows_the_sampling_definition(_Ignoring())


def test_logits_depend_on_every_kv_entry_and_its_position() -> None:
    entries = [KVEntry(t, i) for i, t in enumerate([7, 8, 9, 10])]
    base = next_token_logits(entries, 64)
    assert next_token_logits(list(entries), 64) == base and len(base) == 64
    assert next_token_logits(entries[1:], 64) != base  # missing entry
    assert next_token_logits([*entries[:2], KVEntry(9, 3), KVEntry(10, 3)], 64) != base  # wrong position
    assert next_token_logits([entries[1], entries[0], *entries[2:]], 64) != base  # reordered


def test_corrupted_prefix_pool_changes_the_output() -> None:
    backend = ReferenceBackend()
    cache = CacheManager(32, 4)
    backend.set_cache_adapter(cache)
    prompt = backend.tokenizer.encode("a prompt long enough for blocks")
    first = solo_greedy(backend, prompt, 5)
    block_id = next(iter(backend._pool))
    backend._pool[block_id] = [KVEntry(e.token, e.position + 1) for e in backend._pool[block_id]]
    assert solo_greedy(backend, prompt, 5) != first  # the copy-in path really feeds the model
    cache.check_integrity()


def test_fault_injection_and_free_after_failure() -> None:
    backend = ReferenceBackend(fail_on_token=9, fail_on_decode_token=11)
    with backend.lock:
        state = backend.prefill_lookup([5, 6, 9, 7])
        backend.prefill_chunk(state, 2)
        with pytest.raises(InjectedFault):
            backend.prefill_chunk(state, 2)
        assert backend.kv_length(state.kv) == 2  # nothing half-applied
        backend.free_row_kv(state.kv)
        result = backend.prefill([5, 6])
        batch = backend.splice_into_batched(None, result.kv, 2)
        with pytest.raises(InjectedFault):
            backend.decode_step_batched(batch, [11])
        assert backend.kv_length(batch, 0) == 2
        backend.remove_row_from_cache(batch, 0)
        with pytest.raises(RuntimeError, match="not live"):
            backend.free_row_kv(state.kv)  # double free is detected
    assert backend.num_live_rows == 0
    backend.check_integrity()


def test_a_failed_one_shot_prefill_frees_its_row() -> None:
    """``InferenceBackend.prefill`` (lookup + chunk + store): the caller never gets the row of a prefill that
    raised, so the default frees it."""
    backend = ReferenceBackend(fail_on_token=9)
    with backend.lock:
        with pytest.raises(InjectedFault):
            backend.prefill([5, 6, 9, 7])
        assert backend.num_live_rows == 0
        backend.check_integrity()


def test_kv_reservation_limits() -> None:
    backend = ReferenceBackend(kv_capacity_tokens=100)
    assert backend.kv_reserve("a", 60) and not backend.kv_reserve("b", 60)
    with pytest.raises(KVCapacityError, match="101"):
        backend.kv_reserve("c", 101)
    backend.kv_release("a")
    assert backend.kv_reserve("b", 60) and backend.kv_stats()["tokens_reserved"] == 60


def test_reference_generate_stops_like_the_scheduler() -> None:
    backend = ReferenceBackend()
    prompt = [5, 6, 7]
    free = backend.reference_generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(free) == 30
    stop = free[3]
    stopped = backend.reference_generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop,), ignore_eos=True))
    assert stopped == free[: free.index(stop) + 1]
    with pytest.raises(ValueError, match="seed"):
        backend.reference_generate(prompt, SamplingParams(temperature=1.0))


def test_tokenizer_round_trip_and_chat_template() -> None:
    tokenizer = CharTokenizer(64)
    ids = tokenizer.encode("Hello, world!")
    assert ids[0] == 1 and tokenizer.decode(ids) == "hello, world!"
    assert tokenizer.decode([EOS_ID, *ids[1:]], skip_special_tokens=False).startswith("<eos>hello")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(chat, skip_special_tokens=False).endswith("<start_of_turn>model\n")
    assert all(0 <= t < 64 for t in chat) and tokenizer.has_chat_template


# -- sampler ----------------------------------------------------------------------------------------


def test_greedy_takes_the_first_maximum() -> None:
    assert sample_row([0.1, 2.0, 2.0, -1.0], RowSampling(0.0, 1.0, 0, 0, 0)) == (1, None)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = [3.0, 2.5, 2.0, 0.0, -1.0]
    top_k = {sample_row(logits, RowSampling(5.0, 1.0, 2, seed, 0))[0] for seed in range(200)}
    assert top_k == {0, 1}
    probs = [math.exp(x) for x in log_softmax(logits)]
    top_p = {sample_row(logits, RowSampling(1.0, probs[0] + 0.01, 0, seed, 0))[0] for seed in range(200)}
    assert top_p == {0, 1}


def test_sampling_follows_the_distribution() -> None:
    logits = [math.log(0.7), math.log(0.2), math.log(0.1)]
    counts = Counter(sample_row(logits, RowSampling(1.0, 1.0, 0, 3, step))[0] for step in range(3000))
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_rows_sample_independently_and_report_logprobs() -> None:
    rows = [RowSampling(0.8, 0.9, 0, 1, 4), RowSampling(0.0, 1.0, 0, 0, 0), RowSampling(1.2, 1.0, 3, 2, 9)]
    logits = [[float(i % 7) for i in range(20)], [1.0, 3.0, 2.0], [0.5, 0.4, 0.3, 0.2]]
    tokens, logprobs = sample_rows(logits, rows, want_logprobs=True)
    for index in range(3):
        assert tokens[index] == sample_row(logits[index], rows[index])[0]
        assert logprobs is not None and logprobs[index] == pytest.approx(log_softmax(logits[index])[tokens[index]])
    with pytest.raises(ValueError):
        sample_rows(logits, rows[:2])
