"""Checks on a local checkpoint directory that need no mlx: files present, architecture known.

Used by the probes (cheap, weights untouched) and by the loader (which raises ``ModelLoadError``).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmaserve.errors import WINDOW_OF_ONE, ModelLoadError
from gemmaserve.models.gemma_defaults import (
    GEMMA3_TEXT_DEFAULTS,
    GEMMA4_TEXT_DEFAULTS,
    bidirectional_problem,
    gemma_layer_types,
)

__all__ = [
    "BATCHED_ARCHITECTURES",
    "ModelDir",
    "read_model_dir",
    "mlx_architecture",
    "rope_scalings",
    "text_config",
    "config_overrides",
]

BATCHED_ARCHITECTURES = frozenset({"gemma4", "gemma4_text", "gemma3", "gemma3_text", "llama"})
"""mlx_lm modules (after mlx_lm's own remapping, e.g. mistral -> llama) whose attention layers read
``cache.offset`` as an array and build masks through ``cache.make_mask``: the ones BACKEND=mlx drives
with its left-padded batched KV. Every other mlx_lm architecture runs only under BACKEND=mlx-stream."""


@dataclass(frozen=True, slots=True)
class ModelDir:
    """A checkpoint directory that passed the file checks; ``config`` is its parsed config.json."""

    path: Path
    config: dict[str, Any]
    architecture: str  # the mlx_lm.models module that implements it

    @property
    def name(self) -> str:
        return self.path.name


def read_model_dir(model_path: str | Path) -> ModelDir:
    """Validate ``model_path`` (config.json, safetensors weights, an mlx_lm architecture).

    Raises ModelLoadError naming the missing piece. Imports mlx_lm only to look its models up.
    """
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist; set MODEL to a local checkpoint folder")
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(
            f"{str(path)!r} has no config.json; MODEL must be a Hugging Face checkpoint folder"
        ) from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(config_file)!r}: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{str(config_file)!r} has no 'model_type'; it is not a transformers model config")
    if not any(path.glob("model*.safetensors")):
        raise ModelLoadError(
            f"{str(path)!r} has no model*.safetensors weights; MLX loads safetensors only "
            "(convert .bin/GGUF checkpoints with transformers' save_pretrained first)"
        )
    architecture = mlx_architecture(config)
    _check_sliding_window(config, architecture)
    _check_rope(config)
    _check_causal(config)
    return ModelDir(path, config, architecture)


def rope_scalings(config: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    """The text model's RoPE entries (transformers 5's ``rope_parameters``, the legacy ``rope_scaling``) with their
    type (``rope_type``, else the legacy ``type``)."""
    inner = text_config(config)
    entries = (inner.get("rope_parameters"), inner.get("rope_scaling"))
    return [(entry.get("rope_type", entry.get("type")), entry) for entry in entries if isinstance(entry, dict)]


def _check_rope(config: dict[str, Any]) -> None:
    """ModelLoadError for longrope (Phi-3 style) RoPE whose short and long factors differ: mlx_lm applies the long
    factors at every position, where transformers uses the short ones within ``original_max_position_embeddings``,
    so even a short prompt gets other tokens than transformers'."""
    for kind, entry in rope_scalings(config):
        if kind in ("longrope", "su") and entry.get("short_factor") != entry.get("long_factor"):
            raise ModelLoadError(
                f"{config['model_type']} checkpoint with {kind} RoPE: mlx_lm applies its long_factor at every "
                "position, where transformers uses short_factor up to original_max_position_embeddings, so the "
                "tokens would differ from transformers'; use BACKEND=hf")


def _check_causal(config: dict[str, Any]) -> None:
    """ModelLoadError for an embedding-style Gemma (:func:`~gemmaserve.models.gemma_defaults.bidirectional_problem`)."""
    problem = bidirectional_problem(config)
    if problem is not None:
        raise ModelLoadError(problem)


def _check_sliding_window(config: dict[str, Any], architecture: str) -> None:
    """ModelLoadError for a window of 1 (as every backend: see docs/architecture.md), for a Llama-family
    checkpoint (Mistral) whose ``sliding_window`` mlx_lm's ``llama`` module would not apply (it windows only the
    layers ``layer_types`` names), and for any other architecture whose mlx_lm module applies no window (Qwen2 /
    Qwen3 with ``use_sliding_window``, Mixtral, Phi-3, Starcoder2): every layer would attend to the whole context
    and the tokens part from transformers' once a prompt outgrows the window."""
    inner = text_config(config)
    window = inner.get("sliding_window")
    types = inner.get("layer_types")
    sliding = "sliding_attention" in types if types else inner.get("sliding_window_pattern") != 1  # 1: all global
    if window == 1 and sliding:
        raise ModelLoadError(
            f"{config['model_type']} checkpoint with sliding_window=1: {WINDOW_OF_ONE}")
    if (not isinstance(window, int) or isinstance(window, bool) or inner.get("use_sliding_window") is False
            or not sliding or window >= int(inner.get("max_position_embeddings") or window + 1)):
        return  # no window that is narrower than the context
    if architecture != "llama":
        # a wrapper's text model (gemma4 -> gemma4_text) is where the window lives
        if not any(_module_windows(str(name)) for name in (architecture, inner.get("model_type")) if name):
            raise ModelLoadError(
                f"{config['model_type']} checkpoint with sliding_window={window}: mlx_lm's {architecture!r} module "
                "applies no sliding window, so every layer would attend to the whole context (other tokens than "
                "transformers' past the window); use BACKEND=hf")
    elif "layer_types" not in inner:
        raise ModelLoadError(
            f"{config['model_type']} checkpoint with sliding_window={window}: mlx_lm's llama module applies a "
            "window only to the layers config.json's layer_types names, and this config has none, so every layer "
            "would attend to the whole context (other tokens than transformers' past the window); use BACKEND=hf")


