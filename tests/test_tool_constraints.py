"""``tool_choice`` required / named as a constraint, without a model: random walks through the constraint's allowed
tokens (any token it allows may be picked) always end in calls that parse, name an offered function and whose
arguments validate against its parameter schema (for the schema features the Gemma 4 grammar models)."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("tokenizers")

from gemmaserve.errors import InvalidRequestError  # noqa: E402
from gemmaserve.structured import GrammarCompiler  # noqa: E402
from gemmaserve.tools import (  # noqa: E402
    Gemma4ToolParser,
    JsonToolParser,
    strict_calls_constraint,
    tool_call_constraint,
)
from gemmaserve.tools.constraints import _JSON_OPENING  # noqa: E402


class _Vocabulary:
    """The tiny test tokenizer with Gemma 4's tool tokens, as the constraint compiler sees a tokenizer."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        from tiny_checkpoints import GEMMA4_TOOL_TOKENS, _train_tokenizer_json

        self.text = _train_tokenizer_json(tuple(GEMMA4_TOOL_TOKENS))
        self.tokenizer = Tokenizer.from_str(self.text)

    def tokenizer_json(self) -> str:
        return self.text


@pytest.fixture(scope="module")
def vocabulary() -> _Vocabulary:
    return _Vocabulary()


_leaf = st.one_of(
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "integer"}, {"type": "number"},
                     {"type": "string", "pattern": "^[a-z]{1,3}$"}, {"type": "string", "maxLength": 4},
                     {"type": "string", "pattern": "^\\d<\\$$"}, {"type": "string", "pattern": "x"},
                     {"type": "string", "minLength": 2}, {"type": "string", "pattern": "^[a-z]*$", "maxLength": 2}]),
    st.lists(st.sampled_from(["a", "b c", "x_y", 3, 4.5, True, None]), min_size=1, max_size=3, unique=True)
    .map(lambda values: {"enum": values}),
)
_keys = st.one_of(st.from_regex(r"[a-z]{1,5}", fullmatch=True),  # identifiers, and keys Gemma 4 cannot write bare
                  st.text(st.sampled_from('a Z9_$-.é:,{}[]<>|"'), min_size=1, max_size=6)
                  .filter(lambda key: '<|"|>' not in key))
_parameters = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda item: {"type": "array", "items": item}, inner),
    st.dictionaries(_keys, inner, min_size=1, max_size=3)
    .map(lambda props: {"type": "object", "properties": props, "additionalProperties": False}),
), max_leaves=5).filter(lambda schema: schema.get("type") == "object")


def _walk(vocabulary: _Vocabulary, constraint, seed: int) -> str:
    rng = random.Random(seed)
    tokens = []
    for _ in range(400):
        mask = constraint.allowed()
        allowed = [t for t in range(len(mask) * 8) if mask[t >> 3] >> (t & 7) & 1]
        token = rng.choice(allowed)
        tokens.append(token)
        if constraint.accept(token):
            break
    return vocabulary.tokenizer.decode(tokens, skip_special_tokens=False).replace("<eos>", "")


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                     HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(_parameters, min_size=1, max_size=3), parser=st.sampled_from(["gemma4", "json"]),
       named=st.booleans(), parallel=st.booleans(), seed=st.integers(0, 2**20),
       prefix=st.sampled_from(["fn_", "3d-", "auto", "required."]))
def test_forced_calls_parse_and_validate(vocabulary, schemas, parser, named, parallel, seed, prefix) -> None:
    tools = [{"name": f"{prefix}{i}", "parameters": schema} for i, schema in enumerate(schemas)]
    choice = tools[-1]["name"] if named else None
    compiler = GrammarCompiler(vocabulary, 512, [1])
    constraint = compiler.compile(tool_call_constraint(tools, choice, parser, parallel))
    text = _walk(vocabulary, constraint, seed)
    assume(constraint.is_complete)  # a walk through unbounded numbers or lists may not finish in 400 tokens
    reader = Gemma4ToolParser() if parser == "gemma4" else JsonToolParser()
    out = reader.feed(text)
    rest = reader.finish()
    calls = out.calls + rest.calls
    assert calls and not (out.content + rest.content).strip(), text
    if not (parallel and not named):
        assert len(calls) == 1
    offered = {tool["name"]: tool["parameters"] for tool in tools}
    for call in calls:
        assert call.name in offered and (not named or call.name == choice)
        jsonschema.validate(json.loads(call.arguments), offered[call.name])


@pytest.mark.parametrize("pattern", [r"(^\d{5}$)|(^\d{5}-\d{4}$)", r"(^[a-z]+$)", r"a$|^b", r"(?i)^abc$", r"\bword\b",
                                     r"^a|b$", r"^ab|cd$",
                                     r"[^]", r"\cJ", r"a\0", r"^(?!x)[a-z]+$", r"^[0-9]+\$$", r"a/b"])
