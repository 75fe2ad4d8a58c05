"""Settings of the MLX plugin, read from the environment (and ``.env``), next to the core settings."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from gemmaserve.settings import build_settings, env_alias

__all__ = ["MlxSettings", "load_mlx_settings"]


class MlxSettings(BaseSettings):
    """``MLX_*`` variables. Every field can also be passed as a keyword to :func:`load_mlx_settings`."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=True)

    kv_growth: int = Field(
        256,
        ge=1,
        le=65536,
        validation_alias=env_alias("MLX_KV_GROWTH"),
        description="Columns added each time a batched KV buffer grows; also how far sliding-window layers "
        "may run past their window before their oldest columns are dropped.",
    )
    stream_prompt_caches: int = Field(
        4,
        ge=0,
        validation_alias=env_alias("MLX_STREAM_PROMPT_CACHES"),
        description="mlx-stream: how many finished streams' KV caches to keep for prefix reuse (LRU, one per "
        "session id); each holds its prompt + output KV. 0 disables reuse.",
    )


def load_mlx_settings(**overrides: Any) -> MlxSettings:
    """Build from env/.env with ``overrides`` on top (None values ignored). Raises ConfigurationError."""
    return build_settings(MlxSettings, overrides, title="mlx settings")
