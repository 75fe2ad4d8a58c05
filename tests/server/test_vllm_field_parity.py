"""Request fields and response fields where gemmaserve answered differently from vLLM 0.26: finite logprobs
(never a 500 for a NaN), the chat's own stop ids not counted against a request's ``stop_token_ids``,
``add_special_tokens`` at each endpoint's default, an empty ``model``, ``logprobs: 0``'s ``top_logprobs``,
negative seeds, and ``stop_reason``."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL, sse_events

from gemmaserve.backend import SampledTokens
from gemmaserve.engine.engine import Engine
from gemmaserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from gemmaserve.testing.reference_backend import ReferenceBackend
from gemmaserve.testing.reference_model import EOS_ID, EOT_ID

Client = tuple[TestClient, Engine]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "a"}]


def ok(client: TestClient, path: str, **body: Any) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(client: TestClient, path: str, **body: Any) -> list[dict[str, Any]]:
    response = client.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def refused(client: TestClient, path: str, param: str, *words: str, **body: Any) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and all(word in error["message"] for word in words), error
    return error


# -- 4. non-finite logprobs ------------------------------------------------------------------------------------------
class _NonFinite(ReferenceBackend):
    """Reports every sampled token's logprob as NaN and every alternative's as -inf (what a denormal
    repetition_penalty made of the logits)."""

    def sample(self, logits: Any, rows: Any, *, want_logprobs: bool = False) -> SampledTokens:
        out = super().sample(logits, rows, want_logprobs=want_logprobs)
        if not want_logprobs:
            return out
        top = [[(token, -math.inf) for token, _ in pairs] for pairs in out.top_logprobs or ()]
        return SampledTokens(out.token_ids, [math.nan] * len(out.token_ids), top)


def test_non_finite_logprobs_are_reported_as_vllm_does(make_client: Any) -> None:
    """A NaN logprob made the non-streamed answer a 500 ("Out of range float values are not JSON compliant") and
    the streamed one null: both now report vLLM's floor, -9999.0."""
    client, _ = make_client(_NonFinite(max_model_len=512))
    body = {"prompt": "ab", "max_tokens": 3, "ignore_eos": True, "logprobs": 2}
    full = ok(client, COMPLETIONS, **body)["choices"][0]["logprobs"]
    assert full["token_logprobs"] == [-9999.0] * 3
    assert all(set(entry.values()) == {-9999.0} for entry in full["top_logprobs"])
    chunks = streamed(client, COMPLETIONS, **body)
    values = [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert values == [-9999.0] * 3
    chat = ok(client, CHAT, messages=MESSAGES, max_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=2)
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert entry["logprob"] == -9999.0 and {alt["logprob"] for alt in entry["top_logprobs"]} == {-9999.0}


def test_the_json_encoder_never_fails_on_a_float() -> None:
    from gemmaserve.server.responses import json_bytes, reported_logprob

    assert json.loads(json_bytes({"a": [math.nan, math.inf, -math.inf, 1.5]})) == {"a": [None, None, None, 1.5]}
    huge = 2**70  # past orjson's 64 bits: the json module's path
    encoded = json_bytes({"a": [math.nan, huge], "b": {"c": -math.inf}})
    assert json.loads(encoded) == {"a": [None, huge], "b": {"c": None}}
    assert [reported_logprob(v) for v in (math.nan, -math.inf, -1e5, -0.5, math.inf)] == [-9999.0, -9999.0, -9999.0,
                                                                                         -0.5, 0.0]


# -- 5. chat stop ids ------------------------------------------------------------------------------------------------
@pytest.fixture
def chat_ends(make_client: Any) -> Client:
    """An app whose tokenizer ends a chat turn at EOT_ID (as a chat template's ``<end_of_turn>``)."""
    backend = ReferenceBackend(max_model_len=512)
    backend.tokenizer.chat_stop_token_ids = (EOT_ID,)  # type: ignore[attr-defined]
    return make_client(backend)


def test_the_chats_own_stop_ids_do_not_count_against_the_request(chat_ends: Client) -> None:
    """A chat with the documented maximum of stop_token_ids was refused (the end-of-turn ids were counted), and the
    refusal named ``at`` (the message's first word) as its param."""
    client, _ = chat_ends
    full = [5 + i % 50 for i in range(MAX_STOP_TOKEN_IDS)]
    ok(client, CHAT, messages=MESSAGES, max_tokens=2, stop_token_ids=full)
    refused(client, CHAT, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}", messages=MESSAGES, max_tokens=2,
            stop_token_ids=[*full, 5])