def test_patterns_the_grammar_cannot_model_accept_any_string(vocabulary, pattern) -> None:
    """A JSON Schema pattern with anchors inside groups, zero-width escapes or syntax the constraint engine lacks
    does not make a forced call a 400: the value is then any string (documented), and the call still parses."""
    parameters = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    tools = [{"name": "f", "parameters": parameters}]
    compiler = GrammarCompiler(vocabulary, 512, [1])
    for seed in range(3):
        constraint = compiler.compile(tool_call_constraint(tools, "f", "gemma4", False))
        text = _walk(vocabulary, constraint, seed)
        if constraint.is_complete:
            reader = Gemma4ToolParser()
            calls = reader.feed(text).calls + reader.finish().calls
            assert [call.name for call in calls] == ["f"], text


def test_string_lengths_bind_with_one_bound_and_beside_a_pattern(vocabulary) -> None:
    """``minLength`` alone, ``maxLength`` alone and lengths beside a pattern are all kept (``minLength`` without
    ``maxLength`` was dropped, and a pattern dropped both: a forced call could give ``{"zone": ""}``)."""
    cases = [({"type": "string", "minLength": 4}, lambda v: len(v) >= 4),
             ({"type": "string", "maxLength": 2}, lambda v: len(v) <= 2),
             ({"type": "string", "pattern": "^[a-z]*$", "minLength": 3, "maxLength": 5},
              lambda v: 3 <= len(v) <= 5 and v.isalpha() and v.islower())]
    compiler = GrammarCompiler(vocabulary, 512, [1])
    for schema, check in cases:
        tools = [{"name": "f", "parameters": {"type": "object", "properties": {"z": schema}, "required": ["z"]}}]
        for seed in range(6):
            constraint = compiler.compile(tool_call_constraint(tools, "f", "gemma4", False))
            text = _walk(vocabulary, constraint, seed)
            if constraint.is_complete:
                reader = Gemma4ToolParser()
                (call,) = reader.feed(text).calls + reader.finish().calls
                value = json.loads(call.arguments)["z"]
                assert check(value), (schema, value)


def test_forced_strings_cannot_spell_a_marker_with_plain_tokens(vocabulary) -> None:
    """The parsers read markers out of the decoded text, so a string value may not spell one with ordinary tokens:
    the string marker, the call's closing marker, or the reasoning channel's (which would hide the call)."""
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}]
    compiler = GrammarCompiler(vocabulary, 512, [1])
    tokenizer = vocabulary.tokenizer
    for marker in ('<|"|>', "<tool_call|>", "<|channel>", "<channel|>"):
        constraint = compiler.compile(tool_call_constraint(tools, "f", "gemma4", False))
        for piece in ("<|tool_call>", "call:f{x:", '<|"|>', "a"):
            for token in tokenizer.encode(piece, add_special_tokens=False).ids:
                constraint.accept(token)
        refused = False
        for char in marker:  # one ordinary token per character
            (token,) = tokenizer.encode(char, add_special_tokens=False).ids
            mask = constraint.allowed()
            if not mask[token >> 3] >> (token & 7) & 1:
                refused = True
                break
            constraint.accept(token)
        assert refused, marker


def test_a_large_min_length_compiles(vocabulary) -> None:
    """A ``minLength`` beyond the constraint engine's lexer fuel (about a thousand counted repeats) is enforced as
    512 instead of refusing the request (it was a 400, "fuel exhausted")."""
    compiler = GrammarCompiler(vocabulary, 512, [1])
    for schema in ({"type": "string", "minLength": 5000}, {"type": "string", "minLength": 1000, "maxLength": 1100}):
        tools = [{"name": "f", "parameters": {"type": "object", "properties": {"z": schema}}}]
        assert compiler.compile(tool_call_constraint(tools, "f", "gemma4", False)) is not None


