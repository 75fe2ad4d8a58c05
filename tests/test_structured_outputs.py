"""Structured output end to end: with a tiny random model the constraint is the only thing that can produce
valid output, so every output validating is the test. JSON schemas (hypothesis-generated), regex, choice and
grammar constraints; every backend (custom-cpu, hf, mlx) gives the same seeded text; a constrained request's
tokens do not change when other requests share its batch; the spec's validation; unsatisfiable constraints
end with an error, never a hang."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaserve.engine.request import FinishReason
from gemmaserve.errors import InvalidRequestError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.structured import StructuredOutputs, from_response_format

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")


# -- the spec -----------------------------------------------------------------------------------------------
def test_spec_takes_exactly_one_constraint_and_names_what_is_wrong() -> None:
    assert StructuredOutputs(regex="a+").kind == "regex"
    assert StructuredOutputs(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")
    # property order is part of a schema (the output writes them in it): schemas that differ in it compile apart
    assert StructuredOutputs(json={"b": 1, "a": 2}).key != StructuredOutputs(json={"a": 2, "b": 1}).key
    assert StructuredOutputs(json={"b": 1, "a": 2}).key == StructuredOutputs(json='{"b": 1, "a": 2}').key
    with pytest.raises(InvalidRequestError, match="false, which no output satisfies"):
        StructuredOutputs(json=False)
    for kwargs, words in [({}, "exactly one"), ({"regex": "a", "choice": ["x"]}, "regex, choice"),
                          ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "schema object"),
                          ({"choice": []}, "1 to"), ({"choice": "ab"}, "list of strings"),
                          ({"choice": ["", "x"]}, "non-empty"), ({"regex": ""}, "non-empty"),
                          ({"grammar": "x" * (256 * 1024 + 1)}, "at most")]:
        with pytest.raises(InvalidRequestError, match=words):
            StructuredOutputs(**kwargs)
    with pytest.raises(InvalidRequestError, match="structural_tag is not supported"):
        StructuredOutputs.from_mapping({"structural_tag": {"x": 1}})
    with pytest.raises(InvalidRequestError, match="yaml is not a known field"):
        StructuredOutputs.from_mapping({"yaml": "x"})
    assert StructuredOutputs.from_mapping({"regex": "a", "disable_any_whitespace": True}).regex == "a"


def test_a_schema_nested_too_deeply_is_refused_by_name() -> None:
    """JSON text nested beyond Python's stack raised RecursionError (HTTP 500 through ``structured_outputs.json`` /
    ``guided_json``, which arrive as text and so pass the request body's own checks)."""
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(InvalidRequestError, match="structured_outputs.json is nested too deeply"):
        StructuredOutputs(json=deep)
    circular: dict = {"type": "object"}
    circular["properties"] = {"self": circular}
    with pytest.raises(InvalidRequestError, match="structured_outputs.json cannot be written as JSON"):
        StructuredOutputs(json=circular)


def test_response_format_maps_onto_the_spec() -> None:
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputs(json_object=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert got == StructuredOutputs(json=schema)
    for bad, words in [({"type": "yaml"}, "not supported"), ({"type": "json_schema"}, "needs a"),
                       ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs a \"schema\""), ("x", "object")]:
        with pytest.raises(InvalidRequestError, match=words):
            from_response_format(bad)  # type: ignore[arg-type]


# -- generation ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny_gemma4

    return build_tiny_gemma4(tmp_path_factory.mktemp("structured") / "ckpt")


@pytest.fixture(scope="module")
def llm(checkpoint):
    from gemmaserve import LLM

    engine = LLM(str(checkpoint), backend="custom-cpu", device="cpu", dtype="float32", max_batch_size=8)
    yield engine
    engine.close()


