"""Cheap availability checks for the ``hf`` backend (registry probe) and for a model directory.

:func:`unavailable_reason` is the registry probe: it imports torch and transformers (to check them)
but reads only ``config.json`` of the model directory, never the weights.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from gemmaserve.hardware import device_unavailable_reason

if TYPE_CHECKING:
    from gemmaserve.settings import CoreSettings

__all__ = ["unavailable_reason", "model_dir_problem", "WEIGHT_PATTERNS"]

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_WELL_KNOWN_TYPES = ("gemma4", "gemma4_text", "gemma3", "gemma3_text", "gemma2", "gemma", "llama", "mistral", "qwen3")
_INSTALL_HINT = 'pip install "gemmaserve[hf]" (from a checkout: pip install -e plugins/hf_torch)'


def unavailable_reason(settings: CoreSettings, device: str) -> str | None:
    """Why the ``hf`` backend cannot run with ``settings`` on ``device``, or None if it can."""
    for package in ("torch", "transformers"):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed: {_INSTALL_HINT}"
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception as exc:  # a broken install must read as "unavailable", not crash the listing
        return f"torch/transformers failed to import: {type(exc).__name__}: {exc}"
    problem = device_unavailable_reason(device)
    if problem is not None:
        return problem
    if settings.quantization == "int8":
        from gemmaserve_hf_torch.int8 import int8_unavailable_reason

        problem = int8_unavailable_reason(device)
        if problem is not None:
            return problem
    from gemmaserve_hf_torch.settings import load_hf_settings

    # an invalid HF_* setting raises ConfigurationError: it stops startup (selection) instead of reading as
    # "unavailable" and letting BACKEND=auto fall through to another backend
    trust_remote_code = load_hf_settings().trust_remote_code
    if settings.model:
        return model_dir_problem(Path(settings.model), trust_remote_code=trust_remote_code)
    return None


def model_dir_problem(path: Path, *, trust_remote_code: bool) -> str | None:
    """What makes ``path`` unloadable as a causal LM (missing dir, config.json, weights, or an
    architecture transformers cannot load as a causal LM), or None. Reads config.json only."""
    if not path.exists():
        return f"model directory {str(path)!r} does not exist; set MODEL to a local Hugging Face checkpoint directory"
    if not path.is_dir():
        return f"MODEL={str(path)!r} is not a directory; point it at a Hugging Face checkpoint directory"
    config_file = path / "config.json"
    if not config_file.is_file():
        return (
            f"{str(path)!r} has no config.json; a Hugging Face checkpoint directory holds config.json, "
            "*.safetensors weights and tokenizer files"
        )
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"cannot read {str(config_file)!r}: {exc}"
    if not isinstance(raw, dict):
        return f"{str(config_file)!r} is not a JSON object"
    problem = _architecture_problem(raw, trust_remote_code=trust_remote_code)
    if problem is not None:
        return problem
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        return f"{str(path)!r} has no weights: expected *.safetensors (or pytorch_model*.bin) files next to config.json"
    return None


def _architecture_problem(raw: dict[str, object], *, trust_remote_code: bool) -> str | None:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type")
    auto_map = raw.get("auto_map")
    if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
        if trust_remote_code:
            return None
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return (
                f"model_type {model_type!r} needs the modeling code shipped in the checkpoint; "
                "set TRUST_REMOTE_CODE=1 if you trust it"
            )
    if isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    examples = ", ".join(t for t in _WELL_KNOWN_TYPES if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return (
        f"unsupported architecture: model_type {model_type!r} (architectures {raw.get('architectures')!r}) is not a "
        f"causal LM that transformers {transformers.__version__} can load; supported are the "
        f"{len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} model types of AutoModelForCausalLM, e.g. {examples}"
    )