def test_only_constraints_that_force_special_token_text_use_the_python_tokenizer(vocabulary) -> None:
    """The vocabulary whose tokenizer writes special-token text with ordinary tokens calls Python from llguidance's
    threads, so ordinary constraints and the tool-call grammars (which name the markers as tokens and exclude them
    with a negated regex) keep the native one; text spelling a special token selects it."""
    from gemmaserve.structured import StructuredOutputs

    compiler = GrammarCompiler(vocabulary, 512, [1])
    native = compiler._vocabulary()
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "minLength": 2}}}}]
    ordinary = [tool_call_constraint(tools, name, parser, True) for name in (None, "f") for parser in ("gemma4", "json")]
    ordinary += [StructuredOutputs(json={"type": "object"}), StructuredOutputs(regex="[a-z]+<b"),
                 StructuredOutputs(grammar='root ::= [^"<] "x" # "<eos>"'),
                 StructuredOutputs(grammar='start: <eos> "a" ~/<eos>/')]
    for spec in ordinary:
        assert compiler._vocabulary_for(spec) is native, spec
    special = [StructuredOutputs(choice=["a<eos>"]), StructuredOutputs(regex="<tool_call\\|>"),
               StructuredOutputs(json={"type": "string", "pattern": "^<pad>$"}),
               StructuredOutputs(grammar='root ::= "x" "<|\\"|>"'), StructuredOutputs(grammar='start: "<eos>"')]
    for spec in special:
        assert compiler._vocabulary_for(spec) is not native, spec


@settings(max_examples=200, deadline=None)
@given(texts=st.sets(st.text(alphabet="<|>ab", min_size=1, max_size=5), min_size=1, max_size=12),
       probe=st.text(alphabet="<|>ab", max_size=8))
def test_the_special_token_trie_matches_exactly_its_texts(texts, probe) -> None:
    """The special tokens' pattern is a trie (a flat alternation of Gemma's 6,322 texts took 2.2 s to search a
    200 KB constraint): it matches exactly the texts, the longest one first."""
    import re

    from gemmaserve.structured.grammar import _trie_pattern

    pattern = re.compile(_trie_pattern(sorted(texts)))
    assert bool(pattern.fullmatch(probe)) == (probe in texts)
    for start in range(len(probe)):
        match = pattern.match(probe, start)
        longest = max((t for t in texts if probe.startswith(t, start)), key=len, default=None)
        assert (match.group(0) if match else None) == longest


def test_object_and_list_enum_values_are_enforced(vocabulary) -> None:
    """``const`` / ``enum`` entries that are objects or lists bind the value too (they were dropped: any value)."""
    options = [{"a": 1, "b c": ["x", None]}, [1, "y"], {}, "s"]
    schemas = [{"const": options[0]}, {"enum": options}]
    compiler = GrammarCompiler(vocabulary, 512, [1])
    for schema in schemas:
        tools = [{"name": "f", "parameters": {"type": "object", "properties": {"c": schema}, "required": ["c"]}}]
        for seed in range(4):
            constraint = compiler.compile(tool_call_constraint(tools, "f", "gemma4", False))
            text = _walk(vocabulary, constraint, seed)
            assert constraint.is_complete, text
            reader = Gemma4ToolParser()
            (call,) = reader.feed(text).calls + reader.finish().calls
            assert json.loads(call.arguments)["c"] in options[:1 if "const" in schema else None], text


@pytest.mark.parametrize("text", ['<|"|>', "<tool_call|>", "<|channel>", "a<channel|>b"])
def test_enum_values_and_keys_holding_a_marker_are_refused(text) -> None:
    for parameters in ({"type": "object", "properties": {"c": {"enum": ["ok", text]}}},
                       {"type": "object", "properties": {"c": {"const": {"k": [text]}}}},
                       {"type": "object", "properties": {text: {"type": "string"}}}):
        with pytest.raises(InvalidRequestError, match="cannot write inside a string"):
            tool_call_constraint([{"name": "f", "parameters": parameters}], "f", "gemma4", False)


@pytest.mark.parametrize("parameters", [{"properties": {"a": {"type": "string"}}}, {"type": ["object", "null"]}, {}])
def test_json_forced_arguments_are_an_object_without_type_object(vocabulary, parameters) -> None:
    """A parameters schema that does not say ``"type": "object"`` still forces an object (the json parser takes
    nothing else as arguments: a number or a list made the forced reply content)."""
    compiler = GrammarCompiler(vocabulary, 512, [1])
    done = 0
    for seed in range(6):
        constraint = compiler.compile(tool_call_constraint([{"name": "f", "parameters": parameters}], None, "json",
                                                           False))
        text = _walk(vocabulary, constraint, seed)
        if constraint.is_complete:
            done += 1
            reader = JsonToolParser()
            out = reader.feed(text)
            rest = reader.finish()
            assert [call.name for call in out.calls + rest.calls] == ["f"], text
    assert done


def _accepts(compiler, tools, text: str, vocabulary) -> bool:
    """Whether a forced call to ``tools[0]`` may be written as ``text`` (token by token through its mask)."""
    return _walk_accepts(compiler, tool_call_constraint(tools, tools[0]["name"], "gemma4", False), text,
                         vocabulary.tokenizer.encode(text, add_special_tokens=False).ids)


