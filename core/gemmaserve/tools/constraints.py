"""``tool_choice: "required"`` and a named function as an output constraint, so the reply always is a call that
parses, of a function the request offered.

- ``json`` parser: a JSON schema — ``{"name": <one of the names>, "arguments": <that function's parameters>}``
  (a list of them for ``required`` with ``parallel_tool_calls``); the arguments validate against the schema
  as far as llguidance's JSON schema support goes.
- ``gemma4`` parser: a Lark grammar of Gemma 4's call blocks (``<|tool_call>call:NAME{...}<tool_call|>``) whose
  arguments follow the parameter schema's structure: an object's required properties and any others (sorted as
  the chat template's ``dictsort`` writes them; keys
  bare where :data:`~gemmaserve.tools.parsers.GEMMA4_BARE_KEY` allows, else as strings), the declared types,
  ``enum`` / ``const`` values, string ``pattern`` s (searched, as JSON Schema does: anchor with ``^`` / ``$``
  for a whole-string match) and lengths; numeric bounds and item counts are not enforced in this syntax, and
  parts of a schema it does not model (``anyOf``, ``$ref``, a pattern using look-around, word boundaries,
  back-references or anchors inside groups, ...) accept any value. A string may hold any text but the string,
  call-closing and reasoning-channel markers.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from urllib.parse import quote, unquote
from typing import Any

from gemmaserve.errors import InvalidRequestError
from gemmaserve.structured.spec import StructuredOutputs

from .parsers import (GEMMA4_BARE_KEY, GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, GEMMA4_CHANNEL_CLOSE, GEMMA4_CHANNEL_OPEN,
                      GEMMA4_STRING)

__all__ = ["strict_calls_constraint", "tool_call_constraint"]

_IN_STRING_MARKERS = (GEMMA4_STRING, GEMMA4_CALL_CLOSE, GEMMA4_CHANNEL_OPEN, GEMMA4_CHANNEL_CLOSE)
"""Markers a string of a call cannot hold: the parsers would end the string or the call there, or open a channel."""
_MARKERS = "|".join(re.escape(m) for m in _IN_STRING_MARKERS)
_NO_MARKER = f"~/(?s:.*)({_MARKERS})(?s:.*)/"
"""Lark: any text without the string marker, the call's closing marker or the reasoning channel's markers in it (the
parsers would end the string or the call there, or open a channel), intersected with a string's own lexeme."""

_GENERIC = f"""
value: gstring | GNUMBER | "true" | "false" | "null" | gobject | glist
gstring: {GEMMA4_STRING} GTEXT {GEMMA4_STRING}
GTEXT: /(?s:.*)/ & {_NO_MARKER}
gobject: "{{" (gpair ("," gpair)*)? "}}"
gpair: (GKEY | gstring) ":" value
GKEY: /[^\s:{{}}\[\],<](?:[^:{{}}\[\],<]*[^\s:{{}}\[\],<])?/
glist: "[" (value ("," value)*)? "]"
GNUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/
GINTEGER: /-?(0|[1-9][0-9]*)/
"""


def tool_call_constraint(tools: Sequence[Mapping[str, Any]], name: str | None, parser: str,
                         parallel: bool) -> StructuredOutputs:
    """The constraint for ``tool_choice: "required"`` (``name`` None: any of ``tools``; several calls if
    ``parallel``) or the one function named ``name``. ``tools``: ``{"name", "parameters"}`` each (OpenAI's
    ``function`` objects). Raises InvalidRequestError for a parameter name or an ``enum`` / ``const`` string
    Gemma 4's syntax cannot write (it holds a marker)."""
    _refuse_repeated_names(tools)
    offered = [tool for tool in tools if name is None or tool["name"] == name]
    many = parallel and name is None
    if parser == "json":
        return StructuredOutputs(json=_json_calls_schema(offered, many, strict_only=False))
    return StructuredOutputs(grammar=_gemma4_calls(offered, "call+" if many else "call", strict_only=False))


