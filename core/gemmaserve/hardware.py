"""Accelerator detection: cuda > mps > cpu. Imports torch lazily, only when asked and installed."""

from __future__ import annotations

import importlib.util
import platform
import sys
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["DeviceReport", "cpu_has_native_bfloat16", "detect_devices", "device_unavailable_reason", "is_apple_silicon"]


@dataclass(frozen=True, slots=True)
class DeviceReport:
    """Which device kinds work here (``available``), the best one, and why the others do not."""

    best: str
    available: tuple[str, ...]
    unavailable: dict[str, str] = field(default_factory=dict)


def is_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


@lru_cache(maxsize=1)
def detect_devices() -> DeviceReport:
    """Probe cuda and mps through torch if it is installed; cpu always works."""
    available: list[str] = []
    unavailable: dict[str, str] = {}
    if importlib.util.find_spec("torch") is None:
        unavailable["cuda"] = "torch is not installed"
        unavailable["mps"] = "torch is not installed" if is_apple_silicon() else "not Apple silicon"
    else:
        import torch

        if torch.cuda.is_available():
            available.append("cuda")
        else:
            unavailable["cuda"] = "no CUDA device visible to torch"
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            available.append("mps")
        else:
            unavailable["mps"] = "not Apple silicon" if not is_apple_silicon() else "torch reports MPS unavailable"
    available.append("cpu")
    return DeviceReport(best=available[0], available=tuple(available), unavailable=unavailable)


@lru_cache(maxsize=1)
def cpu_has_native_bfloat16() -> bool:
    """True when torch reports bfloat16 matmul instructions on this CPU (AVX512_BF16 or AMX tiles): where
    ``DTYPE=auto`` loads bfloat16 weights on the CPU. False without torch or on a torch without the probes."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def device_unavailable_reason(device: str) -> str | None:
    """None if ``device`` (``cpu``, ``cuda`` or ``mps``) works here (see :func:`detect_devices`), else why not."""
    report = detect_devices()
    if device in report.available:
        return None
    if device in report.unavailable:
        return f"DEVICE={device}: {report.unavailable[device]}"
    return f"unknown device {device!r} (accepted: cpu, cuda, mps)"
