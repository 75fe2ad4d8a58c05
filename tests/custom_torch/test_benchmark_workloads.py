"""The measuring helpers of benchmarks/ (CPU, tiny shapes, seconds): prefill FLOPs at each workload's own attention
context, workload C's fresh prompts over an emptied prefix cache and its latency keys, workload A's concurrency
record, the decode profile's kernel categories and matmul bandwidth, and the kernel benchmarks' shapes against the
model's own weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCH), str(BENCH / "kernels")]

import decode_model as dm  # noqa: E402
from serving_workloads import (  # noqa: E402
    PrefillFlops,
    mean_keys,
    prefill_flops_per_token,
    run_arrivals,
    serving_requests,
    serving_seed,
)


@pytest.fixture
def tiny_model():  # a fresh one per test: a backend fuses its projections
    return dm.custom_from_hf(dm.build_hf_model({**dm.TINY, "max_position_embeddings": 128}, "cpu", torch.float32, 0))


def test_mean_keys_counts_each_query_window():
    for window in (None, 1, 5, 16):
        for start in (0, 3, 40):
            for length in (1, 7, 64):
                seen = [min(p + 1, window or p + 1) for p in range(start, start + length)]
                assert mean_keys(window, start, length) == pytest.approx(sum(seen) / length)
    with pytest.raises(ValueError):
        mean_keys(None, 0, 0)


def test_prefill_flops_follow_each_prompt(tiny_model):
    flops = PrefillFlops.from_model(tiny_model)
    config = tiny_model.config
    assert flops.fast_stop == config.num_hidden_layers - dm.TINY["num_kv_shared_layers"]  # TINY: 10 - 4

    def by_hand(fast: bool, sliding_keys: float, full_keys: float) -> float:
        stop = flops.fast_stop if fast else config.num_hidden_layers
        return flops.ple + sum(flops.matmul[i] + flops.per_key[i] * (full_keys if flops.windows[i] is None
                                                                     else sliding_keys) for i in range(stop))

    window = config.sliding_window  # 16
    long_sliding = (window * (window + 1) / 2 + (64 - window) * window) / 64  # A-long-like: 64 tokens from 0
    for fast in (True, False):
        assert flops.per_token(fast=fast, prompt_len=64) == pytest.approx(by_hand(fast, long_sliding, 65 / 2))
        # B's prefix hit: 4 own tokens after 32 cached ones see the prefix too
        assert flops.per_token(fast=fast, prompt_len=4, start=32) == pytest.approx(by_hand(fast, window, 34.5))
        # no prompt length: the fixed mean context (the meta figure), as before
        assert prefill_flops_per_token(tiny_model, fast=fast) == pytest.approx(by_hand(fast, window, 256))
    assert flops.per_token(fast=True, prompt_len=64) < flops.per_token(fast=False, prompt_len=64)


def test_workload_c_prompts_are_fresh_per_run_and_reproducible():
    seeds = {serving_seed(0, rate, repeat) for rate in (5.0, 10.0, 12.5) for repeat in (0, 1)}
    assert len(seeds) == 6
    one = serving_requests(20, (8, 40), (2, 8), 512, serving_seed(0, 5.0, 0))
    assert one == serving_requests(20, (8, 40), (2, 8), 512, serving_seed(0, 5.0, 0))
    assert one != serving_requests(20, (8, 40), (2, 8), 512, serving_seed(0, 5.0, 1))
    assert all(8 <= len(p) <= 40 and 2 <= n <= 8 and min(p) >= 4 and max(p) < 512 for p, n in one)


def test_run_arrivals_empties_the_prefix_cache_and_times_from_the_schedule(tiny_model):
    from decode import _custom_backend, _settings

    settings = _settings("cpu", "float32", 8, 128, 8 * 128)
    backend = _custom_backend(tiny_model, settings)
    work = serving_requests(6, (40, 60), (2, 3), 512, "test")
    first = run_arrivals(backend, settings, work, 500.0, seed=1)
    reused = run_arrivals(backend, settings, work, 500.0, seed=1, clear_cache=False)  # the old, biased way
    cleared = run_arrivals(backend, settings, work, 500.0, seed=1)
    assert reused["cached_prompt_tokens"] > 0 and not reused["prefix_cache_cleared"]
    for row in (first, cleared):
        assert row["prefix_cache_cleared"] and row["cached_prompt_tokens"] == 0 and not row["errors"], row
        assert row["finished_requests"] == 6 and row["prompt_tokens"] == sum(len(p) for p, _ in work)
        assert row["ttft_basis"] == "scheduled_arrival"
        # a submit never precedes its scheduled arrival: TTFT from the schedule is never the shorter one
        assert row["ttft_p50_ms"] >= row["ttft_from_submit_p50_ms"] and row["submit_lag_p50_ms"] >= 0
        assert 0 < row["arrival_phase_s"] <= row["wall_s"] and row["arrival_rate_per_s"] >= row["achieved_rate_per_s"]
    backend.close()


def test_workload_a_records_whether_its_rows_ran_together(tiny_model):
    from decode import _concurrency, _custom_backend, _settings

    settings = _settings("cpu", "float32", 4, 128, 100)  # the KV budget holds three 30-token requests
    backend = _custom_backend(tiny_model, settings)
    records = [(1, 0.0, 1.0), (3, 1.0, 2.0), (2, 2.0, 3.0)]
    got = _concurrency(backend, settings, 3, 30, records)
    assert got["all_concurrent"] and got["max_concurrent_rows"] == 3 and got["kv_budget_requests"] == 3
    assert got["kv_pool_requests"] >= 3
    assert not _concurrency(backend, settings, 4, 30, records)["all_concurrent"]  # the budget binds
    assert _concurrency(backend, settings, 1, 30, [])["max_concurrent_rows"] is None
    backend.close()


def test_profile_files_the_matmul_kernels_and_their_reductions_under_matmul():
    from decode_profile import MATMUL, MATMUL_REDUCE, _category, matmul_bandwidth

    for name in ("_skinny_kernel", "_gate_up_geglu_kernel", "_down_weighted_kernel", "_router_logits_kernel",
                 "_argmax_kernel", "_skinny_kernel_0d1d2d", "nvjet_tst_128x64_64x4_1x1_v_bz_TNT",
                 "sm90_xmma_gemm_bf16bf16_bf16f32", "void gemv2T_kernel_val<int, int, __nv_bfloat16>"):
        assert _category(name) == MATMUL, name
    for name in ("_reduce_kernel", "_reduce_residual_norm_kernel", "_sum_slots_kernel",
                 "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>"):
        assert _category(name) == MATMUL_REDUCE, name
    assert _category("void at::native::reduce_kernel<512, 1>") == "reduce/argmax/norm"
    assert _category("_residual_norm_kernel") == "reduce/argmax/norm"
    assert _category("_paged_decode_kernel") == "attention"
    assert _category("_quantize_rows_kernel") == "elementwise/other"

    summary = {"by_category_us": {MATMUL: 800.0, MATMUL_REDUCE: 200.0, "attention": 500.0}}
    got = matmul_bandwidth(summary, 4 * 10**9, 5e12)  # 4 GB in 1 ms (0.8 ms without the reductions)
    assert got["matmul_us"] == 1000.0 and got["matmul_achieved_tbps"] == 4.0
    assert got["matmul_pct_of_copy_bandwidth"] == 80.0 and got["matmul_pct_of_copy_bandwidth_excl_reduce"] == 100.0
    assert matmul_bandwidth({"by_category_us": {}}, 10**9, 5e12) == {}  # CPU: no kernels


def _meta_layers(base: dict) -> list:
    from gemmaserve_custom_torch.models.config import GemmaTextConfig
    from gemmaserve_custom_torch.models.gemma import GemmaForCausalLM

    config = GemmaTextConfig.from_dict(dm.hf_config(base).to_dict())
    return list(GemmaForCausalLM(config, device="meta", dtype=torch.bfloat16).layers)


def test_kernel_benchmark_shapes_are_the_models_projections():
    import bench_pdl
    import bench_skinny_gemm

    def rows(layer, *names: str) -> int:
        return sum(getattr(layer.self_attn, f"{n}_proj").weight.shape[0] for n in names
                   if getattr(layer.self_attn, f"{n}_proj", None) is not None)

    layers = _meta_layers(dm.G31B)
    sliding, full = layers[0], layers[5]
    hidden = dm.G31B["hidden_size"]
    want = {"qkv sliding": (rows(sliding, "q", "k", "v"), hidden), "qkv full": (rows(full, "q", "k", "v"), hidden),
            "o sliding": tuple(sliding.self_attn.o_proj.weight.shape),
            "o full": tuple(full.self_attn.o_proj.weight.shape)}
    got = {name: (n, k) for name, _, n, k in bench_skinny_gemm.SHAPES["31b"]}
    assert want == {name: got[name] for name in want} == {"qkv sliding": (16384, 5376), "qkv full": (18432, 5376),
                                                         "o sliding": (5376, 8192), "o full": (5376, 16384)}
    # bench_pdl's E2B chain holds exactly the model's layer weights (KV-shared layers: q, no k / v)
    spec = bench_pdl.MODELS["e2b"]
    chained = [bench_pdl.layer_weights(spec, i, "meta", torch.bfloat16) for i in range(spec["layers"])]
    model = _meta_layers(dm.E2B)
    for i, (ours, layer) in enumerate(zip(chained, model)):
        assert ours["qkv"].shape[0] == rows(layer, "q", "k", "v"), i
        assert sum(w.numel() for w in ours.values() if w.dim() == 2) == sum(
            p.numel() for p in layer.parameters() if p.dim() == 2), i