def test_forced_gemma4_calls_write_keys_as_the_template_does_and_leave_optional_ones_out(vocabulary) -> None:
    """A forced Gemma 4 call writes its keys in the chat template's order (``dictsort``: sorted, ignoring case)
    and only the ``required`` properties must appear (an optional one was forced, so the model had to invent a
    value); free-form objects take keys such as ``Content-Type`` (only identifiers were allowed)."""
    compiler = GrammarCompiler(vocabulary, 512, [1])
    weather = [{"name": "w", "parameters": {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string"}, "Limit": {"type": "integer"}, "headers": {"type": "object"}}}}]
    call = '<|tool_call>call:w{{{}}}<tool_call|>'
    assert _accepts(compiler, weather, call.format('query:<|"|>x<|"|>'), vocabulary)
    assert _accepts(compiler, weather, call.format('Limit:3,query:<|"|>x<|"|>'), vocabulary)
    assert _accepts(compiler, weather, call.format('headers:{Content-Type:<|"|>json<|"|>},query:<|"|>x<|"|>'),
                    vocabulary)
    assert not _accepts(compiler, weather, call.format('query:<|"|>x<|"|>,Limit:3'), vocabulary)  # order
    assert not _accepts(compiler, weather, call.format('Limit:3}'), vocabulary)  # the required one missing
    loose = [{"name": "w", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "integer"}}}}]
    for body in ("", "a:1", "b:2", "a:1,b:2"):
        assert _accepts(compiler, loose, call.format(body), vocabulary), body


def test_the_gemma4_parser_reads_python_literals_the_template_writes() -> None:
    """Gemma 4's chat template prints a null argument back into the history as ``None`` (``{{ argument }}``);
    a model that repeats it gets its call parsed instead of the whole block left as text."""
    reader = Gemma4ToolParser()
    (call,) = reader.feed('<|tool_call>call:f{x:None,y:True,z:False}<tool_call|>').calls + reader.finish().calls
    assert json.loads(call.arguments) == {"x": None, "y": True, "z": False}


