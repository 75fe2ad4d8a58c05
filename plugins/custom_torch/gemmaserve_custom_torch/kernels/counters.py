"""Arrival counters for kernels that finish their own split work (no second launch): each program counts its
arrival with a GPU-scope acquire-release atomic, and the last to arrive reduces what the others wrote and resets
the counter to zero (``skinny_gemm._in_place_reduce_kernel``, ``paged_attention._paged_decode_kernel`` with
``IN_PLACE``).

Contract: the counters are zero between launches, so one buffer per device serves every launch on one stream,
and a programmatic dependent (``kernels.pdl``) touches them only after its ``gdc_wait`` (when the kernel before it
has finished). Kernels on several streams of one device at once must not use them.
"""

from __future__ import annotations

import torch

__all__ = ["COUNTER_SLOTS", "arrival_counters"]

#: int32 counters per device: enough for every launch of a decode step (the largest takes one per output tile and
#: row block plus one per row block, or one per (sequence, KV head)).
COUNTER_SLOTS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed counter buffer, made on first use (which must not be inside a CUDA-graph capture: a
    buffer made there would be zeroed on every replay by a node of its own). ``needed``: the launch's slots."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the arrival counters are made on the first eager call; run one before capturing a "
                               "CUDA graph")
        counters = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    if needed > counters.numel():
        raise ValueError(f"a launch needs {needed} arrival counters; there are {counters.numel()}")
    return counters