_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 5000)),
    st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
              st.integers(-10, 10), st.integers(1, 100)),
    st.lists(st.text(alphabet="abcxyz ", min_size=1, max_size=5), min_size=1, max_size=4, unique=True)
    .map(lambda values: {"enum": values}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"const": "fixed"}]),
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 6)),
    st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,4}$"}, {"type": "string", "pattern": "^[0-9]{2}-[ab]$"},
                     {"type": "string", "format": "date"}]),
)
_schemas = st.recursive(_leaf, lambda children: st.one_of(
    st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
              children, st.integers(0, 2), st.integers(0, 2)),
    st.builds(lambda props, optional: {"type": "object", "properties": props, "additionalProperties": False,
                                       "required": sorted(props)[optional:]},
              st.dictionaries(st.text(alphabet="abcdefgh_", min_size=1, max_size=6), children, min_size=1, max_size=4),
              st.integers(0, 1)),
), max_leaves=8)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                     HealthCheck.function_scoped_fixture])
@given(schema=_schemas, seed=st.integers(0, 2**32))
def test_every_output_validates_against_its_schema(llm, schema, seed) -> None:
    params = [SamplingParams(max_tokens=512, temperature=temperature, seed=seed + i,
                             structured_outputs=StructuredOutputs(json=schema))
              for i, temperature in enumerate((1.0, 1.0, 0.0))]
    for out in llm.generate([[5, 6, 7, 8]] * len(params), params):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert not re.search(r"\s{2,}", out.text.replace(" ", "")), out.text  # no runaway whitespace


def test_regex_choice_grammar_and_json_object(llm) -> None:
    specs = [
        (StructuredOutputs(regex=r"[a-c]{3}-[0-9]{1,4}"), lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{1,4}", t)),
        (StructuredOutputs(choice=["alpha", "beta gamma", "δ"]), lambda t: t in ("alpha", "beta gamma", "δ")),
        (StructuredOutputs(grammar='root ::= "yes" | "no" | ("n" [0-9] [0-9]?)'),
         lambda t: re.fullmatch(r"yes|no|n[0-9][0-9]?", t)),
        (StructuredOutputs(grammar='start: "x" NUMBER\nNUMBER: /[0-9]{2}/'), lambda t: re.fullmatch(r"x[0-9]{2}", t)),
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for spec, check in specs:
        for seed in range(3):
            out = llm.generate([[9, 10, 11]], SamplingParams(max_tokens=300, temperature=1.0, seed=seed,
                                                              structured_outputs=spec))[0]
            assert out.finish_reason == "stop" and check(out.text), (spec, out.text)


def test_forced_text_spelling_a_special_token_is_written_as_text(llm, checkpoint) -> None:
    """A constraint that forces the characters of a special token (``<eos>``, ``<bos>``, ``<pad>``) writes them with
    ordinary tokens: llguidance tokenized such forced bytes as the special token, which its parser then refused, and
    the request ended with a ConstraintError (choice, regex, enum and grammar alike)."""
    from transformers import AutoTokenizer

    specials = set(AutoTokenizer.from_pretrained(checkpoint).all_special_ids)
    for spec, text in [({"choice": ["<eos>"]}, "<eos>"), ({"regex": "<bos>"}, "<bos>"),
                       ({"json": {"enum": ["<bos>"]}}, '"<bos>"'), ({"grammar": 'root ::= "<eos>"'}, "<eos>"),
                       ({"choice": ["x<pad>y"]}, "x<pad>y")]:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, structured_outputs=spec))[0]
        assert out.finish_reason == "stop" and out.text == text, (spec, out.text, out.finish_reason)
        assert not specials & set(out.token_ids[:-1]), out.token_ids  # all but the closing EOS are ordinary


def test_a_constrained_request_does_not_depend_on_its_batch(llm) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
              "required": ["n", "s"], "additionalProperties": False}
    constrained = SamplingParams(max_tokens=80, temperature=0.9, seed=42, structured_outputs={"json": schema})
    alone = llm.generate([[5, 6, 7]], constrained)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=1.0, seed=n, ignore_eos=True) for n in (3, 30, 9)]
    together = llm.generate([[8, 9], [5, 6, 7], [4, 4, 4, 4], [12]], [others[0], constrained, *others[1:]])
    assert together[1].token_ids == alone


def test_bad_constraints_are_refused_before_running(llm) -> None:
    for spec, words in [({"json": {"type": "objectx"}}, "json is invalid"), ({"regex": "a(b"}, "regex is invalid"),
                        ({"grammar": "root ::= ("}, "grammar is invalid")]:
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate([[5, 6]], SamplingParams(max_tokens=4, structured_outputs=spec))


