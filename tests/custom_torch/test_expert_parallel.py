"""Expert parallel in custom_torch (``ENABLE_EXPERT_PARALLEL``) on the CPU: each tensor-parallel rank holds whole MoE
experts (a contiguous E/N of them) instead of a slice of every expert's width.

- the expert block itself: N ranks' partial outputs (eager loop, and the fused Triton kernels under
  ``TRITON_INTERPRET=1`` with the local-id remap, both groupings, FP8 experts) sum to the full block's output, and
  a rank no token routes to returns exact zeros (never reading its unwritten pair rows);
- the shard rule: each rank reads exactly its experts' rows of ``gate_up_proj`` / ``down_proj``;
- the model (gloo, world size 2): greedy tokens equal ``tensor_parallel_size=1`` and transformers on tiny MoE
  checkpoints of shapes no other test uses (8 experts top 3 with an expert width the width split cannot divide;
  4 experts top 1 with PLE and KV sharing), with staggered requests, through the scheduler and the offline LLM;
- the refusals: an expert count the size does not divide (naming the sizes that work), a model without experts,
  a backend without expert parallel (data parallel: tests/server/test_data_parallel.py).

Sums over ranks add fp32 partials in another order than one rank's loop: outputs are compared at 1e-5, tokens
exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fixtures_backend import assert_matches_hf_generate, assert_no_leaks, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.errors import ConfigurationError
from gemmaserve.settings import CoreSettings
from gemmaserve_custom_torch.backend import CustomTorchBackend
from gemmaserve_custom_torch.models.layers import MoEExperts
from gemmaserve_custom_torch.settings import load_custom_settings
from tiny_checkpoints import build_tiny_gemma4, build_tiny_gemma4_moe

SLIDING, FULL = "sliding_attention", "full_attention"

_CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    # 8 experts top 3 of width 21 (odd: the width split cannot divide it over 2 ranks), K=V with one global KV
    # head (replicated), 2 sliding KV heads (split); 4 experts per rank
    "moe_8x3": lambda path: build_tiny_gemma4_moe(
        path, seed=21, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, num_experts=8, top_k_experts=3,
        moe_intermediate_size=21, intermediate_size=40, num_hidden_layers=4,
        layer_types=[SLIDING, FULL, SLIDING, FULL]),
    # 4 experts top 1 (2 per rank), PLE, 2 KV-shared layers, K=V with 2 global KV heads (split)
    "moe_4x1_ple": lambda path: build_tiny_gemma4_moe(
        path, seed=22, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_global_key_value_heads=2,
        num_experts=4, top_k_experts=1, moe_intermediate_size=16, intermediate_size=48, num_hidden_layers=5,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        sliding_window=6),
}

# (prompt, arrival tick, max tokens): staggered arrivals, a chunked prompt, and a repeat served from the prefix cache
_PROMPT = [2, 31, 77, 305, 12, 9, 250, 64, 143, 6, 71, 409, 18, 222, 90, 310, 15, 160]
_REQUESTS = [(_PROMPT, 0, 10), ([2, 410, 8, 97, 120], 1, 8), (_PROMPT[:7] + [60, 61], 4, 6), (_PROMPT, 30, 5)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("ep_ckpts")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = _CHECKPOINTS[name](root / name)
        return built[name]

    return get


def _backend(path: Path, size: int, expert_parallel: bool) -> CustomTorchBackend:
    core = CoreSettings(model=str(path), device="cpu", dtype="float32", kv_block_size=4, max_batch_size=8,
                        prefill_chunk_tokens=16, tensor_parallel_size=size, enable_expert_parallel=expert_parallel)
    return CustomTorchBackend.from_checkpoint(path, "cpu", core, load_custom_settings(kv_blocks=96))


def _no_children_left() -> None:
    import multiprocessing

    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children(), multiprocessing.active_children()


# ---- the expert block ------------------------------------------------------------------------------------------


def _random_experts(seed: int, num_experts: int, hidden: int, width: int) -> MoEExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = MoEExperts(hidden, num_experts, width)
    with torch.no_grad():
        experts.gate_up_proj.copy_(0.3 * torch.randn(experts.gate_up_proj.shape, generator=gen))
        experts.down_proj.copy_(0.3 * torch.randn(experts.down_proj.shape, generator=gen))
    return experts


def _rank_experts(full: MoEExperts, rank: int, world_size: int) -> MoEExperts:
    """Rank ``rank``'s expert-parallel block: its contiguous E/N experts (and their FP8 scales) of ``full``."""
    from gemmaserve_custom_torch.distributed.shards import expert_range

    first, end = expert_range(full.num_experts, rank, world_size)
    hidden, width = full.down_proj.shape[1], full.down_proj.shape[2]
    part = MoEExperts(hidden, end - first, width, device="meta", first_expert=first, total_experts=full.num_experts)
    part.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[first:end].clone(), requires_grad=False)
    part.down_proj = torch.nn.Parameter(full.down_proj[first:end].clone(), requires_grad=False)
    if full.gate_up_proj_scale is not None and full.down_proj_scale is not None:
        part.gate_up_proj_scale = full.gate_up_proj_scale[first:end].clone()
        part.down_proj_scale = full.down_proj_scale[first:end].clone()
    return part