def test_with_chat_stops_keeps_a_full_request_valid(chat_ends: Client) -> None:
    """``LLM.chat``'s merge (server/prepare.py): a full list plus the end-of-turn ids survives every copy."""
    from gemmaserve.server.prepare import with_chat_stops

    _, engine = chat_ends
    given = tuple(range(5, 5 + MAX_STOP_TOKEN_IDS))
    params = with_chat_stops(SamplingParams(stop_token_ids=given, n=2, temperature=1.0, seed=3),
                             engine.backend.tokenizer)
    assert params.stop_token_ids == (*given, EOT_ID) and params.chat_stop_token_ids == (EOT_ID,)
    assert params.for_sample(1).stop_token_ids == params.stop_token_ids
    assert with_chat_stops(params, engine.backend.tokenizer) is params
    assert with_chat_stops(SamplingParams(stop_token_ids=[EOT_ID]), engine.backend.tokenizer).chat_stop_token_ids == ()
    assert with_chat_stops(SamplingParams(ignore_eos=True), engine.backend.tokenizer).stop_token_ids == ()
    with pytest.raises(Exception, match="chat_stop_token_ids"):
        SamplingParams(stop_token_ids=[7], chat_stop_token_ids=[8])


# -- 6. add_special_tokens -------------------------------------------------------------------------------------------
def test_add_special_tokens_at_each_endpoints_default_and_completions_false(ref: Client) -> None:
    client, _ = ref
    with_bos = ok(client, COMPLETIONS, prompt="ab", max_tokens=1, add_special_tokens=True)
    without = ok(client, COMPLETIONS, prompt="ab", max_tokens=1, add_special_tokens=False)
    assert with_bos["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1  # the BOS
    ok(client, CHAT, messages=MESSAGES, max_tokens=1, add_special_tokens=False)
    refused(client, CHAT, "add_special_tokens", "unset or false", messages=MESSAGES, max_tokens=1,
            add_special_tokens=True)


# -- 7. an empty model name ------------------------------------------------------------------------------------------
def test_an_empty_model_name_is_the_served_model(ref: Client) -> None:
    client, _ = ref
    assert ok(client, COMPLETIONS, model="", prompt="ab", max_tokens=1)["model"] == REFERENCE_MODEL
    assert ok(client, CHAT, model="", messages=MESSAGES, max_tokens=1)["model"] == REFERENCE_MODEL
    assert ok(client, "/tokenize", model="", prompt="ab")["count"] == 3
    assert ok(client, "/detokenize", model="", tokens=[5])["prompt"]
    long_name = "m" * 10_000
    error = client.post(COMPLETIONS, json={"model": long_name, "prompt": "ab"}).json()["error"]
    assert error["code"] == "model_not_found" and len(error["message"]) < 500


# -- 8. logprobs: 0 -------------------------------------------------------------------------------------------------
def test_logprobs_zero_lists_the_sampled_token_per_position(ref: Client) -> None:
    client, _ = ref
    body = {"prompt": "ab", "max_tokens": 4, "ignore_eos": True, "logprobs": 0, "temperature": 0}
    logprobs = ok(client, COMPLETIONS, **body)["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{token: value} for token, value in zip(logprobs["tokens"],
                                                                               logprobs["token_logprobs"])]
    chunks = [c["choices"][0]["logprobs"] for c in streamed(client, COMPLETIONS, **body) if c["choices"][0]["logprobs"]]
    assert [entry for c in chunks for entry in c["top_logprobs"]] == logprobs["top_logprobs"]


# -- 9. negative seeds -----------------------------------------------------------------------------------------------
def test_negative_seeds_are_accepted(ref: Client) -> None:
    client, _ = ref
    body = {"prompt": "ab", "max_tokens": 12, "ignore_eos": True, "temperature": 1.0}
    texts = {seed: ok(client, COMPLETIONS, seed=seed, **body)["choices"][0]["text"]
             for seed in (-5, 2**63 - 5, -(2**63), 0, 7)}
    assert texts[-5] == texts[2**63 - 5] and texts[-(2**63)] == texts[0] and texts[7] != texts[0]
    assert ok(client, COMPLETIONS, seed=-1, **body)["choices"][0]["text"]  # vLLM's "no seed"
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-5, temperature=1.0).seed == 2**63 - 5
    refused(client, COMPLETIONS, "seed", seed=2**63, **body)


