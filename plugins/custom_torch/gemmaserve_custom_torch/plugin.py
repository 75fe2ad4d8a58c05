"""pluggy entry point (``gemmaserve.backends`` group, name ``custom_torch``): registers the three
custom-forward backends. Imports nothing heavy: factory and probe are dotted paths."""

from __future__ import annotations

from collections.abc import Callable

from gemmaserve.hookspecs import hookimpl
from gemmaserve.registry import BackendSpec

__all__ = ["SPECS", "gemmaserve_register_backends"]

_FACTORY = "gemmaserve_custom_torch.backend:create_backend"
_PROBE = "gemmaserve_custom_torch.probe:unavailable_reason"
_SETTINGS = "gemmaserve_custom_torch.settings:CustomTorchSettings"
_WHAT = "hand-written Gemma 3/4 forward, paged KV with prefix sharing and sliding-window storage"

SPECS: tuple[BackendSpec, ...] = (
    BackendSpec("custom-cuda", _FACTORY, ("cuda",), _PROBE, 10, description=f"{_WHAT}; Triton paged decode",
                tensor_parallel=True, expert_parallel=True, quantization=("fp8",), settings=_SETTINGS),
    BackendSpec("custom-mps", _FACTORY, ("mps",), _PROBE, 30, description=f"{_WHAT}; gather decode on Apple GPUs",
                settings=_SETTINGS),
    BackendSpec("custom-cpu", _FACTORY, ("cpu",), _PROBE, 60, description=f"{_WHAT}; gather decode on the CPU",
                tensor_parallel=True, expert_parallel=True, quantization=("fp8",), settings=_SETTINGS),
)


@hookimpl
def gemmaserve_register_backends(register: Callable[[BackendSpec], None]) -> None:
    for spec in SPECS:
        register(spec)
