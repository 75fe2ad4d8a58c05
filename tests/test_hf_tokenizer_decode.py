"""``HFTokenizerAdapter.decode`` calls the Rust tokenizer directly only where transformers' ``decode`` would return
the same text; property-tested against transformers over random ids, special tokens and both flags."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")


def tiny_fast_tokenizer(clean_up: bool | None, cls: Any = None) -> Any:
    import tiny_checkpoints
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return (cls or PreTrainedTokenizerFast)(
        tokenizer_object=Tokenizer.from_str(tiny_checkpoints._train_tokenizer_json()),
        pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        clean_up_tokenization_spaces=clean_up,
    )


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):  # a model-specific decode the fast path must not skip
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return str(super()._decode(token_ids, **kwargs)).upper()

    unset = tiny_fast_tokenizer(False)
    unset.clean_up_tokenization_spaces = None  # transformers then cleans nothing up either
    return {"plain": tiny_fast_tokenizer(False), "clean-up": tiny_fast_tokenizer(True), "unset": unset,
            "override": tiny_fast_tokenizer(False, Shouting)}


def test_the_direct_path_is_taken_only_where_it_is_exact(tokenizers: dict[str, Any]) -> None:
    from gemmaserve.hf_tokenizer import HFTokenizerAdapter

    assert HFTokenizerAdapter(tokenizers["plain"])._rust_decode is not None
    assert HFTokenizerAdapter(tokenizers["unset"])._rust_decode is not None
    assert HFTokenizerAdapter(tokenizers["clean-up"])._rust_decode is None
    assert HFTokenizerAdapter(tokenizers["override"])._rust_decode is None


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans(), which=st.sampled_from(["plain", "clean-up", "unset", "override"]))
def test_decode_is_transformers_decode(tokenizers: dict[str, Any], data: st.DataObject, skip: bool,
                                       which: str) -> None:
    from gemmaserve.hf_tokenizer import HFTokenizerAdapter

    hf = tokenizers[which]
    ids = data.draw(st.lists(st.integers(0, len(hf) - 1), max_size=24))
    assert HFTokenizerAdapter(hf).decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