def test_every_backend_gives_the_same_constrained_text(checkpoint) -> None:
    from gemmaserve import LLM

    backends = ["custom-cpu", "hf"]
    try:
        import gemmaserve_mlx  # noqa: F401
        backends.append("mlx")
    except ImportError:
        pass
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "y"]}, "c": {"type": "array", "maxItems": 2,
                                                                                "items": {"type": "boolean"}}},
              "required": ["a", "b", "c"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, structured_outputs={"json": schema})
              for t, s in ((1.0, 1), (0.7, 2), (0.0, 3))]
    params.append(SamplingParams(max_tokens=30, temperature=1.0, seed=4, structured_outputs={"regex": "[a-z]{2,5}!"}))
    runs = {}
    for name in backends:
        engine = LLM(str(checkpoint), backend=name, device="cpu", dtype="float32", max_batch_size=4)
        try:
            runs[name] = [out.text for out in engine.generate([[5, 6, 7, 8]] * len(params), params)]
        finally:
            engine.close()
    for name in backends[1:]:
        assert runs[name] == runs["custom-cpu"], name
    for text in runs["custom-cpu"][:3]:
        jsonschema.validate(json.loads(text), schema)


def test_a_constraint_no_token_can_follow_ends_with_an_error() -> None:
    """The reference backend's vocabulary has no upper-case letters: a regex that needs one can never start.
    The request fails with a clear error; the unconstrained request beside it completes."""
    from gemmaserve.engine.engine import Engine
    from gemmaserve.settings import CoreSettings
    from gemmaserve.testing.reference_backend import ReferenceBackend

    engine = Engine(ReferenceBackend(vocab_size=64), CoreSettings(device="cpu"))
    try:
        stuck = engine.submit([5, 6, 7], SamplingParams(max_tokens=8, structured_outputs={"regex": "[A-Z]+"}))
        fine = engine.submit([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
        failed, done = stuck.result(timeout=60), fine.result(timeout=60)
    finally:
        engine.shutdown(timeout=10)
    assert failed.finish_reason == FinishReason.ERROR and "no token can continue" in (failed.error or "")
    assert failed.token_ids == [] and done.finish_reason == FinishReason.LENGTH and len(done.token_ids) == 5


def _reference_compiler():
    from gemmaserve.structured import GrammarCompiler
    from gemmaserve.testing.reference_backend import ReferenceBackend

    backend = ReferenceBackend(vocab_size=64)
    return GrammarCompiler(backend.tokenizer, backend.model_info.vocab_size, backend.model_info.eos_token_ids)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schemas=st.lists(_schemas, min_size=2, max_size=6), seed=st.integers(0, 2**32))
def test_masks_computed_together_equal_masks_computed_one_by_one(schemas, seed) -> None:
    """allowed_many (llguidance's thread pool) gives each constraint exactly its own allowed(), step after
    step of a random walk, and a constraint that cannot continue gets its error in its own place."""
    import random

    from gemmaserve.sampling_params import allowed_tokens
    from gemmaserve.structured.grammar import ConstraintError, allowed_many

    compiler = _reference_compiler()
    rng = random.Random(seed)
    live = [compiler.compile(StructuredOutputs(json=schema)) for schema in schemas]
    live.insert(rng.randrange(len(live) + 1), compiler.compile(StructuredOutputs(regex="[A-Z]+")))  # stuck
    for _ in range(40):
        if not live:
            break
        together = allowed_many(live)
        assert len(together) == len(live)
        kept = []
        for constraint, mask in zip(live, together):
            try:
                alone = constraint.allowed()
            except ConstraintError as exc:
                assert isinstance(mask, ConstraintError) and str(mask) == str(exc)
                continue
            assert mask == alone
            choices = [t for t, ok in enumerate(allowed_tokens(mask, 64)) if ok]
            try:
                if not constraint.accept(rng.choice(choices)):
                    kept.append(constraint)
            except ConstraintError:  # the 64-token vocabulary cannot spell every byte a schema forces
                pass
        live = kept


def test_a_batch_of_constrained_rows_with_stuck_ones_among_them() -> None:
    """Masks prepared for the whole batch at once: the two stuck requests fail with the clear error, the two
    satisfiable ones and the unconstrained one complete."""
    from gemmaserve.engine.engine import Engine
    from gemmaserve.settings import CoreSettings
    from gemmaserve.testing.reference_backend import ReferenceBackend

    backend = ReferenceBackend(vocab_size=64)
    engine = Engine(backend, CoreSettings(device="cpu"))
    stuck = SamplingParams(max_tokens=8, structured_outputs={"regex": "[A-Z]+"})
    good = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs={"regex": "[a-c]{4}"})
    try:
        handles = [engine.submit([5, 6, 7], p) for p in (stuck, good, stuck, good)]
        handles.append(engine.submit([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)))
        outs = [h.result(timeout=60) for h in handles]
    finally:
        engine.shutdown(timeout=10)
    for out in (outs[0], outs[2]):
        assert out.finish_reason == FinishReason.ERROR and "no token can continue" in (out.error or "")
    for out in (outs[1], outs[3]):
        text = backend.tokenizer.decode(out.token_ids)
        assert out.finish_reason == FinishReason.STOP and re.fullmatch("[a-c]{4}", text), text
    assert outs[4].finish_reason == FinishReason.LENGTH


