"""Checkpoint checks and the config fixes that let mlx_lm read transformers-5 checkpoints."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from gemmaserve.errors import ModelLoadError

from gemmaserve_mlx.model_dir import config_overrides, mlx_architecture, read_model_dir


def test_read_model_dir_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_model_dir(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        read_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        read_model_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert read_model_dir(tmp_path).architecture == "llama"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    with pytest.raises(ModelLoadError, match="not supported by the installed mlx_lm"):
        read_model_dir(tmp_path)


@pytest.mark.parametrize("extra, refused", [({"sliding_window": 4}, True), ({"sliding_window": None}, False),
                                           ({"sliding_window": 4096}, False),  # the window covers the context
                                           ({"sliding_window": 4, "layer_types": ["sliding_attention"] * 2
                                             + ["full_attention"]}, False)])
def test_a_mistral_window_mlx_lm_would_drop_is_refused(tmp_path: Path, extra: dict, refused: bool) -> None:
    """mlx_lm's llama module windows only the layers layer_types names: a Mistral sliding window without them would
    silently become full attention (other tokens than transformers' once a prompt outgrows the window)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "max_position_embeddings": 4096,
                                                      **extra}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    if refused:
        with pytest.raises(ModelLoadError, match=r"sliding_window=4: .* use BACKEND=hf"):
            read_model_dir(tmp_path)
    else:
        assert read_model_dir(tmp_path).architecture == "llama"


@pytest.mark.parametrize("config", [{"model_type": "gemma4_text", "sliding_window": 1,
                                     "layer_types": ["sliding_attention", "full_attention"]},
                                    {"model_type": "mistral", "sliding_window": 1}])
def test_a_sliding_window_of_one_is_refused(tmp_path: Path, config: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"sliding_window=1: transformers' generate keeps the whole cache"):
        read_model_dir(tmp_path)
    variants = [{"layer_types": ["full_attention"] * 2}]
    if config["model_type"].startswith("gemma"):  # Gemma 3's pattern 1 makes every layer global
        variants.append({"sliding_window_pattern": 1})
    for no_sliding_layer in variants:
        config.pop("layer_types", None)
        (tmp_path / "config.json").write_text(json.dumps({**config, **no_sliding_layer}))
        assert read_model_dir(tmp_path).architecture  # the window applies to no layer


def test_renamed_architectures_use_mlx_lm_remapping() -> None:
    assert mlx_architecture({"model_type": "mistral"}) == "llama"
    assert mlx_architecture({"model_type": "gemma4_text"}) == "gemma4_text"


def test_gemma4_per_layer_config_becomes_global_head_dim(checkpoint: Callable[[str], Path]) -> None:
    raw = json.loads((checkpoint("gemma4_per_layer_config") / "config.json").read_text())
    assert config_overrides(raw) == {"global_head_dim": 32}
    hub = json.loads((checkpoint("gemma4") / "config.json").read_text())
    assert config_overrides(hub) == {}


def test_multimodal_wrapper_gets_its_text_vocab() -> None:
    text = {"model_type": "gemma4_text", "vocab_size": 512, "global_head_dim": 32}
    overrides = config_overrides({"model_type": "gemma4", "text_config": text})
    assert overrides["vocab_size"] == 512 and overrides["text_config"]["vocab_size"] == 512


def test_omitted_gemma_fields_take_transformers_defaults_not_mlx_lms() -> None:
    """A sparse config: every field mlx_lm defaults differently is given transformers' value; Gemma 4's layer types
    are transformers' (every 6th full, the last always full)."""
    text = {"model_type": "gemma4_text", "vocab_size": 512, "global_head_dim": 32, "num_hidden_layers": 7}
    fixed = config_overrides(text)
    assert fixed["num_kv_shared_layers"] == 0 and fixed["use_double_wide_mlp"] is False
    assert fixed["final_logit_softcapping"] is None and fixed["num_key_value_heads"] == 4
    assert fixed["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] * 2
    given = {**text, "layer_types": ["sliding_attention"] * 7}
    assert config_overrides(given)["layer_types"][-1] == "full_attention"
    assert config_overrides({"model_type": "gemma3_text", "vocab_size": 512})["sliding_window"] == 4096


def test_gemma3_rope_scaling_as_transformers_reads_it() -> None:
    """Scaling on Gemma 3's sliding layers, which mlx_lm cannot apply, is refused; a legacy ``rope_scaling`` with
    ``type`` only is default RoPE (transformers 5 reads ``rope_type`` alone); with ``rope_type`` it is kept."""
    nested = {"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0},
        "full_attention": {"rope_type": "default", "rope_theta": 50.0}}}
    with pytest.raises(ModelLoadError, match="sliding_attention.*linear.*BACKEND=hf"):
        config_overrides(nested)
    legacy = {"model_type": "gemma3_text", "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 8.0}}
    assert config_overrides(legacy)["rope_scaling"] is None
    explicit = {**legacy, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert "rope_scaling" not in config_overrides(explicit)


def test_gemma3_rope_parameters_and_layer_pattern(checkpoint: Callable[[str], Path]) -> None:
    raw = json.loads((checkpoint("gemma3") / "config.json").read_text())
    assert config_overrides(raw) == {
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_window_pattern": 3,
    }
    irregular = {**raw, "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}
    with pytest.raises(ModelLoadError, match="repeating"):
        config_overrides(irregular)


def test_llama_rope_parameters() -> None:
    config = {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    assert config_overrides(config) == {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}


@pytest.mark.parametrize("config, refused", [
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 5}, True),
    ({"model_type": "qwen3", "use_sliding_window": False, "sliding_window": 5}, False),  # off, as transformers reads it
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 5,
      "layer_types": ["full_attention"] * 4}, False),  # no layer is windowed
    ({"model_type": "mixtral", "sliding_window": 5}, True), ({"model_type": "phi3", "sliding_window": 4}, True),
    ({"model_type": "mixtral", "sliding_window": None}, False),
    ({"model_type": "gemma3_text", "sliding_window": 4}, False),  # mlx_lm's gemma3 windows its sliding layers
])
def test_a_window_the_mlx_lm_module_does_not_apply_is_refused(tmp_path: Path, config: dict, refused: bool) -> None:
    """mlx_lm's qwen2/qwen3/mixtral/phi3/starcoder2 modules apply no sliding window: such a checkpoint would give
    transformers' tokens without the window, so it is refused by name (BACKEND=hf serves it)."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, **config}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    if refused:
        with pytest.raises(ModelLoadError, match=r"applies no sliding window.*use BACKEND=hf"):
            read_model_dir(tmp_path)
    else:
        assert read_model_dir(tmp_path).architecture


@pytest.mark.parametrize("config, words", [
    ({"model_type": "llama", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                                                 "original_max_position_embeddings": 16}}, "longrope RoPE"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [3.0]}},
     "longrope RoPE"),
    ({"model_type": "gemma4_text", "use_bidirectional_attention": "all"}, "embedding model"),
])
def test_checkpoints_mlx_lm_would_answer_differently_are_refused(tmp_path: Path, config: dict, words: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=words):
        read_model_dir(tmp_path)
