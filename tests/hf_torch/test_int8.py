"""``QUANTIZATION=int8`` on the hf backend (issue 16 item 7, the default model's CPU speed): int8 weights per
output channel times int8 activations per token on fbgemm. A row's output never depends on the rest of the batch
(bitwise), every nn.Linear is replaced, the engine's greedy tokens are transformers' ``generate`` on the same
quantized model under concurrency, and selection / the demo's default pick it only where it runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_support import cpu_settings, hf_settings
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hf_scheduler import PROMPTS, greedy_requests, run

from gemmaserve.errors import ConfigurationError
from gemmaserve.selection import select_backend
from gemmaserve.testing.row_driver import solo_greedy

torch = pytest.importorskip("torch")
from gemmaserve_hf_torch.backend import HFTorchBackend  # noqa: E402
from gemmaserve_hf_torch.int8 import Int8Linear, int8_unavailable_reason, quantize_linears  # noqa: E402
from gemmaserve_hf_torch.loader import load_model  # noqa: E402

pytestmark = pytest.mark.skipif(int8_unavailable_reason("cpu") is not None,
                                reason=str(int8_unavailable_reason("cpu")))


def _rows(seed: int, m: int, k: int) -> torch.Tensor:
    """``m`` rows of width ``k`` at very different scales, with an all-zero row and an outlier column."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[torch.randperm(m, generator=g)][:, None]
    x[torch.randint(0, m, (1,), generator=g)] = 0.0
    x[:, torch.randint(0, k, (1,), generator=g)] *= 40.0
    return x


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 12), k=st.integers(2, 80), n=st.integers(1, 48),
       cuts=st.lists(st.integers(1, 11), max_size=4), bias=st.booleans())
def test_a_rows_output_does_not_depend_on_the_batch(seed, m, k, n, cuts, bias) -> None:
    torch.manual_seed(seed)
    layer = Int8Linear(torch.nn.Linear(k, n, bias=bias))
    x = _rows(seed, m, k)
    whole = layer(x)
    bounds = sorted({0, m, *(c for c in cuts if c < m)})
    for lo, hi in zip(bounds, bounds[1:]):
        assert torch.equal(layer(x[lo:hi]), whole[lo:hi])
    for i in range(m):
        assert torch.equal(layer(x[i : i + 1].clone()), whole[i : i + 1])


def test_int8_linear_is_close_to_the_float_linear_and_keeps_shape_and_dtype() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    layer = Int8Linear(linear)
    x = torch.randn(3, 5, 256)
    reference, got = linear(x), layer(x)
    assert got.shape == (3, 5, 96)
    assert ((got - reference).norm() / reference.norm()).item() < 0.03  # 7-bit activations, 8-bit weights
    assert torch.equal(layer(torch.zeros(2, 256)), linear.bias.detach().expand(2, 96))  # zero rows: the bias alone
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_an_input_changed_in_place_is_normalized_again() -> None:
    """Each call normalizes its input afresh: an input changed in place between two linears' reads is seen."""
    torch.manual_seed(1)
    a, b = (torch.nn.Linear(32, 8, bias=False) for _ in range(2))
    model = torch.nn.Sequential(a, b)
    quantize_linears(model)
    x = torch.randn(2, 32)
    before = model[1](x)
    x.mul_(3.0)
    assert torch.equal(model[0](x), Int8Linear(a)(x.clone()))
    assert not torch.equal(model[1](x), before)


def test_quantize_linears_replaces_every_linear(gemma4_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma4_dir), dtype=torch.float32)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert quantize_linears(model) == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_linears(torch.nn.Sequential(torch.nn.ReLU()))


@pytest.fixture(params=["gemma4", "llama", "gemma3"])
def int8_backend(request: pytest.FixtureRequest) -> Iterator[HFTorchBackend]:
    path = request.getfixturevalue(f"{request.param}_dir")
    loaded = load_model(str(path), "cpu", cpu_settings(quantization="int8"), hf_settings())
    assert isinstance(loaded.model.lm_head, Int8Linear)
    backend = HFTorchBackend(loaded)
    yield backend
    backend.check_integrity()
    assert backend.num_live_rows == 0
    backend.close()


def test_int8_concurrent_requests_equal_solo_runs_and_generate(int8_backend: HFTorchBackend) -> None:
    """Staggered requests under the real scheduler (rows joining and leaving a batched decode): each gives
    transformers' greedy tokens on the same quantized model and its own solo run's. Prompts prefill whole, as
    ``generate`` does: a chunked prefill's attention rounds differently (~1e-7 in float32, harmless there), and
    int8 turns a rounding that crosses a quantization boundary into a whole step (docs/reliability.md)."""
    from hf_checkpoints import hf_greedy

    longest = max(len(prompt) for _, prompt, _ in PROMPTS)
    outputs = run(int8_backend, greedy_requests("q", PROMPTS), prefill_chunk_tokens=longest)
    model = int8_backend.loaded.model
    for i, (_, prompt, n) in enumerate(PROMPTS):
        assert outputs[f"q{i}"].token_ids == hf_greedy(model, prompt, n), f"request {i} differs from generate"
        assert outputs[f"q{i}"].token_ids == solo_greedy(int8_backend, prompt, n), f"request {i} differs alone"


def test_selection_takes_int8_only_where_it_runs(gemma4_dir: Path) -> None:
    chosen = select_backend(cpu_settings(model=str(gemma4_dir), backend="auto", quantization="int8"))
    assert chosen.spec.name == "hf"
    if "custom-cpu" in chosen.rejected:
        assert "QUANTIZATION=int8" in chosen.rejected["custom-cpu"]
        with pytest.raises(ConfigurationError, match=r"QUANTIZATION=int8: backend 'custom-cpu' does not support it.*use hf"):
            select_backend(cpu_settings(model=str(gemma4_dir), backend="custom-cpu", quantization="int8"))
    assert "CPU only" in str(int8_unavailable_reason("cuda"))


def test_the_demo_quantizes_only_when_nothing_else_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemmaserve import hardware
    from gemmaserve.cli import demo_quantization
    from gemmaserve.settings import load_settings

    monkeypatch.delenv("QUANTIZATION", raising=False)
    monkeypatch.delenv("GEMMASERVE_QUANTIZATION", raising=False)
    monkeypatch.setattr(hardware, "cpu_has_native_bfloat16", lambda: False)
    assert demo_quantization(load_settings(device="cpu", backend="auto")) == "int8"
    assert demo_quantization(load_settings(device="cpu", backend="hf")) == "int8"
    assert demo_quantization(load_settings(device="cpu", backend="auto", quantization="none")) is None
    assert demo_quantization(load_settings(device="cpu", backend="custom-cpu")) is None
    assert demo_quantization(load_settings(device="cuda", backend="auto")) is None
    monkeypatch.setattr(hardware, "cpu_has_native_bfloat16", lambda: True)
    assert demo_quantization(load_settings(device="cpu", backend="auto")) is None