class _EncodingVocabulary(_Vocabulary):
    """The test tokenizer with ``encode`` too (a trigger's token id is looked up with it)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.fixture(scope="module")
def encoding_vocabulary() -> _EncodingVocabulary:
    return _EncodingVocabulary()


def _assert_strict_calls_valid(calls, tools) -> None:
    """Every call names an offered function, its arguments an object, valid under the parameters if strict."""
    offered = {tool["name"]: tool for tool in tools}
    for call in calls:
        assert call.name in offered
        arguments = json.loads(call.arguments)
        assert isinstance(arguments, dict)
        if offered[call.name]["strict"]:
            jsonschema.validate(arguments, offered[call.name]["parameters"])


def _allowed_ids(mask) -> list[int]:
    return [t for t in range(len(mask) * 8) if mask[t >> 3] >> (t & 7) & 1]


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                     HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(_parameters, min_size=1, max_size=3), strict=st.lists(st.booleans(), min_size=3, max_size=3),
       seed=st.integers(0, 2**20))
def test_strict_tools_under_auto_hold_every_call_and_leave_text_free(encoding_vocabulary, schemas, strict,
                                                                      seed) -> None:
    """``strict: true`` under ``tool_choice: "auto"``: a walk through the triggered constraint's masks (free text,
    where every token is allowed, and calls opened by ``<|tool_call>``) gives text whose every call names an
    offered function, with arguments valid under the parameters of the strict ones; free steps allow the whole
    vocabulary and the constraint never ends the output."""

    vocabulary = encoding_vocabulary
    tools = [{"name": f"fn{i}", "parameters": schema, "strict": flag} for i, (schema, flag) in
             enumerate(zip(schemas, strict))]
    spec = strict_calls_constraint(tools, "gemma4")
    if not any(strict[:len(schemas)]):
        assert spec is None
        return
    compiler = GrammarCompiler(vocabulary, 512, [1])
    constraint = compiler.compile(spec)
    opener = vocabulary.encode("<|tool_call>", add_special_tokens=False)[0]
    closing = {vocabulary.encode(text, add_special_tokens=False)[-1] for text in ("<tool_call|>", '<|"|>', "}", "]")}
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < 150 or constraint.is_triggered and len(tokens) < 600:
        allowed = _allowed_ids(constraint.allowed())
        if not constraint.is_triggered:
            assert allowed == list(range(512))
            token = opener if rng.random() < 0.2 else rng.choice([t for t in allowed if t not in (1, opener)])
        else:  # any allowed token, but an allowed closing one half the time (calls end within the walk)
            ends = [t for t in allowed if t in closing]
            token = rng.choice(ends if ends and rng.random() < 0.5 else allowed)
        tokens.append(token)
        assert constraint.accept(token) is False
    if constraint.is_triggered:  # a call the walk did not finish is not checked
        tokens = tokens[:len(tokens) - tokens[::-1].index(opener) - 1]
    assume(opener in tokens)  # a walk whose only call ran past its end checks nothing
    text = vocabulary.tokenizer.decode(tokens, skip_special_tokens=False)
    reader = Gemma4ToolParser()
    out = reader.feed(text)
    calls = out.calls + reader.finish().calls
    assert len(calls) == tokens.count(opener)
    _assert_strict_calls_valid(calls, tools)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                     HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**20), steps=st.integers(1, 80))
def test_a_triggered_constraint_rolls_back_and_copies_like_a_replay(encoding_vocabulary, seed, steps) -> None:
    """Advancing (also by rejected tokens, which change nothing), rolling one token back and copying leave the
    triggered constraint where replaying the kept tokens on a fresh one leaves it: the same mask, the same
    phase; a batch of masks (free, triggered and ordinary constraints together) equals each one's own mask."""
    from gemmaserve.structured.grammar import start_masks

    vocabulary = encoding_vocabulary
    tools = [{"name": "f", "strict": True, "parameters": {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}}}]
    spec = strict_calls_constraint(tools, "gemma4")
    compiler = GrammarCompiler(vocabulary, 512, [1])
    constraint = compiler.compile(spec)
    opener = vocabulary.encode("<|tool_call>", add_special_tokens=False)[0]
    rng = random.Random(seed)
    kept: list[int] = []
    for _ in range(steps):
        allowed = _allowed_ids(constraint.allowed())
        token = opener if not constraint.is_triggered and rng.random() < 0.4 else rng.choice(allowed)
        if rng.random() < 0.15:
            token = rng.randrange(512)  # perhaps rejected: then nothing changes
        result = constraint.advance_if_valid(token)
        if isinstance(result, Exception):
            assert constraint.is_triggered and token not in allowed
            continue
        assert result is False
        if rng.random() < 0.25:
            if rng.random() < 0.5:  # a copy undoes what the original would
                constraint = constraint.copy()
            constraint.rollback()
        else:
            kept.append(token)
        replay = compiler.compile(spec)
        for kept_token in kept:
            replay.accept(kept_token)
        assert replay.is_triggered == constraint.is_triggered
        assert bytes(replay.allowed()) == bytes(constraint.allowed())
        twin = constraint.copy()
        assert bytes(twin.allowed()) == bytes(constraint.allowed())
    plain = compiler.compile(tool_call_constraint(tools, "f", "gemma4", False))
    free = compiler.compile(spec)
    rows = [constraint, free, plain, constraint.copy()]
    expected = [bytes(row.allowed()) for row in rows]
    for overlap in (False, True):
        assert [bytes(view) for view in start_masks(rows, overlap=overlap).result()] == expected


def test_a_trigger_must_be_one_token_the_grammar_begins_with(encoding_vocabulary) -> None:
    """A trigger that is not one token, or that the grammar does not begin with, is refused when compiled; tools
    without strict put no constraint under auto, whatever the parser."""
    from gemmaserve.structured import StructuredOutputs

    for parser in ("json", "gemma4"):
        assert strict_calls_constraint([{"name": "f", "strict": False}, {"name": "g"}], parser) is None
    compiler = GrammarCompiler(encoding_vocabulary, 512, [1])
    with pytest.raises(InvalidRequestError, match="exactly one token"):
        compiler.compile(StructuredOutputs(regex="ab+", trigger="abcdefgh zzz"))
    with pytest.raises(InvalidRequestError, match="must begin with its trigger"):
        compiler.compile(StructuredOutputs(regex="ab+", trigger="<|tool_call>"))
    with pytest.raises(InvalidRequestError, match="trigger must be"):
        StructuredOutputs(regex="ab+", trigger="")


def _walk_accepts(compiler, spec, text: str, vocabulary) -> bool:
    """Whether ``text`` can be written token by token through ``spec``'s masks (``vocabulary``: a tokenizer with
    ``encode``, or the text's token ids)."""
    constraint = compiler.compile(spec)
    tokens = vocabulary if isinstance(vocabulary, list) else vocabulary.encode(text, add_special_tokens=False)
    for token in tokens:
        mask = constraint.allowed()
        if not mask[token >> 3] >> (token & 7) & 1:
            return False
        constraint.accept(token)
    return True