def _module_windows(name: str) -> bool:
    """Whether mlx_lm's ``models/<name>.py`` implements a sliding window (it names one: ``sliding_window`` or the
    rotating cache), read without importing it."""
    module = _mlx_lm_module_file(name)
    text = module.read_text(errors="replace") if module is not None else ""
    return "sliding_window" in text or "RotatingKVCache" in text


def mlx_architecture(config: dict[str, Any]) -> str:
    """The mlx_lm.models module for ``config``; raises ModelLoadError when mlx_lm has none.

    Cheap for the usual case (a module named like ``model_type``); only a renamed type (e.g. mistral)
    imports ``mlx_lm.utils`` (and with it transformers) for mlx_lm's remapping table.
    """
    model_type = str(config["model_type"])
    architecture = model_type
    if not _has_mlx_lm_module(architecture):
        from mlx_lm.utils import MODEL_REMAPPING

        architecture = MODEL_REMAPPING.get(model_type, model_type)
    if not _has_mlx_lm_module(architecture):
        raise ModelLoadError(
            f"architecture {model_type!r} is not supported by the installed mlx_lm; "
            "use BACKEND=hf, or upgrade mlx-lm"
        )
    return architecture


def _mlx_lm_module_file(name: str) -> Path | None:
    """``mlx_lm/models/<name>.py`` if it exists, found without importing mlx_lm. Raises ModelLoadError when mlx_lm
    is not installed."""
    if not name.isidentifier():
        return None
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError('mlx_lm is not installed: pip install "gemmaserve[mlx]"')
    files = (Path(root) / "models" / f"{name}.py" for root in spec.submodule_search_locations)
    return next((file for file in files if file.is_file()), None)


def _has_mlx_lm_module(name: str) -> bool:
    return _mlx_lm_module_file(name) is not None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of ``config`` (``text_config`` of multimodal checkpoints)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Top-level config entries to override so mlx_lm reads a transformers-5 checkpoint right.

    - Gemma 4: the full-attention head size is saved in ``per_layer_config`` instead of
      ``global_head_dim`` (hub style); mlx_lm would silently default it to 512.
    - RoPE: transformers 5 saves ``rope_parameters`` (per layer type for Gemma 3) where mlx_lm's
      Llama / Gemma 3 read ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling``; without
      the translation mlx_lm falls back to its defaults (e.g. drops Gemma 3's linear scaling).
    - Gemma 3: mlx_lm places full-attention layers by ``sliding_window_pattern`` (default 6), which
      transformers 5 no longer saves; derive it from ``layer_types``.
    - mlx_lm's multimodal wrappers copy a top-level ``vocab_size`` (default 262144) over the text
      config's: pass the text config's own when the top level has none.
    - Gemma 3 / 4 fields the config omits take transformers' defaults, not mlx_lm's (which differ:
      ``num_kv_shared_layers`` 20, ``use_double_wide_mlp``, a softcap of 30, a 512-token Gemma 3 window), and a
      Gemma 4 model gets transformers' layer types (every 6th full when none are given, the last always full;
      mlx_lm made every 5th full and left the last alone).
    """
    inner = text_config(config)
    model_type = str(inner.get("model_type", config["model_type"]))
    fixes = {
        **_transformers_defaults(inner, model_type),
        **_gemma4_head_dims(inner, model_type),
        **_rope_fields(inner, model_type),
        **_gemma3_pattern(inner, model_type),
    }
    overrides: dict[str, Any] = {}
    if inner is not config:
        if "vocab_size" not in config and isinstance(inner.get("vocab_size"), int):
            overrides["vocab_size"] = inner["vocab_size"]
        if fixes:
            overrides["text_config"] = {**inner, **fixes}
        return overrides
    return fixes


def _transformers_defaults(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The Gemma fields ``config`` omits at transformers' defaults (RoPE left to :func:`_rope_fields`), and Gemma 4's
    layer types as transformers resolves them."""
    family = "gemma4" if model_type.startswith("gemma4") else "gemma3" if model_type.startswith("gemma3") else None
    if family is None:
        return {}
    table = GEMMA4_TEXT_DEFAULTS if family == "gemma4" else GEMMA3_TEXT_DEFAULTS
    rope = ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq", "layer_types")
    theirs = _mlx_lm_defaults(f"{family}_text")
    fixes = {key: value for key, value in table.items()
             if key not in config and key not in rope and (theirs is None or key in theirs and theirs[key] != value)}
    if family == "gemma4":
        layers = int(config.get("num_hidden_layers", table["num_hidden_layers"]))
        given = config.get("layer_types")
        resolved = gemma_layer_types(family, layers, given if isinstance(given, list) else None)
        if resolved != given:
            fixes["layer_types"] = resolved
    return fixes


