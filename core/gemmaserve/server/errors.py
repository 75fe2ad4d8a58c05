"""HTTP errors in the OpenAI shape, and the mapping from engine errors to status codes.

Body: ``{"error": {"message", "type", "param", "code"}}``. 400 bad request, 404 unknown model or
route, 413 body too large, 429 queue full (with ``Retry-After``), 499 client went away (logged,
never sent), 500 backend failure, 503 engine not running (with ``Retry-After``).
"""

from __future__ import annotations

import re
from typing import Any

from gemmaserve.errors import (EngineOverloadedError, GemmaserveError, InvalidRequestError, KVCapacityError,
                               PromptTooLongError)

__all__ = ["APIError", "ClientDisconnected", "constraint_error", "error_body", "from_engine_error", "from_output_error",
           "guess_param", "RETRY_AFTER_S"]

RETRY_AFTER_S = 1
CLIENT_CLOSED = 499

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error response: status, message naming the problem, optional ``param``/``code``/headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    @property
    def error_type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine request has been cancelled."""


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI-style error JSON."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def from_engine_error(
    exc: GemmaserveError, *, engine_alive: bool, prompt_param: str = "prompt", prompt_fits: bool = False
) -> APIError:
    """The HTTP error for an exception the engine raised at submit time. ``prompt_fits``: the prompt
    alone fits the context, so a too-long request is ``max_tokens``'s fault."""
    if isinstance(exc, (PromptTooLongError, KVCapacityError)):  # the second: more than the KV pool holds
        param = "max_tokens" if prompt_fits else prompt_param
        code = "kv_capacity_exceeded" if isinstance(exc, KVCapacityError) else "context_length_exceeded"
        return APIError(400, str(exc), param=param, code=code)
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=guess_param(str(exc), prompt_param), code="invalid_value")
    if isinstance(exc, EngineOverloadedError):
        if not engine_alive:
            return APIError(503, f"the engine is not running: {exc}", code="engine_unavailable")
        return APIError(429, f"server overloaded: {exc}", code="engine_overloaded")
    return APIError(500, f"{type(exc).__name__}: {exc}")


def from_output_error(error_type: str | None, message: str | None, *, prompt_param: str = "prompt",
                      constraint_field: str | None = None) -> APIError:
    """The HTTP error for a request the engine finished with ``finish_reason="error"``. ``constraint_field``: the
    request field its output constraint came from (see :func:`constraint_error`)."""
    text = message or "the backend failed on this request"
    if error_type in ("KVCapacityError", "PromptTooLongError", "InvalidRequestError"):
        code = {"KVCapacityError": "kv_capacity_exceeded", "PromptTooLongError": "context_length_exceeded"}
        return APIError(400, text, param=prompt_param, code=code.get(error_type, "invalid_value"))
    if error_type == "ConstraintError":  # the output constraint could not be continued
        return constraint_error(text, constraint_field, code="constraint_unsatisfiable")
    if error_type == "EngineOverloadedError":
        return APIError(429, f"server overloaded: {text}", code="engine_overloaded")
    return APIError(500, f"{error_type or 'BackendStepError'}: {text}", code="backend_error")


_CONSTRAINT_TEXT = re.compile(r"\bstructured_outputs(?:\.(json_object|json|regex|choice|grammar))?\b")


def constraint_error(message: str, field: str | None, code: str = "invalid_value") -> APIError:
    """The 400 for an output constraint the request cannot have, naming the field it came from: ``field`` is
    ``structured_outputs`` (or None), ``response_format``, one of vLLM's ``guided_*`` fields, or ``tools`` (the
    call constraint of ``tool_choice`` ``"required"`` / a named function). ``message`` names
    ``structured_outputs.<kind>`` (the engine's wording); it is rewritten to name ``field``."""
    if field is None or field == "structured_outputs":
        return APIError(400, message, param="structured_outputs", code=code)
    if field == "tools":
        detail = _CONSTRAINT_TEXT.sub("the call grammar", message)
        return APIError(400, "tools: the tool-call constraint of tool_choice (made from the tools' parameter "
                        f"schemas) cannot be served: {detail}", param="tools", code=code)

    def rename(match: re.Match[str]) -> str:
        if field == "response_format":
            return "response_format.json_schema.schema" if match.group(1) == "json" else "response_format"
        return field

    return APIError(400, _CONSTRAINT_TEXT.sub(rename, message), param=field, code=code)


def guess_param(message: str, default: str) -> str | None:
    """The field a validation message (the engine's, SamplingParams') is about: the one it names first; else
    ``default`` when it mentions the prompt, else None."""
    found = []
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "logit_bias", "logprobs",
                 "min_tokens", "bad_words", "structured_outputs", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "allowed_token_ids"):
        match = re.search(rf"\b{name}\b", message)
        if match is not None:
            found.append((match.start(), name))
    if found:
        return min(found)[1]
    return default if "prompt" in message else None
