"""Response bodies and SSE chunks in the OpenAI shapes (completions and chat completions)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from gemmaserve.backend import Tokenizer

__all__ = ["ResponseMeta", "sse", "json_bytes", "SSE_DONE", "completion_logprobs", "chat_logprobs",
           "reported_logprob", "MIN_REPORTED_LOGPROB"]

SSE_DONE = b"data: [DONE]\n\n"
MIN_REPORTED_LOGPROB = -9999.0
"""vLLM's floor for reported log-probabilities (``max(logprob, -9999.0)``): -inf and NaN are not JSON."""


def json_bytes(payload: Any) -> bytes:
    """``payload`` as compact UTF-8 JSON, for every response body and SSE event (orjson: ~0.3 µs a chunk against
    ~3.6 for ``json.dumps``). Never fails on a float: NaN and infinities are ``null``. What orjson refuses (ints past
    64 bits, a lone surrogate echoed from a request) goes through ``json`` with ASCII escapes, which encodes
    whatever a ``str`` holds."""
    try:
        return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(_finite(payload), separators=(",", ":")).encode()


def _finite(value: Any) -> Any:
    """``value`` (JSON data) with every NaN or infinite float replaced by None (what orjson writes)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` (:func:`json_bytes`)."""
    return b"data: " + json_bytes(payload) + b"\n\n"


def reported_logprob(value: float) -> float:
    """A log-probability as responses report it, finite (vLLM's rule, for streamed and full responses alike):
    at least ``MIN_REPORTED_LOGPROB`` (-inf and NaN become it; +inf, which no distribution gives, becomes 0)."""
    if value >= MIN_REPORTED_LOGPROB:
        return value if value != math.inf else 0.0
    return MIN_REPORTED_LOGPROB


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """The fields every body and chunk of one response shares."""

    id: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, request_id: str, model: str) -> ResponseMeta:
        return cls(f"{prefix}-{request_id}", model, int(time.time()))

    # -- /v1/completions -------------------------------------------------------------------------
    def completion(self, text: str, finish_reason: str | None, logprobs: Any, usage: dict[str, Any],
                   stop_reason: int | str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "stop_reason": stop_reason,
                  "logprobs": logprobs}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage}

    def completion_chunk(self, text: str, finish_reason: str | None, logprobs: Any = None,
                         stop_reason: int | str | None = None) -> dict[str, Any]:
        """A chunk; the one carrying ``finish_reason`` also carries ``stop_reason``."""
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**self._base("text_completion"), "choices": [choice]}

    def completion_usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("text_completion"), "choices": [], "usage": usage}

    # -- /v1/chat/completions ----------------------------------------------------------------------
    def chat(self, text: str, finish_reason: str | None, logprobs: Any, usage: dict[str, Any],
             tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
             stop_reason: int | str | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if tool_calls else text)}
        if reasoning is not None:  # vLLM's name since 0.11, and the older one (DeepSeek's) that many clients read
            message["reasoning"] = message["reasoning_content"] = reasoning or None
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "finish_reason": finish_reason, "stop_reason": stop_reason,
                  "logprobs": logprobs}
        return {**self._base("chat.completion"), "choices": [choice], "usage": usage}

    def chat_chunk(
        self, text: str | None, finish_reason: str | None, logprobs: Any = None, *, role: bool = False,
        tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        """A chunk; the one carrying ``finish_reason`` also carries ``stop_reason``."""
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def chat_usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": usage}

    def _base(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[float], text_offset: int,
    top: Sequence[Sequence[tuple[int, float]]] | None = None, *, skip_special_tokens: bool = True,
) -> dict[str, Any]:
    """Legacy completions ``logprobs``: the sampled tokens' log-probabilities and per token a ``{text: logprob}``
    object of the k most likely tokens (``top``; none for ``logprobs`` = 0) plus the sampled one (OpenAI and vLLM:
    up to k + 1 entries; fewer when tokens share a text, e.g. partial UTF-8 bytes). ``tokens`` show special
    tokens; ``text_offset`` counts from ``text_offset`` by each token's text as it appears in ``text`` (special
    tokens add none unless the request shows them: ``skip_special_tokens`` False). Values are
    :func:`reported_logprob`'s."""
    tokens = [_token_text(tokenizer, token) for token in token_ids]
    offsets = []
    for token_id in token_ids:
        offsets.append(text_offset)
        text_offset += len(tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens))
    sampled = [reported_logprob(value) for value in logprobs]
    alternatives = []
    for i, (text, logprob) in enumerate(zip(tokens, sampled)):
        pairs = top[i] if top is not None else ()
        entry = {_token_text(tokenizer, token): reported_logprob(value) for token, value in reversed(pairs)}
        entry[text] = logprob  # likelier wins a shared text; the sampled token's value wins over all
        alternatives.append(entry)
    return {"tokens": tokens, "token_logprobs": sampled, "top_logprobs": alternatives, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[int, float]]] | None = None) -> dict[str, Any]:
    """Chat ``logprobs``: one entry per sampled token, its ``top_logprobs`` the ``top_logprobs`` most likely
    tokens (empty when none were asked for). Values are :func:`reported_logprob`'s."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        token = _token_text(tokenizer, token_id)
        alternatives = []
        for other, value in (top[i] if top is not None else ()):
            text = _token_text(tokenizer, other)
            alternatives.append({"token": text, "logprob": reported_logprob(value), "bytes": list(text.encode())})
        content.append({"token": token, "logprob": reported_logprob(logprob), "bytes": list(token.encode()),
                        "top_logprobs": alternatives})
    return {"content": content}
