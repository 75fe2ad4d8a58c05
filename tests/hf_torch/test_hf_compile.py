"""COMPILE_MODEL: the compiled forward is used when it works; any compile failure logs a warning
and falls back to eager without changing a single token."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_support import cpu_settings, hf_settings
from hf_checkpoints import hf_greedy

from gemmaserve.sampling_params import SamplingParams
from gemmaserve_hf_torch.backend import HFTorchBackend
from gemmaserve_hf_torch.loader import load_model

PROMPT = list(range(10, 31))
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _backend(llama_dir: Path) -> HFTorchBackend:
    return HFTorchBackend(load_model(str(llama_dir), "cpu", cpu_settings(), hf_settings(compile_model=True)))


@pytest.mark.slow
def test_real_compile_failure_falls_back_to_eager(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch.compile really traces the model; its (forced) backend failure surfaces on the first call."""

    def broken_backend(graph: Any, example_inputs: Any) -> Any:
        raise RuntimeError("forced compiler failure")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: real_compile(model, backend=broken_backend))
    try:
        with caplog.at_level(logging.WARNING, logger="gemmaserve_hf_torch.loader"):
            backend = _backend(llama_dir)
        assert not backend.forward.is_compiled
        assert "torch.compile failed for LlamaForCausalLM" in caplog.text and "falling back to eager" in caplog.text
        assert list(backend.generate_stream(PROMPT, PARAMS)) == hf_greedy(backend.loaded.model, PROMPT, 8)
        backend.close()
    finally:
        torch._dynamo.reset()


def test_compile_call_itself_failing(llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(model: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Dynamo is not supported on this Python")

    monkeypatch.setattr(torch, "compile", refuse)
    with caplog.at_level(logging.WARNING, logger="gemmaserve_hf_torch.loader"):
        backend = _backend(llama_dir)
    assert not backend.forward.is_compiled and "Dynamo is not supported" in caplog.text
    backend.close()


class _FlakyCompiled:
    """Stands in for a compiled module: runs the real model, but from call ``fail_at`` on it raises
    AFTER the forward already appended KV to the cache (the worst case for a retry)."""

    def __init__(self, model: torch.nn.Module, fail_at: int) -> None:
        self.model, self.fail_at, self.calls = model, fail_at, 0

    def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        output = self.model(**kwargs)
        if self.calls >= self.fail_at:
            raise RuntimeError("recompilation failed")
        return output


def test_compiled_forward_is_used_and_a_late_failure_keeps_tokens_exact(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[_FlakyCompiled] = []

    def fake_compile(model: torch.nn.Module, **kwargs: Any) -> _FlakyCompiled:
        made.append(_FlakyCompiled(model, fail_at=5))
        return made[-1]

    monkeypatch.setattr(torch, "compile", fake_compile)
    backend = _backend(llama_dir)
    assert backend.forward.is_compiled and made[0].calls == 1  # the load-time probe forward went through it
    with caplog.at_level(logging.WARNING, logger="gemmaserve_hf_torch.loader"):
        tokens = list(backend.generate_stream(PROMPT, PARAMS))
    assert made[0].calls == 5 and not backend.forward.is_compiled
    assert "recompilation failed" in caplog.text
    assert tokens == hf_greedy(backend.loaded.model, PROMPT, 8)
    backend.check_integrity()
    backend.close()
