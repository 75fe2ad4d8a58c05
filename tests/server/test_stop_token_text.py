"""The HTTP server leaves the text of the token that ended a reply (EOS or a ``stop_token_ids`` token) out of the
text, as vLLM does, while counting the token in ``completion_tokens``; ``include_stop_str_in_output`` keeps it (and
a matched stop string). The parsers' need for special tokens (``skip_special_tokens=False``) is a separate thing."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL as MODEL
from server_harness import sse_events

from gemmaserve.engine.engine import Engine
from gemmaserve.engine.request import Request, RequestState
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.server.generation import Generation, Prepared, Timing
from gemmaserve.testing.reference_model import EOS_ID, CharTokenizer

Client = tuple[TestClient, Engine]


def _complete(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_stop_token_counts_but_its_text_is_left_out(ref: Client) -> None:
    client, engine = ref
    base = {"prompt": "stop token text", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = _complete(client, **base)["choices"][0]["text"]
    tokenizer = engine.backend.tokenizer
    ids = tokenizer.encode(plain, add_special_tokens=False)
    token = ids[6]
    cut = ids.index(token)
    body = _complete(client, **base, stop_token_ids=[token])
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == cut + 1
    assert body["choices"][0]["text"] == tokenizer.decode(ids[:cut])
    response = client.post("/v1/completions", json={"model": MODEL, **base, "stop_token_ids": [token], "stream": True})
    chunks = [event for event in sse_events(response.text) if event != "[DONE]"]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == tokenizer.decode(ids[:cut])


def _finished_events(tokens: list[int], params: SamplingParams) -> list:
    request = Request("r", (3, 4), params)
    request.seed = 0
    request.advance(RequestState.PREFILLING)
    request.advance(RequestState.DECODING)
    events = []
    for token in tokens:
        request.append_token(token, None, (EOS_ID,))
        events.append(request.take_event())
        if request.is_finished:
            break
    return events


def _reply(params: SamplingParams, tokens: list[int], stop: list[str] | None = None) -> tuple[str, list[int]]:
    """The text and tokens a generation makes of ``tokens`` (all its events queued at once: merged)."""

    async def run() -> tuple[str, list[int]]:
        prepared = Prepared(prompt_ids=[3, 4], params=params, stop=stop or [], want_logprobs=False)
        engine: Any = object()  # nothing is submitted: the test queues the events itself
        generation = Generation(engine, CharTokenizer(64), prepared, timing=Timing(), submit=False)
        for event in _finished_events(tokens, params):
            generation._queue.put_nowait(event)
        text = ""
        while not generation.done:
            step = await generation.next_step()
            if step is None:
                break
            text += step.text
        return text, generation.token_ids

    return asyncio.run(run())


def test_include_stop_str_in_output_keeps_the_stop_token_and_string() -> None:
    letters = CharTokenizer(64).encode("abcde", add_special_tokens=False)
    stop_id = letters[3]  # "d"
    hidden = SamplingParams(max_tokens=8, stop_token_ids=[stop_id])
    assert _reply(hidden, letters) == ("abc", letters[:4])
    kept = SamplingParams(max_tokens=8, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert _reply(kept, letters) == ("abcd", letters[:4])
    string = SamplingParams(max_tokens=8, include_stop_str_in_output=True)
    assert _reply(string, letters, stop=["bc"]) == ("abc", letters[:3])


def test_eos_text_is_left_out_even_with_special_tokens_shown() -> None:
    """A tool or reasoning parser decodes with the special tokens: the EOS that ends the reply still shows no text."""
    letters = CharTokenizer(64).encode("ab", add_special_tokens=False)
    params = SamplingParams(max_tokens=8, skip_special_tokens=False)
    assert _reply(params, [*letters, EOS_ID]) == ("ab", [*letters, EOS_ID])
    shown = SamplingParams(max_tokens=8, skip_special_tokens=False, include_stop_str_in_output=True)
    assert _reply(shown, [*letters, EOS_ID])[0] == "ab<eos>"


def test_text_offsets_count_the_special_tokens_the_text_shows(ref: Client) -> None:
    """``skip_special_tokens: false`` puts special tokens' text in the reply: the legacy logprobs' ``text_offset``
    counts it too (it counted none: every offset 0), streamed and not alike."""
    client, engine = ref
    special = next(iter(engine.backend.model_info.eos_token_ids))
    base = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "logit_bias": {str(special): 100}, "skip_special_tokens": False}
    choice = _complete(client, **base)["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert text and len(set(logprobs["text_offset"])) == len(logprobs["tokens"]) == 6
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert text[offset:].startswith(token), (token, offset, text)
    response = client.post("/v1/completions", json={"model": MODEL, **base, "stream": True})
    streamed = [offset for event in sse_events(response.text) if event != "[DONE]"
                for offset in (event["choices"][0].get("logprobs") or {}).get("text_offset", [])]
    assert streamed == logprobs["text_offset"]
