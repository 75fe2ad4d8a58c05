"""benchmarks/decode.py at every ``--config`` (E2B, E4B, 26B-A4B, 31B): the ``--quick`` toy variant of each runs
end to end on the CPU (with the load-time projection fusion on, as on CUDA, so the one-copy weight handling
is exercised), and the model-side helpers (MoE roofline, prefill FLOPs, KV capacity, the shared weights
between the transformers model and the custom one) give the numbers the full-size configs need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import decode_model as dm  # noqa: E402

# KV bytes per token (bf16, K and V of every KV-storing layer), by hand from gemma4-spec.md §4:
# E2B: 12 storing sliding layers x 1 head x 256 + 3 full x 1 x 512; E4B: 20 x 2 x 256 + 4 x 2 x 512;
# 26B-A4B: 25 x 8 x 256 + 5 x 2 x 512 (K=V: global KV heads); 31B: 50 x 16 x 256 + 10 x 4 x 512
KV_PER_TOKEN = {
    "e2b": (2 * 2 * 12 * 1 * 256, 2 * 2 * 3 * 1 * 512),
    "e4b": (2 * 2 * 20 * 2 * 256, 2 * 2 * 4 * 2 * 512),
    "26b-a4b": (2 * 2 * 25 * 8 * 256, 2 * 2 * 5 * 2 * 512),
    "31b": (2 * 2 * 50 * 16 * 256, 2 * 2 * 10 * 4 * 512),
}
PARAMS_B = {"e2b": 4.629, "e4b": 7.463, "26b-a4b": 25.233, "31b": 30.697}  # gemma4-spec.md §4 (tied embedding once)


@pytest.mark.parametrize("config", list(dm.CONFIGS))
def test_decode_benchmark_quick_per_config(tmp_path, config):
    out = tmp_path / "quick.json"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "", "CUSTOM_BACKEND_FUSE": "on"}
    proc = subprocess.run([sys.executable, str(BENCH / "decode.py"), "--quick", "--config", config, "--json", str(out),
                           "--prefix-requests", "0"], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert "errors" not in results, results.get("errors")
    meta = results["meta"]
    assert meta["preset"] == config and meta["config"].lower().startswith("tiny" if config == "e2b" else config)
    for row in results["workload_a"] + results["hf"]:
        assert not row["errors"], row["errors"]
        assert row["ttft_median_ms"] > 0 and row["tpot_median_ms"] > 0 and row["roofline_ms"] > 0
    assert [row["N"] for row in results["workload_a"]] == [1, 2]
    for row in results["workload_a"]:  # the pools and the KV budget hold both rows: they ran together
        assert row["all_concurrent"] and row["max_concurrent_rows"] == row["N"], row
    if config == "26b-a4b":
        assert meta["moe_experts"] == 8 and meta["moe_top_k"] == 2
    memory = results["memory"]
    # one copy of the weights: the transformers model reads the custom model's (fused) tensors
    assert memory["held_bytes_after_backend"] == memory["held_bytes_after_build"]
    assert memory["held_bytes_after_build"] - memory["weight_bytes"] < 4096  # + transformers' RoPE buffers
    capacity = results["capacity"]
    assert set(capacity["configs"]) == set(dm.CONFIGS) and capacity["request_tokens"] == 4096
    for name, row in capacity["configs"].items():
        sliding, full = KV_PER_TOKEN[name]
        assert row["kv_bytes_per_token"] == {"sliding_attention": sliding, "full_attention": full}
        # the default split, planned for MAX_BATCH_SIZE = that many 4,096-token requests, runs them all (the
        # pools run out together at the reference length; the previous even split ran 21 of 66 at 31B)
        assert row["max_concurrent_requests"] == row["default_plan_requests"] > 0
        assert row["default_plan_reference_tokens"] == 4096
    this_run = capacity["this_run"]
    assert this_run["max_concurrent_workload_a_requests_in_pools"] >= 2


def test_full_size_configs_match_the_spec():
    for name, (_, base, _) in dm.CONFIGS.items():
        assert round(dm.config_weight_bytes(base) / 2 / 1e9, 3) == PARAMS_B[name]


def test_moe_roofline_and_prefill_flops():
    from serving_workloads import prefill_flops_per_token

    model = dm.custom_from_hf(dm.build_hf_model(dm.A26B_TINY, "cpu", torch.float32, 0))
    roof = dm.roofline(model)
    layers, hidden, width = 12, 64, 16
    assert (roof.num_experts, roof.top_k) == (8, 2)
    assert roof.expert_bytes == layers * 3 * hidden * width * 4  # gate + up + down of one expert, every layer
    dense = roof.weight_bytes
    assert roof.step_weight_bytes(1) == dense + 2 * roof.expert_bytes  # N=1: exactly the top-k experts
    assert roof.step_weight_bytes(1) < roof.step_weight_bytes(8) < dense + 8 * roof.expert_bytes
    assert roof.experts_read(10**6) == pytest.approx(8)
    flops = prefill_flops_per_token(model, fast=False)
    no_moe = prefill_flops_per_token(dm.custom_from_hf(dm.build_hf_model(
        {**dm.A26B_TINY, "enable_moe_block": False}, "cpu", torch.float32, 0)), fast=False)
    router = layers * 2 * hidden * 8
    assert flops - no_moe == pytest.approx(layers * 2 * 2 * 3 * hidden * width + router)


def test_kv_capacity_uses_the_backend_footprint():
    from gemmaserve_custom_torch.models.config import GemmaTextConfig

    config = GemmaTextConfig.from_dict(dm.hf_config(dm.G31B).to_dict())
    sliding, full = KV_PER_TOKEN["31b"]
    per_request = 16 * sliding * (1024 // 16 + 1) + full * 4096  # window blocks + 1, every full block
    cap = dm.kv_capacity(config, 2, 16, 100 * per_request + 5)
    assert cap["kv_bytes_per_request"] == per_request and cap["max_concurrent_requests"] == 100
    assert cap["sliding_blocks_for_max"] == 100 * 65
    assert cap["default_plan_requests"] == 100 and cap["default_plan_reference_tokens"] == 4096
    assert cap["default_plan_blocks"]["sliding_attention"] * 16 * sliding + cap["default_plan_blocks"][
        "full_attention"] * 16 * full <= 100 * per_request + 5
    assert dm.kv_tokens_fitting(config, 2, 16, 1000 * 16 * (sliding + full), max_rows=10) == (1000 - 10) * 16


def test_release_and_retie_keep_one_copy_and_the_same_logits():
    from gemmaserve_custom_torch.models.fusion import fuse_projections

    hf = dm.build_hf_model(dm.A26B_TINY, "cpu", torch.float32, 0)
    model = dm.custom_from_hf(hf)
    ids = torch.randint(4, 512, (1, 12))
    with torch.no_grad():
        before = hf(ids).logits
    held = dm.held_bytes(hf, model)
    slots = dm.release_shared(hf, model)
    assert fuse_projections(model) > 0
    dm.retie(slots, model)
    assert dm.held_bytes(hf, model) == held
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, before)


def test_workload_c_sizes_the_engine_beyond_the_workload_a_sizes(tmp_path):
    """With ``--serving-rates`` the engine holds ``--serving-max-rows`` requests (the --quick cap: 8), not only the
    largest ``--sizes`` / workload B count: sized by ``--sizes 1`` alone, workload C ran one request at a time."""
    out = tmp_path / "c.json"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(BENCH / "decode.py"), "--quick", "--hf-sizes", "", "--serving-rates", "50",
                           "--serving-requests", "6", "--serving-repeats", "2", "--json", str(out)], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    max_len = dm.CONFIGS["e2b"][2]["max_position_embeddings"]  # the toy config's (C's quick prompts fit in it)
    assert results["memory"]["kv_tokens_wanted"] == 8 * max_len  # quick: A sizes 1,2 and B 4 rows would give 4
    first, second = results["workload_c"]  # --serving-repeats 2: the rate twice, other arrival seeds
    for repeat, serving in enumerate((first, second)):
        assert serving["requests"] == 6 and not serving["errors"] and serving["repeat"] == repeat, serving
        assert serving["itl_p99_over_p50"] == round(serving["itl_p99_ms"] / serving["itl_p50_ms"], 3), serving
        # fresh prompts per run over an emptied prefix cache: the repeat is not served from the first run's KV
        assert serving["prefix_cache_cleared"] and serving["cached_prompt_tokens"] == 0, serving
    assert first["prompt_seed"] != second["prompt_seed"]


def test_the_decode_step_profile_holds_every_row(monkeypatch) -> None:
    """``decode_profile.profile_decode_step`` profiles two decode ticks after the prompts are in; every request
    lives past them (run 30's "256-row" profile ran 12 tokens per request, so the prompts prefilled first had
    finished and the two ticks held different, smaller batches), and each profiled tick says what it launched."""
    import decode_profile
    from decode import _custom_backend, _settings

    rows, prompt_len = 16, 16
    model = dm.custom_from_hf(dm.build_hf_model({**dm.TINY, "max_position_embeddings": 128}, "cpu", torch.float32, 0))
    settings = _settings("cpu", "float32", rows, 128, rows * 128, budget=32)  # the prompts take eight ticks
    backend = _custom_backend(model, settings)
    got = decode_profile.profile_decode_step(backend, settings, rows, prompt_len)
    for label in ("eager_step", "graph_replay_step"):
        assert (got[label]["tick_rows"], got[label]["tick_prompt_tokens"]) == (rows, 0), got[label]
    # too few output tokens (run 30's mistake: 12): the profile refuses to report a smaller step as a 16-row one
    # (a fresh backend: this one's prefix cache now holds the prompts, which would shorten the prompt ticks)
    short = decode_profile.run_engine
    monkeypatch.setattr(decode_profile, "run_engine", lambda b, s, prompts, n: short(b, s, prompts, 12))
    with pytest.raises(RuntimeError, match=rf"held \d+ of {rows} rows"):
        decode_profile.profile_decode_step(_custom_backend(model, settings), settings, rows, prompt_len)
