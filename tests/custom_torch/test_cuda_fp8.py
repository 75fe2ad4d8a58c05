"""GPU (compute capability >= 8.9, e.g. the H200): FP8 weights on CUDA in bf16. Written for the GPU machine; not yet
run (no GPU was lent to the session that wrote it): ``torch._scaled_mm`` with row-wise scales and the per-token
quantization capture in CUDA graphs (graph replay gives the eager FP8 tokens), the fused MoE kernel's FP8 variant
gives the eager FP8 loop's tokens, and FP8 logits stay near the bf16 model's. Shapes are multiples of 16, as CUDA's
FP8 matmuls need."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures_backend import run_scheduler
from gemmaserve.settings import CoreSettings
from gemmaserve_custom_torch.backend import CustomTorchBackend
from gemmaserve_custom_torch.models.quantization import Fp8Linear
from gemmaserve_custom_torch.settings import load_custom_settings
from test_cuda_graphs import _HAS_TRITON, e2b_like_dir, joining_requests  # noqa: F401  (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (_HAS_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a CUDA GPU of compute capability >= 8.9 and triton")]


def _backend(path: Path, quantization: str | None, **custom: Any) -> CustomTorchBackend:
    core = CoreSettings(model=str(path), device="cuda", dtype="bfloat16", kv_block_size=16, max_batch_size=8,
                        max_active_kv_tokens=100_000, prefill_chunk_tokens=16, quantization=quantization)
    return CustomTorchBackend.from_checkpoint(path, "cuda", core, load_custom_settings(kv_blocks=256, **custom))


def _run(path: Path, quantization: str | None, **custom: Any) -> tuple[torch.Tensor, dict[str, list[int]]]:
    backend = _backend(path, quantization, **custom)
    try:
        if quantization:
            assert isinstance(backend.model.layers[0].self_attn.q_proj, Fp8Linear)
        state = backend.prefill_lookup([2, 17, 93, 311, 45, 8, 260, 77])
        backend.prefill_chunk(state, 8)
        logits = state.last_logits.float().cpu().reshape(-1)
        backend.free_row_kv(state.kv)
        backend.prefix_cache.clear()
        done = run_scheduler(backend, joining_requests(11, count=6), max_batch_size=8, prefill_chunk_tokens=16,
                             max_num_batched_tokens=64)
        backend.check_integrity()
        return logits, {rid: request.output_token_ids for rid, request in done.items()}
    finally:
        backend.close()


@pytest.mark.parametrize("name", ["gemma4", "e2b_like", "gemma4_moe"])
def test_fp8_graph_replay_gives_the_eager_fp8_tokens(tiny_checkpoint, e2b_like_dir, name: str) -> None:
    path = e2b_like_dir if name == "e2b_like" else tiny_checkpoint(name)
    _, eager = _run(path, "fp8", cuda_graph=False)
    _, graphs = _run(path, "fp8", cuda_graph=True)
    assert graphs == eager


def test_fp8_fused_moe_experts_give_the_eager_fp8_loop_tokens(tiny_checkpoint) -> None:
    path = tiny_checkpoint("gemma4_moe")
    fused_logits, fused = _run(path, "fp8", cuda_graph=False)
    eager_logits, eager = _run(path, "fp8", cuda_graph=False, fuse="off")
    assert fused == eager
    assert (fused_logits - eager_logits).abs().max() < 0.1 * eager_logits.abs().max()


@pytest.mark.parametrize("name", ["gemma4", "gemma4_moe"])
def test_fp8_logits_stay_near_bf16(tiny_checkpoint, name: str) -> None:
    path = tiny_checkpoint(name)
    fp8_logits, _ = _run(path, "fp8")
    bf16_logits, _ = _run(path, None)
    relative = ((fp8_logits - bf16_logits).norm() / bf16_logits.norm()).item()
    print(f"\n{name}: fp8 vs bf16 on CUDA, relative logit error {relative:.3f}")
    assert relative < 0.75  # tiny random models amplify weight noise (see test_fp8.py)
