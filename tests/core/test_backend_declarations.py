"""What a factory returns is checked against what it declares before the engine serves it
(``engine.factory.capability_problem``), and a streaming-only backend needs nothing but ``generate_stream``
(``gemmaserve.backend.StreamingBackend``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from gemmaserve.backend import BackendCapabilities, ModelInfo, StreamingBackend
from gemmaserve.engine import Engine
from gemmaserve.engine.factory import capability_problem
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings
from gemmaserve.testing.reference_backend import ReferenceBackend
from gemmaserve.testing.reference_model import CharTokenizer


class Counting(StreamingBackend):
    """Yields prompt[-1] + 1, + 2, ... : only generate_stream is written."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = CharTokenizer(512)
        self.model_info = ModelInfo(name="counting", vocab_size=512, max_model_len=256, eos_token_ids=(1,))
        self.sessions: list[str | None] = []

    def generate_stream(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                        session_id: str | None = None) -> Iterator[int]:
        self.sessions.append(session_id)
        for step in range(1, params.max_tokens + 1):
            yield 2 + (prompt_ids[-1] + step) % 400


def test_a_streaming_backend_with_only_generate_stream_serves() -> None:
    backend = Counting()
    assert capability_problem(backend) is None
    engine = Engine(backend, CoreSettings(max_batch_size=2), None)
    try:
        out = engine.submit([5, 6], SamplingParams(max_tokens=3, ignore_eos=True), request_id="r").result(timeout=10)
    finally:
        engine.shutdown()
    assert out.token_ids == [9, 10, 11] and out.finish_reason == "length"
    assert backend.sessions == ["r"]  # the scheduler passes the request id as session_id
    with pytest.raises(NotImplementedError, match="streaming-only"):
        backend.decode_step_batched(None, [1])


def test_declarations_a_backend_cannot_honour_are_named() -> None:
    assert "not a gemmaserve.backend.InferenceBackend" in (capability_problem(object()) or "")
    mixed = ReferenceBackend()
    mixed.capabilities = BackendCapabilities(mixed_step=True)
    assert capability_problem(mixed) is None  # the reference backend implements forward_step

    class NoForwardStep(Counting):
        capabilities = BackendCapabilities(continuous_batching=True, mixed_step=True)

    assert "does not implement forward_step" in (capability_problem(NoForwardStep()) or "")
    for claim in ("logprobs", "top_logprobs", "mixed_step"):
        streaming = Counting()
        streaming.capabilities = BackendCapabilities(continuous_batching=False, **{claim: True})
        problem = capability_problem(streaming) or ""
        assert claim in problem and ("streaming-only" in problem or claim == "mixed_step"), problem
