"""What a request constrains its output to: :class:`StructuredOutputs` (vLLM's ``structured_outputs`` fields)
and the reading of OpenAI's ``response_format``. Pure data and validation; compiling is
:mod:`gemmaserve.structured.grammar`'s job."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gemmaserve.errors import InvalidRequestError

__all__ = ["StructuredOutputs", "MAX_CONSTRAINT_CHARS", "MAX_CHOICES", "from_response_format"]

MAX_CONSTRAINT_CHARS = 256 * 1024
"""Largest schema / regex / grammar (as text) a request may send: compiling is work on the request's thread."""
MAX_CHOICES = 1024
"""Most alternatives of a ``choice`` constraint."""

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_REFUSED = ("structural_tag", "whitespace_pattern", "disable_fallback", "disable_additional_properties")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """Exactly one constraint on the generated text:

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value valid under it, written
      compactly (no whitespace between tokens: bounded, unlike a free-whitespace grammar);
    - ``json_object``: any JSON object (OpenAI's ``{"type": "json_object"}``);
    - ``regex``: the whole output matches the regular expression (Rust ``regex`` syntax, as vLLM's backends);
    - ``choice``: the output is exactly one of the strings;
    - ``grammar``: a context-free grammar in GBNF / EBNF (llama.cpp's format, ``root ::= ...``) or Lark.

    When the constraint is complete the request finishes with ``finish_reason="stop"``. Raises
    :class:`InvalidRequestError` naming the problem when not exactly one is given or one is malformed.

    ``trigger`` (optional; llama.cpp's lazy grammars): the text of one token of the vocabulary (a special token
    such as Gemma 4's ``<|tool_call>``) that the constraint must begin with. The output is then free until that
    token is generated; from it the output follows the constraint until the constraint is complete, then is free
    again until the token comes next (each time a fresh start). Such a constraint never ends the request: EOS,
    stop tokens, stop strings and ``max_tokens`` do, as without a constraint (``min_tokens`` may be combined).

    ``opening`` (optional; not with ``trigger``): a regular expression of the beginnings that commit the output to
    the constraint. The constraint's masks hold the output (special tokens that the text does not show may also
    come) while its text can still begin with a match of ``opening``; once it cannot, the output is free (every
    token allowed). The constraint itself must accept the free text it allows before that point (the json tool
    parser's whole-reply constraint, :func:`gemmaserve.tools.constraints.strict_calls_constraint`, is the use)."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    trigger: str | None = None
    opening: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except RecursionError:
                raise InvalidRequestError("structured_outputs.json is nested too deeply to read; give a schema of "
                                          "ordinary depth") from None
            except ValueError as exc:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise InvalidRequestError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in _KINDS if self._given(kind)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got "
                + (", ".join(given) if given else "none"))
        if self.json is False:
            raise InvalidRequestError("structured_outputs.json is the schema false, which no output satisfies; give "
                                      "a schema some value satisfies (true or {} accept any JSON value)")
        if self.json is not None:
            if not isinstance(self.json, (dict, bool)):
                raise InvalidRequestError(
                    f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
            try:
                text = json.dumps(self.json, ensure_ascii=False)  # counted in characters, not \u escapes
            except (RecursionError, ValueError, TypeError) as exc:  # too deep, circular, or not JSON data
                raise InvalidRequestError(f"structured_outputs.json cannot be written as JSON: {type(exc).__name__}: "
                                          f"{str(exc)[:200]}") from None
            _check_size("json", text)
        for name in ("regex", "grammar"):
            value = self._value(name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string")
                _check_size(name, value)
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise InvalidRequestError(f"structured_outputs.choice takes 1 to {MAX_CHOICES} strings, "
                                          f"got {len(self.choice)}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError("structured_outputs.choice must hold non-empty strings")
            _check_size("choice", json.dumps(self.choice, ensure_ascii=False))
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("structured_outputs.json_object must be true or false")
        if self.trigger is not None and (not isinstance(self.trigger, str) or not 0 < len(self.trigger) <= 256):
            raise InvalidRequestError("structured_outputs.trigger must be the text of one token (1 to 256 characters), "
                                      f"got {self.trigger!r:.300}")
        if self.opening is not None:
            if not isinstance(self.opening, str) or not 0 < len(self.opening) <= 4096:
                raise InvalidRequestError("structured_outputs.opening must be a regular expression of 1 to 4,096 "
                                          f"characters, got {self.opening!r:.300}")
            if self.trigger is not None:
                raise InvalidRequestError("structured_outputs takes a trigger or an opening, not both")

    def _value(self, kind: str) -> Any:
        return getattr(self, kind)

    def _given(self, kind: str) -> bool:
        value = self._value(kind)
        return value not in (None, False) if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        return next(kind for kind in _KINDS if self._given(kind))

    @property
    def key(self) -> str:
        """The constraint as text (compiled grammars are cached by it). Key order is kept: a schema's property
        order is the order its output writes them in. The ``trigger`` is not part of it (it does not change what
        is compiled), nor is the ``opening``."""
        return self.kind + ":" + json.dumps(self._value(self.kind), separators=(",", ":"))

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any]) -> StructuredOutputs:
        """From vLLM's ``structured_outputs`` object; options gemmaserve does not implement are refused by name."""
        if not isinstance(fields, Mapping):
            raise InvalidRequestError("structured_outputs must be an object")
        refused = [name for name in _REFUSED if fields.get(name) not in (None, False)]
        if refused:
            raise InvalidRequestError(f"structured_outputs.{refused[0]} is not supported; accepted: "
                                      f"{', '.join(_KINDS)}, disable_any_whitespace")
        unknown = sorted(set(fields) - set(_KINDS) - set(_REFUSED) - {"disable_any_whitespace"})
        if unknown:
            raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not a known field; accepted: "
                                      f"{', '.join(_KINDS)}, disable_any_whitespace")
        flag = fields.get("disable_any_whitespace")
        if flag is not None and not isinstance(flag, bool):  # JSON is written without free whitespace either way
            raise InvalidRequestError(f"structured_outputs.disable_any_whitespace must be a boolean, got {flag!r:.100}")
        return cls(**{k: v for k, v in fields.items() if k in _KINDS})


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(f"structured_outputs.{name} is {len(text)} characters; at most "
                                  f"{MAX_CONSTRAINT_CHARS} are accepted")


def from_response_format(response_format: Mapping[str, Any] | None) -> StructuredOutputs | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``, or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. The output follows
    the schema either way (``strict`` changes nothing: every schema is enforced). Raises InvalidRequestError."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidRequestError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidRequestError('response_format of type "json_schema" needs a "json_schema" object')
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise InvalidRequestError('response_format.json_schema needs a "schema"')
        return StructuredOutputs(json=schema)
    raise InvalidRequestError(f"response_format.type {kind!r} is not supported; accepted: text, json_object, "
                              "json_schema")