@pytest.mark.parametrize(("num_experts", "top_k", "world_size"), [(8, 3, 2), (6, 2, 3), (4, 1, 4)])
def test_ranks_eager_partial_outputs_sum_to_the_full_block(num_experts: int, top_k: int, world_size: int) -> None:
    full = _random_experts(num_experts, num_experts, 24, 20)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(13, 24, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(13)])
    weights = torch.rand(13, top_k, generator=gen)
    with torch.inference_mode():
        want = full(x, weights, ids)
        parts = [_rank_experts(full, rank, world_size)(x, weights, ids) for rank in range(world_size)]
    torch.testing.assert_close(sum(parts), want, atol=1e-5, rtol=1e-5)
    # pairs routed to no expert of a rank: that rank's output is exactly zero
    with torch.inference_mode():
        first_half = ids % (num_experts // world_size)  # every pair on rank 0's experts
        assert not _rank_experts(full, world_size - 1, world_size)(x, weights, first_half).any()


def test_a_rank_block_outside_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match=r"experts \[6, 9\) are not within the 8 experts"):
        MoEExperts(8, 3, 4, device="meta", first_expert=6, total_experts=8)


_FUSED_SCRIPT = r"""
import json, math, torch
from gemmaserve_custom_torch.kernels import moe
from gemmaserve_custom_torch.kernels.moe import fused_experts, group_by_expert, max_blocks
from gemmaserve_custom_torch.models.layers import MoEExperts
from gemmaserve_custom_torch.models.quantization import quantize_fp8
from test_expert_parallel import _random_experts, _rank_experts
torch.set_num_threads(1)

class NanBuffers:  # every torch.empty of the kernels' module is NaN-filled: an unwritten row read would show
    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *shape, **kwargs):
        out = torch.empty(*shape, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out.fill_(-7)

moe.torch = NanBuffers()

def case(seed, E, k, T, pool=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 24, generator=gen)
    ids = torch.stack([torch.randperm(pool or E, generator=gen)[:k] for _ in range(T)])
    return x, torch.rand(T, k, generator=gen), ids

errors = {}
blocks = dict(block_m=16, block_n=16, block_k=16)
# (E, k, T, ranks, pool): decode-sized, several pairs per expert, 4 ranks of one expert, top-k over one rank
for E, k, T, N, pool in [(8, 3, 9, 2, None), (6, 2, 21, 3, None), (4, 1, 17, 4, None), (8, 2, 5, 2, 4)]:
    full = _random_experts(E + T, E, 24, 20)
    x, weights, ids = case(E * T, E, k, T, pool)
    with torch.inference_mode():
        want = full(x, weights, ids)  # the eager loop over every expert
        for grouping in ("kernel", "torch"):
            parts = []
            for rank in range(N):
                part = _rank_experts(full, rank, N)
                local = ids - part.first_expert  # the module's remap, called directly to pick the grouping
                parts.append(fused_experts(x, weights, local, part.gate_up_proj, part.down_proj, grouping=grouping,
                                           **blocks))
                if pool is not None and part.first_expert >= pool:
                    assert torch.equal(parts[-1], torch.zeros_like(parts[-1])), "a rank with no pair is not zero"
            got = sum(parts)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            errors[f"E{E} k{k} T{T} N{N} {grouping}"] = float((got - want).abs().max())
        part = _rank_experts(full, N - 1, N)  # through the module: MoEExperts.forward remaps the global ids
        part.fused = fused_experts
        eager = _rank_experts(full, N - 1, N)(x, weights, ids)
        torch.testing.assert_close(part(x, weights, ids), eager, atol=1e-5, rtol=1e-5)

# FP8 experts: the rank's experts with their scales (quantize_fp8 is per expert and per row)
full = _random_experts(5, 6, 24, 20)
quantize_fp8(full)
x, weights, ids = case(9, 6, 2, 11)
with torch.inference_mode():
    want = full(x, weights, ids)
    parts = []
    for rank in range(2):
        part = _rank_experts(full, rank, 2)
        part.fused = fused_experts
        parts.append(part(x, weights, ids))
errors["fp8"] = [float((sum(parts) - want).abs().max()), float(want.abs().max())]

# the grouping with ids outside [0, E): every held pair once, no other, the same layout both ways; all held experts
# hit alongside skipped pairs (their padding must not push the layout past max_blocks)
def layout(ids, E, block_m):
    layouts = []
    for method in ("kernel", "torch"):
        groups = group_by_expert(ids, E, block_m, method)
        num_blocks = max_blocks(ids.numel(), E, block_m)
        assert groups.pair_of_row.shape == (num_blocks * block_m,), groups.pair_of_row.shape
        rows, flat, seen, found = groups.pair_of_row.view(num_blocks, block_m), ids.reshape(-1), [], []
        for block, (expert, count) in enumerate(zip(groups.expert_of_block.tolist(), groups.rows_of_block.tolist())):
            pairs = rows[block, :count].tolist()
            assert (expert == E) == (count == 0) and all(int(flat[p]) == expert for p in pairs), (method, block)
            seen += pairs
            found.append((expert, pairs))
        held = [p for p in range(flat.numel()) if 0 <= int(flat[p]) < E]
        assert sorted(seen) == held, (method, seen, held)
        layouts.append(found)
    assert layouts[0] == layouts[1]
    return layouts[0]

gen = torch.Generator().manual_seed(3)
global_ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(40)])
for first in (0, 2, 4, 6):
    layout(global_ids - first, 2, 16)  # rank of 2 experts out of 8: both hit, most pairs skipped
layout(torch.tensor([[5, -3], [0, 9], [1, -1]]), 2, 16)  # outside on either side
print(json.dumps(errors))
"""


