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


def test_values_that_meet_once_divided_by_the_temperature_tie_to_the_lower_id() -> None:
    """The definition filters on scaled values with ties to the lower token id. Changed values (logit_bias) and
    float64 logits are float64 keys that can be distinct yet equal once divided; torch sorts the scaled values."""
    from gemmaserve import torch_sampling
    from gemmaserve.engine import sampling_cpu

    x, ulp, temperature = 1.9720004796981812, 2.220446049250313e-16, 100.0
    assert x / temperature == (x + ulp) / temperature and x + ulp != x
    for top_k, top_p in ((1, 1.0), (0, 1e-9)):
        row = RowSampling(temperature, top_p, top_k, 123, 0, logit_bias=((1, ulp),))
        definition = sampling_cpu.sample_row([x, x], row)[0]
        assert torch_sampling.sample_tokens(torch.tensor([[x, x]]), [row]).token_ids == [definition] == [0]
    a, b = 0.9375436436680729, 0.937543643668073
    row = RowSampling(temperature, 1.0, 1, 123, 0)
    assert torch_sampling.sample_tokens(torch.tensor([[a, b]], dtype=torch.float64), [row]).token_ids == [
        sampling_cpu.sample_row([a, b], row)[0]]


def test_a_row_with_every_token_masked_has_no_top_logprobs() -> None:
    from gemmaserve import torch_sampling
    from gemmaserve.engine import sampling_cpu

    row = RowSampling(1.0, 1.0, 0, 1, 0, allowed=b"", top_logprobs=3)
    logits = [0.5, 1.5, -2.0, 3.0]
    out = torch_sampling.sample_tokens(torch.tensor([logits]), [row], want_logprobs=True)
    assert out.top_logprobs == [sampling_cpu.top_logprobs(logits, row)] == [[]]
