"""Entry-point module (group ``gemmaserve.backends``): registers the ``hf`` backend.

Imports nothing heavy: the factory and probe are dotted paths resolved only when needed.
"""

from __future__ import annotations

from collections.abc import Callable

from gemmaserve import BackendSpec, hookimpl

__all__ = ["gemmaserve_register_backends", "HF_BACKEND_SPEC"]

HF_BACKEND_SPEC = BackendSpec(
    name="hf",
    aliases=("torch", "hf-torch"),
    factory="gemmaserve_hf_torch.backend:create_backend",
    devices=("cpu", "cuda", "mps"),
    probe="gemmaserve_hf_torch.probe:unavailable_reason",
    priority=50,
    quantization=("int8",),
    settings="gemmaserve_hf_torch.settings:HFTorchSettings",
    description="any Hugging Face causal LM via transformers (DynamicCache in-flight KV, core prefix cache)",
)


@hookimpl
def gemmaserve_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(HF_BACKEND_SPEC)