def strict_calls_constraint(tools: Sequence[Mapping[str, Any]], parser: str,
                            parallel: bool = True) -> StructuredOutputs | None:
    """``tool_choice: "auto"`` with ``strict: true`` on some of ``tools`` (OpenAI's ``function`` objects): a
    constraint that holds every call the reply makes to the offered functions, a strict function's arguments to
    its ``parameters`` (as a forced call's are) and any other function's to any object, and leaves text free.
    None when no tool is strict. Raises as :func:`tool_call_constraint` does.

    - ``gemma4``: the reply is free until it opens a call (the ``<|tool_call>`` token, the constraint's trigger);
      after the call it is free again.
    - ``json``: the parser takes a reply that starts (after blanks) with ``{``, ``[`` or a code fence for a call,
      so the constraint is on the whole reply: text that does not start so, or one call (or, if ``parallel``, a
      list of calls), bare or in one code fence."""
    if not any(tool.get("strict") is True for tool in tools):
        return None
    _refuse_repeated_names(tools)
    if parser == "json":
        one = json.dumps({**_json_calls_schema(tools, False, strict_only=True), **_COMPACT}, ensure_ascii=False)
        grammar = (_JSON_REPLY.replace("LISTS", _JSON_LISTS if parallel else "").replace("CALL_SCHEMA", one)
                   + (_JSON_LIST_RULES if parallel else ""))
        return StructuredOutputs(grammar=grammar, opening=_JSON_OPENING)
    return StructuredOutputs(grammar=_gemma4_calls(tools, "call", strict_only=True), trigger=GEMMA4_CALL_OPEN)


_COMPACT = {"x-guidance": {"whitespace_flexible": False}}
"""JSON without free whitespace between tokens, as every other JSON constraint (structured/grammar.py)."""

_BLANK = r"[ \t\r\n]"
_FENCE = rf"{_BLANK}*```[a-zA-Z_]*{_BLANK}*"
_JSON_OPENING = rf"{_BLANK}*(```[a-zA-Z_]*{_BLANK}*)?(\{{|\[{_BLANK}*\{{)"
"""The beginnings the json parser may read as calls (after its blanks, :data:`~gemmaserve.tools.parsers.JSON_BLANKS`:
``{``, a list of objects, or a code fence around either; a list written with blanks before its first object is
one too, which compact JSON cannot write: no token may go there). Any other beginning is text to the parser
(``[1]``, a fence around code), and the strict constraint leaves such a reply free (``StructuredOutputs.opening``)."""

_JSON_REPLY = rf"""start: TEXT | BLANKS? one | FENCE one CLOSE LISTS
TEXT: /(?s:.*)/ & ~/{_JSON_OPENING}(?s:.*)/
BLANKS: /{_BLANK}+/
FENCE: /{_FENCE}/
CLOSE: /{_BLANK}*```/
one: %json CALL_SCHEMA
"""
"""Lark: a reply the json parser reads as text, or one call (CALL_SCHEMA) bare or in a code fence. Each opening
(blanks, a fence, a list's bracket) is one lexeme that ends where the call's first brace begins, which is where
the text lexeme can go no further: llguidance's lexer keeps the longer match, so an opening lexeme that ended
earlier (a blank before a fence's backticks) would be dropped in favour of the text."""

_JSON_LISTS = ''' | LIST calls "]" | FENCED_LIST calls "]" CLOSE'''
_JSON_LIST_RULES = rf"""LIST: /{_BLANK}*\[/
FENCED_LIST: /{_FENCE}\[/
calls: one ("," one)*
"""
"""With parallel calls: a list of calls too, bare or fenced (LISTS: the alternatives ``start`` takes then)."""


def _refuse_repeated_names(tools: Sequence[Mapping[str, Any]]) -> None:
    """InvalidRequestError for two functions of one name: a call names its function, so the constraint could not
    tell which parameters hold it (a strict one and a free one of the same name let any arguments through)."""
    seen: set[str] = set()
    for tool in tools:
        if tool["name"] in seen:
            raise InvalidRequestError(f"tools name the function {tool['name']!r} more than once; give each function "
                                      "a distinct name")
        seen.add(tool["name"])


def _json_calls_schema(offered: Sequence[Mapping[str, Any]], many: bool, strict_only: bool) -> dict[str, Any]:
    """The JSON schema of a call of the json parser (``{"name": <one of the offered names>, "arguments": <that
    function's parameters>}``; with ``strict_only``, only a function marked ``strict: true`` has its arguments held
    to its parameters, the others to any object), a list of one or more calls if ``many``."""
    root = "#/items" if many else "#"
    definitions: dict[str, Any] = {}
    one = []
    for index, tool in enumerate(offered):
        where = f"{root}/anyOf/{index}" if len(offered) > 1 else root
        parameters = tool.get("parameters") or {}
        if strict_only and tool.get("strict") is not True:
            parameters = {}
        arguments = _rebased(parameters, f"{where}/properties/arguments", f"t{index}_", definitions)
        one.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": tool["name"]}, "arguments": {**arguments, "type": "object"}}})
    # the parsers take only an object as a call's arguments
    call: dict[str, Any] = one[0] if len(one) == 1 else {"anyOf": one}
    schema = {"type": "array", "minItems": 1, "items": call} if many else call
    return {**schema, "$defs": definitions} if definitions else schema


