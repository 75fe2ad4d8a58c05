"""Decode-failure isolation in-process (scheduler and engine over the ReferenceBackend, whose outputs
are exact): a failed batched decode step is retried row by row, so only rows that fail alone fail,
and every other request produces exactly the tokens it would have produced without the fault."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from gemmaserve.engine.engine import Engine
from gemmaserve.engine.isolation import MAX_ROW_RETRIES
from gemmaserve.engine.request import Request, RequestEvent, RequestOutput
from gemmaserve.engine.scheduler import ContinuousBatchScheduler
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings
from gemmaserve.testing.reference_backend import InjectedFault, ReferenceBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


class FlakyBackend(ReferenceBackend):
    """Batched decode steps over more than ``min_rows`` rows fail with probability ``p`` (seeded),
    half of the time after the step already advanced the KV; ``always`` fails every such step."""

    def __init__(self, p: float = 0.0, seed: int = 0, *, min_rows: int = 2, always: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.p, self.rng, self.min_rows, self.always = p, random.Random(seed), min_rows, always
        self.injected = 0

    def decode_step_batched(self, batched: Any, input_ids: Sequence[int]) -> list[list[float]]:
        fail = len(input_ids) >= self.min_rows and (self.always or self.rng.random() < self.p)
        after = fail and self.rng.random() < 0.5
        if fail and not after:
            self.injected += 1
            raise InjectedFault("injected batch-size fault before the step")
        logits = super().decode_step_batched(batched, input_ids)
        if after:
            self.injected += 1
            raise InjectedFault("injected batch-size fault after the step advanced the KV")
        return logits


def make(backend: ReferenceBackend, **overrides: int) -> ContinuousBatchScheduler:
    cache = CacheManager(64, 4)
    backend.set_cache_adapter(cache)
    values = {"max_batch_size": 8, "prefill_chunk_tokens": 8, "max_active_kv_tokens": 4096, **overrides}
    return ContinuousBatchScheduler(backend, CoreSettings(**values), cache)


def drain(sched: ContinuousBatchScheduler, max_ticks: int = 5000) -> dict[str, RequestOutput]:
    """Tick until idle, checking the streaming contract and every invariant after each tick."""
    tokens: dict[str, list[int]] = {}
    outputs: dict[str, RequestOutput] = {}
    for _ in range(max_ticks):
        if not sched.has_work:
            break
        events: Iterable[RequestEvent] = sched.step()
        for event in events:
            assert event.request_id not in outputs, "event after the final one"
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished:
                assert event.output is not None and event.output.token_ids == tokens[event.request_id]
                outputs[event.request_id] = event.output
        sched.check_integrity()
        sched.backend.check_integrity()
    assert not sched.has_work, "the scheduler did not drain"
    return outputs


def assert_idle(sched: ContinuousBatchScheduler) -> None:
    backend = sched.backend
    assert isinstance(backend, ReferenceBackend)
    assert backend.num_live_rows == 0 and backend.num_reservations == 0
    assert sched.stats().reserved_kv_tokens == 0
    assert sched.cache_manager is not None and sched.cache_manager.stats().pinned_blocks == 0
    sched.cache_manager.check_integrity()


request_specs = st.lists(
    st.tuples(
        st.lists(st.integers(4, 63), min_size=1, max_size=12),  # prompt
        st.integers(1, 12),  # max_tokens
        st.one_of(st.none(), st.integers(0, 2**16)),  # None = greedy, else the seed of a sampled request
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=request_specs, fault_seed=st.integers(0, 2**16), p=st.sampled_from([0.1, 0.3, 0.6]))
def test_transient_batch_faults_never_change_any_output(
    specs: list[tuple[list[int], int, int | None]], fault_seed: int, p: float
) -> None:
    backend = FlakyBackend(p, fault_seed, kv_capacity_tokens=2048)
    sched = make(backend)
    params = {}
    for index, (prompt, max_tokens, seed) in enumerate(specs):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if seed is None else 0.9,
                                  seed=seed)
        params[f"r{index}"] = (prompt, sampling)
        sched.add_request(Request(f"r{index}", tuple(prompt), sampling))
    outputs = drain(sched)
    for rid, (prompt, sampling) in params.items():
        out = outputs[rid]
        expected = backend.reference_generate(prompt, sampling)
        if out.finish_reason == "error":  # only a request that used up its retries may fail
            assert f"after {MAX_ROW_RETRIES} retries" in (out.error or ""), out.error
            assert out.token_ids == expected[: len(out.token_ids)]
        else:
            assert out.token_ids == expected, rid
    stats = sched.stats()
    assert stats.decode_failures == backend.injected
    assert_idle(sched)


def test_a_step_failing_at_every_batch_size_fails_every_row_once() -> None:
    backend = FlakyBackend(min_rows=1, always=True)  # solo retries fail too: every row is to blame
    sched = make(backend)
    for index in range(3):
        sched.add_request(Request(f"r{index}", (5 + index, 6), SamplingParams(max_tokens=8, ignore_eos=True)))
    outputs = drain(sched)
    for out in outputs.values():
        assert out.finish_reason == "error" and "retried without the other rows" in (out.error or "")
        assert len(out.token_ids) == 1  # the first token came from prefill; the first decode step failed
    assert sched.stats().decode_failures == 1 and sched.stats().decode_rows_retried == 3
    assert_idle(sched)


def test_a_request_survives_at_most_max_row_retries() -> None:
    backend = FlakyBackend(always=True)  # fails whenever two rows decode together; solo steps pass
    sched = make(backend)
    short = SamplingParams(max_tokens=MAX_ROW_RETRIES + 1, ignore_eos=True)
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    sched.add_request(Request("short", (7, 8, 9), short))
    sched.add_request(Request("long", (9, 8, 7), long))
    outputs = drain(sched)
    assert outputs["short"].finish_reason == "length"  # every decode step of it came from a solo retry
    assert outputs["short"].token_ids == backend.reference_generate([7, 8, 9], short)
    long_out = outputs["long"]
    expected = backend.reference_generate([9, 8, 7], long)
    # "long" was retried with "short" MAX_ROW_RETRIES times, then decoded alone: nothing failed
    assert long_out.finish_reason == "length" and long_out.token_ids == expected
    assert sched.stats().decode_rows_retried == 2 * MAX_ROW_RETRIES
    sched.add_request(Request("a", (1, 2), long))
    sched.add_request(Request("b", (2, 1), long))
    outputs = drain(sched)
    for rid in ("a", "b"):
        assert outputs[rid].finish_reason == "error", rid
        assert f"after {MAX_ROW_RETRIES} retries" in (outputs[rid].error or "")
        assert len(outputs[rid].token_ids) == 1 + MAX_ROW_RETRIES
    assert_idle(sched)


def test_a_poisoned_row_fails_alone_with_its_own_error_and_keeps_its_tokens() -> None:
    probe = ReferenceBackend()
    poison_tokens = probe.reference_generate([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
    at = next(i for i in range(2, 12) if poison_tokens[i] not in poison_tokens[:i])
    bad = poison_tokens[at]  # first fed at decode step ``at``
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    candidates = ([a, b] for a in range(8, 64) for b in range(4, 64))
    clean = (prompt for prompt in candidates if bad not in probe.reference_generate(prompt, params))
    others = {f"o{i}": next(clean) for i in range(5)}  # bystanders that never feed the bad token
    expected = {rid: probe.reference_generate(prompt, params) for rid, prompt in others.items()}
    backend = ReferenceBackend(fail_on_decode_token=bad, kv_capacity_tokens=1024)
    sched = make(backend)
    sched.add_request(Request("poison", (5, 6, 7), SamplingParams(max_tokens=12, ignore_eos=True)))
    for rid, prompt in others.items():
        sched.add_request(Request(rid, tuple(prompt), params))
    outputs = drain(sched)
    poison = outputs["poison"]
    assert poison.finish_reason == "error" and poison.error_type == "BackendStepError"
    assert "injected decode failure" in (poison.error or "") and poison.token_ids == poison_tokens[: at + 1]
    for rid, tokens in expected.items():
        assert outputs[rid].finish_reason == "length" and outputs[rid].token_ids == tokens, rid
    assert sched.stats().decode_failures == 1 and sched.stats().decode_rows_retried == 6
    assert_idle(sched)


class WholeCallChunkFault(ReferenceBackend):
    """A whole-tick forward that raises as a real one does (custom_torch's mixed step) when any prompt chunk in it
    holds ``POISON``, instead of reporting the chunk's error alone; the chunk run alone raises too."""

    POISON = 13

    def __init__(self, **kw: Any) -> None:
        super().__init__(mixed_step=True, fail_on_token=self.POISON, **kw)

    def forward_step(self, states: Any, num_tokens: Any, batched: Any, input_ids: Any) -> Any:
        for state, num in zip(states, num_tokens):
            if self.POISON in state.prompt_ids[state.num_computed: state.num_computed + num]:
                raise InjectedFault("a poisoned prompt chunk failed the whole forward")
        return super().forward_step(states, num_tokens, batched, input_ids)


@pytest.mark.parametrize("async_decode", [False, True])
def test_other_requests_failing_chunks_never_use_up_a_decoding_rows_retries(async_decode: bool) -> None:
    """More whole-forward failures than MAX_ROW_RETRIES, each caused by another request's prompt chunk (which
    fails alone, so it is the cause): the decoding row is retried alone each time, never charged, and finishes
    with exactly its tokens; each poisoned request fails with its own error."""
    backend = WholeCallChunkFault(async_decode=async_decode)
    sched = make(backend, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    sched.add_request(Request("victim", (5, 6, 7), params))
    outputs: dict[str, RequestOutput] = {}
    poisoned = 0
    for tick in range(300):
        if tick % 3 == 2 and poisoned <= MAX_ROW_RETRIES:
            sched.add_request(Request(f"poison{poisoned}", (8, WholeCallChunkFault.POISON, 9),
                                      SamplingParams(max_tokens=3)))
            poisoned += 1
        for event in sched.step():
            if event.finished:
                assert event.output is not None
                outputs[event.request_id] = event.output
        sched.check_integrity()
        if not sched.has_work and poisoned > MAX_ROW_RETRIES:
            break
    assert outputs["victim"].finish_reason == "length"
    assert outputs["victim"].token_ids == backend.reference_generate([5, 6, 7], params)
    for i in range(poisoned):
        assert outputs[f"poison{i}"].finish_reason == "error"
        assert "injected prefill failure" in (outputs[f"poison{i}"].error or "")
    assert sched.stats().decode_failures == poisoned > MAX_ROW_RETRIES
    assert_idle(sched)


def test_one_unreadable_launched_step_charges_each_row_one_retry() -> None:
    """Asynchronous decode with rows that need their previous token (a penalty): the third launched step's tokens
    cannot be read, which the next launch finds. One fault is one failure and one retry charged per row, not
    two (the applied step's solo retry and the failed launch's own); the tokens stay exact."""
    from gemmaserve.backend import PendingTokens

    class Unreadable(PendingTokens):
        def result(self) -> Any:
            raise InjectedFault("the device lost the launched step's tokens")

    class LosesOneStep(ReferenceBackend):
        launches = 0

        def decode_step_async(self, *args: Any, **kwargs: Any) -> PendingTokens:
            pending = super().decode_step_async(*args, **kwargs)
            self.launches += 1
            return Unreadable() if self.launches == 3 else pending

    backend = LosesOneStep(async_decode=True)
    sched = make(backend)
    params = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.5)
    sched.add_request(Request("a", (5, 6, 7), params))
    sched.add_request(Request("b", (8, 9), params))
    retries: dict[str, int] = {}
    outputs: dict[str, RequestOutput] = {}
    for _ in range(100):
        for event in sched.step():
            if event.finished:
                assert event.output is not None
                outputs[event.request_id] = event.output
        retries.update({r.request_id: r.decode_retries for r in sched.live_requests()})
        if not sched.has_work:
            break
    assert sched.stats().decode_failures == 1 and retries == {"a": 1, "b": 1}
    for rid, prompt in (("a", [5, 6, 7]), ("b", [8, 9])):
        assert outputs[rid].token_ids == backend.reference_generate(prompt, params), rid
    assert_idle(sched)


@pytest.mark.timeout(60)
def test_engine_cancels_queued_requests_before_they_run() -> None:
    """Through the threaded Engine: requests cancelled while WAITING end as ``cancelled`` with no
    tokens and are never prefilled; the rest are untouched."""
    backend = ReferenceBackend(decode_delay_s=0.005)
    settings_ = CoreSettings(max_batch_size=1, max_active_kv_tokens=4096, prefill_chunk_tokens=8)
    engine = Engine(backend, settings_)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    # The first request runs ~2 s (400 steps of 5 ms), so the window in which the other five wait is wide
    # on a loaded 2-core CI box (a 150 ms window was once missed there and the loop then ran past it).
    first_params = SamplingParams(max_tokens=400, ignore_eos=True)
    try:
        handles = [engine.submit([5 + i, 6, 7], first_params if i == 0 else params) for i in range(6)]
        deadline = time.monotonic() + 10
        while engine.stats().waiting != 5 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert time.monotonic() < deadline, "five requests never waited behind the first"
        for handle in handles[2:5]:
            assert handle.cancel()
        outputs = [handle.result(timeout=30) for handle in handles]
        for index, out in enumerate(outputs):
            if 2 <= index < 5:
                assert out.finish_reason == "cancelled" and out.token_ids == [] and out.cached_tokens == 0
            else:
                expected_params = first_params if index == 0 else params
                assert out.token_ids == backend.reference_generate([5 + index, 6, 7], expected_params)
        stats = engine.stats()
        assert stats.prompt_tokens == 3 * 3 and stats.finished == {"length": 3, "cancelled": 3}
        engine.check_integrity()
        assert backend.num_live_rows == 0
    finally:
        engine.shutdown(timeout=10)
