"""gemmaserve: a plugin-architecture LLM inference engine for Gemma models.

``import gemmaserve`` is light: it never imports torch, transformers, triton or mlx. Backends are
separate distributions discovered through the ``gemmaserve.backends`` entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gemmaserve.hookspecs import hookimpl
from gemmaserve.registry import BackendSpec
from gemmaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gemmaserve.api import LLM, CompletionOutput

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "SamplingParams", "BackendSpec", "hookimpl", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput"):
        from gemmaserve import api

        return getattr(api, name)
    raise AttributeError(f"module 'gemmaserve' has no attribute {name!r}")
