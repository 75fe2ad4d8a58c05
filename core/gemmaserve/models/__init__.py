"""Models that gemmaserve can provide by itself.

Importing this package is cheap: it pulls in no torch, transformers or gguf. The heavy work of
:func:`ensure_default_model` imports those lazily, only when a conversion is needed.
"""

from gemmaserve.models.default_model import (
    DEFAULT_MODEL_NAME,
    DefaultModelDependencyError,
    DefaultModelError,
    default_model_dir,
    ensure_default_model,
    is_default_model_ready,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DefaultModelDependencyError",
    "DefaultModelError",
    "default_model_dir",
    "ensure_default_model",
    "is_default_model_ready",
]
