"""Request bodies of the OpenAI-compatible API (the subset gemmaserve serves), validated strictly.

Bodies are parsed with :func:`parse_body`: JSON types are not coerced (``"5"`` is not an integer),
unknown fields (top-level or inside nested objects) are refused, and every problem becomes an :class:`~gemmaserve.server.errors.APIError`
(HTTP 400) whose message and ``param`` name the offending field and what is accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from gemmaserve.errors import InvalidRequestError
from gemmaserve.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SEED_SPACE,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from gemmaserve.structured.spec import StructuredOutputs, from_response_format
from gemmaserve.server.errors import APIError

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = [
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "SamplingFields",
    "StreamOptions",
    "TokenizeRequest",
    "DetokenizeRequest",
    "parse_body",
    "read_body",
    "BodyBudget",
    "check_message_count",
    "MAX_STOP_STRINGS",
    "MAX_BODY_BYTES",
    "MAX_CARRIED_TEXT_CHARS",
]

MAX_BODY_BYTES = 16 * 2**20
"""Largest request body accepted (HTTP 413 beyond): far more than any context holds as JSON, small
enough that one request cannot make the server buffer and parse an unbounded amount."""
_MAX_TOKEN_ID = 2**31 - 1
MAX_CARRIED_TEXT_CHARS = 4096
"""Characters of a text field the server only carries, whose size changes nothing (``user``,
``response_format.json_schema``'s ``name`` and ``description``): far more than any id, name or description needs."""
"""Choices one request may ask for (``n``): each is its own engine request."""
MAX_TEMPERATURE = 100.0
"""The range SamplingParams accepts offline ([0, 100]); OpenAI documents [0, 2], vLLM accepts more, so a
temperature that works in ``LLM.generate`` works over HTTP too (tests/core/test_cli.py checks they agree)."""
_STRICT = ConfigDict(strict=True, extra="ignore")

# JSON schemas of what the hand-written validators accept (for the OpenAPI document)
_NULL: dict[str, Any] = {"type": "null"}
_TEXT: dict[str, Any] = {"type": "string", "minLength": 1}
_TOKEN_IDS: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": _MAX_TOKEN_ID}}
MAX_REQUEST_ID_CHARS = 256
"""Longest ``request_id`` a caller may set (it is echoed in every chunk's ``id``)."""
MAX_COMPLETION_PROMPTS = 1024
"""Most prompts one /v1/completions request may batch (``prompt`` as a list); each is also a queued request, so
``n`` × prompts is bounded by MAX_WAITING_REQUESTS as well."""
_PROMPT_SCHEMA: dict[str, Any] = {"anyOf": [
    _TEXT, {**_TOKEN_IDS, "minItems": 1},
    {"type": "array", "minItems": 1, "maxItems": MAX_COMPLETION_PROMPTS,
     "items": {"anyOf": [_TEXT, {**_TOKEN_IDS, "minItems": 1}]}},
]}
_STOP_TEXT: dict[str, Any] = {**_TEXT, "maxLength": MAX_STOP_STRING_CHARS}
_STOP_SCHEMA: dict[str, Any] = {
    "anyOf": [_STOP_TEXT, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": _STOP_TEXT}, _NULL]
}
_CONTENT_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "string"}, _NULL, {"type": "array", "items": {"anyOf": [
    {"type": "object", "required": ["type", "text"], "additionalProperties": False,
     "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "refusal"], "additionalProperties": False,  # assistant messages only
     "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}}},
]}}]}


_RESPONSE_FORMAT_SCHEMA: dict[str, Any] = {"type": "object", "required": ["type"], "additionalProperties": False,
                                           "properties": {
    "type": {"enum": ["text", "json_object", "json_schema"]},
    "json_schema": {"type": "object", "additionalProperties": False, "properties": {
        "name": {"type": ["string", "null"], "maxLength": MAX_CARRIED_TEXT_CHARS},
        "description": {"type": ["string", "null"], "maxLength": MAX_CARRIED_TEXT_CHARS},
        "schema": {"type": ["object", "null"]}, "strict": {"type": ["boolean", "null"]}}}}}
