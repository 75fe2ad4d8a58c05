"""Availability probes: ``probe(settings, device) -> str | None`` (None = can run).

Cheap: they import ``mlx.core`` (0.1 s) and read config.json, never mlx_lm or the weights (unless the
model type is one mlx_lm renames). On a machine that is not Apple silicon the MLX backends are
never chosen by ``BACKEND=auto`` (hf is the CPU default there) but run when selected explicitly.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from gemmaserve.errors import ModelLoadError
from gemmaserve.hardware import is_apple_silicon

from gemmaserve_mlx.model_dir import BATCHED_ARCHITECTURES, read_model_dir

if TYPE_CHECKING:
    from gemmaserve.settings import CoreSettings

__all__ = ["probe_batch", "probe_stream", "mlx_import_problem"]

INSTALL_HINT = 'pip install "gemmaserve[mlx]" (on Linux that installs mlx[cpu])'


def probe_batch(settings: CoreSettings, device: str) -> str | None:
    """Why BACKEND=mlx cannot run here, or None."""
    return _probe(settings, device, "mlx", batched=True)


def probe_stream(settings: CoreSettings, device: str) -> str | None:
    """Why BACKEND=mlx-stream cannot run here, or None."""
    return _probe(settings, device, "mlx-stream", batched=False)


def mlx_import_problem() -> str | None:
    """Why mlx / mlx_lm cannot be imported, or None."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as exc:
        return f"mlx is not importable ({exc}): {INSTALL_HINT}"
    if importlib.util.find_spec("mlx_lm") is None:
        return f"mlx_lm is not installed: {INSTALL_HINT}"
    return None


def _probe(settings: CoreSettings, device: str, name: str, *, batched: bool) -> str | None:
    if settings.backend == "auto" and not is_apple_silicon():
        return f"not Apple silicon: select it explicitly with BACKEND={name}"
    problem = mlx_import_problem()
    if problem is not None:
        return problem
    if device == "mps":
        import mlx.core as mx

        if not mx.metal.is_available():
            return "MLX reports no Metal GPU; use DEVICE=cpu"
    if settings.model is None:
        return None  # the embedded default model (Gemma 3, safetensors) is prepared by the core
    try:
        model_dir = read_model_dir(settings.model)
    except ModelLoadError as exc:
        return str(exc)
    if batched and model_dir.architecture not in BATCHED_ARCHITECTURES:
        return (
            f"architecture {model_dir.config['model_type']!r} has no batched-KV support in BACKEND=mlx "
            f"(supported: {', '.join(sorted(BATCHED_ARCHITECTURES))}); use BACKEND=mlx-stream"
        )
    return None