def _gemma4_calls(offered: Sequence[Mapping[str, Any]], start: str, strict_only: bool) -> str:
    """The Lark grammar of Gemma 4 call blocks (``start``: one ``call`` or ``call+``) of the ``offered``
    functions; each function's arguments follow its ``parameters`` (with ``strict_only``, only a function marked
    ``strict: true``; the others take any object)."""
    rules: list[str] = []
    names = []
    for index, tool in enumerate(offered):
        names.append(f"tool{index}")
        if strict_only and tool.get("strict") is not True:
            arguments = "gobject"
        else:
            arguments = _object_rule(tool.get("parameters") or {}, f"t{index}", rules)
        rules.append(f"tool{index}: {json.dumps(tool['name'])} {arguments}")
    return "\n".join([f"start: {start}", f"call: {GEMMA4_CALL_OPEN} \"call:\" ({' | '.join(names)}) "
                      f"{GEMMA4_CALL_CLOSE}", *rules, _GENERIC])


_FRAGMENT_SAFE = "#/$~:@!&'()*+,;="
"""What a URI fragment may hold unencoded besides letters, digits and ``-._~`` (RFC 3986)."""


def _rebased(parameters: Mapping[str, Any], where: str, prefix: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` to be placed at JSON pointer ``where`` of a larger schema: its ``$defs`` / ``definitions``
    move into ``definitions`` (the root's ``$defs``) under names starting with ``prefix``, and its local references
    (``#``, ``#/$defs/X``, ``#/definitions/X``, ``#/properties/...``, percent-encoded or not) are rewritten to
    point where those now are; a root ``$id`` is dropped (references then resolve against the root). Iterative (a schema may nest deeper than Python's recursion limit)."""
    def pointer(name: str) -> str:  # a JSON pointer token (RFC 6901)
        return str(name).replace("~", "~0").replace("/", "~1")

    def renamed(key: str, name: str) -> str:  # the definition's name in the root's $defs
        return f"{prefix}{key.lstrip('$')}_{name}"

    moved = {}
    for key in ("$defs", "definitions"):
        table = parameters.get(key)
        if isinstance(table, Mapping):
            for name in table:
                moved[f"#/{key}/{pointer(name)}"] = f"#/$defs/{pointer(renamed(key, name))}"

    def ref(target: str) -> str:
        if not target.startswith("#"):
            return target
        target = unquote(target)  # a fragment may be percent-encoded (RFC 3986): "#/$defs/sp%20ace"
        for old, new in moved.items():
            if target == old or target.startswith(old + "/"):
                return quote(new + target[len(old):], safe=_FRAGMENT_SAFE)
        return quote(where + target[1:] if target == "#" or target.startswith("#/") else target, safe=_FRAGMENT_SAFE)

    def copy(value: Any) -> Any:  # a deep copy with references rewritten
        top: list[Any] = [None]
        pending: list[tuple[Any, Any, Any]] = [(value, top, 0)]
        while pending:
            item, parent, slot = pending.pop()
            if isinstance(item, Mapping):
                out: dict[str, Any] = {}
                for key, sub in item.items():
                    if key == "$ref" and isinstance(sub, str):
                        out[key] = ref(sub)
                    else:
                        out[key] = None
                        pending.append((sub, out, key))
                parent[slot] = out
            elif isinstance(item, list):
                items: list[Any] = [None] * len(item)
                pending.extend((sub, items, i) for i, sub in enumerate(item))
                parent[slot] = items
            else:
                parent[slot] = item
        return top[0]

    # "$id" would make the references resolve against it, where the moved definitions are not
    body = copy({key: sub for key, sub in parameters.items() if key not in ("$defs", "definitions", "$id")})
    for key in ("$defs", "definitions"):
        table = parameters.get(key)
        if isinstance(table, Mapping):
            for name, sub in table.items():
                definitions[renamed(key, name)] = copy(sub)
    return body


def _object_rule(schema: Mapping[str, Any], prefix: str, rules: list[str]) -> str:
    """A rule for a parameters object (no properties declared: any object): its properties in the order Gemma 4's
    chat template writes a call's keys (Jinja's ``dictsort``: sorted ignoring case), the ``required`` ones always
    and the others optional (OpenAI and vLLM never force an optional argument). Linear in the properties: ``rest_i`` is what may
    follow once property ``i - 1`` was written (``"," pair`` for each later property, optional ones optional) and
    the object's body starts at any property that no required one precedes."""
    if not isinstance(schema, Mapping):
        return "gobject"
    properties = schema.get("properties")
    properties = dict(properties) if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    needed = {str(key) for key in required} if isinstance(required, list) else set()
    for key in needed - {str(key) for key in properties}:
        properties[key] = {}  # required without a schema of its own: any value, but there
    if not properties:
        return '"{" "}"' if schema.get("additionalProperties") is False else "gobject"
    name = f"{prefix}obj"
    ordered = sorted(((str(key), sub) for key, sub in properties.items()), key=lambda item: item[0].lower())
    pairs = [f"{_key(key)} \":\" {_value_rule(sub, f'{prefix}p{index}', rules)}"
             for index, (key, sub) in enumerate(ordered)]
    count = len(ordered)

    def rest(index: int) -> str:  # what may follow property index - 1 ("" past the last)
        return f" {name}r{index}" if index < count else ""

    for index in range(count - 1, 0, -1):
        item = f'"," {pairs[index]}'
        item = item if ordered[index][0] in needed else f"({item})?"
        rules.append(f"{name}r{index}: {item}{rest(index + 1)}")
    starts = []
    for index, (key, _) in enumerate(ordered):
        starts.append(f"({pairs[index]}{rest(index + 1)})")
        if key in needed:
            break
    optional = not needed.intersection(key for key, _ in ordered)  # no required property: {} too
    rules.append(f'{name}: "{{" ({" | ".join(starts)}){"?" if optional else ""} "}}"')
    return name


def _value_rule(schema: Any, prefix: str, rules: list[str]) -> str:
    """An expression for one value under ``schema`` (see the module docstring for what is modelled)."""
    if not isinstance(schema, Mapping):
        return "value"
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            return "value"
        options = [_literal(v) for v in values]
        rules.append(f"{prefix}: {' | '.join(options)}")
        return prefix
    kind = schema.get("type")
    if kind == "object":
        return _object_rule(schema, prefix, rules)
    if kind == "array":
        item = _value_rule(schema.get("items"), f"{prefix}i", rules)
        rules.append(f"{prefix}: \"[\" ({item} (\",\" {item})*)? \"]\"")
        return prefix
    if kind == "string":
        pattern = schema.get("pattern")
        parts = [body for body in [_pattern_body(pattern) if isinstance(pattern, str) else None] if body is not None]
        length = _length_body(schema.get("minLength", 0), schema.get("maxLength"))
        if length is not None:
            parts.append(length)  # with a pattern, the text must match both
        if not parts:
            return "gstring"
        rules.append(f"{prefix}: {GEMMA4_STRING} {prefix.upper()}S {GEMMA4_STRING}")
        lexeme = " & ".join(f"/{part}/" for part in parts)
        rules.append(f"{prefix.upper()}S: {lexeme} & {_NO_MARKER}")  # the string's text, free of markers
        return prefix
    return {"integer": "GINTEGER", "number": "GNUMBER", "boolean": "(\"true\" | \"false\")",
            "null": "\"null\""}.get(kind, "value") if isinstance(kind, str) else "value"


_MAX_MODELLED_MIN_LENGTH = 512
"""The largest ``minLength`` a forced Gemma 4 call enforces: the constraint engine's lexer runs out of fuel near a
thousand counted repeats intersected with the marker exclusion (refusing the request), so a larger minimum is
enforced as this one."""


def _length_body(low: Any, high: Any) -> str | None:
    """The regex of a string of ``minLength`` .. ``maxLength`` characters (either may be absent; a minimum above
    :data:`_MAX_MODELLED_MIN_LENGTH` is enforced as that), or None when the bounds say nothing or are not
    non-negative integers in order (unmodelled: any text)."""
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not count(low) or (high is not None and not (count(high) and high >= low)):
        return None
    low = min(low, _MAX_MODELLED_MIN_LENGTH)
    if high is None:
        return f"(?s:.){{{low},}}" if low else None
    return f"(?s:.){{{low},{high}}}"


_UNMODELLED_PATTERN = re.compile(r"\(\?<?[=!]|\\[1-9bBAzZGk]|\(\?>|[*+?}]\+")
"""Look-around, word boundaries and other zero-width escapes, back-references, atomic groups and possessive repeats:
not in the constraint engine's regex syntax."""
_INNER_ANCHOR = re.compile(r"(?<!\\)(?:\\\\)*[\^$]")
"""An unescaped ``^`` or ``$`` (outside character classes, where the caller strips them first)."""
_CLASS = re.compile(r"\[(?:\\.|[^\]\\])*\]")


_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_ECMA_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[A-Za-z0-9_]", "W": "[^A-Za-z0-9_]"}
"""JSON Schema's (ECMAScript's) ASCII ``\\d`` / ``\\w``, which the constraint engine's Unicode regex would widen."""


@functools.lru_cache(maxsize=1024)
def _pattern_body(pattern: str) -> str | None:
    """A JSON Schema ``pattern`` as a whole-string regex body (unanchored ends match any text, as the schema's
    search semantics say), or None where it is not modelled (empty, a ``/`` that would end the Lark regex, or
    syntax the constraint engine lacks: the value is then any string)."""
    if not pattern or "/" in pattern or _UNMODELLED_PATTERN.search(pattern):
        return None
    start = pattern.startswith("^")
    body = pattern[1:] if start else pattern
    escapes = len(body[:-1]) - len(body[:-1].rstrip("\\"))  # backslashes right before a final "$"
    end = body.endswith("$") and escapes % 2 == 0
    if end:
        body = body[:-1]
    bare = _CLASS.sub("", body)
    if _INNER_ANCHOR.search(bare) or ((start or end) and _top_level_alternation(bare)):
        return None  # anchors inside groups or on some alternatives only (^a|b): not modelled
    body = _ESCAPE.sub(lambda m: _ECMA_CLASSES.get(m.group(1), m.group(0)), body)
    body = f"{'' if start else '(?s:.*)'}(?:{body}){'' if end else '(?s:.*)'}"
    return body if _regex_compiles(body) else None


def _top_level_alternation(body: str) -> bool:
    """True if ``body`` (character classes removed) has a ``|`` outside every group."""
    depth, escaped = 0, False
    for char in body:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            return True
    return False


def _regex_compiles(body: str) -> bool:
    """True if the constraint engine reads ``body`` as a regex (~1 ms; no vocabulary needed)."""
    try:
        import llguidance
    except ImportError:  # nothing can compile the constraint then; the compile step says so
        return True
    grammar = llguidance.LLMatcher.grammar_from_lark(f"start: S\nS: /{body}/")
    return not llguidance.LLMatcher.validate_grammar(grammar)


def _string(text: str, what: str) -> str:
    """``text`` as a Gemma 4 string, as Lark. Raises InvalidRequestError if it holds a marker (``what`` names it)."""
    for marker in _IN_STRING_MARKERS:
        if marker in text:
            raise InvalidRequestError(f"tools: {what} {text!r} contains {marker}, which Gemma 4's call syntax cannot "
                                      "write inside a string; change it or leave tool_choice to \"auto\"")
    return f"{GEMMA4_STRING} {json.dumps(text)} {GEMMA4_STRING}" if text else f"{GEMMA4_STRING} {GEMMA4_STRING}"


def _key(key: str) -> str:
    """A property key as Gemma 4 writes it (see :func:`~gemmaserve.tools.parsers.format_gemma_key`), as Lark."""
    if GEMMA4_BARE_KEY.fullmatch(key):
        return json.dumps(key)
    return _string(key, "the parameter name")


def _literal(value: Any) -> str:
    """A fixed JSON value (an ``enum`` / ``const`` entry) as a Lark expression in Gemma 4's syntax."""
    if isinstance(value, str):
        return _string(value, "the enum / const value")
    if isinstance(value, Mapping):
        pairs = ' "," '.join(f"{_key(str(key))} \":\" {_literal(item)}" for key, item in value.items())
        return f'"{{" {pairs} "}}"' if pairs else '"{" "}"'
    if isinstance(value, list):
        items = ' "," '.join(_literal(item) for item in value)
        return f'"[" {items} "]"' if items else '"[" "]"'
    return json.dumps(json.dumps(value))  # true / false / null / a number, as a Lark string