_STRUCTURED_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "json": {"type": ["object", "string"]}, "regex": {"type": "string"},
    "choice": {"type": "array", "items": {"type": "string"}}, "grammar": {"type": "string"},
    "json_object": {"type": "boolean"}, "disable_any_whitespace": {"type": ["boolean", "null"]}}}


_RESPONSE_FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}), "json_object": frozenset({"type"}), "json_schema": frozenset({"type", "json_schema"})}
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
_LOGIT_BIAS_KEY = re.compile(r"0|[1-9][0-9]{0,9}")


def _refuse_keys(mapping: dict[str, Any], allowed: Collection[str], what: str = "") -> None:
    """ValueError naming the first key of ``mapping`` outside ``allowed`` (and ``what`` it is a key of)."""
    unknown = next((key for key in mapping if key not in allowed), None)
    if unknown is not None:
        where = f" in {what}" if what else ""
        raise ValueError(f"unknown key {unknown!r}{where} (accepted: {', '.join(sorted(allowed))})")


def _only(schema: dict[str, Any]) -> dict[str, Any]:
    """``json_schema_extra`` for an optional field that accepts ``schema`` or null."""
    return {"anyOf": [schema, _NULL]}

_MAX_MESSAGES = "max_messages"


def check_message_count(count: int, limit: int | None) -> None:
    """APIError 400 (``context_length_exceeded``, param ``messages``) when a chat has more than ``limit`` messages
    (None: no limit). Callers pass the context length: a message renders to at least one token, so more messages
    than that cannot fit, and rendering them would cost CPU for nothing."""
    if limit is not None and count > limit:
        raise APIError(400, f"the chat has {count} messages; at most {limit} are accepted (the model's context "
                       f"holds {limit} tokens, and every message takes at least one)", param="messages",
                       code="context_length_exceeded")


def _bounded_messages(value: Any, info: ValidationInfo) -> Any:
    """``messages``' before-validator: the count limit of the parse context, checked before any message is."""
    if isinstance(value, list) and isinstance(info.context, dict):
        check_message_count(len(value), info.context.get(_MAX_MESSAGES))
    return value


BodyT = TypeVar("BodyT", bound=BaseModel)


_CLOSED = ConfigDict(strict=True, extra="ignore", json_schema_extra={"additionalProperties": False})
"""Models that refuse unknown keys themselves (the OpenAPI document says so)."""


class _Closed(BaseModel):
    """A nested request object whose unknown keys are refused (400 naming the key and the accepted ones)."""

    model_config = _CLOSED

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_keys(data, cls.model_fields)
        return data


