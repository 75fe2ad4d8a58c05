"""Availability probe of the custom-* backends: ``unavailable_reason(settings, device) -> str | None``.

Reports (None = can run): torch missing, the device missing, a model folder without a readable
``config.json``, or an architecture other than Gemma 3 / Gemma 4 text. ``MODEL`` unset means the embedded
default model (a Gemma 3 270M), which is supported. Imports torch only to check the device.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmaserve.hardware import device_unavailable_reason

if TYPE_CHECKING:
    from gemmaserve.settings import CoreSettings

__all__ = ["SUPPORTED_ARCHITECTURES", "unavailable_reason", "architecture_reason"]

SUPPORTED_ARCHITECTURES = ("gemma3", "gemma3_text", "gemma4", "gemma4_text")


def unavailable_reason(settings: CoreSettings, device: str) -> str | None:
    """Why a custom-* backend cannot run ``settings.model`` on ``device``, or None if it can."""
    if importlib.util.find_spec("torch") is None:
        return 'torch is not installed (pip install "gemmaserve[custom-torch]")'
    reason = device_unavailable_reason(device)
    if reason is not None:
        return reason
    return architecture_reason(settings.model)


def architecture_reason(model: str | None) -> str | None:
    """None if ``model`` (a checkpoint folder, or None = the default Gemma 3 model) is a supported
    architecture; else a one-line reason naming what was found and what is accepted."""
    if model is None:
        return None
    config_file = Path(model).expanduser() / "config.json"
    if not config_file.is_file():
        return f"MODEL={model!r} has no config.json (expected a Hugging Face checkpoint folder)"
    try:
        raw: Any = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return f"cannot read {config_file}: {exc}"
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED_ARCHITECTURES:
        return (
            f"unsupported architecture {model_type!r} in {config_file} (custom-* backends run "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}; use BACKEND=hf for other models)"
        )
    return None
