"""Plugin registration, availability probes, backend selection, and the whole stack via LLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_helpers import settings_for

from gemmaserve import LLM, SamplingParams
from gemmaserve.errors import BackendUnavailableError
from gemmaserve.hardware import is_apple_silicon
from gemmaserve.plugins import load_registry
from gemmaserve.selection import select_backend

from gemmaserve_mlx import probe


def test_both_backends_are_registered() -> None:
    registry = load_registry()
    batch, stream = registry.get("mlx"), registry.get("mlx-stream")
    assert batch is not None and stream is not None
    assert (batch.priority, batch.devices, batch.plugin) == (20, ("mps", "cpu"), "gemmaserve-mlx")
    assert (stream.priority, stream.devices) == (80, ("mps", "cpu"))


def test_plugin_and_probe_modules_import_nothing_heavy() -> None:
    code = (
        "import sys, gemmaserve_mlx.plugin, gemmaserve_mlx.probe, gemmaserve_mlx.model_dir\n"
        "heavy = {'mlx', 'mlx_lm', 'torch', 'transformers'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(is_apple_silicon(), reason="on Apple silicon auto selection may pick mlx")
def test_auto_selection_off_apple_silicon_never_picks_mlx(gemma4_dir: Path) -> None:
    settings = settings_for(gemma4_dir, backend="auto")
    for name in ("mlx", "mlx-stream"):
        reason = probe.probe_batch(settings, "cpu") if name == "mlx" else probe.probe_stream(settings, "cpu")
        assert reason == f"not Apple silicon: select it explicitly with BACKEND={name}"
    try:
        chosen = select_backend(settings).spec.name
    except BackendUnavailableError:  # no other backend installed here: nothing is chosen, fine too
        chosen = None
    assert chosen not in ("mlx", "mlx-stream")


def test_explicit_selection_probes_the_model(gemma4_dir: Path, tmp_path: Path) -> None:
    assert probe.probe_batch(settings_for(gemma4_dir), "cpu") is None
    assert probe.probe_stream(settings_for(gemma4_dir, backend="mlx-stream"), "cpu") is None
    assert select_backend(settings_for(gemma4_dir)).spec.name == "mlx"
    assert "does not exist" in (probe.probe_batch(settings_for(tmp_path / "missing"), "cpu") or "")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    reason = probe.probe_batch(settings_for(tmp_path), "cpu") or ""
    assert "mamba" in reason and "BACKEND=mlx-stream" in reason
    assert probe.probe_stream(settings_for(tmp_path, backend="mlx-stream"), "cpu") is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    assert "not supported by the installed mlx_lm" in (probe.probe_stream(settings_for(tmp_path), "cpu") or "")


def test_missing_mlx_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # makes `import mlx.core` raise ImportError
    reason = probe.probe_batch(settings_for(None), "cpu") or ""
    assert 'pip install "gemmaserve[mlx]"' in reason and "mlx[cpu]" in reason


def test_mps_without_metal_is_refused(gemma4_dir: Path) -> None:
    import mlx.core as mx

    if mx.metal.is_available():
        pytest.skip("Metal is available here")
    assert "no Metal GPU" in (probe.probe_batch(settings_for(gemma4_dir), "mps") or "")


@pytest.mark.parametrize("backend", ["mlx", "mlx-stream"])
def test_llm_api_runs_each_backend_end_to_end(gemma4_dir: Path, backend: str) -> None:
    """Entry point -> selection -> factory -> engine thread -> scheduler; a follow-up request reuses
    KV (the core prefix cache for mlx, the previous stream's KV for mlx-stream)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(model=str(gemma4_dir), backend=backend, device="cpu", dtype="float32", kv_block_size=4) as llm:
        assert llm.engine.backend_name == backend
        first, twin = llm.generate(["the quick brown fox jumps over", "the quick brown fox jumps over"], params)
        follow_up = [*first.prompt_token_ids, *first.token_ids, *llm.tokenizer.encode(" the dog")]
        (second,) = llm.generate([follow_up], params)
        llm.engine.check_integrity()
    assert first.token_ids == twin.token_ids and len(first.token_ids) == 6 and first.text
    assert len(second.token_ids) == 6
    prompt_len = len(first.prompt_token_ids)
    expected_hit = prompt_len // 4 * 4 if backend == "mlx" else prompt_len + 6
    assert second.cached_tokens == expected_hit


def test_llm_top_logprobs_on_the_batched_backend(gemma4_dir: Path) -> None:
    """``logprobs=k`` end to end on mlx: every generated token comes with its k most likely alternatives, most
    likely first; greedy picks the first of them and its logprob is the chosen one's."""
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
    with LLM(model=str(gemma4_dir), backend="mlx", device="cpu", dtype="float32", kv_block_size=4) as llm:
        (out,) = llm.generate(["the quick brown fox"], params)
    assert out.top_logprobs is not None and out.token_logprobs is not None and len(out.top_logprobs) == 5
    for token, logprob, top in zip(out.token_ids, out.token_logprobs, out.top_logprobs):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob, abs=1e-6)
