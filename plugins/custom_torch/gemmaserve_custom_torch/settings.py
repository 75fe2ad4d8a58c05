"""`CustomTorchSettings`: the custom_torch plugin's own settings, read from ``CUSTOM_BACKEND_*`` env vars.

Pool budget (pick at most one; unset = sized from ``MAX_ACTIVE_KV_TOKENS``, see ``kv/pools.py``):

- ``CUSTOM_BACKEND_KV_MEMORY_GB``: bytes of K/V pool memory, in GiB.
- ``CUSTOM_BACKEND_KV_BLOCKS``: the same budget counted in *uniform blocks*: memory for that many blocks in
  every KV-storing layer (what uniform pools would hold). Window-aware sizing then gives the sliding group
  fewer blocks and the full group the memory saved.

``CUSTOM_BACKEND_SLIDING_BLOCKS`` fixes the sliding group's block count (the full group gets the rest of the
budget); unset = window-aware auto sizing. Instances are immutable; build them with :func:`load_custom_settings`.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gemmaserve.errors import ConfigurationError

__all__ = ["CustomTorchSettings", "load_custom_settings", "resolve_attention"]

AttentionMode = Literal["auto", "triton", "gather"]


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
        None, ge=1, description="Blocks of the sliding-window group; the full group gets the rest. Unset: window-aware."
    )
    block_size: int | None = Field(
        None, ge=1, le=1024, description="Tokens per KV block. Unset: the core KV_BLOCK_SIZE."
    )
    cuda_graph: bool = Field(True, description="Capture decode as a CUDA graph (CUDA fast path; 0 disables).")
    compile: bool = Field(False, description="torch.compile the model (CUDA fast path).")
    explain: bool = Field(False, description="Print torch._dynamo.explain graph-break statistics at capture.")
    attention: AttentionMode = Field(
        "auto", description="Decode attention: auto (triton on CUDA, else gather), triton (paged kernel) or gather."
    )

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
    clean = {key: value for key, value in overrides.items() if value is not None}
    try:
        return CustomTorchSettings(**clean)
    except ValidationError as exc:
        lines = ["invalid custom_torch settings:"]
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"]).upper()
            where = f"CUSTOM_BACKEND_{name}={error.get('input')!r}: " if name else ""
            lines.append(f"  {where}{error['msg']}")
        raise ConfigurationError("\n".join(lines)) from None


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
