"""`TensorParallel`: one rank's view of the tensor-parallel group, and the two collectives the model calls.

A model shard holds one `TensorParallel` (its rank, the world size, the torch.distributed group: gloo on the CPU,
NCCL on CUDA). At world size 1 (`SINGLE`, the default of every module) each collective returns its input and
torch.distributed is never touched, so an unsharded model runs exactly as before.

Both collectives are capturable by CUDA graphs on NCCL (in place, fixed shapes, no host sync); that path is
designed for but untested (see docs/scaling.md): the backend refuses CUDA graphs with tensor parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["COLLECTIVE_TIMEOUT", "SINGLE", "TensorParallel", "close_tensor_parallel", "init_tensor_parallel"]

COLLECTIVE_TIMEOUT = timedelta(seconds=300)
"""How long a rank waits in one collective (or at the rendezvous) before torch.distributed raises: the backstop
for a peer that hangs without dying (a dead peer's closed connection fails the collective at once)."""


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``world_size``; ``group`` is the torch.distributed process group (None = the default
    group, or nothing at world size 1). ``expert_parallel``: MoE experts are split whole over the ranks instead of
    on their width (`shards`). Immutable; shared by every module of one model shard."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    expert_parallel: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum of ``x`` over the ranks, written into ``x`` (a fresh tensor the caller owns) and returned.
        The summation order differs from one unsharded matmul, so fp32 results move in the last bits."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """``x`` [..., n] of every rank -> [..., world_size * n], rank r's values at [r*n, (r+1)*n). Exact."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        if x.is_cuda:
            dist.all_gather_into_tensor(out, x, group=self.group)
        else:  # gloo has no all_gather_into_tensor; the list form writes into views of ``out``
            dist.all_gather(list(out.unbind(0)), x, group=self.group)
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.world_size * x.shape[-1])


SINGLE = TensorParallel()
"""World size 1: every collective is a no-op."""


def init_tensor_parallel(rank: int, world_size: int, rendezvous_file: str, device: torch.device,
                         expert_parallel: bool = False) -> TensorParallel:
    """Join the default process group (gloo for a CPU ``device``, NCCL for CUDA; the rendezvous through a shared
    file, so no port can clash) and return this rank's `TensorParallel`. Blocks until every rank has joined
    (at most `COLLECTIVE_TIMEOUT`). One group per process: the caller destroys it with :func:`close_tensor_parallel`."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel backend "
                           "per process (close the other engine first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{rendezvous_file}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, world_size, None, expert_parallel)


def close_tensor_parallel() -> None:
    """Leave the default process group if this process is in one (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
