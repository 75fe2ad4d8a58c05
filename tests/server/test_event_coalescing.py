"""A generation behind the engine folds the queued events into one step (one SSE chunk); its timing keeps each
event's production time. ``RequestEvent.then`` by property."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaserve.engine.request import FinishReason, Request, RequestEvent, RequestState
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.server.generation import Generation, Prepared, Timing
from gemmaserve.testing.reference_model import CharTokenizer


class DeadEngine:
    """Nothing is submitted (``submit=False``): the test feeds the generation's queue itself."""


def decoding_request(max_tokens: int, logprobs: bool = False) -> Request:
    request = Request("r", (3, 4), SamplingParams(max_tokens=max_tokens, ignore_eos=True), logprobs)
    request.seed = 0
    request.advance(RequestState.PREFILLING)
    request.advance(RequestState.DECODING)
    return request


def events_of(request: Request, tokens: list[list[int]], start: float = 10.0) -> list[RequestEvent]:
    """One event per inner list (its tokens appended, then ``take_event``), made 1 s apart from ``start``, up to
    the one that finishes the request."""
    events: list[RequestEvent] = []
    for k, group in enumerate(tokens):
        if events and events[-1].finished:
            break
        for token in group:
            request.append_token(token, -0.5 if request.want_logprobs else None, ())
        event = request.take_event()
        event.produced_at = start + k
        events.append(event)
    return events


def generation(max_tokens: int, logprobs: bool = False, stop: list[str] | None = None,
               special: bool = False) -> Generation:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, skip_special_tokens=not special)
    prepared = Prepared(prompt_ids=[3, 4], params=params, stop=stop or [], want_logprobs=logprobs)
    return Generation(DeadEngine(), CharTokenizer(64), prepared, timing=Timing(start=9.5), submit=False)  # type: ignore[arg-type]


def letters(text: str) -> list[int]:
    return CharTokenizer(64).encode(text, add_special_tokens=False)


async def drain(g: Generation) -> tuple[list[str], list[int]]:
    """Every step's text and all tokens until the generation is over (or nothing is queued)."""
    texts: list[str] = []
    while not g.done and (not g._queue.empty() or g._held is not None):
        step = await g.next_step()
        if step is None:
            break
        texts.append(step.text)
    return texts, g.token_ids


def test_special_tokens_shown_merge_like_one_at_a_time() -> None:
    """Chat with a tool or reasoning parser decodes with the special tokens: an EOS that does not end the request
    (ignore_eos) is an ordinary token, its text kept (vLLM's rule: only the token that ends a request loses its
    text); merged or not, the reply's text is the same."""
    eos = 2
    tokens = [[letters("a")[0]], [eos], [letters("b")[0]], [letters("c")[0]]]

    async def one_at_a_time() -> str:
        g = generation(8, special=True)
        text = ""
        for event in events_of(decoding_request(8), tokens):
            g._queue.put_nowait(event)
            step = await g.next_step()
            assert step is not None
            text += step.text
        return text

    async def merged() -> str:
        g = generation(8, special=True)
        for event in events_of(decoding_request(8), tokens):
            g._queue.put_nowait(event)
        texts, ids = await drain(g)
        assert ids == [t for group in tokens for t in group]
        return "".join(texts)

    expected = asyncio.run(one_at_a_time())
    assert expected == "a<eos>bc"
    assert asyncio.run(merged()) == expected


def test_tokens_before_a_failure_go_out_before_the_error() -> None:
    from gemmaserve.server.errors import APIError

    async def scenario() -> None:
        g = generation(8)
        request = decoding_request(8)
        events = events_of(request, [[letters("a")[0]], [letters("b")[0]]])
        request.finish(FinishReason.ERROR, RuntimeError("injected"))
        events.append(request.take_event())
        for event in events:
            g._queue.put_nowait(event)
        step = await g.next_step()
        assert step is not None and step.token_ids == letters("ab") and step.text == "ab"
        with pytest.raises(APIError):
            await g.next_step()

    asyncio.run(scenario())


def test_tokens_after_a_stop_string_are_not_timed() -> None:
    async def scenario() -> None:
        g = generation(8, stop=["b"])
        for event in events_of(decoding_request(8), [[letters("a")[0]], [letters("b")[0]], [letters("c")[0]]]):
            g._queue.put_nowait(event)
        step = await g.next_step()
        assert step is not None and step.finish_reason == "stop" and step.text == "a"
        assert g.token_ids == letters("ab")  # the stop string's token counts, what follows it does not
        assert g.timing.gaps == [1.0] and g.timing.tpot(len(g.token_ids)) == pytest.approx(1.0)

    asyncio.run(scenario())


def test_queued_events_make_one_step_and_keep_their_times() -> None:
    async def scenario() -> None:
        g = generation(6, logprobs=True)
        for event in events_of(decoding_request(6, logprobs=True), [[40], [41, 42], [43]]):
            g._queue.put_nowait(event)
        step = await g.next_step()
        assert step is not None and step.token_ids == [40, 41, 42, 43] and step.logprobs == [-0.5] * 4
        assert step.finish_reason is None and not g.done
        assert g.timing.ttft == pytest.approx(0.5) and g.timing.gaps == [1.0, 1.0]
        assert g.timing.tpot(4) == pytest.approx(2.0 / 3)

    asyncio.run(scenario())


def test_the_final_event_ends_the_merge_and_the_generation() -> None:
    async def scenario() -> None:
        g = generation(3)
        request = decoding_request(3)
        for event in events_of(request, [[40], [41], [42]]):
            g._queue.put_nowait(event)
        step = await g.next_step()
        assert step is not None and step.token_ids == [40, 41, 42] and step.finish_reason == "length"
        assert g.done and await g.next_step() is None

    asyncio.run(scenario())


def test_a_generation_that_keeps_up_gets_one_step_per_event() -> None:
    async def scenario() -> None:
        g = generation(4)
        events = events_of(decoding_request(4), [[40], [41], [42, 43]])
        steps = []
        for event in events:
            g._queue.put_nowait(event)
            step = await g.next_step()
            assert step is not None
            steps.append(step.token_ids)
        assert steps == [[40], [41], [42, 43]] and g.done

    asyncio.run(scenario())


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.lists(st.integers(0, 63), max_size=4), min_size=1, max_size=8), logprobs=st.booleans(),
       finish=st.booleans())
def test_then_is_concatenation(groups: list[list[int]], logprobs: bool, finish: bool) -> None:
    total = sum(map(len, groups))
    request = decoding_request(total if finish and total else total + 1, logprobs)
    events = events_of(request, groups)
    merged = events[0]
    for event in events[1:]:
        merged = merged.then(event)
    assert merged.new_token_ids == [t for e in events for t in e.new_token_ids] == request.output_token_ids
    assert merged.finished == events[-1].finished and merged.output is events[-1].output
    assert merged.produced_at == events[-1].produced_at and merged.request_id == "r"
    if logprobs:
        assert merged.new_logprobs == [-0.5] * len(request.output_token_ids)
    else:
        assert merged.new_logprobs is None
    assert events[0].new_token_ids == groups[0]  # the parts are not changed


def test_then_refuses_other_requests_and_events_after_the_last() -> None:
    first = RequestEvent("a", [1], False)
    with pytest.raises(ValueError, match="'a' and 'b'"):
        first.then(RequestEvent("b", [2], False))
    with pytest.raises(ValueError, match="after its final one"):
        RequestEvent("a", [1], True).then(RequestEvent("a", [2], True))
