"""The tool-call parsers over adversarial chunkings: markers split anywhere, several calls per chunk, text that
looks like the start of a marker, bodies that do not parse, replies that end inside a call."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaserve.tools.parsers import (
    GEMMA4_CALL_CLOSE,
    GEMMA4_CALL_OPEN,
    Gemma4ToolParser,
    JsonToolParser,
    format_gemma_value,
    parse_gemma_arguments,
)

_text = st.lists(st.sampled_from(list("ab <|>_:{}\"'\n,") + ["<|", "<|tool", "tool_call|", "é"]),
                 max_size=12).map("".join)  # pieces that look like the start of a marker
_key = st.one_of(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True),  # and keys Gemma 4 writes as strings
                 st.text(st.sampled_from(list(' a9$é:,{}[]<|>"')), max_size=6).filter(lambda k: '<|"|>' not in k))
_scalar = st.one_of(st.text(alphabet="abc xyz,:{}[]0123", max_size=8), st.integers(-10**6, 10**6), st.booleans(),
                    st.none(), st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False).map(lambda x: round(x, 3)))
_value = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(_key, inner, max_size=3)), max_leaves=6)
_call = st.tuples(st.from_regex(r"[A-Za-z0-9_.\-]{1,9}", fullmatch=True), st.dictionaries(_key, _value, max_size=4))


def _feed_in_pieces(parser, text: str, cuts: list[int]):
    points = sorted({min(len(text), c) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    content, calls = "", []
    for piece in pieces:
        out = parser.feed(piece)
        assert GEMMA4_CALL_OPEN not in out.content or GEMMA4_CALL_CLOSE in out.content  # never a bare opener
        content += out.content
        calls += out.calls
    out = parser.finish()
    return content + out.content, calls + out.calls


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.tuples(_text, st.lists(_call, min_size=1, max_size=2)), max_size=4), tail=_text,
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_gemma4_calls_and_content_survive_any_chunking(parts, tail, cuts) -> None:
    text, want_content, want_calls = "", "", []
    for before, block in parts:  # a block of one call, or several back to back
        body = "".join(f"call:{name}{format_gemma_value(args)}" for name, args in block)
        text += before + GEMMA4_CALL_OPEN + body + GEMMA4_CALL_CLOSE
        want_content += before
        want_calls += block
    text += tail
    want_content += tail
    content, calls = _feed_in_pieces(Gemma4ToolParser(), text, cuts)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    assert len({c.id for c in calls}) == len(calls)


@settings(max_examples=200, deadline=None)
@given(value=_value)
def test_gemma_value_round_trip(value) -> None:
    assert parse_gemma_arguments(format_gemma_value(value)) == value


@pytest.mark.parametrize("body", ["call:f", "call:f{a:}", "call:{a:1}", "nonsense", "call:f{a:1}}", 'call:f{a:<|"|>x}'])
def test_a_gemma4_block_that_does_not_parse_stays_content(body) -> None:
    text = "before " + GEMMA4_CALL_OPEN + body + GEMMA4_CALL_CLOSE + " after"
    for cuts in ([], [3, 9, 15, 21], list(range(len(text)))):
        content, calls = _feed_in_pieces(Gemma4ToolParser(), text, cuts)
        assert calls == [] and content == text


def test_gemma4_reads_keys_and_names_as_its_template_writes_them() -> None:
    text = (GEMMA4_CALL_OPEN + 'call:3d-render{first name:<|"|>Ann<|"|>,2fa:true,città:null,<|"|>a:b<|"|>:1}'
            + GEMMA4_CALL_CLOSE)
    content, calls = _feed_in_pieces(Gemma4ToolParser(), text, [])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("3d-render", {"first name": "Ann", "2fa": True, "città": None, "a:b": 1})]


def test_an_unterminated_gemma4_call_is_content_at_the_end() -> None:
    parser = Gemma4ToolParser()
    assert parser.feed("hi <|tool").content == "hi "
    assert parser.feed("_call>call:f{a:1").content == ""
    assert parser.finish().content == GEMMA4_CALL_OPEN + "call:f{a:1"
    parser = Gemma4ToolParser()
    assert parser.feed("x <|to").content == "x "
    assert parser.finish().content == "<|to"  # not a marker after all


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(_call, min_size=1, max_size=3), shape=st.sampled_from(["one", "list", "fence", "params"]),
       cuts=st.lists(st.integers(0, 300), max_size=8))
def test_json_calls_in_any_chunking(calls, shape, cuts) -> None:
    key = "parameters" if shape == "params" else "arguments"
    objects = [{"name": name, key: args} for name, args in calls]
    body = json.dumps(objects[0] if shape in ("one", "params") else objects)
    text = f"```json\n{body}\n```" if shape == "fence" else body
    content, parsed = _feed_in_pieces(JsonToolParser(), text, cuts)
    want = calls[:1] if shape in ("one", "params") else calls
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in parsed] == want


@pytest.mark.parametrize("text", ["plain words", "{not json", '{"x": 1}', '[{"name": 3}]', "```\nhello\n```",
                                  '{"name": "f", "arguments": "not json"}', '{"name": "f", "arguments": [1]}', "",
                                  '{"name": "Alice Smith", "email": "a@b.c", "age": 30}',  # an answer with a name
                                  '[{"name": "Paris"}, {"name": "Lyon"}]', '```json\n{"name": "Ann"}\n```'])
def test_json_text_that_is_not_a_call_is_content(text) -> None:
    for cuts in ([], list(range(len(text)))):
        content, calls = _feed_in_pieces(JsonToolParser(), text, cuts)
        assert calls == [] and content == text


def test_json_plain_text_streams_at_once() -> None:
    parser = JsonToolParser()
    assert parser.feed("  ").content == ""
    assert parser.feed("hello").content == "  hello"
    assert parser.feed(" there").content == " there"
    assert parser.finish().content == ""


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.tuples(_text, _text, st.booleans()), max_size=3), tail=_text,
       open_end=st.booleans(), cuts=st.lists(st.integers(0, 300), max_size=10))
def test_gemma4_reasoning_channel_in_any_chunking(parts, tail, open_end, cuts) -> None:
    from gemmaserve.tools.parsers import GEMMA4_CHANNEL_CLOSE, GEMMA4_CHANNEL_OPEN, Gemma4ReasoningParser

    text, want_reasoning, want_content = "", "", ""
    for before, thought, labelled in parts:
        before = before.replace("<|", "")  # content that cannot open a channel by accident
        thought = thought.replace("<", "")
        text += before + GEMMA4_CHANNEL_OPEN + ("thought\n" if labelled else "") + thought + GEMMA4_CHANNEL_CLOSE
        want_content += before
        want_reasoning += thought
    tail = tail.replace("<|", "")
    if open_end:
        text += GEMMA4_CHANNEL_OPEN + "thought\n" + tail.replace("<", "")
        want_reasoning += tail.replace("<", "")
    else:
        text += tail
        want_content += tail
    parser = Gemma4ReasoningParser()
    points = sorted({min(len(text), c) for c in cuts})
    reasoning = content = ""
    for a, b in zip([0, *points], [*points, len(text)]):
        r, c = parser.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    assert (reasoning + r, content + c) == (want_reasoning, want_content)


def test_a_label_only_reasoning_channel_is_empty_at_any_split() -> None:
    from gemmaserve.tools.parsers import Gemma4ReasoningParser

    text = "<|channel>thought<channel|>Hi"
    for cuts in [[], *([i] for i in range(len(text))), list(range(len(text)))]:
        parser = Gemma4ReasoningParser()
        points = sorted(set(cuts))
        pieces = [parser.feed(text[a:b]) for a, b in zip([0, *points], [*points, len(text)])]
        pieces.append(parser.finish())
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == ("", "Hi"), cuts


def _strict_json(text: str):
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@settings(max_examples=200, deadline=None)
@given(number=st.from_regex(r"-?(0|[1-9][0-9]{0,40})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,5})?", fullmatch=True))
def test_numbers_in_call_arguments_are_kept_as_written(number) -> None:
    """A number reaches ``arguments`` as the model wrote it: ``1e999`` became ``Infinity`` (not JSON: JavaScript's
    JSON.parse refuses it), ``-2.5e3`` became ``-2500.0``, and a 4,301-digit integer made the call content."""
    gemma = Gemma4ToolParser().feed(f"{GEMMA4_CALL_OPEN}call:f{{n:{number},m:[{number}]}}{GEMMA4_CALL_CLOSE}")
    assert gemma.calls[0].arguments == f'{{"n": {number}, "m": [{number}]}}'
    _strict_json(gemma.calls[0].arguments)
    parser = JsonToolParser()
    parser.feed(f'{{"name": "f", "arguments": {{"n": {number}}}}}')
    assert parser.finish().calls[0].arguments == f'{{"n": {number}}}'


def test_long_numbers_and_json_constants() -> None:
    digits = "7" * 4301  # beyond Python's int() limit for decimal text
    (call,) = Gemma4ToolParser().feed(f"{GEMMA4_CALL_OPEN}call:f{{n:{digits}}}{GEMMA4_CALL_CLOSE}").calls
    assert call.arguments == f'{{"n": {digits}}}'
    for constant in ("NaN", "Infinity", "-Infinity"):  # Python's json reads them; they are not JSON
        parser = JsonToolParser()
        text = f'{{"name": "f", "arguments": {{"n": {constant}}}}}'
        parser.feed(text)
        out = parser.finish()
        assert not out.calls and out.content == text


@pytest.mark.parametrize("depth", [300, 450, 700, 990, 5000])
def test_calls_nested_beyond_the_stack_stay_content(depth) -> None:
    """However deep the nesting, a call either parses or stays content: reading it back may recurse deeper than
    parsing did (depths of about 400-999 raised RecursionError out of the parsers, a 500 or a cut stream)."""
    deep = "[" * depth + "]" * depth
    gemma = Gemma4ToolParser().feed(f"{GEMMA4_CALL_OPEN}call:f{{a:{deep}}}{GEMMA4_CALL_CLOSE}")
    assert (len(gemma.calls) == 1 and not gemma.content) or (not gemma.calls and deep in gemma.content)
    parser = JsonToolParser()
    parser.feed(f'{{"name": "f", "arguments": {{"a": {deep}}}}}')
    out = parser.finish()
    assert (len(out.calls) == 1 and not out.content) or (not out.calls and deep in out.content)


def test_a_json_reply_starting_with_a_backtick_streams_once_it_is_no_fence() -> None:
    """One or two backticks may open a code fence; the next character decides (the whole reply was held to the end
    when it began with a backtick)."""
    parser = JsonToolParser()
    assert parser.feed("`").content == ""
    assert parser.feed("x").content == "`x"
    assert parser.feed("` is a variable").content == "` is a variable"
    assert parser.finish().content == ""
    fenced = JsonToolParser()
    text = '```json\n{"name": "f", "arguments": {"a": 1}}\n```'
    assert all(fenced.feed(char).content == "" for char in text)
    out = fenced.finish()
    assert out.content == "" and [(c.name, c.arguments) for c in out.calls] == [("f", '{"a": 1}')]
    short = JsonToolParser()
    assert short.feed("``").content == "" and short.finish().content == "``"


_OLD_FENCE = re.compile(r"^\s*```[a-zA-Z_]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)
"""The fence pattern the JSON parser used (backtracking: a minute on a fence holding 2,000 blank lines)."""


@settings(max_examples=400, deadline=None)
@given(text=st.lists(st.sampled_from(["```", "`", "json", "py_", " ", "\n", "\t", "{", "}", '"a"', "[1]", "x"]),
                     max_size=10).map("".join))
def test_the_linear_fence_reader_reads_what_the_old_pattern_read(text) -> None:
    """The JSON parser's fence reader takes the body a backtracking regex took (as JSON: the same value), in
    linear time; a fence holding thousands of blank lines is read at once."""
    from gemmaserve.tools.parsers import _unfenced

    old = _OLD_FENCE.match(text)
    expected = old.group(1) if old is not None else text
    assert _unfenced(text).strip() == expected.strip()
    parser = JsonToolParser()
    parser.feed("```" + "\n " * 20_000)
    assert parser.finish().content.startswith("```")  # no call, the text kept
