"""``n`` > 1: one engine request per choice; choice ``i`` is the single request with ``seed + i``; usage counts the
prompt once; streamed chunks carry their choice's index and interleave; errors and disconnects end them all."""

from __future__ import annotations

from typing import Any

from server_harness import REFERENCE_MODEL as MODEL
from server_harness import sse_events


def _post(client: Any, path: str, **fields: Any) -> Any:
    return client.post(path, json={"model": MODEL, **fields})


def test_n_choices_equal_single_requests_with_successive_seeds(ref: Any) -> None:
    client, _ = ref
    for path, extra in (("/v1/completions", {"prompt": "hello there"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        fields = {**extra, "max_tokens": 6, "temperature": 1.3, "seed": 40, "ignore_eos": True}
        many = _post(client, path, n=3, **fields)
        assert many.status_code == 200, many.text
        body = many.json()
        singles = [_post(client, path, **{**fields, "seed": 40 + i}).json() for i in range(3)]
        text = (lambda choice: choice.get("text", choice.get("message", {}).get("content")))
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [text(c) for c in body["choices"]] == [text(s["choices"][0]) for s in singles]
        usage = body["usage"]
        assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
        assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles) == 18
        streamed = _post(client, path, n=3, stream=True, stream_options={"include_usage": True}, **fields)
        events = [e for e in sse_events(streamed.text) if e != "[DONE]"]
        per_choice: dict[int, str] = {}
        finished = []
        for event in events[:-1]:
            for choice in event["choices"]:
                piece = choice.get("text", choice.get("delta", {}).get("content")) or ""
                per_choice[choice["index"]] = per_choice.get(choice["index"], "") + piece
                if choice["finish_reason"]:
                    finished.append(choice["index"])
        assert per_choice == {i: text(c) for i, c in enumerate(body["choices"])}
        assert sorted(finished) == [0, 1, 2] and events[-1]["usage"]["completion_tokens"] == 18
        assert len({event["id"] for event in events}) == 1  # one response: its chunks share one id
        assert len({event["created"] for event in events}) == 1


def test_n_is_bounded(ref: Any) -> None:
    client, _ = ref
    response = _post(client, "/v1/completions", prompt="x", n=65, max_tokens=2)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_a_batch_of_prompts_answers_each_with_its_n_choices(ref: Any) -> None:
    """``prompt`` as a list (OpenAI's and vLLM's batch): choice ``i * n + j`` is prompt ``i``'s ``j``-th, equal to
    that prompt sent alone with ``seed + j``; usage counts each prompt once; token-id prompts, echo and streaming
    too; a batch that would hold more choices than the queue bound is a 400."""
    client, _ = ref
    prompts = ["hello there", [5, 6, 7, 8], "the quick brown fox"]
    fields = {"max_tokens": 5, "temperature": 1.1, "seed": 7, "ignore_eos": True}
    body = _post(client, "/v1/completions", prompt=prompts, n=2, echo=True, **fields).json()
    singles = [[_post(client, "/v1/completions", prompt=p, echo=True, **{**fields, "seed": 7 + j}).json()
                for j in range(2)] for p in prompts]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [s["choices"][0]["text"] for pair in singles for s in pair]
    assert body["choices"][0]["text"].startswith("hello there")  # echo: each choice carries its own prompt
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(pair[0]["usage"]["prompt_tokens"] for pair in singles)
    assert usage["completion_tokens"] == 30 and usage["total_tokens"] == usage["prompt_tokens"] + 30
    streamed = _post(client, "/v1/completions", prompt=prompts, n=2, stream=True,
                     stream_options={"include_usage": True}, **fields)
    events = [e for e in sse_events(streamed.text) if e != "[DONE]"]
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    plain = _post(client, "/v1/completions", prompt=prompts, n=2, **fields).json()
    assert [texts[i] for i in range(6)] == [c["text"] for c in plain["choices"]]
    for k, (echoed, generated) in enumerate(zip(body["choices"], plain["choices"])):  # each choice, its own prompt
        prompt = prompts[k // 2]
        assert echoed["text"].endswith(generated["text"]) and (
            echoed["text"] == prompt + generated["text"] if isinstance(prompt, str) else len(echoed["text"]) > 5)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: what the earlier runs left
    assert [events[-1]["usage"][c] for c in counts] == [plain["usage"][c] for c in counts] == [usage[c] for c in counts]
    wide = _post(client, "/v1/completions", prompt=["a"] * 40, n=40, max_tokens=1)
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "prompt", wide.text


def test_a_stream_with_more_choices_than_the_batch_holds_streams_them_as_they_come(make_client: Any) -> None:
    """n over MAX_BATCH_SIZE: the later choices start only when earlier ones end, so waiting for every choice's
    first token before the response began held the first choices' tokens back until they had finished (then sent
    in one chunk); the stream starts with the first choice's first token and carries each step as it comes."""
    import json

    from gemmaserve.testing.reference_backend import ReferenceBackend

    client, _ = make_client(ReferenceBackend(decode_delay_s=0.01), max_batch_size=2)
    body = {"model": MODEL, "prompt": "ab", "n": 4, "max_tokens": 16, "ignore_eos": True, "stream": True,
            "temperature": 1.0, "seed": 1}
    steps: dict[int, int] = {}
    finished: list[int] = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["finish_reason"]:
                finished.append(choice["index"])
            elif choice["text"]:
                steps[choice["index"]] = steps.get(choice["index"], 0) + 1
    assert sorted(finished) == [0, 1, 2, 3]
    assert steps[0] >= 6, steps  # the first choices' tokens came step by step, not all at once at the end