class StreamOptions(_Closed):
    """``{"include_usage": bool, "continuous_usage_stats": bool}`` (the second is vLLM's: with ``include_usage``,
    every chunk also carries its choice's running usage)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


NEUTRAL_EXTRAS: dict[str, tuple[Any, ...]] = {
    # OpenAI fields with nothing to do here: accepted at these values only
    "store": (None, False), "metadata": (None,), "service_tier": (None, "auto", "default"),
    # vLLM's extra sampling fields, accepted at their defaults (which is what gemmaserve does)
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None,),
    "priority": (None, 0),
    "return_tokens_as_token_ids": (None, False), "detokenize": (None, True),
    # SGLang's fields, which vllm-router adds to every body it forwards (at these values: the defaults)
    "no_stop_trim": (None, False), "return_hidden_states": (None, False), "separate_reasoning": (None, True),
    "stream_reasoning": (None, True), "include_reasoning": (None, True),
}
"""Request fields gemmaserve does not implement but accepts at the value that means "off" / the default (any
other value is a 400 naming the field). Every other unknown field is a 400 too: nothing is silently ignored."""


def _refuse_unknown_fields(cls: type[BaseModel], data: Any, neutral: dict[str, tuple[Any, ...]]) -> Any:
    """``data`` unchanged if every top-level field is one of ``cls``'s or a ``neutral`` one at a neutral value;
    else APIError 400 naming the field (``code: "invalid_value"``)."""
    if not isinstance(data, dict):
        return data
    for name, value in data.items():
        if name in cls.model_fields:
            continue
        if name in neutral:
            if not any(value == ok and type(value) is type(ok) or value is ok for ok in neutral[name]):
                raise APIError(400, f"{name}={_short(value)} is not supported; leave it unset"
                               + (f" or {neutral[name][1]!r}" if len(neutral[name]) > 1 else ""),
                               param=name, code="invalid_value")
            continue
        hint = "; use tools / tool_choice" if name in ("functions", "function_call") else ""
        raise APIError(400, f"unknown field {name!r}: gemmaserve does not implement it{hint} (the accepted fields "
                       "are listed in docs/api.md)", param=name, code="invalid_value")
    return data


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. ``None`` means "the default". A field the
    request models do not define is refused (400 naming it), except :data:`NEUTRAL_EXTRAS` at their neutral
    values."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        return _refuse_unknown_fields(cls, data, NEUTRAL_EXTRAS)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-SEED_SPACE, lt=SEED_SPACE)
    stop: Any = Field(None, validate_default=True, json_schema_extra=_STOP_SCHEMA)
    stop_token_ids: list[int] | None = Field(
        None, json_schema_extra=_only({**_TOKEN_IDS, "maxItems": MAX_STOP_TOKEN_IDS}))
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    n: int | None = Field(None, ge=1, json_schema_extra=_only({"type": "integer", "minimum": 1, "maximum": 64}))
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=_only({
        "type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,9})$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}))
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                             allow_inf_nan=False)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """vLLM's: keep only the prompt's last k tokens (-1: the last the context holds)."""
    allowed_token_ids: list[int] | None = Field(
        None, json_schema_extra=_only({**_TOKEN_IDS, "minItems": 1, "maxItems": MAX_ALLOWED_TOKEN_IDS}))
    """vLLM's: only these token ids may be generated."""
    user: str | None = Field(None, max_length=MAX_CARRIED_TEXT_CHARS)
    response_format: dict[str, Any] | None = Field(None, json_schema_extra=_only(_RESPONSE_FORMAT_SCHEMA))
    structured_outputs: dict[str, Any] | None = Field(None, json_schema_extra=_only(_STRUCTURED_SCHEMA))
    return_token_ids: bool | None = None
    """vLLM's: the prompt's and the reply's token ids in the response (streamed: each chunk's, the prompt's once)."""
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    """vLLM's: the caller's id for the request; the response's ``id`` is ``cmpl-<request_id>`` /
    ``chatcmpl-<request_id>`` (and logs name it). Default: a random one."""
    guided_json: Any = Field(None, json_schema_extra=_only({"type": ["object", "string"]}))
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(stops)}")
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string has {longest} characters; at most {MAX_STOP_STRING_CHARS} are accepted")
        return stops

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's context) or at least 1 (the prompt's last "
                             "tokens to keep)")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not 0 < len(value) <= MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids takes 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(value)}")
        if value is not None and any(not 0 <= token <= _MAX_TOKEN_ID for token in value):
            raise ValueError("allowed_token_ids must be non-negative token ids")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are accepted, got {len(value)}")
        if value is not None and any(not 0 <= token <= _MAX_TOKEN_ID for token in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are canonical decimal token ids (``"0"``, ``"42"``; not ``" 5"``, ``"+5"``, ``"05"``, ``"1_0"``), so
        no two keys name the same token; at most ``MAX_LOGIT_BIAS`` of them (counted first: a million keys cost a
        second of checking)."""
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are accepted, got {len(value)}")
        bad = next((key for key in value or () if not _LOGIT_BIAS_KEY.fullmatch(key)), None)
        if bad is not None:
            raise ValueError(f"key {_short(bad)} is not a token id: keys are token ids written in decimal digits "
                             "without sign, spaces or leading zeros (\"0\", \"42\"), at most 10 digits")
        return value

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI's shapes only: ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema":
        {"name", "description", "schema", "strict"}}``; any other key is refused."""
        if value is None:
            return value
        kind = value.get("type")
        allowed = _RESPONSE_FORMAT_KEYS.get(kind) if isinstance(kind, str) else None
        if allowed is None:
            raise ValueError(f"type must be one of {', '.join(_RESPONSE_FORMAT_KEYS)}, got {_short(kind)}")
        _refuse_keys(value, allowed, f"a {kind!r} response_format")
        spec = value.get("json_schema")
        if kind == "json_schema":
            if not isinstance(spec, dict):
                raise ValueError('type "json_schema" needs a "json_schema" object {"name", "schema", "strict"}')
            _refuse_keys(spec, _JSON_SCHEMA_KEYS, "json_schema")
            for key, types, accepted in (("strict", (bool,), "a boolean"), ("name", (str,), "a string"),
                                         ("description", (str,), "a string"), ("schema", (dict,), "an object")):
                if spec.get(key) is not None and not isinstance(spec[key], types):
                    raise ValueError(f"json_schema.{key} must be {accepted} or null, got {_short(spec[key])}")
            for key in ("name", "description"):
                if isinstance(spec.get(key), str) and len(spec[key]) > MAX_CARRIED_TEXT_CHARS:
                    raise ValueError(f"json_schema.{key} has {len(spec[key])} characters; at most "
                                     f"{MAX_CARRIED_TEXT_CHARS} are accepted")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _check_structured_flags(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        flag = (value or {}).get("disable_any_whitespace")
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"disable_any_whitespace must be a boolean, got {_short(flag)}")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise APIError(400, "stream_options applies to streamed responses only; send it with stream: true or "
                           "leave it unset (a non-streamed response always carries usage)", param="stream_options",
                           code="invalid_value")
        return self

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}; send several requests for more choices")
        return value

    @property
    def structured(self) -> StructuredOutputs | None:
        """The output constraint: ``structured_outputs`` (vLLM), ``response_format`` (OpenAI) or vLLM's older
        ``guided_*`` fields; at most one of the three ways. Raises InvalidRequestError naming the problem."""
        guided = {name: value for name, value in (("json", self.guided_json), ("regex", self.guided_regex),
                                                  ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if value is not None}
        formatted = from_response_format(self.response_format)
        given = [name for name, present in (("structured_outputs", self.structured_outputs is not None),
                                            ("response_format", formatted is not None),
                                            ("guided_*", bool(guided))) if present]
        if len(given) > 1:
            raise InvalidRequestError(f"give one output constraint, not {' and '.join(given)}")
        if self.structured_outputs is not None:
            return StructuredOutputs.from_mapping(self.structured_outputs)
        if guided:
            return StructuredOutputs.from_mapping(guided)
        return formatted

    @property
    def constraint_field(self) -> str | None:
        """The request field the output constraint comes from (errors about it name this field; with none,
        ``allowed_token_ids``, whose mask can run out the same way), or None."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        guided = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                  if getattr(self, name) is not None]
        if guided:
            return guided[0]
        if self.response_format is not None:
            return "response_format"
        return "allowed_token_ids" if self.allowed_token_ids is not None else None

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (newer OpenAI name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: running usage on every chunk only with ``include_usage`` too."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def stop_strings(self) -> list[str]:
        assert isinstance(self.stop, list)  # normalised by _check_stop
        return list(self.stop)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt``: one string or one list of token ids, or a batch: a list of them (OpenAI's
    and vLLM's form; choice ``i * n + j`` is prompt ``i``'s ``j``-th). Validated into :attr:`prompts`' list form."""

    prompt: Any = Field(json_schema_extra=_PROMPT_SCHEMA)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    """OpenAI's: accepted when it equals ``n`` (every sample is returned, as the offline ``SamplingParams``
    accepts it); choosing the best ``n`` of more is refused (:meth:`_check_best_of`)."""
    suffix: str | None = Field(None, json_schema_extra=_only({"type": "string", "maxLength": 0}))
    add_special_tokens: bool | None = None
    """vLLM's (default true): false tokenizes a text prompt without the tokenizer's special tokens (no BOS)."""

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[str | list[int]]:
        """The prompts, one or more (a single prompt becomes a one-element list)."""
        batch = isinstance(value, list) and bool(value) and all(isinstance(item, (str, list)) for item in value)
        prompts = value if batch else [value]
        if len(prompts) > MAX_COMPLETION_PROMPTS:
            raise ValueError(f"at most {MAX_COMPLETION_PROMPTS} prompts per request are accepted, got {len(prompts)}")
        for index, prompt in enumerate(prompts):
            where = f"prompt {index} of the batch" if batch else "prompt"
            if isinstance(prompt, str) and prompt:
                continue
            if isinstance(prompt, list) and prompt and all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID for t in prompt):
                continue
            if isinstance(prompt, (str, list)) and not prompt:
                raise ValueError(f"{where} is empty")
            raise ValueError(f"{where} must be a non-empty string or a non-empty list of non-negative integer "
                             "token ids")
        return prompts

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported; leave it unset")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        n = self.n or 1
        if self.best_of is not None and self.best_of != n:
            raise APIError(400, f"best_of={self.best_of} with n={n}: returning the best n of more samples is not "
                           "supported; every sample is returned, so leave best_of unset or equal to n",
                           param="best_of", code="invalid_value")
        return self

    @model_validator(mode="after")
    def _check_echo_logprobs(self) -> CompletionRequest:
        """``echo`` with ``logprobs`` would need the prompt tokens' logprobs (OpenAI and vLLM return them first),
        which the engine does not compute: refused rather than answered with the generated tokens' only."""
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported: the prompt tokens' logprobs (which echo adds "
                           "to the logprobs) are not computed; send echo without logprobs, or logprobs without "
                           "echo", param="echo", code="invalid_value")
        return self


