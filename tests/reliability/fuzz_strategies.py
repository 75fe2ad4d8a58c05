"""Hypothesis strategies for hostile inputs, shared by the Python-API and HTTP fuzzers: prompts
(empty, huge, lone surrogates, control and special-token text), token-id lists (negative, past the
vocabulary, huge, wrong types) and sampling values (NaN, infinities, negative, huge, wrong types)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

__all__ = ["SAMPLING_FIELDS", "VOCAB_SIZE", "ordinary_prompts", "sampling_values", "text_prompts", "token_prompts"]

VOCAB_SIZE = 512
"""The tiny test checkpoint's vocabulary (tests/tiny_checkpoints.py)."""
SPECIAL = ["<bos>", "<eos>", "<pad>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<|endoftext|>", "\x00"]
SURROGATES = ["\ud800", "\udfff", "\udc00x", "a\ud83d"]  # lone halves of a UTF-16 pair

_FLOATS = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, 1e308, -1e308, 1e-320]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0.0, max_value=2.0),
)
_INTS = st.one_of(
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, -(10**30)]),
    st.integers(),
    st.integers(min_value=1, max_value=8),
)
_JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def text_prompts() -> st.SearchStrategy[str]:
    """Text prompts: about half ordinary text, the rest empty, huge, special tokens, control
    characters or lone surrogates."""
    ordinary = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
    fragments = st.one_of(st.text(max_size=30), st.sampled_from(SPECIAL), st.sampled_from(SURROGATES),
                          st.text(st.characters(codec="utf-8", categories=["Cc", "Cf", "Zs", "So"]), max_size=10))
    hostile = st.lists(fragments, min_size=1, max_size=6).map("".join)
    huge = st.sampled_from(["fox " * 2000, "\u00e9" * 5000, "<bos>" * 600, "x" * 20000])
    return st.one_of(ordinary, ordinary, ordinary, hostile, hostile, st.just(""), huge)


def token_prompts(vocab_size: int = VOCAB_SIZE) -> st.SearchStrategy[list[Any]]:
    """Token-id lists: about half valid, the rest empty, huge, or with negative ids, ids at/after
    the vocabulary, huge ints or wrong types."""
    valid = st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=24)
    bad_ids = st.one_of(st.sampled_from([-1, vocab_size, vocab_size + 1, 2**31 - 1, 2**63, -(2**70)]),
                        st.booleans(), st.floats(allow_nan=True), st.none(), st.text(max_size=2))
    hostile = st.lists(st.one_of(st.integers(0, vocab_size - 1), bad_ids), min_size=1, max_size=12)
    huge = st.sampled_from([[5] * 3000, list(range(vocab_size)) * 2])
    return st.one_of(valid, valid, valid, hostile, hostile, st.just([]), huge)


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")


def sampling_values(*, valid_only: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """A subset of SAMPLING_FIELDS, each value valid about two times in three, else hostile
    (always valid with ``valid_only``)."""
    valid = {
        "max_tokens": st.integers(1, 8),
        "temperature": st.one_of(st.just(0.0), st.floats(0.0, 2.0)),
        "top_p": st.floats(0.01, 1.0),
        "top_k": st.one_of(st.integers(0, 600), st.sampled_from([2**31 - 1, 2**63, 10**30])),
        "seed": st.integers(0, 2**63 - 1),
        "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE + 10), max_size=4),
        "ignore_eos": st.booleans(),
    }
    hostile = {
        "max_tokens": st.one_of(_INTS, _FLOATS, _JUNK),
        "temperature": st.one_of(_FLOATS, _INTS, _JUNK),
        "top_p": st.one_of(_FLOATS, _INTS, _JUNK),
        "top_k": st.one_of(_INTS, _FLOATS, _JUNK),
        "seed": st.one_of(_INTS, _FLOATS, _JUNK),
        # a list of anything; a non-iterable value is a TypeError in SamplingParams (see test_fuzz_api.py)
        "stop_token_ids": st.lists(st.one_of(_INTS, _FLOATS, st.none(), st.text(max_size=2)), min_size=1,
                                   max_size=4),
        "ignore_eos": st.one_of(_JUNK, _INTS),
    }
    if valid_only:
        return st.fixed_dictionaries({}, optional=valid)
    return st.fixed_dictionaries({}, optional={
        name: st.one_of(valid[name], valid[name], hostile[name]) for name in SAMPLING_FIELDS
    })


def ordinary_prompts() -> st.SearchStrategy[str | list[int]]:
    """Prompts a well-behaved client sends: non-empty text or valid token ids."""
    return st.one_of(st.text(st.characters(codec="utf-8"), min_size=1, max_size=40),
                     st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24))
