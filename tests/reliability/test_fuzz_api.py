"""Hypothesis fuzzes the Python API (``gemmaserve.LLM``, ``generate`` and ``stream``) with the reference
and custom-cpu backends: hostile prompts, token-id lists and sampling values. Every call either
finishes normally or raises a GemmaserveError with a message; none hangs, none ends in a backend
error, and the engine keeps serving with consistent KV bookkeeping afterwards."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_strategies import sampling_values, text_prompts, token_prompts
from gemmaserve import LLM, SamplingParams
from gemmaserve.engine.engine import Engine
from gemmaserve.errors import GemmaserveError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.settings import load_settings
from gemmaserve.testing.reference_backend import ReferenceBackend
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reliability_harness import require_custom_torch

CALL_TIMEOUT_S = 60
EXAMPLES = {"reference": 200, "custom-cpu": 120}
MAX_TOKENS_CAP = 12
"""Valid but long outputs are shortened so the examples stay quick; invalid values are kept."""


@pytest.fixture(scope="module", params=["reference", "custom-cpu"])
def llm(request: pytest.FixtureRequest) -> Iterator[tuple[str, LLM]]:
    if request.param == "reference":
        settings_ = load_settings(device="cpu", max_model_len=512, kv_block_size=4, prefix_cache_blocks=128,
                                  max_batch_size=8, max_waiting_requests=64)
        backend = ReferenceBackend(max_model_len=512, kv_capacity_tokens=4096)
        cache = CacheManager(settings_.prefix_cache_blocks, settings_.kv_block_size)
        backend.set_cache_adapter(cache)
        engine = Engine(backend, settings_, cache, owns_backend=True, backend_name="reference")
        model = LLM(settings=settings_, engine=engine)
    else:
        require_custom_torch()
        checkpoint: Path = request.getfixturevalue("tiny_checkpoint")
        model = LLM(model=str(checkpoint), backend="custom-cpu", device="cpu", dtype="float32", max_batch_size=8)
    yield request.param, model
    model.close()


def _cap(fields: dict[str, Any]) -> dict[str, Any]:
    """Generations kept short: a large max_tokens, and None (up to the end of the context; tested in
    tests/core/test_api_vllm_parity.py), become MAX_TOKENS_CAP."""
    value = fields.get("max_tokens", 0)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS_CAP < value < 400):
        fields = {**fields, "max_tokens": MAX_TOKENS_CAP}
    return fields


def _call(fn: Any) -> Any:
    """Run ``fn()`` on a worker thread; a call that does not return within CALL_TIMEOUT_S is a hang."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(fn)
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"the call hung for more than {CALL_TIMEOUT_S} s")


def _check_outcome(model: LLM, prompt: Any, params: SamplingParams, stream: bool) -> str:
    """Run one call; returns ``"generated"`` or ``"rejected"`` (a GemmaserveError with a message)."""
    def generate() -> list[Any]:
        if stream:
            return [chunk.output for chunk in model.stream(prompt, params) if chunk.finished]
        return list(model.generate(prompt, params))

    try:
        outputs = _call(generate)
    except GemmaserveError as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return "rejected"
    assert outputs, "no final output"
    for output in outputs:
        assert output.finish_reason in ("stop", "length"), (output.finish_reason, output.error)
        assert 1 <= len(output.token_ids) <= params.max_tokens
    return "generated"


def test_python_api_gives_clear_errors_for_hostile_input(llm: tuple[str, LLM]) -> None:
    name, model = llm
    counts = {"params_rejected": 0, "examples": 0, "generated": 0, "rejected": 0}

    vocab = model.engine.backend.model_info.vocab_size

    @settings(max_examples=EXAMPLES[name], deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(prompt=st.one_of(text_prompts(), token_prompts(vocab)), fields=sampling_values(), stream=st.booleans())
    @example(prompt="a\ud800b", fields={}, stream=False)  # found: a lone surrogate crashed the tokenizer
    @example(prompt="hi", fields={"temperature": 1.0, "top_k": 10**30, "max_tokens": 3}, stream=False)  # found
    @example(prompt=[5, 6], fields={"temperature": 1e-320, "top_k": 2**63, "seed": 2**63 - 1}, stream=True)
    @example(prompt=[True, 5], fields={"temperature": float("nan")}, stream=False)
    def fuzz(prompt: Any, fields: dict[str, Any], stream: bool) -> None:
        counts["examples"] += 1
        try:
            params = SamplingParams(**_cap(fields))
        except GemmaserveError as exc:
            assert str(exc).strip()
            counts["params_rejected"] += 1
            params = SamplingParams(max_tokens=4)  # still send the prompt
        counts[_check_outcome(model, prompt, params, stream)] += 1

    fuzz()
    print(f"python API fuzz ({name}):", counts)
    assert counts["params_rejected"] > 0 and counts["examples"] >= EXAMPLES[name]
    assert counts["generated"] >= EXAMPLES[name] // 8 and counts["rejected"] >= EXAMPLES[name] // 5, counts
    after = model.generate("The quick brown fox", SamplingParams(max_tokens=3, ignore_eos=True))
    assert after[0].finish_reason == "length" and len(after[0].token_ids) == 3
    engine = model.engine
    engine.check_integrity()
    with engine.backend.lock:
        engine.backend.check_integrity()
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.finished.get("error", 0) == 0
    live_rows = getattr(engine.backend, "num_live_rows", None)
    assert (live_rows if live_rows is not None else stats.kv.get("live_rows", 0)) == 0


def test_stop_token_ids_of_the_wrong_type_is_a_clear_error() -> None:
    from gemmaserve.errors import InvalidRequestError

    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # type: ignore[arg-type]  # null = none
    for bad in (5.5, "12", {"a": 1}):
        with pytest.raises(InvalidRequestError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad)  # type: ignore[arg-type]
