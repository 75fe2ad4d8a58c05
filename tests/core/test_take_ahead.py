"""A constrained request's token taken ahead (deferred sampling) advances its constraint in place and is rolled
back whenever that token is not the one appended: every mask the request hands to sampling equals the mask of a
fresh constraint fed exactly the tokens appended so far (plus the token taken ahead, for ``ahead=1``), whatever
order of take-ahead, append, forgetting and mismatched appends the scheduler goes through."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaserve.engine.request import Request
from gemmaserve.sampling_params import SamplingParams, allowed_tokens

pytest.importorskip("llguidance")

_VOCAB = 64
_SPECS = [{"regex": "[a-c]{2,9}"}, {"choice": ["abc", "abd", "bca"]},
          {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]


def _compiler():
    from gemmaserve.structured import GrammarCompiler
    from gemmaserve.testing.reference_backend import ReferenceBackend

    backend = ReferenceBackend(vocab_size=_VOCAB)
    return GrammarCompiler(backend.tokenizer, _VOCAB, backend.model_info.eos_token_ids), backend


_COMPILER, _BACKEND = _compiler()


def _oracle_mask(spec: dict, tokens: list[int]) -> bytes | None:
    """The mask after ``tokens`` on a fresh constraint, or None when one of them is rejected."""
    from gemmaserve.structured import StructuredOutputs
    from gemmaserve.structured.grammar import ConstraintError

    constraint = _COMPILER.compile(StructuredOutputs(**spec))
    try:
        for token in tokens:
            if constraint.accept(token):
                return None  # complete: no mask follows
        return constraint.allowed()
    except ConstraintError:
        return None


def _pick(mask: bytes | None, choice: int) -> int:
    allowed = [t for t, ok in enumerate(allowed_tokens(mask, _VOCAB)) if ok] if mask else []
    return allowed[choice % len(allowed)] if allowed else choice % _VOCAB


_ops = st.lists(st.tuples(st.sampled_from(["ahead_then_append", "ahead_then_forget", "ahead_then_other",
                                           "append", "ahead_invalid_then_forget"]),
                          st.integers(0, 1000), st.integers(0, 1000)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(_SPECS), ops=_ops)
def test_masks_after_tokens_taken_ahead_equal_a_fresh_constraints(spec: dict, ops: list) -> None:
    from gemmaserve.structured import StructuredOutputs

    eos = tuple(_BACKEND.model_info.eos_token_ids)
    request = Request("r", (5, 6), SamplingParams(max_tokens=100, structured_outputs=spec))
    request.seed = 1
    request.constraint = _COMPILER.compile(StructuredOutputs(**spec))
    for op, first, second in ops:
        if request.is_finished:
            break
        now = request.row_sampling().allowed
        assert now == _oracle_mask(spec, request.output_token_ids)
        token = _pick(now, first)
        if op == "ahead_invalid_then_forget":
            token = next((t for t, ok in enumerate(allowed_tokens(now or b"", _VOCAB)) if not ok), token)
        request.take_ahead(token)
        expected_next = _oracle_mask(spec, [*request.output_token_ids, token])
        following = request.row_sampling(ahead=1).allowed
        if expected_next is not None:
            assert following == expected_next
        if op == "ahead_then_append" or op == "append":
            request.append_token(token, None, eos)
        elif op == "ahead_then_other":
            request.append_token(_pick(now, second), None, eos)  # another token than the one taken ahead
        # forget: the step that sampled ``token`` failed; the next sampling asks for ahead=0
        if not request.is_finished:
            assert request.row_sampling().allowed == _oracle_mask(spec, request.output_token_ids)