def test_masks_written_into_the_backends_memory_give_the_same_tokens() -> None:
    """A backend's ``mask_memory`` (here: memory full of garbage, never zeroed) receives the batched masks, which
    reach its sampling there, and a constrained request's tokens are the ones it gets with the engine's own
    buffers; memory too small for the batch is refused (the masks are then computed row by row), never written
    past."""
    import ctypes

    from gemmaserve.engine.engine import Engine
    from gemmaserve.settings import CoreSettings
    from gemmaserve.testing.reference_backend import ReferenceBackend

    class BackendMemory(ReferenceBackend):
        def __init__(self, *args, short: int = 0, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.short, self.owners, self.sampled_from = short, [], set()

        def mask_memory(self, nbytes: int) -> tuple[int, object]:
            owner = (ctypes.c_char * (nbytes - self.short))(*([b"\xa5"] * (nbytes - self.short)))
            self.owners.append(owner)
            return ctypes.addressof(owner), owner

        def sample(self, logits, rows, *, want_logprobs=False):
            self.sampled_from |= {id(row.allowed.obj.owner) for row in rows if isinstance(row.allowed, memoryview)}
            return super().sample(logits, rows, want_logprobs=want_logprobs)

    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured_outputs={"regex": "[a-c]{2,6}x"})
              for seed in range(4)]
    tokens = []
    backends = (ReferenceBackend(vocab_size=64), BackendMemory(vocab_size=64), BackendMemory(vocab_size=64, short=4))
    for backend in backends:
        engine = Engine(backend, CoreSettings(device="cpu"))
        try:
            outs = [h.result(timeout=60) for h in [engine.submit([5, 6, 7], p) for p in params]]
        finally:
            engine.shutdown(timeout=10)
        assert all(out.finish_reason == FinishReason.STOP for out in outs), outs
        tokens.append([out.token_ids for out in outs])
    assert tokens[0] == tokens[1] == tokens[2]
    good, short = backends[1], backends[2]
    assert good.owners and good.sampled_from and good.sampled_from <= {id(owner) for owner in good.owners}
    assert short.owners and not short.sampled_from & {id(owner) for owner in short.owners}


def test_mask_memory_that_cannot_hold_the_batch_is_refused() -> None:
    """``start_masks`` refuses memory that is misaligned or smaller than the batch (where its owner tells its
    extent), naming the problem, before llguidance writes anything."""
    import ctypes

    import torch

    from gemmaserve.structured.grammar import mask_rows

    buffer = (ctypes.c_char * 64)()
    tensor = torch.empty(64, dtype=torch.uint8)
    for placed, problem in [((ctypes.addressof(buffer) + 2, buffer), "4-byte aligned"),
                            ((ctypes.addressof(buffer) + 8, buffer), "outside its owner's 64 bytes"),
                            ((tensor.data_ptr() + 4, tensor), "outside its owner's 64 bytes"),
                            ((0, None), "positive")]:
        with pytest.raises(ValueError, match=problem):
            mask_rows(4, 16, lambda nbytes, placed=placed: placed)
    views = mask_rows(4, 16, lambda nbytes: (tensor.data_ptr(), tensor))  # exactly its 64 bytes
    views[3][:] = bytes(range(16))
    assert tensor[48:].tolist() == list(range(16))


