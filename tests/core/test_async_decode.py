"""Asynchronous decode (``ASYNC_SCHEDULING`` with ``capabilities.async_decode``): the scheduler launches step k+1
before it applies step k's tokens. Against the ReferenceBackend in both tick modes; the tokens, the events and
the bookkeeping must be exactly those of synchronous scheduling."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from gemmaserve.backend import PendingTokens, SampledTokens
from gemmaserve.engine.request import FinishReason, Request
from gemmaserve.sampling_params import RowSampling, SamplingParams
from gemmaserve.testing.reference_backend import ReferenceBackend
from gemmaserve.testing.reference_model import EOS_ID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_scheduler import Recorder, assert_idle, check_all, make, run, run_arrivals

_request = st.tuples(
    st.lists(st.integers(5, 8), min_size=1, max_size=24),
    st.integers(1, 12),  # max_tokens
    st.integers(0, 6),  # arrival tick
    st.sampled_from([0.0, 0.0, 0.8, 1.5]),  # temperature
    st.integers(0, 3),  # seed
)


class _Lagging(PendingTokens):
    """Tokens that are only readable once the next step was launched (or the reader gives up waiting): proves
    that the scheduler launches before it reads, and that nothing reads a step twice."""

    def __init__(self, backend: LaggingBackend, sampled: SampledTokens) -> None:
        self.backend, self.sampled, self.launch = backend, sampled, backend.launches
        self.reads = 0

    def result(self) -> SampledTokens:
        self.reads += 1
        self.backend.reads.append((self.launch, self.backend.launches))
        return self.sampled


class LaggingBackend(ReferenceBackend):
    """ReferenceBackend whose async steps record the launch count when their tokens are read."""

    def __init__(self, **options: object) -> None:
        super().__init__(async_decode=True, **options)  # type: ignore[arg-type]
        self.launches = 0
        self.reads: list[tuple[int, int]] = []  # (launch number of the step read, launches done at the read)
        self.sources: list[list[int]] = []

    def decode_step_async(self, batched, input_ids, from_previous, rows, *, want_logprobs=False):  # type: ignore[no-untyped-def]
        ready = super().decode_step_async(batched, input_ids, from_previous, rows, want_logprobs=want_logprobs)
        self.launches += 1
        self.sources.append(list(from_previous))
        return _Lagging(self, ready.result())


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(_request, min_size=1, max_size=6),
    chunk=st.integers(1, 9),
    batch=st.integers(1, 4),
    mixed=st.booleans(),
    cache_blocks=st.sampled_from([0, 8, 64]),
    reserve=st.booleans(),
)
def test_async_tokens_equal_the_reference_whatever_the_arrivals(
    requests: list[tuple[list[int], int, int, float, int]], chunk: int, batch: int, mixed: bool, cache_blocks: int,
    reserve: bool,
) -> None:
    backend = LaggingBackend(mixed_step=mixed, kv_capacity_tokens=4096 if reserve else None)
    sched, _, _ = make(backend, cache_blocks=cache_blocks, prefill_chunk_tokens=chunk, max_batch_size=batch)
    recorder, params = run_arrivals(sched, requests)  # integrity (one KV position ahead) checked every tick
    for rid, (prompt, sampling) in params.items():
        assert recorder.outputs[rid].token_ids == backend.reference_generate(prompt, sampling), rid
    assert_idle(sched)
    assert all(done >= launch for launch, done in backend.reads)


def test_the_next_step_is_launched_before_the_tokens_are_read() -> None:
    backend = LaggingBackend()
    sched, _, _ = make(backend)
    sched.add_request(Request("a", (5, 6, 7), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    recorder = run(sched)
    assert recorder.outputs["a"].token_ids == backend.reference_generate([5, 6, 7], SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True))
    # 7 decode steps; every step but the last was read after the step after it was launched
    assert [launch for launch, _ in backend.reads] == list(range(1, 8))
    assert all(done == launch + 1 for launch, done in backend.reads[:-1])
    # ... and the last one (its row's max_tokens ends with it) was read before anything more was launched
    assert backend.reads[-1] == (7, 7) and backend.launches == 7
    # rows keep feeding on the device: from the second step on, the row names its row of the previous step
    assert backend.sources[0] == [-1] and all(s == [0] for s in backend.sources[1:])


def test_a_row_that_stops_on_eos_emits_nothing_after_its_end() -> None:
    backend = LaggingBackend()
    probe = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = [[5 + i % 3, 6, 7 + i % 2, 5 + i] for i in range(20)]
    stops = [p for p in prompts if len(backend.reference_generate(p, probe)) < 40 and
             backend.reference_generate(p, probe)[-1] == EOS_ID]
    if not stops:
        pytest.skip("no prompt of this toy model stops on EOS within 40 tokens")
    prompt = stops[0]
    other = [5, 5, 5]
    sched, _, _ = make(backend)
    sched.add_request(Request("eos", tuple(prompt), probe))
    sched.add_request(Request("long", tuple(other), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
    recorder = run(sched)
    assert recorder.outputs["eos"].token_ids == backend.reference_generate(prompt, probe)
    assert recorder.outputs["eos"].finish_reason == FinishReason.STOP
    assert len(recorder.outputs["long"].token_ids) == 40
    assert_idle(sched)


def test_cancelling_a_row_with_a_step_in_flight_drops_that_step_for_it() -> None:
    backend = LaggingBackend()
    sched, _, _ = make(backend)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("a", (5, 6), params))
    sched.add_request(Request("b", (7, 8), params))
    recorder = Recorder()
    for _ in range(6):
        recorder.feed(sched.step())
        check_all(sched)
    assert sched._launched is not None and any(r.request_id == "a" for r in sched._launched.requests)
    got = len(recorder.tokens["a"])
    recorder.feed(sched.abort_request("a"))
    check_all(sched)
    recorder = run(sched, recorder)
    assert recorder.outputs["a"].finish_reason == FinishReason.CANCELLED
    assert len(recorder.tokens["a"]) == got  # the launched step's token for "a" was dropped
    assert recorder.outputs["b"].token_ids == backend.reference_generate([7, 8], params)
    assert_idle(sched)


def _outcomes(prompts: list[list[int]], params: SamplingParams, scheduler: dict[str, int],
              **backend: object) -> dict[str, tuple[list[int], FinishReason]]:
    """(tokens, finish reason) per request id of ``prompts`` run to the end on a fresh ReferenceBackend."""
    sched, _, _ = make(ReferenceBackend(**backend), **scheduler)  # type: ignore[arg-type]
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(str(i), tuple(prompt), params))
    recorder = run(sched)
    assert_idle(sched)
    return {rid: (o.token_ids, o.finish_reason) for rid, o in recorder.outputs.items()}


@pytest.mark.parametrize("mixed", [False, True])
def test_a_failing_step_retries_rows_alone_as_in_synchronous_decode(mixed: bool) -> None:
    probe = ReferenceBackend()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 7, 6, 5], [6, 6]]
    tokens = probe.reference_generate(prompts[0], params)
    outputs = {use_async: _outcomes(prompts, params, {}, mixed_step=mixed, async_decode=use_async,
                                    fail_on_decode_token=tokens[3]) for use_async in (False, True)}
    assert outputs[True] == outputs[False]
    assert outputs[True]["0"][1] == FinishReason.ERROR and outputs[True]["1"][1] == FinishReason.LENGTH


def test_async_scheduling_off_runs_synchronously() -> None:
    backend = LaggingBackend()
    sched, _, _ = make(backend, async_scheduling=False)  # type: ignore[arg-type]
    sched.add_request(Request("a", (5, 6, 7), SamplingParams(max_tokens=5, temperature=0.0)))
    run(sched)
    assert backend.launches == 0 and not backend.reads
    assert_idle(sched)


def test_seeded_rows_sample_with_the_step_of_the_token_they_produce() -> None:
    """A row launched ahead samples its token with step = tokens generated + 1 (the one not applied yet)."""
    seen: list[list[int]] = []

    class Recording(LaggingBackend):
        def sample(self, logits, rows: Sequence[RowSampling], *, want_logprobs: bool = False):  # type: ignore[no-untyped-def]
            seen.append([row.step for row in rows])
            return super().sample(logits, rows, want_logprobs=want_logprobs)

    backend = Recording()
    sched, _, _ = make(backend)
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    sched.add_request(Request("a", (5, 6, 7), params))
    recorder = run(sched)
    assert recorder.outputs["a"].token_ids == backend.reference_generate([5, 6, 7], params)
    assert seen == [[step] for step in range(6)]


def test_mixed_ticks_launch_before_the_previous_tick_is_applied() -> None:
    """With mixed_step, a tick carrying prompt chunks launches too (forward_step_async): a completed prompt's
    first token is applied one tick later, and the tokens are those of the reference."""
    calls: list[int] = []

    class Counting(ReferenceBackend):
        def forward_step_async(self, states, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(len(states))
            return super().forward_step_async(states, *args, **kwargs)

    backend = Counting(mixed_step=True, async_decode=True)
    sched, _, _ = make(backend, prefill_chunk_tokens=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {"a": [5, 6, 7, 8, 5, 6, 7], "b": [8, 8, 7], "c": [6, 5, 6, 5, 6, 5, 6, 5, 6]}
    for rid, prompt in prompts.items():
        sched.add_request(Request(rid, tuple(prompt), params))
    recorder = Recorder()
    recorder.feed(sched.step())  # tick 1 launches every first chunk; b completes, its first token is in flight
    assert calls == [3] and "b" not in recorder.tokens and sched._awaiting_first == {"b"}
    recorder.feed(sched.step())  # tick 2 applies tick 1: b's first token arrives
    assert recorder.tokens["b"] == backend.reference_generate(prompts["b"], params)[:1]
    recorder = run(sched, recorder)
    for rid, prompt in prompts.items():
        assert recorder.outputs[rid].token_ids == backend.reference_generate(prompt, params), rid
    assert_idle(sched)


def test_cancelling_a_prompt_whose_first_token_is_in_flight() -> None:
    backend = ReferenceBackend(mixed_step=True, async_decode=True)
    sched, _, _ = make(backend)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("a", (5, 6, 7), params))
    sched.add_request(Request("b", (8, 7), params))
    recorder = Recorder()
    recorder.feed(sched.step())
    assert sched._awaiting_first == {"a", "b"}
    recorder.feed(sched.abort_request("a"))
    check_all(sched)
    recorder = run(sched, recorder)
    assert recorder.outputs["a"].finish_reason == FinishReason.CANCELLED and recorder.outputs["a"].token_ids == []
    assert recorder.outputs["b"].token_ids == backend.reference_generate([8, 7], params)
    assert_idle(sched)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_failing_chunk_fails_its_request_alone_as_in_synchronous_ticks(mixed: bool) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 40, 6, 5], [6, 6], [7, 5, 5, 5, 6]]
    outputs = {use_async: _outcomes(prompts, params, {"prefill_chunk_tokens": 2}, mixed_step=mixed,
                                    async_decode=use_async, fail_on_token=40) for use_async in (False, True)}
    assert outputs[True] == outputs[False]
    assert outputs[True]["1"][1] == FinishReason.ERROR and outputs[True]["0"][1] == FinishReason.LENGTH


def test_through_the_engine_cancel_and_shutdown_with_steps_in_flight() -> None:
    """The engine thread with asynchronous ticks: a request cancelled mid-stream ends cancelled and emits nothing
    after; the others keep the reference tokens; a shutdown with a launched step cancels the rest, no hang."""
    import time

    from gemmaserve.engine import Engine
    from gemmaserve.settings import CoreSettings

    backend = LaggingBackend(mixed_step=True, decode_delay_s=0.001)
    settings = CoreSettings(max_batch_size=8, prefill_chunk_tokens=4, max_active_kv_tokens=8192)
    engine = Engine(backend, settings)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = [(5, 6, 7), (8, 7, 6, 5, 5), (6, 6), (7, 8)]
    handles = [engine.submit(list(p), params, request_id=str(i)) for i, p in enumerate(prompts)]
    seen = []
    for event in handles[0]:
        seen.extend(event.new_token_ids)
        if len(seen) >= 3 and not event.finished:
            handles[0].cancel()
        if event.finished:
            break
    assert event.output.finish_reason == FinishReason.CANCELLED and event.output.token_ids == seen
    for i in (1, 2, 3):
        assert handles[i].result(timeout=10).token_ids == backend.reference_generate(list(prompts[i]), params)
    engine.check_integrity()
    launches = backend.launches
    late = [engine.submit([5, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True)) for _ in range(3)]
    deadline = time.monotonic() + 10
    while backend.launches < launches + 20:  # the late ones are decoding, a step launched ahead
        assert time.monotonic() < deadline, "the engine made no progress"
        time.sleep(0.005)
    engine.shutdown(timeout=10)
    assert all(h.result(timeout=10).finish_reason == FinishReason.CANCELLED for h in late)


# -- deferred sampling: constrained and penalized rows launched ahead --------------------------------------
_KINDS = {
    "plain": {},
    "regex": {"structured_outputs": {"regex": "[a-d]{2,9}"}},
    "choice": {"structured_outputs": {"choice": ["abc", "dabba", "cc"]}},
    "stuck-later": {"structured_outputs": {"regex": "ab[A-Z]"}},  # no upper-case token: fails after "ab"
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
    "both": {"structured_outputs": {"regex": "[a-c]+d"}, "frequency_penalty": 2.0},
    "bad-words": {"bad_words": ["ab", "ca", "e"]},
}
_deferred_request = st.tuples(
    st.lists(st.integers(5, 30), min_size=1, max_size=10), st.integers(1, 14), st.integers(0, 5),
    st.sampled_from([0.0, 0.9, 1.7]), st.integers(0, 3), st.sampled_from(sorted(_KINDS)))


def _deferred_run(backend: ReferenceBackend, requests: list, **scheduler: object) -> dict[str, tuple]:
    sched, _, _ = make(backend, **scheduler)  # type: ignore[arg-type]
    recorder = Recorder()
    last = max(r[2] for r in requests)
    for tick in range(10_000):
        for index, (prompt, max_tokens, arrival, temperature, seed, kind) in enumerate(requests):
            if arrival == tick:
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **_KINDS[kind])
                sched.add_request(Request(str(index), tuple(prompt), params))
        if tick > last and not sched.has_work:
            break
        recorder.feed(sched.step())
        check_all(sched)
    assert_idle(sched)
    return {rid: (o.token_ids, o.finish_reason, o.error) for rid, o in recorder.outputs.items()}


class DeferringBackend(LaggingBackend):
    """Counts the decode steps launched with a deferred (callable) sampling."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.deferred = 0

    def decode_step_async(self, batched, input_ids, from_previous, rows, *, want_logprobs=False):  # type: ignore[no-untyped-def]
        self.deferred += callable(rows)
        return super().decode_step_async(batched, input_ids, from_previous, rows, want_logprobs=want_logprobs)


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(_deferred_request, min_size=1, max_size=6), batch=st.integers(1, 4),
       chunk=st.integers(2, 9))
def test_deferred_sampling_gives_the_synchronous_tokens(requests: list, batch: int, chunk: int) -> None:
    """Structured-output and penalized rows launched ahead, their sampling deferred until the previous token is
    read (masks after a token taken ahead, constraints completing or failing mid-way, penalties counting it):
    every request's tokens, finish reason and error are those of synchronous scheduling."""
    backend = DeferringBackend()
    got = _deferred_run(backend, requests, max_batch_size=batch, prefill_chunk_tokens=chunk)
    want = _deferred_run(ReferenceBackend(), requests, max_batch_size=batch, prefill_chunk_tokens=chunk,
                         async_scheduling=False)
    assert got == want


def test_a_constrained_batch_is_launched_ahead_with_its_sampling_deferred() -> None:
    backend = DeferringBackend()
    requests = [([5, 6], 12, 0, 0.9, 1, "regex"), ([7], 12, 0, 0.0, 2, "penalties"), ([8, 9], 12, 1, 0.0, 0, "plain")]
    got = _deferred_run(backend, requests)
    assert got == _deferred_run(ReferenceBackend(), requests, async_scheduling=False)
    assert backend.deferred >= 5  # the constrained / penalized rows did not force synchronous steps
    assert all(done >= launch for launch, done in backend.reads)
