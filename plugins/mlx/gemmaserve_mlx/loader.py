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
    from mlx_lm.utils import load as mlx_lm_load

    model_dir = read_model_dir(model_path)
    target = mlx_device(device, settings)
    dtype = mlx_dtype(settings, target)
    try:
        with mx.stream(target):
            result = mlx_lm_load(str(model_dir.path), model_config=config_overrides(model_dir.config))
            model, wrapper = result[0], result[1]
            model.set_dtype(dtype)
            _materialize(model)
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        raise ModelLoadError(f"mlx_lm cannot load {str(model_dir.path)!r}: {exc}") from exc
    tokenizer = MlxTokenizer(wrapper, model_dir.name)
    info = _model_info(model_dir, tokenizer, settings, dtype, "mps" if target == mx.gpu else "cpu")
    return LoadedModel(model, tokenizer, model_dir, target, dtype, info)


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