def test_json_forced_calls_keep_the_parameters_references(encoding_vocabulary) -> None:
    """Parameters with ``$defs`` / ``definitions`` and ``$ref`` s (pydantic writes them; ``#`` recurses) keep
    their meaning inside the call's schema: the call of one, of several tools, and the parallel list."""
    vocabulary = encoding_vocabulary
    compiler = GrammarCompiler(vocabulary, 512, [1])
    tree = {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}}, "required": ["u"], "properties": {
        "u": {"$ref": "#/$defs/Unit"}, "kids": {"type": "array", "items": {"$ref": "#"}}}}
    other = {"type": "object", "definitions": {"a/b": {"type": "integer"}}, "required": ["x"],
             "properties": {"x": {"$ref": "#/definitions/a~1b"}}}
    tools = [{"name": "tree", "parameters": tree}, {"name": "other", "parameters": other}]
    good = '{"name":"tree","arguments":{"u":"c","kids":[{"u":"f","kids":[]}]}}'
    bad = '{"name":"tree","arguments":{"u":"c","kids":[{"name":"tree"}]}}'  # the wrapper's shape, not the tree's
    for name, parallel in ((None, True), (None, False), ("tree", False)):
        spec = tool_call_constraint(tools, name, "json", parallel)
        wrap = (lambda text: f"[{text}]") if parallel and name is None else (lambda text: text)
        assert _walk_accepts(compiler, spec, wrap(good), vocabulary), (name, parallel)
        assert not _walk_accepts(compiler, spec, wrap(bad), vocabulary), (name, parallel)
        if name is None:
            assert _walk_accepts(compiler, spec, wrap('{"name":"other","arguments":{"x":3}}'), vocabulary)
            assert not _walk_accepts(compiler, spec, wrap('{"name":"other","arguments":{"x":"3"}}'), vocabulary)


def test_gemma4_calls_hold_required_names_and_closed_empty_objects(encoding_vocabulary) -> None:
    """A required property without a schema of its own must still be written (any value); no properties and
    ``additionalProperties: false`` (OpenAI's strict function without parameters) is ``{}`` only; forced and
    under strict auto alike."""
    vocabulary = encoding_vocabulary
    compiler = GrammarCompiler(vocabulary, 512, [1])
    call = "<|tool_call>call:f{{{}}}<tool_call|>"
    cases = [({"type": "object", "properties": {}, "additionalProperties": False}, ["", ], ["x:1"]),
             ({"type": "object", "required": ["city"]}, ["city:1", 'city:<|"|>a<|"|>'], ["", "x:1"]),
             ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, ["a:1,b:2", "b:2"],
              ["", "a:1"])]
    for parameters, accepted, refused in cases:
        tools = [{"name": "f", "parameters": parameters, "strict": True}]
        for spec in (tool_call_constraint(tools, "f", "gemma4", False), strict_calls_constraint(tools, "gemma4")):
            for body in accepted:
                assert _walk_accepts(compiler, spec, call.format(body), vocabulary), (parameters, body)
            for body in refused:
                assert not _walk_accepts(compiler, spec, call.format(body), vocabulary), (parameters, body)


def test_a_key_ending_in_a_separator_control_character_is_read_as_written() -> None:
    """The grammar's bare keys end at Rust's ``\\s`` (which has no U+001C..U+001F); the parser strips only the blanks
    it skips, so such a key reaches the arguments as the model wrote it."""
    parser = Gemma4ToolParser()
    calls = parser.feed("<|tool_call>call:f{o:{a\x1c:1}}<tool_call|>").calls + parser.finish().calls
    assert json.loads(calls[0].arguments) == {"o": {"a\x1c": 1}}


_WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
            "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]}}}


