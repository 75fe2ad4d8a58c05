"""Plugin registration, the registry probe and the plugin settings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gemmaserve.errors import ConfigurationError
from gemmaserve.plugins import load_registry
from gemmaserve.registry import BackendSpec
from gemmaserve.settings import load_settings
from gemmaserve_hf_torch import plugin
from gemmaserve_hf_torch.probe import model_dir_problem, unavailable_reason
from gemmaserve_hf_torch.settings import load_hf_settings


def test_hook_registers_the_hf_spec() -> None:
    specs: list[BackendSpec] = []
    plugin.gemmaserve_register_backends(register=specs.append)
    assert len(specs) == 1
    spec = specs[0]
    assert (spec.name, spec.aliases, spec.priority) == ("hf", ("torch", "hf-torch"), 50)
    assert spec.factory == "gemmaserve_hf_torch.backend:create_backend"
    assert spec.probe == "gemmaserve_hf_torch.probe:unavailable_reason"
    assert spec.devices == ("cpu", "cuda", "mps")


def test_entry_point_registry_resolves_aliases() -> None:
    registry = load_registry()
    for name in ("hf", "torch", "hf-torch", "HF_TORCH"):
        assert registry.resolve_name(name) == "hf", name
    assert registry.get("hf").plugin == "gemmaserve-hf-torch"  # the distribution that ships it


def test_plugin_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, gemmaserve_hf_torch.plugin, gemmaserve_hf_torch.settings; "
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_probe_accepts_a_checkpoint_and_no_model(gemma4_dir: Path, llama_dir: Path) -> None:
    assert unavailable_reason(load_settings(model=str(gemma4_dir)), "cpu") is None
    assert unavailable_reason(load_settings(model=str(llama_dir)), "cpu") is None
    assert unavailable_reason(load_settings(), "cpu") is None


def _copy_config(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_probe_names_what_is_wrong_with_the_model_dir(llama_dir: Path, tmp_path: Path) -> None:
    def reason(path: Path, trust: bool = False) -> str:
        text = model_dir_problem(path, trust_remote_code=trust)
        assert text is not None
        return text

    assert "does not exist" in reason(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in reason(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in reason(tmp_path / "empty")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    assert "cannot read" in reason(tmp_path / "badjson")
    assert "no weights" in reason(_copy_config(llama_dir, tmp_path / "noweights"))
    text = reason(_copy_config(llama_dir, tmp_path / "vit", model_type="vit", architectures=["ViTModel"]))
    assert "unsupported architecture" in text and "'vit'" in text and "gemma4" in text and "llama" in text
    remote = _copy_config(llama_dir, tmp_path / "remote", model_type="my_custom_lm", auto_map={"AutoModelForCausalLM": "m.M"})
    shutil.copy(llama_dir / "model.safetensors", remote / "model.safetensors")
    assert "TRUST_REMOTE_CODE" in reason(remote)
    assert model_dir_problem(remote, trust_remote_code=True) is None
    # the registry probe reports the same reason
    assert "does not exist" in (unavailable_reason(load_settings(model=str(tmp_path / "nope")), "cpu") or "")


def test_probe_reports_missing_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert "CUDA" in (unavailable_reason(load_settings(), "cuda") or "")


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = load_hf_settings()
    assert (defaults.compile_model, defaults.hf_attn_implementation, defaults.trust_remote_code) == (False, "sdpa", False)
    monkeypatch.setenv("COMPILE_MODEL", "1")
    monkeypatch.setenv("GEMMASERVE_HF_ATTN_IMPLEMENTATION", " EAGER ")
    monkeypatch.setenv("TRUST_REMOTE_CODE", "true")
    loaded = load_hf_settings()
    assert (loaded.compile_model, loaded.hf_attn_implementation, loaded.trust_remote_code) == (True, "eager", True)
    monkeypatch.setenv("HF_ATTN_IMPLEMENTATION", "flash_attention_2")
    with pytest.raises(ConfigurationError, match="HF_ATTN_IMPLEMENTATION"):
        load_hf_settings()