_ECHOED_REPLY_FIELDS = frozenset({"refusal", "annotations", "audio", "function_call"})
_REASONING_FIELDS = frozenset({"reasoning", "reasoning_content"})
"""A reply's reasoning (vLLM's name and the older one), accepted on messages sent back and not templated."""


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Any = Field(None, validate_default=True, json_schema_extra=_CONTENT_SCHEMA)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        """A message field the template would not see is refused, except the fields an OpenAI reply carries when
        a client sends it back unchanged (``refusal``, ``annotations``, ``audio``, ``function_call`` when empty;
        ``reasoning`` / ``reasoning_content``: an assistant message's is given to the template as ``reasoning``)."""
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name in _REASONING_FIELDS and value is not None and not isinstance(value, str):
                raise ValueError(f"message field {name!r} must be a string or null")
            if name in cls.model_fields or name in _REASONING_FIELDS:
                continue
            if name in _ECHOED_REPLY_FIELDS and value in (None, []):
                continue
            raise ValueError(f"message field {name!r} is not supported (accepted: role, content, tool_calls, "
                             "tool_call_id, name)")
        return data

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> str:
        """A string, null, or a list of text parts (and, on an assistant message sent back, OpenAI's ``refusal``
        parts, read as text as vLLM does), joined with newlines."""
        if value is None or isinstance(value, str):
            return value or ""
        if isinstance(value, list):
            assistant = info.data.get("role") == "assistant"
            texts = []
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                key = "refusal" if kind == "refusal" and assistant else "text"
                if kind != key or not isinstance(part.get(key), str):
                    named = (f"a {_short(kind)} part is not" if isinstance(kind, str)
                             else "parts other than text are not")
                    raise ValueError(f'{named} supported (gemmaserve serves text only); send text parts '
                                     '({"type": "text", "text": "..."})'
                                     + (' (or "refusal" parts on assistant messages)' if assistant else ""))
                _refuse_keys(part, ("type", key), f"a {key} content part")
                texts.append(part[key])
            return "\n".join(texts)  # vLLM's rule for templates that take a string
        raise ValueError("content must be a string, a list of text parts, or null")

    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """What the chat template sees: role and plain-text content; an assistant message's ``tool_calls`` (their
        JSON ``arguments`` as objects, as Hugging Face templates expect) and its ``reasoning`` (sent back as
        ``reasoning`` or ``reasoning_content``), a tool message's ``tool_call_id`` and ``name``."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        extra = self.model_extra or {}
        reasoning = extra.get("reasoning") or extra.get("reasoning_content")
        if self.role == "assistant" and isinstance(reasoning, str) and reasoning:
            out["reasoning"] = reasoning  # Gemma 4's template shows it before a tool-call turn's calls
        if self.tool_calls:
            out["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class MessageFunction(_Closed):
    name: str = Field(min_length=1)
    arguments: str = "{}"


class MessageToolCall(_Closed):
    """An earlier call in the conversation (an assistant message's ``tool_calls`` entry)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunction

    def as_template_dict(self) -> dict[str, Any]:
        try:  # empty arguments are an empty object (vLLM's rule; a call of a function without parameters)
            arguments = json.loads(self.function.arguments) if self.function.arguments.strip() else {}
        except (ValueError, RecursionError):
            raise APIError(400, f"tool call {self.function.name!r}: arguments must be a JSON object text, got "
                           f"{self.function.arguments[:80]!r}", param="messages", code="invalid_value") from None
        if not isinstance(arguments, dict):
            raise APIError(400, f"tool call {self.function.name!r}: arguments must be a JSON object",
                           param="messages", code="invalid_value")
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


MAX_TOOLS = 128
"""Functions one request may offer."""
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class FunctionDefinition(_Closed):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _TOOL_NAME.fullmatch(value):
            raise ValueError("function names are 1 to 64 letters, digits, '_', '.' or '-'")
        return value

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = None if value is None else value.get("type", "object")
        if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ValueError(f"parameters is the JSON schema of the arguments object: its type is \"object\" "
                             f"(or absent), not {json.dumps(kind)}")
        return value


class ToolDefinition(_Closed):
    """One entry of ``tools``: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"]
    function: FunctionDefinition


ChatMessage.model_rebuild()  # its tool_calls refer to the models above


RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize", "tools",
    "documents", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
    "max_length", "return_tensors",
})
"""``chat_template_kwargs`` keys that would override what the server passes to the template itself."""


class ChatTemplateOptions(BaseModel):
    """vLLM's chat template options, shared by /v1/chat/completions and /tokenize (messages)."""

    model_config = _STRICT

    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value or ()))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set through chat_template_kwargs; use the request "
                             "field of that name where there is one")
        return value

    def check_generation_prompt(self) -> None:
        """400 if ``add_generation_prompt: true`` is sent with ``continue_final_message: true`` (vLLM's rule)."""
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true: either the "
                           "model starts a new turn (add_generation_prompt) or it continues the last message "
                           "(continue_final_message, which appends no generation prompt)",
                           param="continue_final_message", code="invalid_value")

    @property
    def generation_prompt(self) -> bool:
        """Whether the template appends the generation prompt: ``add_generation_prompt`` (default true), off with
        ``continue_final_message`` unless asked for explicitly (which :meth:`check_generation_prompt` refuses)."""
        return self.add_generation_prompt is not False and not self.continue_final_message

    @property
    def template_options(self) -> dict[str, Any]:
        """The keyword arguments of ``Tokenizer.apply_chat_template`` beyond the messages that differ from the
        default (empty for a plain chat, so a tokenizer without these options still serves it)."""
        options: dict[str, Any] = {}
        if self.continue_final_message:  # first: what a tokenizer without options is refused for is named first
            options["continue_final_message"] = True
        if not self.generation_prompt:
            options["add_generation_prompt"] = False
        if self.chat_template_kwargs:
            options["template_kwargs"] = dict(self.chat_template_kwargs)
        return options