def test_compilers_on_one_vocabulary_share_its_llguidance_tokenizer() -> None:
    """A second engine on the same tokenizer reuses the vocabulary built for the first (seconds on Gemma's);
    another vocabulary size or end-of-sequence set gets its own, and both compile working constraints."""
    from gemmaserve.structured import GrammarCompiler
    from gemmaserve.testing.reference_backend import ReferenceBackend

    backend = ReferenceBackend(vocab_size=64)
    tokenizer, eos = backend.tokenizer, backend.model_info.eos_token_ids
    first, second = GrammarCompiler(tokenizer, 64, eos), GrammarCompiler(tokenizer, 64, eos)
    other = GrammarCompiler(tokenizer, 64, [*eos, 7])
    first.warm(), second.warm(), other.warm()
    assert first._vocabulary() is second._vocabulary()
    assert other._vocabulary() is not first._vocabulary()
    for compiler in (first, second, other):
        assert compiler.compile(StructuredOutputs(regex="[a-c]+")).allowed()


def test_a_hf_tokenizer_serializes_its_vocabulary_once() -> None:
    """``tokenizer_json`` (seconds for Gemma's vocabulary) is built on the first call and kept: every engine
    over the same tokenizer reads the same text (padding and truncation off, as structured output needs)."""
    pytest.importorskip("transformers")
    from tiny_checkpoints import _train_tokenizer_json
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from gemmaserve.hf_tokenizer import HFTokenizerAdapter

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_train_tokenizer_json()))
    adapter = HFTokenizerAdapter(fast)
    text = adapter.tokenizer_json()
    assert json.loads(text)["truncation"] is None and json.loads(text)["padding"] is None
    assert adapter.tokenizer_json() is text  # the kept text, not a second serialization (a new str each time)


def test_the_host_path_benchmark_walks_constrained_requests_through_deferred_sampling(tmp_path) -> None:
    """benchmarks/structured.py --host-path: the engine's take-ahead, masks, row samplings and packing over real
    constrained requests (tiny byte-level tokenizer), in both orders, every part timed, no request ended early."""
    pytest.importorskip("transformers")
    import sys

    from tiny_checkpoints import save_tiny_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import structured

    save_tiny_tokenizer(tmp_path)
    got = structured.host_path(tmp_path, rows=3, steps=6)
    parts = ("take_ahead", "masks_and_row_sampling", "pack")
    assert got["rows"] == 3 and got["steps"] == 6
    for order in ("overlapped", "serial"):
        assert all(got[order][f"{name}_ms_p50"] > 0 for name in (*parts, "total"))
        assert got[order]["total_ms_p50"] >= max(got[order][f"{name}_ms_p50"] for name in parts)


