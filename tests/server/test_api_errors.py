"""Every bad input gets a 4xx with an OpenAI-style error body naming the problem; engine-side
failures map to 400/429/500/503 (in-process, reference backend)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_harness import REFERENCE_MODEL as MODEL
from server_harness import sse_events

from gemmaserve.sampling_params import SamplingParams
from gemmaserve.testing.reference_backend import ReferenceBackend
from gemmaserve.testing.reference_model import CharTokenizer

OK_PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_error(response: Any, status: int, param: str | None, *, words: tuple[str, ...] = ()) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] and error["param"] == param, error
    if status == 400:  # docs/api.md: every 400 names its kind (invalid_value, missing_field, invalid_json, ...)
        assert error["code"], error
    for word in words:
        assert word in error["message"], error["message"]
    return error


COMPLETION_CASES: list[tuple[str, Any, int, str | None, tuple[str, ...]]] = [
    # id, raw body (bytes) or JSON-able patch of OK_PROMPT, status, param, words in the message
    ("malformed-json", b'{"prompt": "x",', 400, "body", ("not valid JSON",)),
    ("empty-body", b"", 400, "body", ("empty",)),
    ("not-an-object", b"[1, 2]", 400, "body", ("JSON object",)),
    ("missing-prompt", {"prompt": None}, 400, "prompt", ("required",)),
    ("empty-prompt", {"prompt": ""}, 400, "prompt", ("empty",)),
    ("empty-token-prompt", {"prompt": []}, 400, "prompt", ("empty",)),
    ("stop-string-too-long", {"stop": ["x" * 4097]}, 400, "stop", ("4097 characters", "4096")),
    ("empty-prompt-in-a-batch", {"prompt": ["a", ""]}, 400, "prompt", ("prompt 1 of the batch", "empty")),
    ("bad-prompt-in-a-batch", {"prompt": ["a", [1, "b"]]}, 400, "prompt", ("prompt 1 of the batch", "token ids")),
    ("token-outside-vocab-in-a-batch", {"prompt": [[5], [5, 999]]}, 400, "prompt",
     ("prompt 1 of the batch", "999", "position 1")),
    ("mixed-prompt", {"prompt": [1, "a"]}, 400, "prompt", ("token ids",)),
    ("negative-token", {"prompt": [5, -1]}, 400, "prompt", ("token ids",)),
    ("prompt-wrong-type", {"prompt": 42}, 400, "prompt", ("string",)),
    ("token-outside-vocab", {"prompt": [5, 999]}, 400, "prompt", ("999",)),
    ("prompt-too-long", {"prompt": "a" * 600}, 400, "prompt", ("512",)),
    ("max-tokens-too-long", {"max_tokens": 600}, 400, "max_tokens", ("lower max_tokens",)),
    ("max-tokens-zero", {"max_tokens": 0}, 400, "max_tokens", ("greater than or equal to 1",)),
    ("max-tokens-negative", {"max_tokens": -3}, 400, "max_tokens", ()),
    ("max-tokens-string", {"max_tokens": "5"}, 400, "max_tokens", ("integer",)),
    ("max-tokens-float", {"max_tokens": 5.5}, 400, "max_tokens", ("integer",)),
    ("max-completion-tokens-zero", {"max_completion_tokens": 0}, 400, "max_completion_tokens", ()),
    ("temperature-negative", {"temperature": -0.1}, 400, "temperature", ()),
    ("temperature-too-high", {"temperature": 100.5}, 400, "temperature", ("100",)),
    ("temperature-string", {"temperature": "hot"}, 400, "temperature", ("number",)),
    ("top-p-zero", {"top_p": 0}, 400, "top_p", ()),
    ("top-p-too-high", {"top_p": 1.5}, 400, "top_p", ()),
    ("top-k-too-low", {"top_k": -2}, 400, "top_k", ()),
    ("top-k-float", {"top_k": 1.5}, 400, "top_k", ()),
    ("seed-below-int64", {"seed": -2**63 - 1}, 400, "seed", ()),
    ("n-zero", {"n": 0}, 400, "n", ("greater than or equal to 1",)),
    ("unknown-field", {"frobnicate": 1}, 400, "frobnicate", ("unknown field",)),
    ("beam-search", {"use_beam_search": True}, 400, "use_beam_search", ("not supported",)),
    ("store", {"store": True}, 400, "store", ("not supported",)),
    ("best-of-two", {"best_of": 2}, 400, "best_of", ("equal to n",)),
    ("best-of-more-than-n", {"best_of": 3, "n": 2}, 400, "best_of", ("equal to n",)),
    ("stop-empty-string", {"stop": [""]}, 400, "stop", ("non-empty",)),
    ("too-many-stops", {"stop": [str(i) for i in range(17)]}, 400, "stop", ("16",)),
    ("stop-wrong-type", {"stop": 5}, 400, "stop", ()),
    ("stop-token-negative", {"stop_token_ids": [-1]}, 400, "stop_token_ids", ()),
    ("stream-not-bool", {"stream": "yes"}, 400, "stream", ("boolean",)),
    ("echo-not-bool", {"echo": 1}, 400, "echo", ()),
    ("logprobs-over-20", {"logprobs": 21}, 400, "logprobs", ("less than or equal to 20",)),
    ("presence-penalty", {"presence_penalty": 2.5}, 400, "presence_penalty", ("less than or equal to 2",)),
    ("logit-bias-key", {"logit_bias": {"five": 1.0}}, 400, "logit_bias", ("token ids",)),
    # counted before any key is read (a million keys cost a second of checking): the count is what is refused
    ("logit-bias-count", {"logit_bias": {"five": 1.0, **{str(i): 1.0 for i in range(1024)}}}, 400, "logit_bias",
     ("at most 1024 logit_bias entries", "1025")),
    ("logit-bias-range", {"logit_bias": {"5": 101.0}}, 400, "logit_bias", ("[-100, 100]",)),
    ("logit-bias-vocab", {"logit_bias": {"999999": 1.0}}, 400, "logit_bias", ("vocabulary",)),
    ("min-p-range", {"min_p": 1.5}, 400, "min_p", ()),
    ("min-tokens-over-max", {"min_tokens": 50, "max_tokens": 10}, 400, "min_tokens", ("max_tokens",)),
    ("repetition-penalty", {"repetition_penalty": 0}, 400, "repetition_penalty", ("greater than or equal to 0.01",)),
    ("repetition-penalty-denormal", {"repetition_penalty": 5e-324}, 400, "repetition_penalty", ("0.01",)),
    ("suffix", {"suffix": "tail"}, 400, "suffix", ("not supported",)),
    ("stream-options-type", {"stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage", ()),
    ("unknown-model", {"model": "gpt-4"}, 404, "model", ("gpt-4", MODEL)),
]


@pytest.mark.parametrize(("raw", "status", "param", "words"), [c[1:] for c in COMPLETION_CASES],
                         ids=[c[0] for c in COMPLETION_CASES])
def test_bad_completion_requests(ref: Any, raw: Any, status: int, param: str | None, words: tuple[str, ...]) -> None:
    client, _ = ref
    if isinstance(raw, bytes):
        content = raw
    else:
        body = {key: value for key, value in {**OK_PROMPT, **raw}.items() if value is not None}
        content = json.dumps(body).encode()
    response = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_error(response, status, param, words=words)


CHAT_CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("no-messages", {"messages": []}, 400, "messages"),
    ("missing-messages", {"messages": None}, 400, "messages"),
    ("bad-role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("content-number", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("image-part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content"),
    ("message-not-object", {"messages": ["hi"]}, 400, "messages.0"),
    ("message-unknown-field", {"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, 400, "messages.0"),
    ("message-refusal-text", {"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, 400,
     "messages.0"),
    ("top-logprobs-over-20", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", {"top_logprobs": 3}, 400, "top_logprobs"),
    ("tool-not-function", {"tools": [{"type": "code", "function": {"name": "f"}}]}, 400, "tools.0.type"),
    ("tool-bad-name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools.0.function.name"),
    ("tool-name-newline", {"tools": [{"type": "function", "function": {"name": "fn\n"}}]}, 400,
     "tools.0.function.name"),
    ("tool-choice-unknown", {"tools": [{"type": "function", "function": {"name": "f"}}],
                             "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("tool-choice-no-tools", {"tool_choice": "required"}, 400, "tool_choice"),
    ("unknown-format", {"response_format": {"type": "yaml"}}, 400, "response_format"),
    ("bad-schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     400, "response_format"),
    ("bad-guided-regex", {"guided_regex": "a(b"}, 400, "guided_regex"),
    ("bad-guided-json", {"guided_json": {"type": "string", "minLength": 1.5}}, 400, "guided_json"),
    ("guided-json-not-schema", {"guided_json": 5}, 400, "guided_json"),
    ("min-tokens-with-constraint", {"min_tokens": 2, "response_format": {"type": "json_object"}}, 400, "min_tokens"),
    ("tool-choice-extra-key", {"tools": [{"type": "function", "function": {"name": "f"}}],
                               "tool_choice": {"type": "function", "function": {"name": "f"}, "strict": True}},
     400, "tool_choice"),
    ("tool-choice-function-extra-key", {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "f", "arguments": "{}"}}}, 400, "tool_choice"),
    ("content-part-extra-key", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}, 400, "messages.0.content"),
    ("bad-regex", {"structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs"),
    ("two-constraints", {"structured_outputs": {"regex": "a"}, "guided_choice": ["x"]}, 400, "structured_outputs"),
    ("unknown-constraint-field", {"structured_outputs": {"yaml": "x"}}, 400, "structured_outputs"),
    ("n-too-many", {"n": 65}, 400, "n"),
    ("prompt-too-long", {"messages": [{"role": "user", "content": "b" * 600}]}, 400, "messages"),
    ("unknown-model", {"model": "llama"}, 404, "model"),
]


@pytest.mark.parametrize(("patch", "status", "param"), [c[1:] for c in CHAT_CASES], ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_requests(ref: Any, patch: dict[str, Any], status: int, param: str | None) -> None:
    client, _ = ref
    body = {key: value for key, value in {**OK_CHAT, **patch}.items() if value is not None}
    assert_error(client.post("/v1/chat/completions", json=body), status, param)


def test_unknown_routes_and_methods_use_the_error_shape(ref: Any) -> None:
    client, _ = ref
    assert_error(client.get("/v1/completions"), 405, None)
    assert_error(client.post("/v1/embeddings", json={}), 404, None, words=("/v1/embeddings",))


def test_good_requests_still_work_after_bad_ones(ref: Any) -> None:
    client, _ = ref
    assert client.post("/v1/completions", json=OK_PROMPT).status_code == 200
    assert client.post("/v1/chat/completions", json=OK_CHAT).status_code == 200
    assert client.get("/debug/kv").json()["integrity"] == "ok"


class NoTemplateTokenizer(CharTokenizer):
    @property
    def has_chat_template(self) -> bool:
        return False


def test_chat_without_a_chat_template_is_a_clear_400(make_client: Any) -> None:
    backend = ReferenceBackend()
    backend.tokenizer = NoTemplateTokenizer(64)
    client, _ = make_client(backend)
    error = assert_error(client.post("/v1/chat/completions", json=OK_CHAT), 400, "messages", words=("chat template",))
    assert error["code"] == "no_chat_template"
    assert client.post("/v1/completions", json=OK_PROMPT).status_code == 200


def test_kv_that_can_never_fit_is_a_400_even_when_streaming(make_client: Any) -> None:
    client, engine = make_client(ReferenceBackend(kv_capacity_tokens=40))
    for stream in (False, True):
        response = client.post("/v1/completions", json={**OK_PROMPT, "max_tokens": 60, "stream": stream})
        assert_error(response, 400, "prompt", words=("KV",))
    assert client.post("/v1/completions", json=OK_PROMPT).status_code == 200
    assert engine.stats().finished["error"] == 2


def test_backend_failure_before_the_first_token_is_a_500(make_client: Any) -> None:
    tokenizer = CharTokenizer(64)
    poison = tokenizer.encode("z", add_special_tokens=False)[0]
    client, _ = make_client(ReferenceBackend(fail_on_token=poison))
    for stream in (False, True):
        response = client.post("/v1/completions", json={**OK_PROMPT, "prompt": "zebra", "stream": stream})
        assert_error(response, 500, None, words=("injected",))
    assert client.post("/v1/completions", json=OK_PROMPT).status_code == 200


def test_backend_failure_mid_stream_is_reported_in_band(make_client: Any) -> None:
    probe = ReferenceBackend()
    prompt_ids = probe.tokenizer.encode("mid stream")
    tokens = probe.reference_generate(prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True))
    client, _ = make_client(ReferenceBackend(fail_on_decode_token=tokens[2]))
    body = {**OK_PROMPT, "prompt": "mid stream", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "injected" in error["message"]
    assert all("choices" in event for event in events[:-2])
    non_streamed = client.post("/v1/completions", json={**body, "stream": False})
    assert_error(non_streamed, 500, None)


def test_latencies_reached_before_a_failure_are_recorded(make_client: Any) -> None:
    """As vLLM records a first token and the gaps between tokens when they happen, a request that fails (or is
    cancelled) after its first token still counts in ``vllm:time_to_first_token_seconds`` and the inter-token
    histogram (only requests that succeeded counted: slow requests that clients gave up on were left out). vLLM's
    exact bucket bounds are used."""
    from server_harness import metric, parse_prometheus

    from gemmaserve.server.metrics import E2E_BUCKETS, ITL_BUCKETS

    probe = ReferenceBackend()
    prompt_ids = probe.tokenizer.encode("mid stream")
    tokens = probe.reference_generate(prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True))
    client, _ = make_client(ReferenceBackend(fail_on_decode_token=tokens[3]))
    vllm = {"model_name": MODEL, "engine": "0"}
    for stream in (True, False):
        body = {**OK_PROMPT, "prompt": "mid stream", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == (200 if stream else 500)
    after = parse_prometheus(client.get("/metrics").text)
    assert metric(after, "vllm:time_to_first_token_seconds_count", **vllm) == 2
    itl = sorted(float(dict(labels)["le"]) for (name, labels), _ in after.items()
                 if name == "vllm:inter_token_latency_seconds_bucket" and dict(labels)["le"] != "+Inf")
    e2e = sorted(float(dict(labels)["le"]) for (name, labels), _ in after.items()
                 if name == "vllm:e2e_request_latency_seconds_bucket" and dict(labels)["le"] != "+Inf")
    assert tuple(itl) == ITL_BUCKETS and tuple(e2e) == E2E_BUCKETS and ITL_BUCKETS[0] == 0.01 and E2E_BUCKETS[0] == 0.3


def test_a_server_bug_mid_stream_is_reported_in_band(make_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error while formatting a chunk ends the stream with an error event and ``[DONE]`` (it cut the
    stream with neither: the client could not tell the end from a dropped connection); the server keeps serving."""
    import gemmaserve.server.app as app_module

    client, _ = make_client()
    real_chunk = app_module._View.chunk

    def failing_chunk(self: Any, step: Any) -> Any:
        raise RuntimeError("formatting bug")

    monkeypatch.setattr(app_module._View, "chunk", failing_chunk)
    body = {**OK_PROMPT, "max_tokens": 6, "ignore_eos": True, "stream": True}
    response = client.post("/v1/completions", json=body)
    events = sse_events(response.text)
    assert events[-1] == "[DONE]" and "formatting bug" in events[-2]["error"]["message"], events
    assert events[-2]["error"]["type"] == "server_error"
    monkeypatch.setattr(app_module._View, "chunk", real_chunk)
    assert client.post("/v1/completions", json=OK_PROMPT).status_code == 200