# -- 10. stop_reason -------------------------------------------------------------------------------------------------
def test_stop_reason_names_the_stop_string_or_token(ref: Client) -> None:
    client, engine = ref
    backend = engine.backend
    assert isinstance(backend, ReferenceBackend)
    prompt = "stop reason"
    ids = backend.reference_generate(backend.tokenizer.encode(prompt), SamplingParams(max_tokens=20, ignore_eos=True))
    text = backend.tokenizer.decode(ids)
    base = {"prompt": prompt, "max_tokens": 20, "ignore_eos": True, "temperature": 0}
    stop = text[5:7]
    token = next(t for t in ids[3:] if t != EOS_ID)
    cases: list[tuple[dict[str, Any], Any, str]] = [({"stop": [stop]}, stop, "stop"),
                                                    ({"stop_token_ids": [token]}, token, "stop"),
                                                    ({}, None, "length")]
    for extra, reason, finish in cases:
        choice = ok(client, COMPLETIONS, **base, **extra)["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason), extra
        chunks = streamed(client, COMPLETIONS, **base, **extra)
        last = chunks[-1]["choices"][0]
        assert (last["finish_reason"], last["stop_reason"]) == (finish, reason), extra
        assert all("stop_reason" not in c["choices"][0] for c in chunks[:-1])
        chat = ok(client, CHAT, messages=MESSAGES, max_tokens=3, ignore_eos=True, **extra)["choices"][0]
        assert "stop_reason" in chat
    eos = ok(client, COMPLETIONS, prompt=prompt, max_tokens=20, stop_token_ids=[EOS_ID], temperature=0)["choices"][0]
    if eos["finish_reason"] == "stop":
        assert eos["stop_reason"] is None  # an EOS id reports None, as vLLM's


def test_model_cards_carry_vllms_fields(ref: Client) -> None:
    """/v1/models entries in vLLM's shape: ``root`` (the model the server was given), ``parent``, a ``permission``
    list and ``created`` (the server's start, not 1970)."""
    import time

    client, _ = ref
    card = client.get("/v1/models").json()["data"][0]
    assert card["root"] and card["parent"] is None and card["permission"][0]["object"] == "model_permission"
    assert abs(card["created"] - time.time()) < 24 * 3600
    assert client.get(f"/v1/models/{card['id']}").json() == card


def test_reasoning_field_names_and_refusal_parts_sent_back(ref: Client) -> None:
    """An assistant message sent back with vLLM's ``reasoning`` (or the older ``reasoning_content``) and OpenAI's
    ``refusal`` content parts is accepted (the refusal read as text); an image part is refused naming its type."""
    client, _ = ref
    from gemmaserve.server.protocol import ChatMessage

    for field in ("reasoning", "reasoning_content"):
        history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", field: "thought"},
                   {"role": "user", "content": "b"}]
        ok(client, CHAT, messages=history, max_tokens=2)
        # the template gets it as `reasoning` (Gemma 4's shows it before a tool-call turn's calls)
        assert ChatMessage.model_validate(history[1]).as_template_dict()["reasoning"] == "thought"
    refused(client, CHAT, "messages.1", "'reasoning'", "string", max_tokens=2, messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "x", "reasoning": 5}])
    refusal = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
               {"role": "user", "content": "b"}]
    as_text = [*refusal[:1], {"role": "assistant", "content": "no"}, *refusal[2:]]
    tokens = [client.post("/tokenize", json={"messages": m}).json()["tokens"] for m in (refusal, as_text)]
    assert tokens[0] == tokens[1]
    ok(client, CHAT, messages=refusal, max_tokens=2)
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
    refused(client, CHAT, "messages.0.content", "'refusal'", messages=user_refusal, max_tokens=2)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    refused(client, CHAT, "messages.0.content", "'image_url'", "text only", messages=image, max_tokens=2)


def test_empty_stream_options_without_stream(ref: Client) -> None:
    """vLLM refuses ``stream_options`` without ``stream`` only when it sets something: ``{}`` is accepted."""
    client, _ = ref
    ok(client, COMPLETIONS, prompt="a", max_tokens=2, stream_options={})
    refused(client, COMPLETIONS, "stream_options", "stream", prompt="a", max_tokens=2,
            stream_options={"include_usage": False})


