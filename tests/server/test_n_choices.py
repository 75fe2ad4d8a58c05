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
