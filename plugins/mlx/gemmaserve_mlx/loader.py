"""Load a local checkpoint with mlx_lm: model, tokenizer, device, dtype and the core ``ModelInfo``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from gemmaserve.backend import ModelInfo
from gemmaserve.errors import BackendUnavailableError, ModelLoadError

from gemmaserve_mlx.model_dir import ModelDir, config_overrides, read_model_dir, text_config
from gemmaserve_mlx.tokenizer import MlxTokenizer

if TYPE_CHECKING:
    from gemmaserve.settings import CoreSettings

__all__ = ["LoadedModel", "load_model", "mlx_device", "mlx_dtype"]

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(slots=True)
class LoadedModel:
    """An mlx_lm model ready to run on ``device`` (an ``mx.Device``), with its tokenizer and facts."""

    model: nn.Module
    tokenizer: MlxTokenizer
    model_dir: ModelDir
    device: Any
    dtype: Any
    info: ModelInfo


def mlx_device(device: str, settings: CoreSettings) -> Any:
    """``mps`` -> the Metal GPU; ``cpu`` -> the CPU, except that an auto-detected ``cpu`` (torch absent
    on a Mac) still uses Metal when MLX has it. Raises BackendUnavailableError for mps without Metal."""
    metal = mx.metal.is_available()
    if device == "mps":
        if not metal:
            raise BackendUnavailableError("DEVICE=mps but MLX reports no Metal GPU; use DEVICE=cpu")
        return mx.gpu
    if device != "cpu":
        raise BackendUnavailableError(f"the MLX backends run on mps or cpu, not {device!r}")
    return mx.gpu if (metal and settings.device == "auto") else mx.cpu


def mlx_dtype(settings: CoreSettings, device: Any) -> Any:
    """DTYPE as an mlx dtype; auto = bfloat16 on the GPU, float32 on the CPU."""
    if settings.dtype == "auto":
        return mx.bfloat16 if device == mx.gpu else mx.float32
    return _DTYPES[settings.dtype]


def load_model(model_path: str | Path, device: str, settings: CoreSettings) -> LoadedModel:
    """Load ``model_path`` (a local HF safetensors folder). Raises ModelLoadError with the cause."""
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import load_tokenizer

    model_dir = read_model_dir(model_path)
    target = mlx_device(device, settings)
    dtype = mlx_dtype(settings, target)
    try:
        with mx.stream(target):
            model, config = mlx_lm_load_model(model_dir.path, model_config=config_overrides(model_dir.config),
                                              get_model_classes=_model_classes)
            wrapper = load_tokenizer(model_dir.path, eos_token_ids=config.get("eos_token_id", None))
            model.set_dtype(dtype)
            _materialize(model)
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        raise ModelLoadError(f"mlx_lm cannot load {str(model_dir.path)!r}: {exc}") from exc
    except TypeError as exc:  # mlx_lm's ModelArgs missing fields a transformers-5 config.json names otherwise
        raise ModelLoadError(
            f"mlx_lm's {model_dir.architecture!r} module cannot read {str(model_dir.path)!r}'s config.json ({exc}): "
            "transformers 5 saves some fields under names this mlx_lm does not read; use BACKEND=hf for this "
            "checkpoint, or upgrade mlx-lm") from exc
    tokenizer = MlxTokenizer(wrapper, model_dir.name)
    info = _model_info(model_dir, tokenizer, settings, dtype, "mps" if target == mx.gpu else "cpu")
    return LoadedModel(model, tokenizer, model_dir, target, dtype, info)


_TRANSFORMERS5_MULTIMODAL_NAMES = (("model.language_model.", "language_model.model."),
                                   ("model.vision_tower.", "vision_tower."),
                                   ("model.multi_modal_projector.", "multi_modal_projector."),
                                   ("lm_head.", "language_model.lm_head."))
"""Weight-name prefixes of a Gemma 3 multimodal checkpoint saved by transformers 5, and the Hub names mlx_lm's
``gemma3`` module reads."""


def _model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx_lm's model and args classes for ``config``; its ``gemma3`` (multimodal wrapper) takes the weight names
    transformers 5 saves too (it finds no ``language_model`` in them and fails otherwise)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    if model_class.__module__ != "mlx_lm.models.gemma3":
        return model_class, args_class

    class Gemma3Model(model_class):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            return super().sanitize({_hub_name(key): value for key, value in weights.items()})

    return Gemma3Model, args_class


def _hub_name(key: str) -> str:
    for new, hub in _TRANSFORMERS5_MULTIMODAL_NAMES:
        if key.startswith(new):
            return hub + key[len(new):]
    return key


def _materialize(model: nn.Module) -> None:
    """Evaluate every array the model holds, including private ones that ``parameters()`` skips
    (e.g. RoPE frequency tables): a lazy array made on this thread's stream cannot be evaluated from
    another thread (the engine's), so run one token through the model here."""
    from mlx_lm.models.cache import make_prompt_cache

    mx.eval(model.parameters())
    mx.eval(model(mx.array([[0]]), cache=make_prompt_cache(model)))


def _model_info(
    model_dir: ModelDir, tokenizer: MlxTokenizer, settings: CoreSettings, dtype: Any, device: str
) -> ModelInfo:
    config = text_config(model_dir.config)
    vocab = config.get("vocab_size") or model_dir.config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ModelLoadError(f"{str(model_dir.path)!r}: config.json has no valid vocab_size")
    model_len = config.get("max_position_embeddings") or model_dir.config.get("max_position_embeddings") or 8192
    if settings.max_model_len is not None:
        model_len = min(model_len, settings.max_model_len)
    eos = set(tokenizer.eos_token_ids)
    for source in (model_dir.config, config):
        value = source.get("eos_token_id")
        eos.update([value] if isinstance(value, int) else [v for v in value or () if isinstance(v, int)])
    return ModelInfo(
        name=model_dir.name,
        vocab_size=int(vocab),
        max_model_len=int(model_len),
        eos_token_ids=tuple(sorted(eos)),
        architecture=str(model_dir.config["model_type"]),
        dtype=str(dtype).removeprefix("mlx.core."),
        device=device,
    )
