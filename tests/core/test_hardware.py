"""`device_unavailable_reason`: the one device check the backend probes share (built on `detect_devices`)."""

from __future__ import annotations

import pytest

from gemmaserve import hardware
from gemmaserve.hardware import DeviceReport, device_unavailable_reason


@pytest.fixture
def cpu_only(monkeypatch):
    report = DeviceReport("cpu", ("cpu",), {"cuda": "no CUDA device visible to torch", "mps": "not Apple silicon"})
    monkeypatch.setattr(hardware, "detect_devices", lambda: report)


def test_available_devices_have_no_reason(cpu_only):
    assert device_unavailable_reason("cpu") is None


def test_unavailable_devices_say_why(cpu_only):
    assert device_unavailable_reason("cuda") == "DEVICE=cuda: no CUDA device visible to torch"
    assert device_unavailable_reason("mps") == "DEVICE=mps: not Apple silicon"


def test_unknown_devices_name_what_is_accepted(cpu_only):
    assert device_unavailable_reason("tpu") == "unknown device 'tpu' (accepted: cpu, cuda, mps)"


def test_native_bfloat16_follows_torchs_cpu_probes() -> None:
    torch = pytest.importorskip("torch")
    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert hardware.cpu_has_native_bfloat16() is expected
