"""GPU (two or more CUDA devices): tensor parallel over NCCL on cuda:0 and cuda:1 (triton attention, fused
projections and elementwise kernels, eager ticks). Written for a 2-GPU machine; not yet run (see docs/scaling.md):
greedy tokens at tensor_parallel_size=2 equal those at 1 in fp32 (E2B-like geometry: one KV head replicated, PLE,
KV sharing; and the tiny MoE, its experts split on their width and whole with expert parallel, where the fused MoE
kernels run on local expert ids), the CUDA-graph refusal, and clean shutdown."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures_backend import run_scheduler
from gemmaserve.errors import ConfigurationError
from gemmaserve.settings import CoreSettings
from gemmaserve_custom_torch.backend import CustomTorchBackend
from gemmaserve_custom_torch.settings import load_custom_settings
from test_cuda_graphs import _HAS_TRITON, e2b_like_dir, joining_requests  # noqa: F401  (fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (_HAS_TRITON and torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                                 reason="needs two CUDA GPUs and triton")]


def _backend(path: Path, size: int, expert_parallel: bool = False, **custom: Any) -> CustomTorchBackend:
    core = CoreSettings(model=str(path), device="cuda", dtype="float32", kv_block_size=16, max_batch_size=8,
                        max_active_kv_tokens=100_000, prefill_chunk_tokens=16, tensor_parallel_size=size,
                        enable_expert_parallel=expert_parallel)
    return CustomTorchBackend.from_checkpoint(path, "cuda", core,
                                              load_custom_settings(kv_blocks=256, **{"cuda_graph": False, **custom}))


def _tokens(path: Path, size: int, expert_parallel: bool = False) -> dict[str, list[int]]:
    backend = _backend(path, size, expert_parallel)
    try:
        assert (backend.workers is not None) == (size > 1)
        done = run_scheduler(backend, joining_requests(7, count=6), max_batch_size=8, prefill_chunk_tokens=16,
                             max_num_batched_tokens=64)
        backend.check_integrity()
        return {rid: request.output_token_ids for rid, request in done.items()}
    finally:
        backend.close()


@pytest.mark.parametrize("name", ["e2b_like", "gemma4_moe"])
def test_nccl_tensor_parallel_greedy_equals_one_gpu_fp32(tiny_checkpoint, e2b_like_dir, name):
    path = e2b_like_dir if name == "e2b_like" else tiny_checkpoint(name)
    assert _tokens(path, 2) == _tokens(path, 1)
    assert not multiprocessing.active_children()


def test_nccl_expert_parallel_greedy_equals_one_gpu_fp32(tiny_checkpoint):
    """Whole experts per rank (4 experts: 2 each) through the fused MoE kernels with local ids, over NCCL."""
    from gemmaserve_custom_torch.models.fusion import moe_is_fused

    path = tiny_checkpoint("gemma4_moe")
    backend = _backend(path, 2, expert_parallel=True)
    try:
        experts = backend.model.layers[0].experts
        assert moe_is_fused(backend.model) and (experts.first_expert, experts.num_experts) == (0, 2)
    finally:
        backend.close()
    assert _tokens(path, 2, expert_parallel=True) == _tokens(path, 1)
    assert not multiprocessing.active_children()


def test_cuda_graphs_are_refused_with_tensor_parallel(e2b_like_dir):
    with pytest.raises(ConfigurationError, match="CUSTOM_BACKEND_CUDA_GRAPH=0"):
        _backend(e2b_like_dir, 2, cuda_graph=True)
    assert not multiprocessing.active_children()
