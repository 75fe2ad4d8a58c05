"""Tool calls in a model's text: streaming parsers for Gemma 4's native format and for JSON.

- ``gemma4``: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, one block per call (a block holding several
  ``call:`` entries is read as those calls); a value is a string between ``<|"|>`` markers, a number, ``true`` /
  ``false`` / ``null``, an object ``{key:value,...}`` or a list ``[value,...]``; a key is written bare (any text
  without ``:{}[],<`` and without surrounding whitespace: :data:`GEMMA4_BARE_KEY`) or as a string. The markers
  are special tokens: the text fed here must keep them (decoded with ``skip_special_tokens=False``).
- ``json``: the whole reply is one call ``{"name": ..., "arguments": {...}}`` (``parameters`` is accepted for
  ``arguments``) or a list of them, optionally in a Markdown code fence; anything else (an object that repeats a
  key included) is content.

A parser is fed the reply's text in whatever pieces it arrives (a marker split across pieces, several calls in
one piece) and returns the content to show now and the calls completed so far; :meth:`finish` flushes at the end.
Text that could still be the start of a marker is held back, never shown and then retracted. A call whose body
does not parse is shown as content (nothing is lost). Not thread-safe: one parser per response.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GEMMA4_BARE_KEY", "GEMMA4_CALL_CLOSE", "GEMMA4_CALL_OPEN", "GEMMA4_CHANNEL_CLOSE", "GEMMA4_CHANNEL_OPEN",
           "GEMMA4_STRING", "JSON_BLANKS", "Gemma4ReasoningParser", "Gemma4ToolParser", "JsonNumber", "JsonToolParser",
           "ParsedText", "ToolCall", "ToolParser", "format_gemma_key", "format_gemma_value", "json_text",
           "parse_gemma_arguments", "PARSERS"]

GEMMA4_CALL_OPEN = "<|tool_call>"
GEMMA4_CALL_CLOSE = "<tool_call|>"
GEMMA4_STRING = '<|"|>'
_WORDS = (("true", True), ("false", False), ("null", None), ("None", None), ("True", True), ("False", False))
"""The literal words of a Gemma 4 call's values: JSON's, and Python's as the chat template prints a null (and a
boolean it did not recognise) back into the history (``{{ argument }}``)."""

GEMMA4_BARE_KEY = re.compile(r"[^\s:{}\[\],<](?:[^:{}\[\],<]*[^\s:{}\[\],<])?")
"""A key Gemma 4's syntax writes bare (its chat template writes every key so); any other key is written as a string."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of the arguments object (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(slots=True)
class ParsedText:
    """What a piece of text turned into: content to show and the calls it completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    """Base of the streaming parsers (see the module docstring)."""

    name = ""

    def feed(self, text: str) -> ParsedText:
        raise NotImplementedError

    def finish(self) -> ParsedText:
        raise NotImplementedError


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Gemma4ToolParser(ToolParser):
    name = "gemma4"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._searched = 0  # in a call: the buffer's first characters known not to start the closing marker

    def feed(self, text: str) -> ParsedText:
        self._buffer += text
        out = ParsedText()
        while True:
            if not self._in_call:
                at = self._buffer.find(GEMMA4_CALL_OPEN)
                if at < 0:
                    keep = _held_back(self._buffer, GEMMA4_CALL_OPEN)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(GEMMA4_CALL_OPEN):]
                self._in_call, self._searched = True, 0
            end = self._buffer.find(GEMMA4_CALL_CLOSE, self._searched)
            if end < 0:  # a long call streams in linear time: the next feed searches only what is new
                self._searched = max(0, len(self._buffer) - len(GEMMA4_CALL_CLOSE) + 1)
                return out
            body, self._buffer = self._buffer[:end], self._buffer[end + len(GEMMA4_CALL_CLOSE):]
            self._in_call = False
            calls = _parse_gemma_calls(body)
            if calls is None:
                out.content += GEMMA4_CALL_OPEN + body + GEMMA4_CALL_CLOSE
            else:
                out.calls.extend(calls)

    def finish(self) -> ParsedText:
        """An unterminated call is shown as the text it was (with its opening marker)."""
        rest = (GEMMA4_CALL_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return ParsedText(rest)


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # the characters the API accepts in a tool's name


@dataclass(frozen=True, slots=True)
class JsonNumber:
    """A number as the reply wrote it (JSON's number syntax, which Gemma 4's shares), kept as its text so that a
    call's arguments carry it unchanged: no float rounding, no overflow to ``Infinity`` (which is not JSON), no
    limit on its digits."""

    text: str


def json_text(value: Any) -> str:
    """``value`` as JSON text (``json.dumps``' separators, non-ASCII kept), a :class:`JsonNumber` written as is."""
    if isinstance(value, JsonNumber):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(key, ensure_ascii=False)}: {json_text(item)}"
                               for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(json_text(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _parse_gemma_calls(body: str) -> list[ToolCall] | None:
    """The ``call:NAME{...}`` entries of one block (one, or several back to back), or None if it does not parse."""
    calls: list[ToolCall] = []
    values = _GemmaValues(body, raw_numbers=True)
    at = values.skip(0)
    while at < len(body):
        if not body.startswith("call:", at):
            return None
        match = _NAME.match(body, at + 5)
        if match is None:
            return None
        try:
            value, at = values.value(match.end())
            if not isinstance(value, dict):
                return None
            calls.append(ToolCall(match.group(0), json_text(value)))
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
            return None
        at = values.skip(at)
    return calls or None


def parse_gemma_arguments(text: str) -> Any:
    """The value written in Gemma 4's argument syntax (``{key:<|"|>text<|"|>,n:3}``) as Python data. Raises
    ValueError if ``text`` is not exactly one value."""
    parser = _GemmaValues(text)
    value, end = parser.value(0)
    if text[end:].strip():
        raise ValueError(f"unexpected text after the value at {end}")
    return value


class _GemmaValues:
    """Recursive-descent reader of Gemma 4 argument values."""

    _NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
    _KEY = re.compile(r"[^:{}\[\],<]+")  # a bare key, its trailing whitespace stripped below

    def __init__(self, text: str, raw_numbers: bool = False) -> None:
        self.text = text
        self.raw_numbers = raw_numbers  # numbers as JsonNumber text instead of int / float

    def skip(self, at: int) -> int:
        """The first index at or after ``at`` that is not whitespace."""
        while at < len(self.text) and self.text[at] in " \t\n\r":
            at += 1
        return at

    def value(self, at: int) -> tuple[Any, int]:
        text = self.text
        at = self.skip(at)
        if text.startswith(GEMMA4_STRING, at):
            end = text.find(GEMMA4_STRING, at + len(GEMMA4_STRING))
            if end < 0:
                raise ValueError("unterminated string")
            return text[at + len(GEMMA4_STRING): end], end + len(GEMMA4_STRING)
        if text.startswith("{", at):
            return self._object(at + 1)
        if text.startswith("[", at):
            return self._list(at + 1)
        for word, value in _WORDS:  # "None" / "True" / "False": what Gemma 4's template writes for Python values
            if text.startswith(word, at):
                return value, at + len(word)
        match = self._NUMBER.match(text, at)
        if match is None:
            raise ValueError(f"no value at {at}")
        number = match.group(0)
        if self.raw_numbers:
            return JsonNumber(number), match.end()
        return (float(number) if any(c in number for c in ".eE") else int(number)), match.end()

    def _object(self, at: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        at = self.skip(at)
        if self.text.startswith("}", at):
            return out, at + 1
        while True:
            at = self.skip(at)
            if self.text.startswith(GEMMA4_STRING, at):  # a quoted key
                key, at = self.value(at)
            else:
                match = self._KEY.match(self.text, at)
                if match is None:
                    raise ValueError(f"no key at {at}")
                key, at = match.group(0).rstrip(" \t\n\r"), match.end()  # skip()'s blanks, as the grammar's
            at = self.skip(at)
            if not self.text.startswith(":", at):
                raise ValueError(f"':' expected at {at}")
            out[key], at = self.value(at + 1)
            at = self.skip(at)
            if self.text.startswith(",", at):
                at += 1
                continue
            if self.text.startswith("}", at):
                return out, at + 1
            raise ValueError(f"',' or '}}' expected at {at}")

    def _list(self, at: int) -> tuple[list[Any], int]:
        out: list[Any] = []
        at = self.skip(at)
        if self.text.startswith("]", at):
            return out, at + 1
        while True:
            item, at = self.value(at)
            out.append(item)
            at = self.skip(at)
            if self.text.startswith(",", at):
                at += 1
                continue
            if self.text.startswith("]", at):
                return out, at + 1
            raise ValueError(f"',' or ']' expected at {at}")


def format_gemma_value(value: Any) -> str:
    """``value`` in Gemma 4's argument syntax (the inverse of :func:`parse_gemma_arguments`)."""
    if isinstance(value, str):
        return GEMMA4_STRING + value + GEMMA4_STRING
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, dict):
        pairs = (f"{format_gemma_key(key)}:{format_gemma_value(item)}" for key, item in value.items())
        return "{" + ",".join(pairs) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_gemma_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} in Gemma 4's argument syntax")


def format_gemma_key(key: str) -> str:
    """``key`` as an object key in Gemma 4's syntax: bare where :data:`GEMMA4_BARE_KEY` allows, else a string."""
    return key if GEMMA4_BARE_KEY.fullmatch(key) else GEMMA4_STRING + key + GEMMA4_STRING


_FENCE_LANGUAGE = re.compile(r"[a-zA-Z_]*")
JSON_BLANKS = " \t\r\n"
"""The blanks the json parser skips around a call (JSON's whitespace; other Unicode spaces are text, as the strict
tools' constraint, tools/constraints.py, reads them)."""


def _unfenced(text: str) -> str:
    """The body of a reply that is one Markdown code fence (```` ```json ... ``` ````: the language tag and the
    whitespace around the body dropped), else ``text``. Linear in the text (a backtracking pattern took a minute
    on a fence followed by 2,000 blank lines)."""
    stripped = text.strip(JSON_BLANKS)
    if len(stripped) < 6 or not stripped.startswith("```") or not stripped.endswith("```"):
        return text
    inner = stripped[3:-3]
    return inner[_FENCE_LANGUAGE.match(inner).end():].strip(JSON_BLANKS)  # type: ignore[union-attr]  # always matches


class JsonToolParser(ToolParser):
    """See the module docstring. A reply that starts like JSON (``{``, ``[`` or a code fence) is held until the
    end, then parsed; any other reply streams as content at once."""

    name = "json"

    def __init__(self) -> None:
        self._buffer = ""
        self._decided: bool | None = None  # None: undecided; True: holding a possible call; False: content

    def feed(self, text: str) -> ParsedText:
        if self._decided is False:
            return ParsedText(text)
        self._buffer += text
        stripped = self._buffer.lstrip(JSON_BLANKS)
        if not stripped:
            return ParsedText()
        if self._decided is None:
            if "```".startswith(stripped):  # "`" or "``": a code fence or not, the next text tells
                return ParsedText()
            self._decided = stripped[0] in "{[" or stripped.startswith("```")
            if not self._decided:
                out, self._buffer = self._buffer, ""
                return ParsedText(out)
        return ParsedText()

    def finish(self) -> ParsedText:
        text, self._buffer = self._buffer, ""
        if not self._decided:
            return ParsedText(text)
        try:
            value = _json_loads(_unfenced(text))
        except (ValueError, RecursionError):
            return ParsedText(text)
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and ("arguments" in item or "parameters" in item)):  # {"name": "Ann", ...} is an answer
                return ParsedText(text)
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):  # already JSON text
                try:
                    arguments = _json_loads(arguments)
                except (ValueError, RecursionError):
                    return ParsedText(text)
            if not isinstance(arguments, dict):
                return ParsedText(text)
            try:
                calls.append(ToolCall(item["name"], json_text(arguments)))
            except RecursionError:  # nested deeper than writing it back can go
                return ParsedText(text)
        return ParsedText("", calls) if calls else ParsedText(text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are distinct; ValueError for a repeated one (``"city"`` and ``"cit\\u0079"`` too: a
    reader would keep the last, which no schema check saw)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError("an object repeats a key")
    return value


def _json_loads(text: str) -> Any:
    """Strict JSON (no ``NaN`` / ``Infinity``, no repeated key in an object), numbers kept as :class:`JsonNumber`
    text."""
    return json.loads(text, parse_int=JsonNumber, parse_float=JsonNumber, parse_constant=_refuse_constant,
                      object_pairs_hook=_distinct_keys)


PARSERS: dict[str, type[ToolParser]] = {"gemma4": Gemma4ToolParser, "json": JsonToolParser}
"""The parsers by ``--tool-call-parser`` name."""


GEMMA4_CHANNEL_OPEN = "<|channel>"
GEMMA4_CHANNEL_CLOSE = "<channel|>"


class Gemma4ReasoningParser:
    """Gemma 4's reasoning channel (``--reasoning-parser gemma4``): text between ``<|channel>`` and
    ``<channel|>`` (a leading ``thought`` label and newline dropped) is reasoning, the rest content. Streaming
    and chunking as the tool parsers: :meth:`feed` returns (reasoning, content) made final; :meth:`finish`
    flushes (an unterminated channel is reasoning: the model was still thinking)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_channel = False
        self._label_pending = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        while True:
            marker = GEMMA4_CHANNEL_CLOSE if self._in_channel else GEMMA4_CHANNEL_OPEN
            at = self._buffer.find(marker)
            if self._in_channel and self._label_pending:
                label = "thought\n"
                head = self._buffer[: len(label)]
                after = self._buffer[len("thought"):] if self._buffer.startswith("thought") else None
                if at < 0 and ((label.startswith(head) and len(head) < len(label))
                               or (after is not None and GEMMA4_CHANNEL_CLOSE.startswith(after))):
                    return reasoning, content  # the label (or a label-only channel's close) may still be arriving
                if self._buffer.startswith(label):
                    self._buffer = self._buffer[len(label):]
                elif self._buffer.startswith("thought") and (at == len("thought")):
                    self._buffer = self._buffer[len("thought"):]
                self._label_pending = False
                continue
            if at < 0:
                keep = _held_back(self._buffer, marker)
                ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                if self._in_channel:
                    reasoning += ready
                else:
                    content += ready
                return reasoning, content
            if self._in_channel:
                reasoning += self._buffer[:at]
            else:
                content += self._buffer[:at]
            self._buffer = self._buffer[at + len(marker):]
            self._in_channel = not self._in_channel
            self._label_pending = self._in_channel

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._in_channel else ("", rest)
