"""``LLM`` refuses token ids outside the vocabulary with InvalidRequestError before anything decodes them (a
Hugging Face tokenizer raises OverflowError on a negative id; ``LLM.stream`` decodes the prompt for its
stop-string watcher before the engine validates it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from gemmaserve.api import LLM
from gemmaserve.engine.engine import Engine
from gemmaserve.errors import InvalidRequestError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import load_settings
from gemmaserve.testing.reference_backend import ReferenceBackend


class _StrictDecode:
    """The reference tokenizer, decoding like a Hugging Face one: an id outside the vocabulary raises."""

    def __init__(self, inner: object, vocab_size: int) -> None:
        self._inner = inner
        self._vocab_size = vocab_size

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def decode(self, token_ids: Sequence[int], **kwargs: object) -> str:
        if any(not 0 <= t < self._vocab_size for t in token_ids):
            raise OverflowError("out of range integral type conversion attempted")
        return self._inner.decode(token_ids, **kwargs)  # type: ignore[attr-defined]


@pytest.fixture
def llm() -> Iterator[LLM]:
    backend = ReferenceBackend(max_model_len=512)
    backend.tokenizer = _StrictDecode(backend.tokenizer, backend.model_info.vocab_size)  # type: ignore[assignment]
    engine = Engine(backend, load_settings(device="cpu", max_batch_size=4), owns_backend=True)
    with LLM(settings=engine.settings, engine=engine) as model:
        yield model


@pytest.mark.parametrize("bad", [-1, 64, 2**40])
@pytest.mark.parametrize("stop", [(), ("x",)])
def test_out_of_vocabulary_prompt_ids_are_invalid_requests(llm: LLM, bad: int, stop: tuple[str, ...]) -> None:
    params = SamplingParams(max_tokens=2, stop=list(stop))
    with pytest.raises(InvalidRequestError, match=r"position 1 is not a valid token id.*\[0, 64\)"):
        list(llm.stream([5, bad], params))
    with pytest.raises(InvalidRequestError, match="not a valid token id"):
        llm.generate([[5, bad]], params)
    assert llm.generate([[5, 6]], params)[0].finish_reason in ("length", "stop")


def test_settings_with_other_settings_is_a_type_error() -> None:
    """LLM(settings=..., max_batch_size=...) used to drop the keyword silently."""
    from gemmaserve.settings import CoreSettings

    settings = CoreSettings(max_batch_size=4)
    with pytest.raises(TypeError, match="max_batch_size"):
        LLM(settings=settings, max_batch_size=8)
    with pytest.raises(TypeError, match="model"):
        LLM("/some/model", settings=settings)