def test_continuous_usage_stats_gives_each_chunk_its_running_usage(ref: Client) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries its choice's
    usage so far; the final usage chunk as before. Without ``include_usage`` it adds nothing (vLLM's rule)."""
    client, _ = ref
    for path, body in ((COMPLETIONS, {"prompt": "hello"}), (CHAT, {"messages": MESSAGES})):
        events = streamed(client, path, max_tokens=5, ignore_eos=True, n=2,
                          stream_options={"include_usage": True, "continuous_usage_stats": True}, **body)
        final = events[-1]["usage"]
        counts: dict[int, int] = {}
        for event in events[:-1]:
            choice = event["choices"][0]
            piece = choice.get("text") if path == COMPLETIONS else choice["delta"].get("content")
            counts[choice["index"]] = counts.get(choice["index"], 0) + (1 if piece else 0)
            usage = event["usage"]
            assert usage["prompt_tokens"] == final["prompt_tokens"] and usage["total_tokens"] == (
                usage["prompt_tokens"] + usage["completion_tokens"]) and usage["completion_tokens"] <= 5
        last = {}
        for event in events[:-1]:
            last[event["choices"][0]["index"]] = event["usage"]["completion_tokens"]
        assert last == {0: 5, 1: 5} and final["completion_tokens"] == 10
        plain = streamed(client, path, max_tokens=3, stream_options={"include_usage": False,
                                                                     "continuous_usage_stats": True}, **body)
        assert all("usage" not in event for event in plain)


def test_return_token_ids_gives_the_prompt_and_reply_ids(ref: Client) -> None:
    """vLLM's ``return_token_ids``: a completion choice carries ``prompt_token_ids`` and ``token_ids`` (a chat
    response its ``prompt_token_ids`` at the top); streamed, each chunk its own ids and the prompt's once; the ids
    decode to the text."""
    client, engine = ref
    tokenizer = engine.backend.tokenizer
    body = ok(client, COMPLETIONS, prompt=[5, 6, 7], max_tokens=4, ignore_eos=True, return_token_ids=True)
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7] and len(choice["token_ids"]) == 4
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    chat = ok(client, CHAT, messages=MESSAGES, max_tokens=3, ignore_eos=True, return_token_ids=True)
    assert chat["prompt_token_ids"] == client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == 3
    for path, extra in ((COMPLETIONS, {"prompt": [5, 6, 7]}), (CHAT, {"messages": MESSAGES})):
        events = streamed(client, path, max_tokens=4, ignore_eos=True, return_token_ids=True, **extra)
        with_prompt = [e for e in events if "prompt_token_ids" in e or "prompt_token_ids" in e["choices"][0]]
        assert len(with_prompt) == 1
        ids = [t for e in events for t in e["choices"][0]["token_ids"]]
        assert len(ids) == 4
    assert "token_ids" not in ok(client, COMPLETIONS, prompt="a", max_tokens=2)["choices"][0]


def test_include_reasoning_false_needs_the_reasoning_parser(ref: Client) -> None:
    client, _ = ref
    refused(client, CHAT, "include_reasoning", "--reasoning-parser", messages=MESSAGES, max_tokens=2,
            include_reasoning=False)
    ok(client, CHAT, messages=MESSAGES, max_tokens=2, include_reasoning=True)


def test_request_id_names_the_response(ref: Client) -> None:
    """vLLM's ``request_id``: the response's ``id`` is ``cmpl-<request_id>`` / ``chatcmpl-<request_id>``, streamed
    too; an empty or over-long one is a 400."""
    client, _ = ref
    assert ok(client, COMPLETIONS, prompt="a", max_tokens=2, request_id="job-7")["id"] == "cmpl-job-7"
    assert {e["id"] for e in streamed(client, CHAT, messages=MESSAGES, max_tokens=2, request_id="job-8")} == {
        "chatcmpl-job-8"}
    refused(client, COMPLETIONS, "request_id", prompt="a", max_tokens=2, request_id="")
    refused(client, COMPLETIONS, "request_id", prompt="a", max_tokens=2, request_id="x" * 257)


def test_x_request_id_header_names_the_response_ahead_of_the_body(ref: Client) -> None:
    """vLLM reads the ``X-Request-Id`` header ahead of the body's ``request_id``: it names the response, streamed
    too; an over-long one is a 400 naming the header."""
    client, _ = ref
    body = {"model": REFERENCE_MODEL, "prompt": "a", "max_tokens": 2}
    for extra in ({}, {"request_id": "from-body"}):
        response = client.post(COMPLETIONS, json={**body, **extra}, headers={"X-Request-Id": "trace-123"})
        assert response.status_code == 200, response.text
        assert response.json()["id"] == "cmpl-trace-123"
    chat = client.post(CHAT, json={"model": REFERENCE_MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True},
                       headers={"x-request-id": "trace-9"})
    assert {e["id"] for e in sse_events(chat.text)[:-1]} == {"chatcmpl-trace-9"}
    response = client.post(COMPLETIONS, json=body, headers={"X-Request-Id": "x" * 257})
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Id", response.text