def test_the_decode_benchmark_measures_the_batched_mask_path(tmp_path, monkeypatch) -> None:
    """benchmarks/structured.py --e2b (toy shapes on the CPU): the constrained passes start their masks in batches
    through the engine's own call (its timing wrapper forwards every argument: runs 28 and 29 measured the
    row-by-row fallback because it did not), and a batch that fails makes the benchmark fail instead of timing
    the fallback."""
    pytest.importorskip("transformers")
    import sys

    from tiny_checkpoints import save_tiny_tokenizer

    import gemmaserve.engine.request as request_module

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import structured

    import gemmaserve.structured.grammar as grammar_module

    save_tiny_tokenizer(tmp_path)
    compute = grammar_module.MaskBatch._compute
    got = structured.decode_overhead_e2b(3, 6, tmp_path, quick=True, profile_engine=True,
                                         profile_top=10_000)
    for label in ("constrained", "constrained_again"):
        assert got[label]["errors"] == [] and got[label]["mask_calls"] > 0, got[label]
        assert got[label]["mask_ms_median"] > 0, got[label]
        # the split (started, waited for, computed on the mask thread) counts only the batches handed to the mask
        # thread; this CPU pass decodes synchronously, so its batches are computed on the engine thread
        # (prepare_masks, overlap=False) and none may be counted there (the GPU's deferred ticks hand them over)
        split = [got[label].get(f"mask_{part}_ms_median") for part in ("start", "wait", "native")]
        assert split == [None] * 3, got[label]
    assert grammar_module.MaskBatch._compute is compute  # the benchmark's timing wrappers are gone
    # --profile-engine: the engine thread's functions, the constrained pass's including the mask calls
    profiled = {label: [row[0] for row in got[f"engine_profile_{label}"]["by_cumulative_time"]]
                for label in ("unconstrained", "constrained")}
    assert any("(_tick)" in name for name in profiled["unconstrained"]), profiled
    def advances(names: list[str]) -> bool:  # a constraint advanced by a sampled token (TokenConstraint.accept)
        return any(name.startswith("grammar.py:") and name.endswith("(accept)") for name in names)

    assert advances(profiled["constrained"]) and not advances(profiled["unconstrained"]), profiled

    def broken(*args, **kwargs):
        raise RuntimeError("no pool")

    monkeypatch.setattr(request_module, "grammar_start_masks", broken)
    with pytest.raises(RuntimeError, match="computed row by row.*no pool"):
        structured.decode_overhead_e2b(3, 6, tmp_path, quick=True)


@pytest.mark.parametrize("spec", [{"regex": "((a{100}){100}){100}"},
                                  {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(3000))}],
                         ids=["nested-repeats", "3000-alternatives"])
def test_constraints_beyond_the_engines_limits_are_refused_at_compile_time(spec, monkeypatch) -> None:
    """A constraint whose lexer or first parser rows exceed llguidance's limits is refused when it is compiled
    (a server does that off the engine thread), naming the limit, within a bounded time; the refusal is
    remembered, so sending it again costs no second compile."""
    import time

    from gemmaserve.structured import grammar

    compiler = _reference_compiler()
    compiler.compile(StructuredOutputs(json={"type": "object"}))  # the vocabulary, built outside the timing
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="exceeds what the constraint engine accepts") as first:
        compiler.compile(StructuredOutputs(**spec))
    assert time.perf_counter() - start < 10
    calls = []
    monkeypatch.setattr(grammar, "_template", lambda *args: calls.append(args))
    with pytest.raises(InvalidRequestError) as again:
        compiler.compile(StructuredOutputs(**spec))
    assert str(again.value) == str(first.value) and not calls


def test_a_constraint_compiled_ahead_is_only_copied_when_its_request_is_submitted(monkeypatch) -> None:
    """Engine.compile_constraint (what a server calls on its preparing threads) compiles on the calling thread;
    the submit that follows copies the cached constraint and the request runs to its grammar's end."""
    from gemmaserve.engine.engine import Engine
    from gemmaserve.settings import CoreSettings
    from gemmaserve.structured import grammar
    from gemmaserve.testing.reference_backend import ReferenceBackend

    backend = ReferenceBackend(vocab_size=64)
    engine = Engine(backend, CoreSettings(device="cpu"))
    spec = StructuredOutputs(regex="[a-c]{5}")
    try:
        engine.compile_constraint(spec)
        compiled = []
        monkeypatch.setattr(grammar, "_template", lambda *args: compiled.append(args))
        out = engine.submit([5, 6, 7], SamplingParams(max_tokens=20, structured_outputs=spec)).result(timeout=60)
        with pytest.raises(InvalidRequestError, match="structured_outputs.regex is invalid"):
            monkeypatch.undo()
            engine.compile_constraint(StructuredOutputs(regex="(a"))
    finally:
        engine.shutdown(timeout=10)
    assert not compiled
    assert out.finish_reason == FinishReason.STOP and re.fullmatch("[a-c]{5}", backend.tokenizer.decode(out.token_ids))


