"""Settings of the ``hf`` backend, read from the environment / ``.env`` like the core settings.

=========================  =======  ==========================================================
env var                    default  meaning
=========================  =======  ==========================================================
``COMPILE_MODEL``          false    ``torch.compile`` the model; on failure warn and run eager
``HF_ATTN_IMPLEMENTATION`` sdpa     transformers attention kernel: ``sdpa`` or ``eager``
``TRUST_REMOTE_CODE``      false    allow checkpoints whose modeling code ships in the directory
=========================  =======  ==========================================================

Each also accepts a ``GEMMASERVE_`` prefix. Only ``sdpa`` and ``eager`` are accepted: the backend
drives every forward with an explicit 2-D padding mask and per-row positions, which is what those
two kernels are tested with (flash-attention kernels also cap the head dim below Gemma 4's 512).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gemmaserve.settings import build_settings, env_alias

__all__ = ["HFTorchSettings", "load_hf_settings"]


class HFTorchSettings(BaseSettings):
    """Plugin settings; see the module docstring for the env names."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=True)

    compile_model: bool = Field(
        False,
        validation_alias=env_alias("COMPILE_MODEL"),
        description="torch.compile the model; if compiling fails, log a warning and fall back to eager.",
    )
    hf_attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", validation_alias=env_alias("HF_ATTN_IMPLEMENTATION"), description="Attention kernel: sdpa or eager."
    )
    trust_remote_code: bool = Field(
        False,
        validation_alias=env_alias("TRUST_REMOTE_CODE"),
        description="Allow model code shipped inside the checkpoint directory (runs that code).",
    )

    @field_validator("hf_attn_implementation", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value


def load_hf_settings(**overrides: Any) -> HFTorchSettings:
    """Build the plugin settings from env/.env with ``overrides`` on top (None values ignored).

    Raises :class:`ConfigurationError` naming each bad variable and what is accepted.
    """
    return build_settings(HFTorchSettings, overrides, title="hf_torch settings")