class ChatCompletionRequest(ChatTemplateOptions, SamplingFields):
    """POST /v1/chat/completions. vLLM's template options: ``chat_template_kwargs`` (extra template variables),
    ``add_generation_prompt`` (default true), ``continue_final_message`` (continue the last message, no
    generation prompt; not with an explicit ``add_generation_prompt: true``), ``echo`` (the last message's content
    is prepended to the reply when it has the reply's role). A per-request ``chat_template`` is refused."""

    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool | None = False
    chat_template: str | None = Field(None, json_schema_extra=_NULL)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = Field(None, json_schema_extra=_only({"anyOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                         "properties": {"name": {"type": "string"}}}}}]}))
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = None
    """vLLM's (default true): false leaves the reasoning channel out of the reply (needs --reasoning-parser)."""
    add_special_tokens: bool | None = Field(None, json_schema_extra=_only({"const": False}))
    """vLLM's (default false): true (special tokens added on top of what the chat template writes) is refused."""

    @field_validator("messages", mode="before")
    @classmethod
    def _count_messages(cls, value: Any, info: ValidationInfo) -> Any:
        return _bounded_messages(value, info)

    @field_validator("add_special_tokens")
    @classmethod
    def _check_add_special_tokens(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("true is not supported on chat (the chat template writes the special tokens, BOS "
                             "included, and vLLM's true would add a second BOS); leave it unset or false")
        return value

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or ``tool_choice: "none"``), ``"auto"``, ``"required"``, or ``"function"`` (``tool_choice``
        names one: :attr:`tool_choice_function`). Raises APIError naming ``tool_choice`` when it is malformed or
        names no tool."""
        choice = self.tool_choice
        names = [tool.function.name for tool in self.tools or ()]
        if choice is None:
            return "auto" if names else None
        if choice == "none":
            return None
        if choice in ("auto", "required"):
            if not names:
                raise APIError(400, f'tool_choice "{choice}" needs tools', param="tool_choice", code="invalid_value")
            return str(choice)
        name = self.tool_choice_function
        if name in names:
            return "function"
        raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools "
                       f"({', '.join(names) or 'none given'})", param="tool_choice", code="invalid_value")

    @property
    def tool_choice_function(self) -> str | None:
        """The function a ``{"type": "function", "function": {"name": ...}}`` ``tool_choice`` names (None for the
        string modes). Raises APIError naming ``tool_choice`` when it is malformed."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str) and choice in ("none", "auto", "required"):
            return None
        if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
                and isinstance(choice["function"].get("name"), str)):
            try:
                _refuse_keys(choice, ("type", "function"), "tool_choice")
                _refuse_keys(choice["function"], ("name",), "tool_choice.function")
            except ValueError as exc:
                raise APIError(400, str(exc), param="tool_choice", code="invalid_value") from None
            return choice["function"]["name"]
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', param="tool_choice", code="invalid_value")

    @property
    def tool_functions(self) -> list[dict[str, Any]]:
        """The tools as the chat template (and the call constraint) sees them: OpenAI's ``function`` objects."""
        return [{"type": "function", "function": tool.function.model_dump(exclude_none=True)}
                for tool in self.tools or ()]

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("a per-request chat template is not accepted; start the server with --chat-template "
                             "FILE (CHAT_TEMPLATE), or pass template variables in chat_template_kwargs")
        return value

    @property
    def echo_text(self) -> str:
        """What ``echo`` prepends (vLLM's rule): the last message's content if its role is the reply's role
        (``assistant`` with the generation prompt, else the last message's own role), else nothing."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        role = "assistant" if self.generation_prompt else last.role
        return str(last.content or "") if last.role == role else ""



class TokenizeRequest(ChatTemplateOptions):
    """POST /tokenize, vLLM's two shapes: ``{model?, prompt, add_special_tokens?}`` or ``{model?, messages,
    add_generation_prompt?, continue_final_message?, chat_template_kwargs?}`` (rendered as the chat endpoint
    renders them). vLLM options gemmaserve does not implement are refused unless left at their default:
    ``return_token_strs``, ``chat_template``, ``tools``, ``mm_processor_kwargs``."""

    model_config = _CLOSED

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        return _refuse_unknown_fields(cls, data, {})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None
    """vLLM's: ``token_strs``, the vocabulary's string of each token (tokenizers with ``convert_ids_to_tokens``)."""
    chat_template: str | None = Field(None, json_schema_extra=_NULL)
    tools: list[Any] | None = Field(None, json_schema_extra=_NULL)
    mm_processor_kwargs: dict[str, Any] | None = Field(None, json_schema_extra=_NULL)

    @field_validator("messages", mode="before")
    @classmethod
    def _count_messages(cls, value: Any, info: ValidationInfo) -> Any:
        return _bounded_messages(value, info)

    @field_validator("chat_template", "tools", "mm_processor_kwargs")
    @classmethod
    def _check_unsupported(cls, value: Any, info: Any) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported; the server's chat template is used")
        return value

    @model_validator(mode="after")
    def _one_shape(self) -> TokenizeRequest:
        """One of the two shapes; APIError naming the field that does not belong."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send either 'prompt' (a string) or 'messages' (a chat), not both and not neither",
                           param="prompt" if self.prompt is None else "messages",
                           code="missing_field" if self.prompt is None else "invalid_value")
        if self.messages is not None and self.add_special_tokens:
            raise APIError(400, "add_special_tokens is not supported with messages: the chat template adds them",
                           param="add_special_tokens", code="invalid_value")
        chat_only = [name for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
                     if getattr(self, name) is not None]
        if self.prompt is not None and chat_only:
            raise APIError(400, f"{chat_only[0]} applies to messages only (add_generation_prompt, "
                           "continue_final_message and chat_template_kwargs); leave it unset with a prompt",
                           param=chat_only[0], code="invalid_value")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: ``{model?, tokens}`` -> ``{prompt}`` (vLLM's shape); other fields are refused."""

    model_config = _CLOSED

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        return _refuse_unknown_fields(cls, data, {})

    model: str | None = None
    tokens: list[int] = Field(json_schema_extra=_TOKEN_IDS)

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, value: list[int]) -> list[int]:
        if any(isinstance(t, bool) or not 0 <= t <= _MAX_TOKEN_ID for t in value):
            raise ValueError("tokens must be non-negative integer token ids")
        return value