def test_a_gbnf_grammar_of_too_many_rules_is_refused_before_conversion() -> None:
    """GBNF converts to Lark in Python in time quadratic in its rules: more than 500 rules are refused at once,
    naming Lark syntax as the way to write a larger grammar, which is accepted at that size."""
    import time

    compiler = _reference_compiler()
    rules = 600
    gbnf = "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1} | "b"' for i in range(rules)) + f'\nr{rules} ::= "c"'
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=r"^structured_outputs.grammar defines 602 GBNF rules; at most 500 .* Lark syntax"):
        compiler.compile(StructuredOutputs(grammar=gbnf))
    assert time.perf_counter() - start < 1.0
    lark = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(rules)) + f'\nr{rules}: "c"'
    compiler.compile(StructuredOutputs(grammar=lark))
    small = "root ::= item+\nitem ::= [a-c]"
    compiler.compile(StructuredOutputs(grammar=small))


def test_long_chains_of_rule_references_compile_without_crashing_the_process() -> None:
    """llguidance's native compiler recurses once per link of a rule-reference chain: a 3,000-rule Lark chain or a
    3,000-link ``$ref`` chain (well inside the 256 KiB a constraint may hold) overflowed an 8 MiB thread stack and
    killed the process with SIGSEGV. Compiled on the compile threads' large stacks, both compile and decode; run in
    a child process so that a crash fails this test instead of the suite."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent('''
        import threading
        from gemmaserve.structured import GrammarCompiler, StructuredOutputs
        from gemmaserve.structured.grammar import start_masks
        from gemmaserve.testing.reference_backend import ReferenceBackend

        threading.stack_size(8 * 2**20)  # what an ordinary thread gets on Linux; the caller's stack must not matter
        backend = ReferenceBackend(vocab_size=64)
        compiler = GrammarCompiler(backend.tokenizer, 64, backend.model_info.eos_token_ids)
        n, a = 3000, backend.tokenizer.encode("a", add_special_tokens=False)[0]
        lark = "\\n".join(["start: r0", *(f'r{i}: "a" r{i + 1} | "b"' for i in range(n)), f'r{n}: "c"'])
        defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
        defs[f"d{n}"] = {"type": "integer"}
        def run():
            compiler.compile(StructuredOutputs(json={"$defs": defs, "$ref": "#/$defs/d0"}))  # its first mask too
            constraint = compiler.compile(StructuredOutputs(grammar=lark))
            for _ in range(20):  # down the chain: "a" after "a"
                mask = bytes(start_masks([constraint]).result()[0])
                assert mask[a >> 3] >> (a & 7) & 1 and not constraint.accept(a)  # allowed, not yet complete
            print("compiled")
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_schema_text_nested_past_pythons_recursion_limit_is_refused_by_name() -> None:
    """A ``json`` constraint given as text may nest deeper than Python's recursion limit: refused as invalid (an
    InvalidRequestError, a 400 over HTTP), never a RecursionError (a 500)."""
    depth = 600
    schema = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    with pytest.raises(InvalidRequestError, match="structured_outputs.json"):
        _reference_compiler().compile(StructuredOutputs.from_mapping({"json": schema}))


def test_the_gbnf_rule_limit_counts_lines_ended_by_a_carriage_return() -> None:
    """llguidance reads ``\\r`` as a line end too, so the GBNF rule limit must count such lines."""
    rules = [f'r{i} ::= "a" r{i + 1} | "b"' for i in range(600)] + ['r600 ::= "c"']
    for end in ("\n", "\r\n", "\r"):
        with pytest.raises(InvalidRequestError, match="GBNF rules"):
            _reference_compiler().compile(StructuredOutputs(grammar=end.join(['root ::= r0', *rules])))


def test_constraint_sizes_count_characters_not_json_escapes() -> None:
    """The 256 Ki-character limit counts a non-ASCII character once (``json.dumps`` wrote it as a 6-character
    ``\\uXXXX`` escape, so a 53,248-character CJK choice list was refused as 303,104 characters)."""
    choices = [f"{i}" + "日本語" * 16 for i in range(1024)]
    StructuredOutputs(choice=choices)
    StructuredOutputs(json={"enum": choices})
    with pytest.raises(InvalidRequestError, match="characters"):
        StructuredOutputs(choice=["日本語" * 1000] * 100)
