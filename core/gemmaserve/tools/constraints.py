"""``tool_choice: "required"`` and a named function as an output constraint, so the reply always is a call that
parses, of a function the request offered.

- ``json`` parser: a JSON schema — ``{"name": <one of the names>, "arguments": <that function's parameters>}``
  (a list of them for ``required`` with ``parallel_tool_calls``); the arguments validate against the schema
  as far as llguidance's JSON schema support goes.
- ``gemma4`` parser: a Lark grammar of Gemma 4's call blocks (``<|tool_call>call:NAME{...}<tool_call|>``) whose
  arguments follow the parameter schema's structure: every property of an object (in the schema's order), the
  declared types, ``enum`` / ``const`` values, string ``pattern`` s and lengths; numeric bounds and item counts
  are not enforced in this syntax, and parts of a schema it does not model (``anyOf``, ``$ref``, ...) accept any
  value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gemmaserve.structured.spec import StructuredOutputs

from .parsers import GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, GEMMA4_STRING

__all__ = ["tool_call_constraint"]

_GENERIC = f"""
value: gstring | GNUMBER | "true" | "false" | "null" | gobject | glist
gstring: {GEMMA4_STRING} GTEXT {GEMMA4_STRING}
GTEXT: /[^<]*/
gobject: "{{" (gpair ("," gpair)*)? "}}"
gpair: GKEY ":" value
GKEY: /[A-Za-z_][A-Za-z0-9_]*/
glist: "[" (value ("," value)*)? "]"
GNUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/
GINTEGER: /-?(0|[1-9][0-9]*)/
"""


def tool_call_constraint(tools: Sequence[Mapping[str, Any]], choice: str, parser: str,
                         parallel: bool) -> StructuredOutputs:
    """The constraint for ``tool_choice`` ``"required"`` (any of ``tools``; several calls if ``parallel``) or
    one function's name. ``tools``: ``{"name", "parameters"}`` each (OpenAI's ``function`` objects)."""
    offered = [tool for tool in tools if choice == "required" or tool["name"] == choice]
    many = parallel and choice == "required"
    if parser == "json":
        one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"], "properties": {
            "name": {"const": tool["name"]}, "arguments": tool.get("parameters") or {"type": "object"}}}
            for tool in offered]
        call: dict[str, Any] = one[0] if len(one) == 1 else {"anyOf": one}
        return StructuredOutputs(json={"type": "array", "minItems": 1, "items": call} if many else call)
    rules: list[str] = []
    names = []
    for index, tool in enumerate(offered):
        names.append(f"tool{index}")
        arguments = _object_rule(tool.get("parameters") or {}, f"t{index}", rules)
        rules.append(f"tool{index}: {json.dumps(tool['name'])} {arguments}")
    start = "call+" if many else "call"
    grammar = "\n".join([f"start: {start}", f"call: {GEMMA4_CALL_OPEN} \"call:\" ({' | '.join(names)}) "
                         f"{GEMMA4_CALL_CLOSE}", *rules, _GENERIC])
    return StructuredOutputs(grammar=grammar)


def _object_rule(schema: Mapping[str, Any], prefix: str, rules: list[str]) -> str:
    """A rule for a parameters object (no properties declared: any object)."""
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping) or not properties:
        return "gobject"
    name = f"{prefix}obj"
    pairs = []
    for index, (key, sub) in enumerate(properties.items()):
        pairs.append(f"{json.dumps(str(key))} \":\" {_value_rule(sub, f'{prefix}p{index}', rules)}")
    comma = ' "," '
    rules.append(f'{name}: "{{" {comma.join(pairs)} "}}"')
    return name


def _value_rule(schema: Any, prefix: str, rules: list[str]) -> str:
    """An expression for one value under ``schema`` (see the module docstring for what is modelled)."""
    if not isinstance(schema, Mapping):
        return "value"
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        options = [_literal(v) for v in values if isinstance(v, (str, int, float, bool)) or v is None]
        if not options:
            return "value"
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
        if isinstance(pattern, str) and pattern and "/" not in pattern:
            body = pattern.removeprefix("^").removesuffix("$")
            rules.append(f"{prefix}: {GEMMA4_STRING} /{body}/ {GEMMA4_STRING}")
            return prefix
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if isinstance(low, int) and isinstance(high, int) and 0 <= low <= high:
            rules.append(f"{prefix}: {GEMMA4_STRING} /[^<]{{{low},{high}}}/ {GEMMA4_STRING}")
            return prefix
        return "gstring"
    return {"integer": "GINTEGER", "number": "GNUMBER", "boolean": "(\"true\" | \"false\")",
            "null": "\"null\""}.get(kind, "value") if isinstance(kind, str) else "value"


def _literal(value: Any) -> str:
    """A fixed value as a Lark expression in Gemma 4's syntax."""
    if isinstance(value, str):
        return f"{GEMMA4_STRING} {json.dumps(value)} {GEMMA4_STRING}" if value else f"{GEMMA4_STRING} {GEMMA4_STRING}"
    if value is True or value is False or value is None:
        return json.dumps(json.dumps(value))
    return json.dumps(json.dumps(value))