class BodyBudget:
    """Request-body bytes all requests together may be receiving at once (``MAX_BUFFERED_BODY_BYTES``): without it,
    clients that send most of a large body and then stall make the server hold ``MAX_BODY_BYTES`` per connection.
    Used on the event loop only (no lock)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0

    def reserve(self, size: int) -> None:
        """Take ``size`` more bytes; APIError(503, ``body_budget_exhausted``, Retry-After) when they do not fit."""
        if self.used + size > self.total:
            raise APIError(503, f"the server is receiving too many request bodies at once (MAX_BUFFERED_BODY_BYTES="
                           f"{self.total} bytes in all); retry later", code="body_budget_exhausted",
                           headers={"Connection": "close"})
        self.used += size

    def release(self, size: int) -> None:
        self.used -= size


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, budget: BodyBudget | None = None) -> bytes:
    """The whole request body; raises APIError(413) as soon as it is known to exceed ``limit``
    bytes (from Content-Length, or while reading), without buffering the rest. ``budget``: the bytes received are
    reserved there as they arrive (what is buffered, not what a header declares: headers alone reserve nothing)
    and given back when this returns or raises; APIError(503) when a chunk does not fit."""
    declared = request.headers.get("content-length", "")
    if budget is not None:
        limit = min(limit, budget.total)  # a body over the whole budget could never be accepted: 413, not 503
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    reserved = 0
    try:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            if budget is not None and size > reserved:
                budget.reserve(size - reserved)
                reserved = size
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        if budget is not None:
            budget.release(reserved)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes or more; at most {limit} are accepted",
                    param="body", code="body_too_large")


def parse_body(model: type[BodyT], raw: bytes, max_messages: int | None = None) -> BodyT:
    """Validate a JSON request body. Raises APIError(400) naming the first bad field. ``max_messages``: a chat of
    more messages is refused before any message is validated (see :func:`check_message_count`)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", param="body", code="invalid_json")
    try:
        return model.model_validate_json(raw, context={_MAX_MESSAGES: max_messages})
    except ValidationError as exc:
        raise _as_api_error(exc) from None


def _as_api_error(exc: ValidationError) -> APIError:
    error = exc.errors(include_url=False)[0]
    loc = [str(part) for part in error.get("loc", ())]
    param = ".".join(loc) or "body"
    kind = error.get("type", "")
    if kind == "json_invalid":
        detail = str(error["msg"]).removeprefix("Invalid JSON: ")
        if "surrogate" in detail or "hex escape" in detail:
            where = detail[detail.find(" at line "):] if " at line " in detail else ""
            detail = (f"invalid \\u escape{where}: a lone UTF-16 surrogate (\\ud800-\\udfff not written as a "
                      "high-low pair) or a \\u without 4 hex digits; JSON strings must be valid Unicode")
        return APIError(400, f"the request body is not valid JSON: {detail}", param="body", code="invalid_json")
    if kind == "missing":
        return APIError(400, f"'{param}' is required", param=param, code="missing_field")
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if "input" in error and kind not in ("value_error",):
        message += f" (got {_short(error['input'])})"
    if not loc and kind == "value_error":  # a check across fields (model validator)
        return APIError(400, message, param="body", code="invalid_value")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {message}", param="body", code="invalid_value")
    return APIError(400, f"invalid '{param}': {message}", param=param, code="invalid_value")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
