"""Settings helpers shared by the hf_torch tests (a uniquely named module: every test folder has
its own ``conftest``, so tests must not import helpers from ``conftest`` by name)."""

from __future__ import annotations

from typing import Any

from gemmaserve.settings import CoreSettings, load_settings
from gemmaserve_hf_torch.settings import HFTorchSettings

__all__ = ["cpu_settings", "hf_settings"]


def cpu_settings(**overrides: Any) -> CoreSettings:
    """Core settings for tests: cpu / float32 unless overridden (init values win over the env)."""
    return load_settings(**{"device": "cpu", "dtype": "float32", **overrides})


def hf_settings(**overrides: Any) -> HFTorchSettings:
    """Plugin settings for tests: eager-safe defaults (no compile, sdpa) unless overridden."""
    return HFTorchSettings(**{"compile_model": False, "hf_attn_implementation": "sdpa", **overrides})
