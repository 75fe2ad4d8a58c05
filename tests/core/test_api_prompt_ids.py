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


@pytest.mark.parametrize("prompt", [b"Hello", bytearray(b"Hi")])
def test_a_bytes_prompt_is_refused_not_read_as_token_ids(llm: LLM, prompt: bytes) -> None:
    """bytes are a Sequence of ints: they used to run as token ids (their byte values)."""
    with pytest.raises(InvalidRequestError, match="decode it to str"):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="decode it to str"):
        llm.generate([prompt, "text"], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="decode it to str"):
        list(llm.stream(prompt, SamplingParams(max_tokens=2)))


def test_an_empty_list_of_sampling_params_is_not_the_default(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="0 SamplingParams given for 2 prompts"):
        llm.generate(["a", "b"], [])
    with pytest.raises(InvalidRequestError, match="must be SamplingParams"):
        list(llm.stream("a", []))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["no", "false", None, 0, 1])
def test_ignore_eos_must_be_a_bool(llm: LLM, value: object) -> None:
    with pytest.raises(InvalidRequestError, match="ignore_eos must be a bool"):
        llm.generate("a", SamplingParams(max_tokens=2, ignore_eos=value))  # type: ignore[arg-type]


@pytest.mark.parametrize("name, value", [("port", 1), ("api_key", "secret"), ("host", "0.0.0.0"),
                                         ("allowed_origins", "*"), ("limit_concurrency", 4), ("render_processes", 2),
                                         ("stream_stall_timeout_s", 3), ("engine_iteration_timeout_s", 5),
                                         ("max_buffered_body_bytes", 1024), ("allow_credentials", True)])
def test_http_server_settings_are_refused_offline(name: str, value: object) -> None:
    """Keywords that only the HTTP server reads would do nothing in an offline LLM: refused, naming the server."""
    from gemmaserve.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=rf"LLM\({name}=\.\.\.\) configures the HTTP server"):
        LLM(backend="reference", device="cpu", **{name: value})


def test_settings_must_be_core_settings() -> None:
    with pytest.raises(TypeError, match="takes a gemmaserve.settings.CoreSettings, got dict"):
        LLM(settings={"max_batch_size": 2})  # type: ignore[arg-type]


def test_an_engine_given_takes_no_other_settings() -> None:
    """``LLM(engine=...)`` serves the engine as built: settings given beside it would do nothing, so they are
    refused by name; without them the LLM reports the engine's own settings."""
    settings = load_settings(device="cpu")
    engine = Engine(ReferenceBackend(max_model_len=64), settings)
    with pytest.raises(TypeError, match="takes no other settings, got max_model_len, model"):
        LLM(engine=engine, max_model_len=8, model="/elsewhere")
    with LLM(engine=engine) as llm:
        assert llm.settings is engine.settings


def test_log_level_given_offline_sets_gemmaserve_loggers() -> None:
    import logging

    logger = logging.getLogger("gemmaserve")
    before = logger.level
    try:
        settings = load_settings(device="cpu", log_level="debug")
        with LLM(settings=settings, engine=Engine(ReferenceBackend(max_model_len=64), settings)):
            assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)
