"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched as a programmatic dependent may
start while the kernel before it in the stream is still running, and waits (``griddepcontrol.wait``) for that
kernel to finish and flush its writes only where it needs them.

The contract every kernel here keeps when its ``PDL`` constexpr is on (it is off by default; the interpreter and
devices before compute capability 9 never see it):

- before the wait it reads only what no earlier kernel of the step writes (weights), and writes nothing;
- it releases its own dependents (``griddepcontrol.launch_dependents``) at its start, so the next kernel's
  weight reads overlap this kernel's work; the dependent still waits for this kernel's completion before it
  reads this kernel's output, so the chain stays ordered (each wait covers everything before it, transitively).

:func:`launch_options` gives a launch's keywords; :func:`await_previous` is the start of a kernel with nothing
to read ahead (elementwise kernels read only the previous kernel's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["await_previous", "launch_options", "pdl_supported"]


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependents (CUDA, compute capability 9+)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(pdl: bool) -> dict[str, bool]:
    """Keywords of a launch of a kernel with a ``PDL`` constexpr. Off, only ``PDL=False`` (no ``launch_pdl``, which
    the interpreter and pre-Hopper devices must not see): torch.compile's Triton wrapper needs every argument
    passed, defaults included (without it the compiled launcher lost one, run 35)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


@triton.jit
def await_previous(PDL: tl.constexpr):
    """Start of a PDL kernel that reads nothing ahead: release the next kernel, then wait for the previous."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