def _mlx_lm_defaults(module: str) -> dict[str, Any] | None:
    """The field defaults of ``mlx_lm.models.<module>.ModelArgs`` (None if mlx_lm cannot be imported here: then
    every omitted field is filled)."""
    import dataclasses

    try:
        args = importlib.import_module(f"mlx_lm.models.{module}").ModelArgs
    except ImportError:
        return None
    return {f.name: f.default for f in dataclasses.fields(args) if f.default is not dataclasses.MISSING}


def _gemma4_head_dims(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``global_head_dim`` (and the global KV heads) recovered from ``per_layer_config``."""
    layers = config.get("per_layer_config")
    if not model_type.startswith("gemma4") or "global_head_dim" in config or not isinstance(layers, dict):
        return {}
    fixes: dict[str, Any] = {}
    for override in layers.values():
        if isinstance(override, dict):
            if "head_dim" in override:
                fixes["global_head_dim"] = override["head_dim"]
            if "num_key_value_heads" in override and config.get("num_global_key_value_heads") is None:
                fixes["num_global_key_value_heads"] = override["num_key_value_heads"]
    return fixes


def _rope_fields(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """mlx_lm's flat RoPE fields from transformers-5 ``rope_parameters`` (Gemma 4 reads those itself). Gemma 3's
    full-layer scaling is resolved as transformers resolves it (a legacy ``rope_scaling`` over the nested
    full-attention entry; its rope type from ``rope_type`` alone, default when absent, where mlx_lm read ``type``);
    scaling on its sliding layers, which mlx_lm cannot apply, is a ModelLoadError."""
    params = config.get("rope_parameters")
    legacy = config.get("rope_scaling")
    gemma3 = model_type.startswith("gemma3")
    if model_type.startswith("gemma4") or (not isinstance(params, dict) and not (gemma3 and isinstance(legacy, dict))):
        return {}
    params = params if isinstance(params, dict) else {}
    fixes: dict[str, Any] = {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        sliding = params.get("sliding_attention") or {}
        kind = sliding.get("rope_type", "default")
        if kind != "default":  # mlx_lm's gemma3 builds its sliding layers' RoPE from a base frequency alone
            raise ModelLoadError(
                f"rope_parameters['sliding_attention'].rope_type is {kind!r}: mlx_lm's gemma3 applies RoPE scaling "
                "to full-attention layers only, so its sliding layers would silently use plain RoPE; use BACKEND=hf "
                "for this checkpoint")
        if "rope_theta" in full and "rope_theta" not in config:
            fixes["rope_theta"] = full["rope_theta"]
        if "rope_theta" in sliding and "rope_local_base_freq" not in config:
            fixes["rope_local_base_freq"] = sliding["rope_theta"]
        scaling = full
    else:
        scaling = params
        if "rope_theta" in params and "rope_theta" not in config:
            fixes["rope_theta"] = params["rope_theta"]
    if gemma3:
        resolved = {"rope_type": "default", **scaling, **(legacy if isinstance(legacy, dict) else {})}
        kind = resolved["rope_type"]  # a legacy "type" is not read (transformers 5 reads rope_type alone here)
        kept = {key: value for key, value in resolved.items() if key not in ("rope_theta", "type")}
        wanted = None if kind == "default" else {**kept, "rope_type": kind}
        if wanted != legacy:
            fixes["rope_scaling"] = wanted
    elif legacy is None and scaling.get("rope_type", "default") != "default":
        fixes["rope_scaling"] = {key: value for key, value in scaling.items() if key != "rope_theta"}
    return fixes


def _gemma3_pattern(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``sliding_window_pattern`` from ``layer_types``; ModelLoadError if mlx_lm cannot express them."""
    layer_types = config.get("layer_types")
    if not model_type.startswith("gemma3") or not isinstance(layer_types, list) or not layer_types:
        return {}
    if "full_attention" not in layer_types:
        raise ModelLoadError("Gemma 3 config has no full_attention layer; mlx_lm's gemma3 needs at least one")
    pattern = layer_types.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(len(layer_types))]
    if layer_types != expected:
        raise ModelLoadError(
            f"Gemma 3 layer_types {layer_types} are not a repeating sliding/full pattern, which is all "
            "mlx_lm's gemma3 can express; use BACKEND=hf"
        )
    return {} if config.get("sliding_window_pattern") == pattern else {"sliding_window_pattern": pattern}