def test_fused_rank_outputs_sum_to_the_full_block_under_the_interpreter() -> None:
    """The fused kernels per rank (local ids = global - first expert; other ranks' pairs skipped) sum to the full
    eager block, with both groupings, every pair buffer NaN-filled (a skipped pair's unwritten row is never read),
    FP8 experts too; a rank that no pair reaches returns exact zeros."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _FUSED_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == 9, errors
    error, scale = errors["fp8"]
    assert error <= 1e-5 * max(scale, 1.0), errors  # the same FP8 arithmetic per expert; fp32 summation order


# ---- the shard rule --------------------------------------------------------------------------------------------


def test_each_rank_reads_exactly_its_experts(checkpoint) -> None:
    """Expert weights: rank r's rows [r·E/N, (r+1)·E/N) of dim 0, whole; every other tensor as the width split
    reads it (the rules are shared)."""
    from safetensors import safe_open

    from gemmaserve_custom_torch.distributed.shards import Shard, read_shard, shard_config, shard_for
    from gemmaserve_custom_torch.models.config import GemmaTextConfig

    path = checkpoint("moe_8x3")
    config = GemmaTextConfig.from_pretrained(path)
    assert shard_config(config, 2, expert_parallel=True).moe_intermediate_size == 21  # whole experts
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        expert_keys = 0
        for key in f.keys():  # noqa: SIM118
            local = key.removeprefix("model.")
            if local.endswith(("experts.gate_up_proj", "experts.down_proj")):
                full = f.get_tensor(key)
                parts = [read_shard(f, key, shard_for(local, config, rank, 2, expert_parallel=True))
                         for rank in (0, 1)]
                assert [p.shape[0] for p in parts] == [4, 4] and torch.equal(torch.cat(parts), full), key
                assert shard_for(local, config, 1, 2, expert_parallel=True) == Shard(0, ((4, 8),))
                expert_keys += 1
            else:
                for rank in (0, 1):
                    assert shard_for(local, config, rank, 2, expert_parallel=True) == shard_for(local, config, rank, 2)
    assert expert_keys == 2 * config.num_hidden_layers


# ---- the model over 2 ranks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(_CHECKPOINTS))
def test_expert_parallel_greedy_equals_single_rank_and_transformers(checkpoint, hf_reference, name: str) -> None:
    path = checkpoint(name)
    results = {}
    logits = {}
    for size in (1, 2):
        backend = _backend(path, size, expert_parallel=size == 2)
        try:
            experts = backend.model.layers[0].experts
            total = backend.model.full_config.moe_num_experts
            assert (experts.first_expert, experts.num_experts, experts.total_experts) == (0, total // size, total)
            assert experts.gate_up_proj.shape[1] == 2 * backend.model.full_config.moe_intermediate_size  # whole
            state = backend.prefill_lookup(_PROMPT[:9])
            backend.prefill_chunk(state, 9)
            logits[size] = state.last_logits.clone()
            backend.free_row_kv(state.kv)
            backend.prefix_cache.clear()
            done = run_scheduler(backend, _REQUESTS)
            results[size] = {rid: request.output_token_ids for rid, request in done.items()}
            assert backend.prefix_cache.stats["hits"] >= 1
            assert_no_leaks(backend)
        finally:
            backend.close()
    assert results[2] == results[1]
    torch.testing.assert_close(logits[2], logits[1], atol=1e-5, rtol=0)
    hf = hf_reference(path, torch.float32)
    for rid, (prompt, _, _) in zip(results[2], _REQUESTS):
        assert_matches_hf_generate(hf, prompt, results[2][rid])
    _no_children_left()


def test_offline_llm_with_expert_parallel(checkpoint) -> None:
    """``LLM(tensor_parallel_size=2, enable_expert_parallel=True)``: batched greedy, a seeded sample, and requests
    submitted while others run (staggered in wall-clock time) equal one rank's."""
    from gemmaserve import LLM, SamplingParams

    path = checkpoint("moe_8x3")
    prompts = [_PROMPT, [2, 400, 7, 99, 123], _PROMPT[:11], [2, 5, 6, 7]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (7, 4, 9, 3)]
    outputs = {}
    for size in (1, 2):
        with LLM(str(path), backend="custom-cpu", device="cpu", dtype="float32", tensor_parallel_size=size,
                 enable_expert_parallel=size == 2, kv_block_size=4, prefill_chunk_tokens=8) as llm:
            workers = llm.engine.backend.workers
            assert workers is None if size == 1 else (workers.tp.world_size == 2 and workers.tp.expert_parallel)
            outputs[size] = [out.token_ids for out in llm.generate(prompts, params)]
            seeded = llm.generate([_PROMPT], SamplingParams(max_tokens=5, temperature=0.8, seed=3))
            outputs[size].append(seeded[0].token_ids)
            handles = []
            for prompt in prompts:
                handles.append(llm.engine.submit(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
                time.sleep(0.05)
            outputs[size] += [handle.result().token_ids for handle in handles]
    assert outputs[2] == outputs[1]
    assert [len(tokens) for tokens in outputs[2]] == [7, 4, 9, 3, 5, 8, 8, 8, 8]
    _no_children_left()


# ---- refusals --------------------------------------------------------------------------------------------------


def test_expert_parallel_refusals(checkpoint, tmp_path) -> None:
    from gemmaserve import LLM
    from gemmaserve_custom_torch.distributed.shards import check_shardable
    from gemmaserve_custom_torch.models.config import GemmaTextConfig

    path = checkpoint("moe_8x3")
    config = GemmaTextConfig.from_pretrained(path)
    # the width split cannot divide an expert width of 21; expert parallel can (8 experts over 2 ranks)
    with pytest.raises(ConfigurationError, match=r"moe_intermediate_size=21 is not divisible by 2.*\(this model: 1\); "
                                                 r"or set ENABLE_EXPERT_PARALLEL"):
        check_shardable(config, 2)
    check_shardable(config, 2, expert_parallel=True)
    with pytest.raises(ConfigurationError, match=r"TENSOR_PARALLEL_SIZE=3 with ENABLE_EXPERT_PARALLEL cannot shard "
                                                 r"this model: .*8 experts \(num_experts\) are not divisible by 3.*"
                                                 r"every dimension named \(this model: 1, 2, 4\)$"):
        check_shardable(config, 3, expert_parallel=True)
    with pytest.raises(ConfigurationError, match=r"8 experts \(num_experts\) are not divisible by 3"):
        LLM(str(path), backend="custom-cpu", device="cpu", tensor_parallel_size=3, enable_expert_parallel=True)
    dense = build_tiny_gemma4(tmp_path / "dense", seed=23, num_hidden_layers=3,
                              layer_types=[SLIDING, SLIDING, FULL], num_kv_shared_layers=0)
    for size in (1, 2):
        with pytest.raises(ConfigurationError, match=r"this model has none \(no MoE block\): unset "
                                                     r"ENABLE_EXPERT_PARALLEL"):
            LLM(str(dense), backend="custom-cpu", device="cpu", tensor_parallel_size=size, enable_expert_parallel=True)
    with pytest.raises(ConfigurationError, match=r"backend 'hf' does not support expert parallel"):
        LLM(str(path), backend="hf", device="cpu", enable_expert_parallel=True)
    _no_children_left()


def test_the_flag_and_the_env_reach_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from gemmaserve.cli import _add_engine_flags, settings_from_args

    parser = argparse.ArgumentParser()
    _add_engine_flags(parser)
    assert "ENABLE_EXPERT_PARALLEL" in parser.format_help()
    assert settings_from_args(parser.parse_args(["--enable-expert-parallel"])).enable_expert_parallel
    monkeypatch.setenv("ENABLE_EXPERT_PARALLEL", "1")
    assert settings_from_args(parser.parse_args([])).enable_expert_parallel  # an unset flag leaves the env in charge
    monkeypatch.delenv("ENABLE_EXPERT_PARALLEL")
    assert not settings_from_args(parser.parse_args([])).enable_expert_parallel