def test_strict_tools_under_auto_with_the_json_parser_hold_whole_replies(encoding_vocabulary) -> None:
    """The json parser reads a reply opening (after JSON blanks) with ``{``, a list of objects or a code fence
    around either as calls, so strict tools under auto hold such a reply to one call (a list only with parallel
    calls) of the strict schema, any object for a non-strict function; any other reply is free once its opening
    rules calls out (code fences, ``[1]``, a Unicode space first: text to the parser too)."""
    vocabulary = encoding_vocabulary
    compiler = GrammarCompiler(vocabulary, 512, [1])
    tools = [{"name": "weather", "strict": True, "parameters": _WEATHER},
             {"name": "clock", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}]
    call = '{"name":"weather","arguments":{"city":"Oslo","unit":"c"}}'
    free = '{"name":"clock","arguments":{"anything":[1,{"b":null}]}}'
    for parallel in (True, False):
        spec = strict_calls_constraint(tools, "json", parallel)
        accepted = ["It is sunny in Oslo.", "", "  ", "`x` is a name", "``y``", "\n\tok { then } [x]", call,
                    "\n " + call, free, f"```json\n{call}\n```", f"\n\n```\n{free}\n```", f"```json{call}```",
                    "```\nplain fenced text\n```", "```python\nprint([1])\n```", " [1,2]", "[[1]]",
                    "\u00a0" + call, "\u2028```json\n{}\n```"]
        refused = ['{"answer":4}', '{"name":"weather","arguments":{"city":"Stockholm"}}',
                   '{"name":"weather","arguments":{"town":"Oslo"}}', '{"name":"nope","arguments":{}}',
                   '{"name":"weather","arguments":{"city":"Oslo"}} more', '{ "name":"clock","arguments":{}}',
                   f"[ {call}]", f"```\n[\n{call}]\n```", f"```json\n{call}\n``` and more"]
        if parallel:
            accepted += [f"[{call},{free}]", f"```json\n[{call}]\n```", f"  [{free}]"]
        else:
            refused += [f"[{call}]", f"```json\n[{call}]\n```"]
        for text in accepted:
            assert _walk_accepts(compiler, spec, text, vocabulary), (parallel, text)
            reader = JsonToolParser()
            got = reader.feed(text).calls + reader.finish().calls
            assert bool(got) == text.lstrip(" \t\r\n").startswith(("{", "[{", "```json\n{", "```json{",
                                                                       "```\n{", "```json\n[")), (parallel, text)
        for text in refused:
            assert not _walk_accepts(compiler, spec, text, vocabulary), (parallel, text)
        done = compiler.compile(spec)  # a call ends the reply
        for token in vocabulary.encode(call, add_special_tokens=False):
            done.accept(token)
        assert done.is_complete


def test_json_strict_replies_decide_early_and_then_leave_text_free(encoding_vocabulary) -> None:
    """Before the opening is decided, special tokens the text does not show may come (an end-of-turn ends an
    empty reply) and are not text; once text rules calls out every token is allowed; advances roll back."""
    vocabulary = encoding_vocabulary
    compiler = GrammarCompiler(vocabulary, 512, [1])
    spec = strict_calls_constraint([{"name": "f", "strict": True, "parameters": _WEATHER}], "json", True)
    constraint = compiler.compile(spec)
    hidden = [t for t in _allowed_ids(constraint.allowed()) if not vocabulary.tokenizer.decode([t])]
    assert 1 in hidden and vocabulary.encode("<|tool_call>", add_special_tokens=False)[0] in hidden
    for token in hidden[:3]:
        assert constraint.accept(token) is False and constraint.phase == "open"
    for token in vocabulary.encode("  ", add_special_tokens=False):
        constraint.accept(token)
    assert constraint.phase == "open"
    twin = constraint.copy()
    for token in vocabulary.encode("ok", add_special_tokens=False):
        constraint.accept(token)
    assert constraint.phase == "free" and _allowed_ids(constraint.allowed()) == list(range(512))
    for _ in vocabulary.encode("ok", add_special_tokens=False):
        constraint.rollback()
    assert constraint.phase == "open"
    assert bytes(constraint.allowed()) == bytes(twin.allowed())
    token = vocabulary.encode("{", add_special_tokens=False)[0]
    assert twin.accept(token) is False and twin.phase == "held"
    assert not set(hidden) & set(_allowed_ids(twin.allowed()))  # inside a call, only the call's tokens
    twin.rollback()
    assert twin.phase == "open"
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                     HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(_parameters, min_size=1, max_size=3), strict=st.lists(st.booleans(), min_size=3, max_size=3),
       parallel=st.booleans(), opening=st.sampled_from(["{", "[{", "```json\n", " \n{", "\n```\n[{", "", "`", "x", "```py\n", "[1"]),
       seed=st.integers(0, 2**20))
def test_json_strict_replies_are_text_or_valid_calls(encoding_vocabulary, schemas, strict, parallel, opening,
                                                     seed) -> None:
    """A walk through the json parser's strict-under-auto constraint (any allowed token, after an opening the walk
    tries to write first) ends in a reply the parser reads either as text that does not open like calls, or as
    calls (one unless ``parallel``) of offered functions whose strict ones' arguments validate."""
    assume(any(strict[:len(schemas)]))
    vocabulary = encoding_vocabulary
    tools = [{"name": f"fn{i}", "parameters": schema, "strict": flag} for i, (schema, flag) in
             enumerate(zip(schemas, strict))]
    constraint = GrammarCompiler(vocabulary, 512, [1]).compile(strict_calls_constraint(tools, "json", parallel))
    rng = random.Random(seed)
    tokens: list[int] = []
    planned = vocabulary.encode(opening, add_special_tokens=False) if opening else []
    ended = False
    for step in range(400):
        allowed = _allowed_ids(constraint.allowed())
        if step < len(planned) and planned[step] in allowed:
            token = planned[step]
        else:  # EOS now and then where it is allowed (free text would rarely end otherwise)
            token = 1 if 1 in allowed and rng.random() < 0.05 else rng.choice(allowed)
        if token == 1:
            ended = True
            break
        tokens.append(token)
        if constraint.accept(token):
            ended = True
            break
    assume(ended)  # a walk through unbounded text, numbers or lists may not end in 400 tokens
    text = vocabulary.tokenizer.decode(tokens, skip_special_tokens=True)  # what the server shows the json parser
    reader = JsonToolParser()
    out = reader.feed(text)
    rest = reader.finish()
    calls = out.calls + rest.calls
    opened = re.match(_JSON_OPENING, text) is not None  # a reply the parser may read as calls
    assert bool(calls) == opened, text
    if not opened:
        assert out.content + rest.content == text
        return
    assert not (out.content + rest.content).strip(), text
    assert parallel or len(calls) == 1
    _assert_strict_calls_valid(calls, tools)


