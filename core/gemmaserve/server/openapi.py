"""The OpenAPI document: FastAPI's, plus what it cannot see by itself.

The generation endpoints parse their bodies by hand (strict JSON, OpenAI-shaped errors), so FastAPI
does not know them: this adds their request-body schemas (from the pydantic models in
:mod:`~gemmaserve.server.protocol`, with ``max_tokens`` bounded by the served context) and the
responses they give (200 as JSON or server-sent events, and the error statuses with the error body).
Clients and API fuzzers (schemathesis) read it at ``GET /openapi.json``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.openapi.utils import get_openapi

from gemmaserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["install_openapi"]

_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}
_ERRORS = {
    "400": "invalid request (the message and `param` name the field)",
    "404": "unknown model",
    "413": "the body is larger than 16 MiB",
    "429": "queue full; retry after `Retry-After` seconds",
    "500": "the backend failed on this request",
    "503": "the engine is not running; retry after `Retry-After` seconds",
}
_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def install_openapi(app: FastAPI, context_limit: int) -> None:
    """Make ``app.openapi()`` return the completed document (built once). ``context_limit`` is the
    most prompt + output tokens one request may hold; ``max_tokens`` is documented up to it - 1."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            components = document.setdefault("components", {}).setdefault("schemas", {})
            components["ErrorResponse"] = _ERROR_SCHEMA
            for path, model in _BODIES.items():
                schema = model.model_json_schema(ref_template=_REF)
                components.update(schema.pop("$defs", {}))
                for name in ("max_tokens", "max_completion_tokens"):
                    if name in schema["properties"]:
                        schema["properties"][name]["anyOf"][0]["maximum"] = max(1, context_limit - 1)
                components[model.__name__] = schema
                ref = {"$ref": _REF.format(model=model.__name__)}
                operation = document["paths"][path]["post"]
                operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
            for path, responses in _RESPONSES.items():
                for operation in document["paths"].get(path, {}).values():
                    operation["responses"] = {status: _response(*spec) for status, spec in responses.items()}
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_JSON = {"application/json": {"schema": {"type": "object"}}}
_ERROR = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
_GENERATED = {**_JSON, "text/event-stream": {"schema": {"type": "string"}}}
_GENERATION = {
    "200": ("the completion (JSON), or with `stream: true` server-sent events ending in `data: [DONE]`", _GENERATED),
    **{status: (text, _ERROR) for status, text in _ERRORS.items()},
}
_RESPONSES: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "/v1/completions": _GENERATION,
    "/v1/chat/completions": _GENERATION,
    "/tokenize": {"200": ("`{count, max_model_len, tokens, token_strs}`", _JSON),
                  **{status: (_ERRORS[status], _ERROR) for status in ("400", "404", "413")}},
    "/detokenize": {"200": ("`{prompt}`", _JSON), **{status: (_ERRORS[status], _ERROR) for status in ("400", "404", "413")}},
    "/version": {"200": ("`{version}`", _JSON)},
    "/v1/models": {"200": ("the served model", _JSON)},
    "/v1/models/{model_id}": {"200": ("the served model", _JSON), "404": ("unknown model", _ERROR)},
    "/health": {"200": ("the engine loop runs", _JSON),
                "503": ("the engine loop is not running, or the server is shutting down", _ERROR)},
    "/metrics": {"200": ("Prometheus text format 0.0.4", {"text/plain": {"schema": {"type": "string"}}})},
    "/debug/kv": {"200": ("KV snapshot, integrity ok", _JSON), "500": ("KV snapshot naming an inconsistency", _JSON)},
}


def _response(description: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": content}
