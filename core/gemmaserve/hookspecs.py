"""pluggy hook specifications. Plugins implement them in a module named by an entry point of the
``gemmaserve.backends`` group. This module imports nothing heavy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from gemmaserve.registry import BackendSpec
    from gemmaserve.settings import CoreSettings

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME"]

PROJECT_NAME = "gemmaserve"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def gemmaserve_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Call ``register(BackendSpec(...))`` once per backend the plugin provides.

    Must be cheap and re-entrant, and must not import torch, transformers, triton or mlx: a spec
    names its factory and probe as dotted paths, resolved only when needed.
    """


@hookspec(firstresult=True)
def gemmaserve_select_backend(settings: CoreSettings, candidates: Sequence[BackendSpec], device: str) -> str | None:
    """Return the name of the backend to use when ``BACKEND=auto``, or None to defer to the default
    rule (lowest priority number among available backends supporting ``device``)."""