def test_two_functions_of_one_name_are_refused_when_calls_are_held() -> None:
    """A strict function and a free one of the same name would let any arguments through under the strict name:
    forced and strict calls refuse repeated names (either parser); tools without strict under auto do not care."""
    tools = [{"name": "delete", "strict": True, "parameters": _WEATHER}, {"name": "delete", "parameters": {}}]
    for parser in ("json", "gemma4"):
        with pytest.raises(InvalidRequestError, match="'delete' more than once"):
            strict_calls_constraint(tools, parser)
        with pytest.raises(InvalidRequestError, match="'delete' more than once"):
            tool_call_constraint(tools, None, parser, True)
        assert strict_calls_constraint([{**tool, "strict": False} for tool in tools], parser) is None


def test_percent_encoded_references_and_a_root_id_survive_the_rebase(encoding_vocabulary) -> None:
    """A reference written percent-encoded (``#/$defs/sp%20ace``) and parameters carrying a root ``$id`` compile
    inside the call's schema and keep their meaning (both were 400s once moved)."""
    vocabulary = encoding_vocabulary
    compiler = GrammarCompiler(vocabulary, 512, [1])
    spaced = {"type": "object", "required": ["u"], "$defs": {"sp ace": {"enum": ["c", "f"]}},
              "properties": {"u": {"$ref": "#/$defs/sp%20ace"}}}
    based = {**spaced, "$id": "https://example.com/weather.json", "properties": {"u": {"$ref": "#/$defs/sp ace"}}}
    for parameters in (spaced, based):
        tools = [{"name": "f", "strict": True, "parameters": parameters}]
        for spec in (tool_call_constraint(tools, "f", "json", False), strict_calls_constraint(tools, "json")):
            assert _walk_accepts(compiler, spec, '{"name":"f","arguments":{"u":"c"}}', vocabulary)
            assert not _walk_accepts(compiler, spec, '{"name":"f","arguments":{"u":"x"}}', vocabulary)


def test_a_repeated_key_however_escaped_is_never_an_unchecked_call(encoding_vocabulary) -> None:
    """llguidance's JSON lets an extra key spelled with an escape (``"cit\\u0079"``) through where ``city`` is
    declared; a JSON reader keeps the last, which no schema check saw. The json parser reads an object that repeats
    a key as text, so such a reply is never a call."""
    reply = '{"name":"weather","arguments":{"city":"Oslo","cit\\u0079":"Stockholm"}}'
    reader = JsonToolParser()
    out = reader.feed(reply)
    rest = reader.finish()
    assert not out.calls + rest.calls and out.content + rest.content == reply
    reader = JsonToolParser()
    assert reader.feed('{"name":"weather","arguments":{"city":"Oslo"}}').calls + reader.finish().calls


def test_a_refused_token_is_a_constraint_error_for_the_opening_constraint(encoding_vocabulary) -> None:
    """A token the opening constraint refuses (bad_words or logit_bias outside its mask) comes back as a
    ConstraintError, as for any constraint (it recursed without end and failed the whole batch); the constraint is
    left where it was."""
    from gemmaserve.structured import ConstraintError

    vocabulary = encoding_vocabulary
    compiler = GrammarCompiler(vocabulary, 512, [1])
    constraint = compiler.compile(strict_calls_constraint([{"name": "f", "strict": True, "parameters": _WEATHER}],
                                                          "json"))
    constraint.accept(vocabulary.encode("{", add_special_tokens=False)[0])
    refused = next(t for t in range(512) if t not in _allowed_ids(constraint.allowed()))
    before = bytes(constraint.allowed())
    assert isinstance(constraint.advance_if_valid(refused), ConstraintError)
    with pytest.raises(ConstraintError):
        constraint.accept(refused)
    assert bytes(constraint.allowed()) == before and constraint.phase == "held"
