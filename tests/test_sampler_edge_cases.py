"""Extreme but accepted sampling parameters never break a backend's sampler (found by schemathesis)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gemmaserve.sampling_params import MIN_TEMPERATURE, RowSampling, SamplingParams  # noqa: E402


def _samplers():
    samplers = []
    for module in ("gemmaserve_custom_torch.sampling", "gemmaserve_hf_torch.sampling"):
        try:
            samplers.append(pytest.param(__import__(module, fromlist=["sample_tokens"]).sample_tokens, id=module))
        except ImportError:
            continue
    return samplers


def test_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=5e-324).temperature == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE


@pytest.mark.parametrize("sample_tokens", _samplers())
def test_tiny_top_p_keeps_the_most_likely_token(sample_tokens) -> None:
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    rows = [RowSampling(0.7, 5e-324, 0, 1, 0), RowSampling(1.0, 1e-300, 3, 2, 5), RowSampling(2.0, 1e-9, 0, 3, 9)]
    assert sample_tokens(logits, rows).token_ids == logits.argmax(-1).tolist()