def test_allowed_token_ids_restrict_every_token(ref: Client) -> None:
    """vLLM's ``allowed_token_ids``: every generated token is one of them, greedy or sampled, streamed or not, on
    both endpoints; ids outside the vocabulary, an empty list, or a combination with an output constraint are a
    400 naming the field."""
    client, _ = ref
    allowed = [11, 12, 30]
    for path, extra in ((COMPLETIONS, {"prompt": "abc"}), (CHAT, {"messages": MESSAGES})):
        for temperature in (0.0, 1.0):
            body = dict(model=REFERENCE_MODEL, max_tokens=12, ignore_eos=True, temperature=temperature, seed=3,
                        return_token_ids=True, allowed_token_ids=allowed, **extra)
            reply = ok(client, path, **body)["choices"][0]
            assert len(reply["token_ids"]) == 12 and set(reply["token_ids"]) <= set(allowed), reply
            events = streamed(client, path, **body)
            ids = [t for event in events for choice in event["choices"] for t in choice.get("token_ids") or []]
            assert ids == reply["token_ids"]  # the same seed, streamed or not
    base = dict(model=REFERENCE_MODEL, prompt="abc", max_tokens=4)
    refused(client, COMPLETIONS, "allowed_token_ids", "outside the vocabulary", allowed_token_ids=[10**6], **base)
    refused(client, COMPLETIONS, "allowed_token_ids", allowed_token_ids=[], **base)
    refused(client, COMPLETIONS, "allowed_token_ids", "cannot be combined", allowed_token_ids=allowed,
            structured_outputs={"regex": "a+"}, **base)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(ref: Client) -> None:
    """vLLM's truncate_prompt_tokens on both endpoints: the prompt is its last k tokens (usage counts those); text
    longer than the context is served when truncated, only its tail tokenized; 0 and values below -1 are a 400
    naming the field."""
    client, engine = ref
    ids = list(range(5, 45))
    reply = ok(client, COMPLETIONS, model=REFERENCE_MODEL, prompt=ids, max_tokens=3, truncate_prompt_tokens=6,
               ignore_eos=True, return_token_ids=True, temperature=0)
    assert reply["usage"]["prompt_tokens"] == 6 and reply["choices"][0]["prompt_token_ids"] == ids[-6:]
    alone = ok(client, COMPLETIONS, model=REFERENCE_MODEL, prompt=ids[-6:], max_tokens=3, ignore_eos=True,
               return_token_ids=True, temperature=0)
    assert reply["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    long_text = "a" * 200_000
    tokenizer = engine.backend.tokenizer
    seen, encode = [], tokenizer.encode
    tokenizer.encode = lambda text, *args, **kwargs: seen.append(len(text)) or encode(text, *args, **kwargs)
    try:
        reply = ok(client, COMPLETIONS, model=REFERENCE_MODEL, prompt=long_text + "xyz", max_tokens=2,
                   truncate_prompt_tokens=9, return_token_ids=True)
    finally:
        del tokenizer.encode
    assert reply["usage"]["prompt_tokens"] == 9
    assert reply["choices"][0]["prompt_token_ids"] == encode("a" * 6 + "xyz", add_special_tokens=False)[-9:]
    # only the tail a context's worth of the longest tokens could fill is tokenized, not 200,000 characters
    assert max(seen) <= (engine.scheduler.max_model_len + 64) * tokenizer.max_token_chars + 1, seen
    chat = ok(client, CHAT, model=REFERENCE_MODEL, messages=MESSAGES, max_tokens=2, truncate_prompt_tokens=3)
    assert chat["usage"]["prompt_tokens"] == 3
    for bad in (0, -2):
        refused(client, COMPLETIONS, "truncate_prompt_tokens", model=REFERENCE_MODEL, prompt="ab", max_tokens=2,
                truncate_prompt_tokens=bad)


def test_allowed_tokens_running_out_and_tool_choice_none_on_a_plain_template(ref: Client) -> None:
    """A request whose allowed_token_ids the bans cover at some step is a 400 naming allowed_token_ids (the engine
    ends it; no token outside the list); tool_choice "none" on a tokenizer whose template takes only the messages
    leaves the tools out instead of refusing the request."""
    client, engine = ref
    e = engine.backend.tokenizer.encode("e", add_special_tokens=False)
    error = refused(client, COMPLETIONS, "allowed_token_ids", model=REFERENCE_MODEL, prompt="ab", max_tokens=4,
                    allowed_token_ids=e * 2, bad_words=["ee"], ignore_eos=True)
    assert error["code"] == "constraint_unsatisfiable"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert ok(client, CHAT, model=REFERENCE_MODEL, messages=MESSAGES, max_tokens=2, tools=tools, tool_choice="none")
