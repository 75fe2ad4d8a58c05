"""The per-tick token budget (MAX_NUM_BATCHED_TOKENS) and one-call ticks (``forward_step``), against the
ReferenceBackend in both modes: seed primitives (``prefill_chunks`` + ``decode_step_batched``) and ``mixed_step``."""

from __future__ import annotations

import pytest
from gemmaserve.engine.scheduler import PREFILL_SPREAD_TICKS
from gemmaserve.errors import ConfigurationError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings, build_settings
from gemmaserve.testing.reference_backend import ReferenceBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_scheduler import Recorder, assert_idle, make, req, run, run_arrivals

_request = st.tuples(
    st.lists(st.integers(5, 8), min_size=1, max_size=30),
    st.integers(1, 10),  # max_tokens
    st.integers(0, 5),  # arrival tick
    st.sampled_from([0.0, 0.0, 0.9]),  # temperature
    st.integers(0, 3),  # seed
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(_request, min_size=1, max_size=6),
    chunk=st.integers(1, 9),
    batch=st.integers(1, 4),
    extra_budget=st.integers(0, 12),
    mixed=st.booleans(),
    step_cap=st.sampled_from([None, 1, 3]),
    cache_blocks=st.sampled_from([0, 8, 64]),
    mixed_chunk=st.sampled_from([0, 1, 2, 5, 256]),
)
def test_tokens_do_not_depend_on_the_budget_or_the_tick_shape(
    requests: list[tuple[list[int], int, int, float, int]], chunk: int, batch: int, extra_budget: int, mixed: bool,
    step_cap: int | None, cache_blocks: int, mixed_chunk: int,
) -> None:
    backend = ReferenceBackend(mixed_step=mixed, max_step_chunk=step_cap)
    budget = batch + extra_budget
    sched, _, _ = make(backend, cache_blocks=cache_blocks, prefill_chunk_tokens=chunk, max_batch_size=batch,
                       max_num_batched_tokens=budget, mixed_prefill_chunk_tokens=mixed_chunk)
    plan = sched._plan_chunks

    def checked_plan(events):  # type: ignore[no-untyped-def]
        queues, tick = sched._q, sched.stats().num_steps
        need = 0
        for r in queues.prefilling:
            remaining = len(r.prompt_token_ids) if r.prefill_state is None else r.prefill_state.num_remaining
            left = r.queued_at_tick + PREFILL_SPREAD_TICKS - tick
            need += remaining if left <= 1 else -(-remaining // left)
        allowed = max(mixed_chunk, need) if mixed_chunk and queues.rows else budget
        work = plan(events)
        assert sum(num for _, _, num, _ in work) <= allowed, "MIXED_PREFILL_CHUNK_TOKENS beside rows"
        return work

    sched._plan_chunks = checked_plan  # type: ignore[method-assign]
    recorder, params = run_arrivals(sched, requests)
    for rid, (prompt, sampling) in params.items():
        assert recorder.outputs[rid].token_ids == backend.reference_generate(prompt, sampling), rid
    for sizes, rows in backend.step_calls:
        assert sum(sizes) + rows <= budget and all(0 < size <= chunk for size in sizes)
    assert_idle(sched)


def test_ticks_beside_decoding_rows_take_the_mixed_cap() -> None:
    """Beside decoding rows a tick spends at most max(MIXED_PREFILL_CHUNK_TOKENS, what the queued prompts'
    deadlines need) on prompts (0 turns the cap off); with nothing decoding yet each prompt gets up to
    PREFILL_CHUNK_TOKENS."""
    for mixed_cap, expected in ((3, [[2, 2, 8], [3], [3]]), (0, [[2, 2, 8], [8], [4]])):
        backend = ReferenceBackend(mixed_step=True)
        sched, _, _ = make(backend, cache_blocks=0, prefill_chunk_tokens=8, max_batch_size=4,
                           max_num_batched_tokens=64, mixed_prefill_chunk_tokens=mixed_cap)
        sched.add_request(req("first", [5, 6], max_tokens=30, ignore_eos=True))
        sched.add_request(req("second", [6, 5], max_tokens=30, ignore_eos=True))
        sched.add_request(req("long", [7] * 20, max_tokens=2, ignore_eos=True))
        recorder = Recorder()
        for _ in range(3):
            recorder.feed(sched.step())
        # tick 2: 12 tokens left over 6 ticks to the deadline need 2 a tick, less than the cap
        assert [sorted(sizes) for sizes, _ in backend.step_calls[:3]] == expected, mixed_cap
        assert [rows for _, rows in backend.step_calls[1:3]] == [2, 2]
        run(sched, recorder)
        assert recorder.outputs["long"].token_ids == backend.reference_generate(
            [7] * 20, SamplingParams(max_tokens=2, ignore_eos=True))
        assert_idle(sched)


def test_queued_prompts_get_what_their_deadlines_need_beyond_the_cap() -> None:
    """Two 40-token prompts queued beside a decoding row need ceil(40 / 7) = 6 tokens a tick each to finish
    within PREFILL_SPREAD_TICKS of being queued: the tick spends 12, more than the cap of 3, and both have
    their first token by their deadline; a prompt past its deadline gets the full budget."""
    assert PREFILL_SPREAD_TICKS == 8
    backend = ReferenceBackend(mixed_step=True)
    sched, _, _ = make(backend, cache_blocks=0, prefill_chunk_tokens=8, max_batch_size=4,
                       max_num_batched_tokens=64, mixed_prefill_chunk_tokens=3)
    sched.add_request(req("first", [5, 6], max_tokens=60, ignore_eos=True))
    recorder = Recorder()
    recorder.feed(sched.step())
    sched.add_request(req("a", [7] * 40, max_tokens=2, ignore_eos=True))
    sched.add_request(req("b", [8] * 40, max_tokens=2, ignore_eos=True))
    first_token_tick: dict[str, int] = {}
    for tick in range(2, 12):
        recorder.feed(sched.step())
        for name in ("a", "b"):
            if recorder.tokens.get(name) and name not in first_token_tick:
                first_token_tick[name] = tick
    assert sorted(backend.step_calls[1][0]) == [4, 8]
    assert max(first_token_tick.values()) <= 1 + PREFILL_SPREAD_TICKS, first_token_tick
    run(sched, recorder)
    for name, token in (("a", 7), ("b", 8)):
        assert recorder.outputs[name].token_ids == backend.reference_generate(
            [token] * 40, SamplingParams(max_tokens=2, ignore_eos=True))
    assert_idle(sched)

    # late: one prompt queued long ago (its deadline passed) takes the whole budget beside the rows
    backend = ReferenceBackend(mixed_step=True)
    sched, _, _ = make(backend, cache_blocks=0, prefill_chunk_tokens=64, max_batch_size=4,
                       max_num_batched_tokens=64, mixed_prefill_chunk_tokens=3)
    sched.add_request(req("first", [5, 6], max_tokens=60, ignore_eos=True))
    recorder = Recorder()
    recorder.feed(sched.step())
    late = req("late", [7] * 50, max_tokens=2, ignore_eos=True)
    sched.add_request(late)
    late.queued_at_tick -= PREFILL_SPREAD_TICKS
    recorder.feed(sched.step())
    assert backend.step_calls[-1] == ([50], 1)
    run(sched, recorder)
    assert_idle(sched)


@pytest.mark.parametrize("mixed", [False, True])
def test_decode_rows_come_first_and_prefill_goes_in_arrival_order(mixed: bool) -> None:
    backend = ReferenceBackend(mixed_step=mixed)
    asked: list[list[int]] = []
    original = backend.prefill_chunks

    def recording(states, num_tokens):  # type: ignore[no-untyped-def]
        asked.append([len(state.prompt_ids) for state in states])
        return original(states, num_tokens)

    backend.prefill_chunks = recording  # type: ignore[method-assign]
    sched, _, _ = make(backend, cache_blocks=0, prefill_chunk_tokens=8, max_batch_size=4, max_num_batched_tokens=10)
    sched.add_request(req("decoder", [5, 6], max_tokens=40, ignore_eos=True))
    recorder = Recorder()
    recorder.feed(sched.step())  # "decoder" prefills and decodes from now on
    for name, length in (("a", 30), ("b", 11), ("c", 9)):
        sched.add_request(req(name, [7] * length, max_tokens=2, ignore_eos=True))
    per_tick = []
    for _ in range(7):
        before = len(recorder.tokens["decoder"])
        recorder.feed(sched.step())
        per_tick.append(len(recorder.tokens["decoder"]) - before)
    assert per_tick == [1] * 7, "the decoding row stalled while a burst prefilled"
    # 10 tokens a tick, 1 for the decoding row: "a" takes 8, then "b" the 1 left, ... in arrival order
    assert [sorted(lengths) for lengths in asked[1:4]] == [[11, 30], [11, 30], [11, 30]]
    assert sched.stats().num_waiting == 0
    run(sched, recorder)
    for name, length in (("a", 30), ("b", 11), ("c", 9)):
        assert recorder.outputs[name].token_ids == backend.reference_generate(
            [7] * length, SamplingParams(max_tokens=2, ignore_eos=True))
    assert_idle(sched)


def test_mixed_backend_gets_one_call_per_tick() -> None:
    backend = ReferenceBackend(mixed_step=True)
    decodes = []
    original = backend.decode_step_batched
    backend.decode_step_batched = lambda b, ids: decodes.append(len(ids)) or original(b, ids)  # type: ignore[method-assign]
    sched, _, _ = make(backend, cache_blocks=0, prefill_chunk_tokens=4, max_num_batched_tokens=16)
    sched.add_request(req("x", [5, 6, 7], max_tokens=5, ignore_eos=True))
    sched.add_request(req("y", list(range(5, 25)), max_tokens=3, ignore_eos=True))
    ticks = 0
    while sched.has_work:
        calls = len(backend.step_calls)
        sched.step()
        ticks += 1
        assert len(backend.step_calls) == calls + 1
    assert ticks == len(backend.step_calls) == len(decodes) + sum(rows == 0 for _, rows in backend.step_calls)
    assert_idle(sched)


@pytest.mark.parametrize("mixed", [False, True])
def test_failures_stay_with_their_request_in_one_call_ticks(mixed: bool) -> None:
    probe = ReferenceBackend()
    poison = [5, 6, 7]
    tokens = probe.reference_generate(poison, SamplingParams(max_tokens=10, ignore_eos=True))
    bystander = probe.reference_generate([8, 8], SamplingParams(max_tokens=30, ignore_eos=True))
    assert tokens[3] not in bystander and 40 not in tokens + bystander
    backend = ReferenceBackend(mixed_step=mixed, fail_on_token=40, fail_on_decode_token=tokens[3])
    sched, _, _ = make(backend, prefill_chunk_tokens=3, max_num_batched_tokens=9)
    sched.add_request(req("poison", poison, max_tokens=10, ignore_eos=True))
    sched.add_request(req("bystander", [8, 8], max_tokens=30, ignore_eos=True))
    sched.add_request(req("bad-prompt", [5, 6, 7, 8, 9, 10, 40, 11], max_tokens=4))
    sched.add_request(req("late", [9, 9, 9, 9, 9, 9, 9], max_tokens=4, ignore_eos=True))
    out = run(sched).outputs
    assert out["poison"].finish_reason == "error" and out["poison"].token_ids == tokens[:4]
    assert out["bad-prompt"].finish_reason == "error" and "prefill" in (out["bad-prompt"].error or "")
    assert out["bystander"].token_ids == bystander
    assert out["late"].token_ids == probe.reference_generate([9] * 7, SamplingParams(max_tokens=4, ignore_eos=True))
    assert_idle(sched)


def test_cancel_mid_prefill_under_a_budget_frees_everything() -> None:
    sched, _, _ = make(ReferenceBackend(mixed_step=True, kv_capacity_tokens=4096), prefill_chunk_tokens=4,
                       max_num_batched_tokens=8)
    sched.add_request(req("long", list(range(5, 45)), max_tokens=3))
    sched.add_request(req("other", [5, 6], max_tokens=3))
    recorder = Recorder()
    recorder.feed(sched.step())
    recorder.feed(sched.step())
    assert sched.stats().num_prefilling >= 1
    events = sched.abort_request("long")
    assert events and events[-1].finished
    recorder.feed(events)
    run(sched, recorder)
    assert recorder.outputs["long"].finish_reason == "cancelled"
    assert_idle(sched)


def test_budget_below_the_batch_size_is_refused_with_both_names() -> None:
    with pytest.raises(ConfigurationError) as info:
        build_settings(CoreSettings, {"max_batch_size": 64, "max_num_batched_tokens": 32})
    assert "MAX_NUM_BATCHED_TOKENS" in str(info.value) and "MAX_BATCH_SIZE" in str(info.value)
    assert CoreSettings(max_batch_size=8, max_num_batched_tokens=8).max_num_batched_tokens == 8