def test_a_stopped_engine_answers_503_with_retry_after(make_client: Any) -> None:
    client, engine = make_client()
    engine.shutdown(timeout=10)
    health = client.get("/health")
    assert_error(health, 503, None)
    response = client.post("/v1/completions", json=OK_PROMPT)
    assert_error(response, 503, None)
    assert response.headers["retry-after"] == "1"


def test_health_answers_503_with_the_backends_failure(make_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    client, engine = make_client()
    assert client.get("/health").status_code == 200
    # what custom_torch reports after losing a tensor-parallel worker
    monkeypatch.setattr(engine.backend, "failure", lambda: "worker rank 1 exited with code -9")
    error = assert_error(client.get("/health"), 503, None)
    assert "worker rank 1 exited with code -9" in error["message"]


class CountingTokenizer(CharTokenizer):
    """Counts the characters it is asked to tokenize."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.encoded_chars = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: Any) -> list[int]:
        self.encoded_chars += sum(len(m["content"]) for m in messages)
        return super().apply_chat_template(messages)


def test_text_that_can_never_fit_is_refused_before_it_is_tokenized(make_client: Any) -> None:
    """512-token context, one character per token: a 2 MB prompt (or chat message) gets its
    context_length_exceeded without the tokenizer ever seeing it; one that may fit is tokenized as before."""
    backend = ReferenceBackend()
    backend.tokenizer = CountingTokenizer(64)
    client, _ = make_client(backend)
    huge = "a" * 2_000_000
    error = assert_error(client.post("/v1/completions", json={**OK_PROMPT, "prompt": huge}), 400, "prompt",
                         words=("2000000 characters", "512-token context"))
    assert error["code"] == "context_length_exceeded"
    chat = {**OK_CHAT, "messages": [{"role": "user", "content": huge[:600]}]}
    error = assert_error(client.post("/v1/chat/completions", json=chat), 400, "messages",
                         words=("more than 512 characters",))
    assert error["code"] == "context_length_exceeded" and backend.tokenizer.encoded_chars == 0
    assert client.post("/v1/completions", json={**OK_PROMPT, "prompt": "a" * 400}).status_code == 200
    assert backend.tokenizer.encoded_chars == 400


def test_best_of_equal_to_n_returns_every_sample(make_client: Any) -> None:
    """best_of equal to n asks for nothing beyond n (as the offline SamplingParams accepts it)."""
    client, _ = make_client()
    reply = client.post("/v1/completions", json={**OK_PROMPT, "n": 2, "best_of": 2, "temperature": 1.0})
    assert reply.status_code == 200 and [c["index"] for c in reply.json()["choices"]] == [0, 1]


def test_token_prompts_that_cannot_fit_are_refused_before_the_engine_sees_them(make_client: Any) -> None:
    """A token-id prompt (or a rendered chat) that leaves no room for one output token is a 400
    context_length_exceeded from the preparation step: the engine's own check scans the ids on the event loop,
    which for millions of ids stalled every other stream."""
    client, engine = make_client()
    submitted: list[int] = []
    original = engine.submit_many

    def counting(requests: Any, *args: Any, **kwargs: Any) -> Any:
        submitted.append(len(requests))
        return original(requests, *args, **kwargs)

    engine.submit_many = counting  # type: ignore[method-assign]
    for prompt, which in (([5] * 512, "the prompt is 512 tokens"), ([[5] * 3, [6] * 100_000], "prompt 1 of the batch")):
        error = assert_error(client.post("/v1/completions", json={**OK_PROMPT, "prompt": prompt}), 400, "prompt",
                             words=("shorten the prompt to under 512 tokens", which))
        assert error["code"] == "context_length_exceeded"
    assert submitted == []
    assert client.post("/v1/completions", json={**OK_PROMPT, "prompt": [5] * 500}).status_code == 200
    assert submitted == [1]


def test_stop_token_ids_are_bounded(make_client: Any) -> None:
    from gemmaserve.errors import InvalidRequestError
    from gemmaserve.sampling_params import MAX_STOP_TOKEN_IDS

    client, _ = make_client()
    too_many = {**OK_PROMPT, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}
    assert_error(client.post("/v1/completions", json=too_many), 400, "stop_token_ids",
                 words=(f"at most {MAX_STOP_TOKEN_IDS}",))
    ok = {**OK_PROMPT, "stop_token_ids": [60 - i % 8 for i in range(MAX_STOP_TOKEN_IDS)]}  # in the 64-token vocabulary
    assert client.post("/v1/completions", json=ok).status_code == 200
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))


def test_neutral_extras_are_accepted_at_their_neutral_values(ref: Any) -> None:
    client, _ = ref
    body = {"prompt": "hi", "max_tokens": 2, "store": False, "metadata": None, "skip_special_tokens": True,
            "include_stop_str_in_output": False, "length_penalty": 1.0, "priority": 0, "service_tier": "auto"}
    assert client.post("/v1/completions", json=body).status_code == 200
    echoed = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "refusal": None,
                                                                "annotations": [], "audio": None, "function_call": None,
                                                                "reasoning_content": "hm"},
                           {"role": "user", "content": "again"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=echoed).status_code == 200  # an OpenAI reply sent back
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "functions": [{"name": "f"}]}
    response = client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 400 and "tools" in response.json()["error"]["message"]


def test_debug_kv_reports_are_fresh_shared_and_spaced(ref: Any) -> None:
    """Every /debug/kv caller gets a report computed after it asked; concurrent callers share one; reports start
    at least REPORT_INTERVAL_S apart (a flood takes the engine's locks at most 1/interval times a second)."""
    import threading
    import time

    from gemmaserve.server import debug

    client, engine = ref
    starts: list[float] = []
    original = debug.kv_report
    debug.kv_report = lambda e: starts.append(time.monotonic()) or original(e)
    try:
        asked = time.monotonic()
        first = client.get("/debug/kv").json()
        assert starts and starts[-1] >= asked and first["integrity"] == "ok"
        cache = debug.KVReportCache(engine, interval_s=0.05)
        before = len(starts)
        results: list[dict[str, Any]] = []
        threads = [threading.Thread(target=lambda: results.append(cache.get())) for _ in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        made = starts[before:]
        assert len(results) == 12 and all(r["integrity"] == "ok" for r in results)
        assert 1 <= len(made) < 12  # shared
        assert all(b - a >= 0.05 - 1e-3 for a, b in zip(made, made[1:]))  # spaced
    finally:
        debug.kv_report = original


def test_null_include_usage_is_the_default(ref: Any) -> None:
    client, _ = ref
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True,
                                                     "stream_options": {"include_usage": None}})
    assert response.status_code == 200, response.text
    assert '"usage"' not in response.text


def test_an_engine_refusal_names_the_field_it_starts_with() -> None:
    """The streaming backends' penalty refusal names every penalty in its advice; the 400's ``param`` is the field
    the message starts with (it named repetition_penalty for a presence_penalty request)."""
    from gemmaserve.server.errors import guess_param

    message = ("presence_penalty: this backend streams whole generations (no per-step sampling), so it cannot apply "
               "penalties; leave repetition_penalty at 1 and presence_penalty / frequency_penalty at 0")
    assert guess_param(message, "prompt") == "presence_penalty"
    assert guess_param("frequency_penalty and x: ... repetition_penalty", "prompt") == "frequency_penalty"
    assert guess_param("the prompt is too long", "messages") == "messages"
