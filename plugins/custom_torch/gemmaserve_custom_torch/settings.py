"""`CustomTorchSettings`: the custom_torch plugin's own settings, read from ``CUSTOM_BACKEND_*`` env vars.

Pool budget (pick at most one; unset = sized from ``MAX_ACTIVE_KV_TOKENS``, see ``kv/pools.py``):

- ``CUSTOM_BACKEND_KV_MEMORY_GB``: bytes of K/V pool memory, in GiB.
- ``CUSTOM_BACKEND_KV_BLOCKS``: the same budget counted in *uniform blocks*: memory for that many blocks in
  every KV-storing layer (what uniform pools would hold). Window-aware sizing then gives the sliding group
  fewer blocks and the full group the memory saved.

``CUSTOM_BACKEND_SLIDING_BLOCKS`` fixes the sliding group's block count (the full group gets the rest of the
budget); unset = window-aware auto sizing (``kv.pools.plan_pool_sizes``: room for MAX_BATCH_SIZE windows when
the budget allows, else both pools run out together at a reference request length). Instances are immutable;
build them with :func:`load_custom_settings`.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gemmaserve.errors import ConfigurationError
from gemmaserve.settings import build_settings

__all__ = ["REMOVED_SETTINGS", "CustomTorchSettings", "load_custom_settings", "resolve_attention",
           "resolve_fast_paths"]

AttentionMode = Literal["auto", "triton", "gather"]


REMOVED_SETTINGS = {
    "prefill_graph": "prompt chunks run in the one-forward tick, whose CUDA graphs per token bucket replaced the "
                     "prefill graphs (CUSTOM_BACKEND_CUDA_GRAPH=0 turns every graph off)",
    "batched_prefill": "the one-forward tick runs every chunk of a tick in one forward",
}
"""Settings of earlier releases that are refused (naming why) instead of silently ignored."""


class CustomTorchSettings(BaseSettings):
    """Settings of the custom-{cuda,mps,cpu} backends (env prefix ``CUSTOM_BACKEND_``)."""

    model_config = SettingsConfigDict(env_prefix="CUSTOM_BACKEND_", env_file=".env", extra="ignore", frozen=True)

    kv_memory_gb: float | None = Field(
        None, gt=0, description="K/V pool memory in GiB (exclusive with KV_BLOCKS). Unset: from MAX_ACTIVE_KV_TOKENS."
    )
    kv_blocks: int | None = Field(
        None, ge=1, description="K/V budget in uniform blocks (a block in every storing layer); not with KV_MEMORY_GB."
    )
    sliding_blocks: int | None = Field(
        None, ge=1, description="Blocks of the sliding-window group; the full group gets the rest. Unset: window-aware "
        "(kv.pools.plan_pool_sizes)."
    )
    block_size: int | None = Field(
        None, ge=1, le=1024, description="Tokens per KV block. Unset: the core KV_BLOCK_SIZE."
    )
    cuda_graph: bool = Field(
        True, description="Replay decode as CUDA graphs per batch bucket and ticks with prompt tokens per token bucket "
        "(CUDA + triton attention; 0 disables)."
    )
    graph_capture: Literal["lazy", "startup"] = Field(
        "lazy", description="Capture a decode / tick bucket's graph on its first use (lazy) or all at startup."
    )
    compile: bool = Field(False, description="torch.compile the decode forward (dynamic=False), under the graphs.")
    explain: bool = Field(False, description="Log torch._dynamo.explain graph/break counts at the first decode.")
    prefill_attention: Literal["auto", "eager", "sdpa"] = Field(
        "auto", description="Attention of the one-row prefill fallback (a chunk whose pool is too tight for the tick): "
        "eager (bitwise transformers), sdpa (fused kernels); auto = sdpa on CUDA."
    )
    fuse: Literal["auto", "on", "off"] = Field(
        "auto", description="Fuse q/k/v and gate/up matmuls, RMSNorm, elementwise and MoE expert kernels at load; "
        "auto = on CUDA."
    )
    attention: AttentionMode = Field(
        "auto", description="Decode attention: auto (triton on CUDA, else gather), triton (paged kernel) or gather."
    )
    prefill_graph: str | None = Field(None, description="Removed (refused if set): see REMOVED_SETTINGS.")
    batched_prefill: str | None = Field(None, description="Removed (refused if set): see REMOVED_SETTINGS.")
    mixed_step: bool = Field(
        True, description="Run each tick's prefill chunks and decode rows as one ragged forward (forward_step); "
        "0 keeps the separate prefill_chunks + decode path. Decode-only ticks replay the decode graphs either way."
    )
    skinny_max_rows: int | None = Field(
        None, ge=0, le=64, description="Decode matmuls of at most this many rows (model-dtype weights: q/k/v, o, "
        "gate/up with GeGLU, down, PLE) run the few-row Triton kernels (kernels/skinny_gemm.py) instead of cuBLAS; "
        "0 = off. Unset: 32 where the load can (CUDA, triton, fusion, no tensor parallel, no COMPILE), else 0; a "
        "value above 0 is refused where it cannot run."
    )
    pdl: bool | None = Field(
        None, description="Launch the fused norms, elementwise kernels, paged decode attention and few-row matmuls as "
        "programmatic dependents (each kernel's weight reads overlap the previous kernel's end). Unset: on where the "
        "load can (compute capability 9.0+, triton, fusion, no tensor parallel, no COMPILE); 1 is refused elsewhere."
    )
    fast_prefill: bool = Field(
        True, description="In the one-forward tick, run the trailing KV-shared layers (Gemma 4) only for tokens whose "
        "logits are needed (stored K/V and sampled tokens unchanged); 0 computes every token through every layer."
    )

    @model_validator(mode="after")
    def _refuse_removed(self) -> CustomTorchSettings:
        for name, why in REMOVED_SETTINGS.items():
            if getattr(self, name) is not None:
                raise ValueError(f"CUSTOM_BACKEND_{name.upper()} was removed: {why}; unset it")
        return self

    @model_validator(mode="after")
    def _exclusive_budget(self) -> CustomTorchSettings:
        if self.kv_memory_gb is not None and self.kv_blocks is not None:
            raise ValueError(
                "set only one of CUSTOM_BACKEND_KV_MEMORY_GB and CUSTOM_BACKEND_KV_BLOCKS (both define the pool budget)"
            )
        return self


def load_custom_settings(**overrides: Any) -> CustomTorchSettings:
    """Settings from env/.env with ``overrides`` on top (None values ignored).

    Raises :class:`ConfigurationError` naming every bad ``CUSTOM_BACKEND_*`` variable and what is accepted.
    """
    return build_settings(CustomTorchSettings, overrides, title="custom_torch settings", env_prefix="CUSTOM_BACKEND_")


def resolve_attention(mode: AttentionMode, device_type: str, has_triton: bool) -> Literal["triton", "gather"]:
    """The decode attention path to use. ``triton`` needs CUDA (or ``TRITON_INTERPRET=1``, for tests) and
    an importable triton; ``auto`` picks it on CUDA when available. Raises ConfigurationError otherwise."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if mode == "gather":
        return "gather"
    if mode == "auto":
        return "triton" if device_type == "cuda" and has_triton else "gather"
    if not has_triton:
        raise ConfigurationError("CUSTOM_BACKEND_ATTENTION=triton but triton is not installed; use 'gather' or 'auto'")
    if device_type != "cuda" and not interpret:
        raise ConfigurationError(
            f"CUSTOM_BACKEND_ATTENTION=triton needs a CUDA device (got {device_type}); use 'gather' or 'auto' "
            "(or set TRITON_INTERPRET=1 to run the kernel in the Triton interpreter, for tests)"
        )
    return "triton"


def resolve_fast_paths(custom: CustomTorchSettings, device_type: str) -> tuple[Literal["eager", "sdpa"], bool]:
    """(prefill attention, fuse projections) for ``device_type``: ``auto`` means sdpa and fusion on CUDA, the
    bitwise-transformers eager path and unfused weights elsewhere."""
    on_cuda = device_type == "cuda"
    prefill = custom.prefill_attention if custom.prefill_attention != "auto" else ("sdpa" if on_cuda else "eager")
    fuse = custom.fuse == "on" or (custom.fuse == "auto" and on_cuda)
    return prefill, fuse
