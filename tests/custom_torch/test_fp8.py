"""FP8 weights in custom_torch (``QUANTIZATION=fp8`` and compressed-tensors FP8 checkpoints) on the CPU, where torch
runs ``float8_e4m3fn`` and ``torch._scaled_mm``: quantization round trips, FP8 tiny models (Gemma 4 dense with PLE
and KV sharing, Gemma 4 MoE, Gemma 3) generating through the scheduler close to their fp32 model, a compressed-tensors
checkpoint written here loading into the same FP8 weights as online quantization, tensor parallel at world size 2
(gloo), the fused MoE kernel on FP8 experts (Triton interpreter, in subprocesses: the flag must be set before the
kernels are decorated), and the refusals.

FP8 changes numerics (3 mantissa bits per weight and activation), so logits are compared with a bound and greedy
tokens by their first divergence; each test prints its figures (run with ``-s`` to see them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures_backend import assert_no_leaks, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.errors import ConfigurationError
from gemmaserve.settings import CoreSettings, load_settings
from gemmaserve_custom_torch.backend import CustomTorchBackend
from gemmaserve_custom_torch.models.gemma import GemmaForCausalLM
from gemmaserve_custom_torch.models.quantization import (
    FP8_DTYPE,
    Fp8Linear,
    dequantize,
    linear,
    parse_scheme,
    quantize_per_token,
    quantize_weight,
)
from gemmaserve_custom_torch.settings import load_custom_settings
from tiny_checkpoints import build_tiny_gemma3, build_tiny_gemma4, build_tiny_gemma4_moe

SLIDING, FULL = "sliding_attention", "full_attention"

# Shapes of their own (not in the docs or other tests)
_CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    # PLE (dim 8), 2 KV-shared layers with a double-wide MLP, 6 query heads over 2 KV heads
    "dense_ple_shared": lambda path: build_tiny_gemma4(
        path, seed=21, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72,
        num_hidden_layers=5, layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL], num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, sliding_window=6),
    # dense MLP + 5 experts top 2 of width 20, K=V full layers with 2 global KV heads
    "moe": lambda path: build_tiny_gemma4_moe(
        path, seed=22, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=2,
        num_experts=5, moe_intermediate_size=20, intermediate_size=56, num_hidden_layers=3,
        layer_types=[SLIDING, FULL, FULL]),
    # Gemma 3 ((1 + w) norms), 1 KV head
    "gemma3": lambda path: build_tiny_gemma3(
        path, seed=23, hidden_size=64, num_attention_heads=4, num_key_value_heads=1, intermediate_size=96,
        num_hidden_layers=3, layer_types=[SLIDING, SLIDING, FULL]),
}

_PROMPTS = [[2, 17, 93, 311, 45, 8, 260, 77, 140, 5, 66], [2, 400, 7, 99, 123], [2, 5, 6, 7, 8, 9, 10, 11, 12, 13],
            [2, 250, 31, 402, 19, 230, 88]]
_NEW_TOKENS = 12

# compressed-tensors quantization_config as llm-compressor's FP8_DYNAMIC scheme writes it (the router kept
# in the model dtype, as online quantization keeps it)
_CT_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "float-quantized",
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True},
    }},
    "ignore": ["lm_head", "re:.*router.*", "re:.*embed_tokens.*"],
}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "per_layer_input_gate",
                "per_layer_projection", "per_layer_model_projection")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("fp8_ckpts")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = _CHECKPOINTS[name](root / name)
        return built[name]

    return get


def _backend(path: Path, quantization: str | None = None, tensor_parallel_size: int = 1,
             **custom: Any) -> CustomTorchBackend:
    core = CoreSettings(model=str(path), device="cpu", dtype="float32", kv_block_size=4, max_batch_size=8,
                        prefill_chunk_tokens=16, quantization=quantization, tensor_parallel_size=tensor_parallel_size)
    return CustomTorchBackend.from_checkpoint(path, "cpu", core, load_custom_settings(kv_blocks=96, **custom))


def _run(backend: CustomTorchBackend) -> tuple[torch.Tensor, list[list[int]]]:
    """(last-position prefill logits [prompts, V], greedy tokens per prompt through the scheduler)."""
    rows = []
    for prompt in _PROMPTS:
        state = backend.prefill_lookup(prompt)
        backend.prefill_chunk(state, len(prompt))
        rows.append(state.last_logits.reshape(-1).clone())
        backend.free_row_kv(state.kv)
    backend.prefix_cache.clear()
    done = run_scheduler(backend, [(prompt, i, _NEW_TOKENS) for i, prompt in enumerate(_PROMPTS)])
    assert_no_leaks(backend)
    return torch.stack(rows), [list(done[f"r{i}"].output_token_ids) for i in range(len(_PROMPTS))]


def _relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """||logits - reference|| / ||reference|| over all prompts' logits (uncorrelated logits of equal spread: ~1.4)."""
    return ((logits - reference).norm() / reference.norm()).item()


def _first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len when equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _generate(path: Path, quantization: str | None, **kwargs: Any) -> tuple[torch.Tensor, list[list[int]]]:
    backend = _backend(path, quantization, **kwargs)
    try:
        return _run(backend)
    finally:
        backend.close()


# ---- quantization primitives ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_and_activation_round_trips_are_within_e4m3_rounding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 40, 56, generator=gen) * torch.rand(3, 40, 1, generator=gen) * 4).to(dtype)
    w[0, 5] = 0  # an all-zero row quantizes to zeros
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (3, 40) and scale.dtype == torch.float32
    back = dequantize(q, scale)
    wf = w.float()
    # e4m3: 3 mantissa bits (relative step 2^-3, rounding error <= 2^-4), subnormals below 2^-6 (step 2^-9) x scale
    bound = torch.maximum(wf.abs() * 2**-4, scale[..., None] * 2**-9) * (1 + 1e-6)
    assert ((back - wf).abs() <= bound).all()
    assert (back[0, 5] == 0).all()
    torch.testing.assert_close(back.abs().amax(-1), wf.abs().amax(-1), atol=0, rtol=1e-6)  # amax maps to 448

    x = torch.randn(7, 56, generator=gen).to(dtype) * 3
    xq, x_scale = quantize_per_token(x)
    assert xq.dtype == FP8_DTYPE and x_scale.shape == (7, 1)
    x_back = xq.float() * x_scale
    assert ((x_back - x.float()).abs() <= torch.maximum(x.float().abs() * 2**-4, x_scale * 2**-9) * (1 + 1e-6)).all()

    # the FP8 matmul equals the fp32 product of the dequantized operands up to fp32 summation order
    y = linear(x, q[1], scale[1])
    assert y.dtype == dtype and y.shape == (7, 40)
    exact = x_back @ back[1].T
    torch.testing.assert_close(y.float(), exact, atol=1e-4 if dtype == torch.float32 else 0.1, rtol=1e-2)


def test_fp8_linear_keeps_leading_dims_and_empty_batches() -> None:
    source = torch.nn.Linear(24, 40, bias=False)
    layer = Fp8Linear.from_linear(source)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (40,)
    x = torch.randn(2, 3, 24)
    assert layer(x).shape == (2, 3, 40)
    assert layer(x[:, :0]).shape == (2, 0, 40)
    rel = (layer(x) - source(x)).norm() / source(x).norm()
    assert rel < 0.06


# ---- FP8 models through the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(_CHECKPOINTS))
def test_fp8_model_generates_close_to_the_fp32_model(checkpoint, name: str) -> None:
    path = checkpoint(name)
    ref_logits, ref_tokens = _generate(path, None)
    backend = _backend(path, "fp8")
    try:
        model = backend.model
        layer = model.layers[0]
        assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
        assert model.embed_tokens.weight.dtype == torch.float32  # embeddings / tied LM head / norms stay
        assert layer.input_layernorm.weight is not None and layer.input_layernorm.weight.dtype == torch.float32
        if name == "moe":
            assert layer.experts.gate_up_proj.dtype == FP8_DTYPE and layer.experts.down_proj_scale.shape == (5, 40)
            assert layer.router.proj.weight.dtype == torch.float32
        if name == "dense_ple_shared":
            assert isinstance(model.per_layer_model_projection, Fp8Linear)
            assert isinstance(layer.per_layer_input_gate, Fp8Linear)
        logits, tokens = _run(backend)
    finally:
        backend.close()
    error, relative = (logits - ref_logits).abs().max().item(), _relative_error(logits, ref_logits)
    divergence = [_first_divergence(a, b) for a, b in zip(tokens, ref_tokens)]
    print(f"\n{name}: fp8 vs fp32 max |logit error| {error:.4f} (max |logit| {ref_logits.abs().max():.3f}), relative "
          f"{relative:.3f}; first greedy divergence per prompt {divergence} of {_NEW_TOKENS}")
    # Tiny random models amplify weight noise (sharp scale-1 attention, random norm weights): FP8 moves their
    # logits by a large fraction, yet they stay correlated with fp32; a wrong scale or layout gives ~1.4
    assert relative < 0.75
    assert all(len(t) == _NEW_TOKENS for t in tokens)

    # fuse_projections (q/k/v and gate/up concatenated, scales concatenated) changes nothing per token
    fused_logits, fused_tokens = _generate(path, "fp8", fuse="on")
    assert fused_tokens == tokens
    torch.testing.assert_close(fused_logits, logits, atol=1e-5, rtol=0)


def test_fp8_forward_is_the_fp32_product_of_its_quantized_operands(checkpoint, monkeypatch) -> None:
    """The strict check behind the loose bounds above: with ``_scaled_mm`` replaced by fp32 arithmetic on the
    dequantized operands, logits move only by fp32 summation order (so the FP8 error is all quantization)."""
    path = checkpoint("moe")
    logits, tokens = _generate(path, "fp8")

    def emulated(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", emulated)
    emulated_logits, emulated_tokens = _generate(path, "fp8")
    assert emulated_tokens == tokens
    torch.testing.assert_close(emulated_logits, logits, atol=1e-5, rtol=0)


# ---- compressed-tensors checkpoints ---------------------------------------------------------------------------


def _write_compressed_tensors(source: Path, target: Path, strategy: str = "channel",
                              config: dict[str, Any] | None = None) -> Path:
    """``source`` (an fp32 checkpoint) with its projection weights in compressed-tensors FP8: ``weight`` as
    float8_e4m3fn and ``weight_scale`` [out, 1] (channel) or [1] (tensor); config.json gets quantization_config."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            (target / item.name).write_bytes(item.read_bytes())
    tensors = load_file(source / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module.rsplit(".", 1)[-1] in _PROJECTIONS:
            if strategy == "channel":
                q, scale = quantize_weight(tensor)
                out[module + ".weight_scale"] = scale[:, None].contiguous()
            else:
                scale = (tensor.float().abs().amax() / 448.0).reshape(1)
                q = (tensor.float() / scale).clamp(-448, 448).to(FP8_DTYPE)
                out[module + ".weight_scale"] = scale
            out[key] = q
        else:
            out[key] = tensor
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    quant = json.loads(json.dumps(_CT_CONFIG))
    quant["config_groups"]["group_0"]["weights"]["strategy"] = strategy
    raw["quantization_config"] = config or quant
    (target / "config.json").write_text(json.dumps(raw, indent=2))
    return target


@pytest.mark.parametrize("name", ["dense_ple_shared", "moe"])
def test_compressed_tensors_checkpoint_equals_online_quantization(checkpoint, tmp_path: Path, name: str) -> None:
    source = checkpoint(name)
    path = _write_compressed_tensors(source, tmp_path / "ct")
    online_logits, online_tokens = _generate(source, "fp8")
    backend = _backend(path)  # QUANTIZATION unset: the checkpoint's FP8 weights load as they are
    try:
        proj = backend.model.layers[0].self_attn.q_proj
        assert isinstance(proj, Fp8Linear) and proj.weight_scale.shape == (proj.out_features,)
        if name == "moe":  # experts are not Linear modules: a compressed-tensors checkpoint keeps them in bf16/fp32
            assert backend.model.layers[0].experts.gate_up_proj.dtype == torch.float32
        logits, tokens = _run(backend)
    finally:
        backend.close()
    if name == "moe":  # online quantization also quantized the experts: close, not equal
        assert _relative_error(logits, online_logits) < 0.75
    else:
        online = GemmaForCausalLM.from_hf(source, dtype=torch.float32, quantization="fp8").state_dict()
        loaded = GemmaForCausalLM.from_hf(path, dtype=torch.float32).state_dict()
        assert online.keys() == loaded.keys()
        for key, value in online.items():  # the same FP8 bytes and scales
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key].view(torch.uint8) if value.dtype ==
                                                                    FP8_DTYPE else loaded[key], value.view(
                                                                        torch.uint8) if value.dtype == FP8_DTYPE
                                                                    else value), key
        assert tokens == online_tokens
        # CPU matmul kernels may sum in another order for differently aligned (mmapped) buffers: last bits only
        torch.testing.assert_close(logits, online_logits, atol=1e-5, rtol=0)


def test_compressed_tensors_tensor_wise_scales_load(checkpoint, tmp_path: Path) -> None:
    source = checkpoint("gemma3")
    path = _write_compressed_tensors(source, tmp_path / "ct_tensor", strategy="tensor")
    ref_logits, _ = _generate(source, None)
    backend = _backend(path)
    try:
        scale = backend.model.layers[1].mlp.up_proj.weight_scale
        assert scale.shape == (96,) and torch.all(scale == scale[0])  # one scale broadcast to every row
        logits, tokens = _run(backend)
    finally:
        backend.close()
    error, relative = (logits - ref_logits).abs().max().item(), _relative_error(logits, ref_logits)
    print(f"\ngemma3 tensor-wise compressed-tensors vs fp32: max |logit error| {error:.4f}, relative {relative:.3f}")
    assert relative < 0.75
    assert all(len(t) == _NEW_TOKENS for t in tokens)


def test_tensor_parallel_loads_fp8_shards(checkpoint, tmp_path: Path) -> None:
    """World size 2 (gloo): column-parallel weights take their rows' scales, row-parallel ones keep every row's
    scale. Row-parallel inputs are quantized per token over each rank's slice, so logits move slightly."""
    path = _write_compressed_tensors(checkpoint("dense_ple_shared"), tmp_path / "ct_tp")
    single_logits, single_tokens = _generate(path, None)
    backend = _backend(path, tensor_parallel_size=2)
    try:
        attn = backend.model.layers[0].self_attn
        assert isinstance(attn.q_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
        assert attn.q_proj.weight_scale.shape == (attn.q_proj.weight.shape[0],)  # this rank's rows
        assert attn.o_proj.weight_scale.shape == (48,)  # row-parallel: every output row
        logits, tokens = _run(backend)
    finally:
        backend.close()
    error, relative = (logits - single_logits).abs().max().item(), _relative_error(logits, single_logits)
    divergence = [_first_divergence(a, b) for a, b in zip(tokens, single_tokens)]
    print(f"\nfp8 tensor_parallel_size=2 vs 1: max |logit error| {error:.4f}, relative {relative:.3f}; first "
          f"divergence {divergence}")
    assert relative < 0.5  # measured 0.332

    # online quantization at world size 2: each rank quantizes its slice (row-parallel rows over its columns)
    source = checkpoint("dense_ple_shared")
    online_single, _ = _generate(source, "fp8")
    online_parallel, parallel_tokens = _generate(source, "fp8", tensor_parallel_size=2)
    relative = _relative_error(online_parallel, online_single)
    print(f"online fp8 tensor_parallel_size=2 vs 1: relative logit error {relative:.3f}")
    assert relative < 0.75 and all(len(t) == _NEW_TOKENS for t in parallel_tokens)  # measured 0.497


# ---- fused MoE experts on FP8 weights (kernels/moe.py, TRITON_INTERPRET=1) ------------------------------------

_KERNEL_SCRIPT = r"""
import json, torch
from gemmaserve_custom_torch.kernels.moe import fused_experts
from gemmaserve_custom_torch.models.layers import MoEExperts
from gemmaserve_custom_torch.models.quantization import quantize_fp8
torch.set_num_threads(1)
out = []
# (E, k, H, I, T, block_m, dtype): decode-sized, several tokens per expert, an expert width off the block sizes
for E, k, H, I, T, block_m, dtype in [(5, 2, 40, 20, 7, None, torch.float32), (4, 3, 48, 32, 33, 16, torch.float32),
                                      (6, 2, 64, 24, 1, None, torch.float32), (5, 3, 40, 20, 9, None, torch.float16)]:
    gen = torch.Generator().manual_seed(E * 100 + T)
    experts = MoEExperts(H, E, I, dtype=dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(0.3 * torch.randn(experts.gate_up_proj.shape, generator=gen))
        experts.down_proj.copy_(0.3 * torch.randn(experts.down_proj.shape, generator=gen))
    quantize_fp8(experts)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    with torch.inference_mode():
        want = experts(x, weights, ids)  # the eager FP8 loop (torch._scaled_mm per expert)
        got = fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_scale,
                            experts.down_proj_scale, block_m=block_m)
    assert got.dtype == dtype and got.shape == want.shape
    out.append([str(dtype), float((got.float() - want.float()).abs().max()), float(want.float().abs().max())])
print(json.dumps(out))
"""

_MODEL_SCRIPT = r"""
import json, sys, torch
from gemmaserve_custom_torch.models import ContiguousKVContext, GemmaForCausalLM
from gemmaserve_custom_torch.models.fusion import fuse_moe, fuse_projections, moe_is_fused
torch.set_num_threads(1)
models = [GemmaForCausalLM.from_hf(sys.argv[1], "cpu", torch.float32, quantization="fp8") for _ in range(2)]
fuse_projections(models[1])
fuse_moe(models[1])
assert moe_is_fused(models[1]) and models[1].layers[0].experts.gate_up_proj.dtype == torch.float8_e4m3fn
prompt = torch.tensor([[2, 17, 93, 311, 45, 8, 260, 77, 140]])
logits, tokens = [], []
with torch.inference_mode():
    for model in models:
        ctx = ContiguousKVContext(model.config)
        logits.append(model(prompt, ctx.next_positions(1, prompt.shape[1]), ctx))
        ids, got = torch.tensor([[int(logits[-1][0, -1].argmax())]]), []
        for _ in range(6):
            got.append(int(ids[0, 0]))
            step = model(ids, ctx.next_positions(1, 1), ctx, logits_to_keep=1)
            ids = torch.tensor([[int(step[0, -1].argmax())]])
        tokens.append(got)
print(json.dumps({"diff": float((logits[0] - logits[1]).abs().max()), "tokens": tokens}))
"""


def _interpret(script: str, *args: str) -> Any:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fused_moe_kernel_on_fp8_experts_equals_the_eager_fp8_loop() -> None:
    """Same arithmetic up to summation order: per-row FP8 inputs, FP8 weight values, fp32 sums, scales, one
    rounding (fp32: a few ulps; fp16: the model-dtype roundings of both paths coincide here)."""
    pytest.importorskip("triton")
    for dtype, error, spread in _interpret(_KERNEL_SCRIPT):
        assert error <= (2e-5 if dtype == "torch.float32" else 1e-2) * spread, (dtype, error, spread)


def test_fp8_moe_model_with_fused_experts_generates_the_eager_tokens(checkpoint) -> None:
    pytest.importorskip("triton")
    out = _interpret(_MODEL_SCRIPT, str(checkpoint("moe")))
    assert out["tokens"][0] == out["tokens"][1]
    # fp32 summation order moves values by ulps, which can move a quantized activation across an FP8 rounding
    # edge (one e4m3 step); measured 1.6e-4 on logits of magnitude ~1
    assert out["diff"] < 2e-3


# ---- refusals ---------------------------------------------------------------------------------------------------


def _scheme(**changes: Any) -> dict[str, Any]:
    raw = json.loads(json.dumps(_CT_CONFIG))
    group = raw["config_groups"]["group_0"]
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            group[section][field] = value
        else:
            raw[section] = value
    return raw


@pytest.mark.parametrize(("changes", "message"), [
    ({"weights__strategy": "block"}, r"weight strategy 'block'.*channel and tensor"),
    ({"weights__strategy": "group"}, r"weight strategy 'group'"),
    ({"input_activations__dynamic": False}, r"static input activations"),
    ({"weights__num_bits": 4, "weights__type": "int"}, r"4-bit 'int'"),
    ({"quant_method": "gptq"}, r"quant_method 'gptq'"),
    ({"format": "pack-quantized"}, r"format 'pack-quantized'"),
])
def test_unsupported_checkpoint_schemes_are_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        parse_scheme(_scheme(**changes))
    assert "compressed-tensors, format float-quantized" in str(info.value)


def test_static_activation_checkpoint_fails_to_load(checkpoint, tmp_path: Path) -> None:
    path = _write_compressed_tensors(checkpoint("gemma3"), tmp_path / "ct_static",
                                     config=_scheme(input_activations__dynamic=False))
    with pytest.raises(ConfigurationError, match="static input activations"):
        _backend(path)


def test_unknown_quantization_and_backends_without_fp8_are_refused(checkpoint) -> None:
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.engine.factory import build_engine

    with pytest.raises(ConfigurationError, match=r"(?s)QUANTIZATION.*'fp8'"):
        load_settings(quantization="awq")
    with pytest.raises(ConfigurationError, match=r"(?s)QUANTIZATION.*'fp8'"):
        LLM("/nonexistent", quantization="awq")
    assert load_settings(quantization="").quantization is None
    assert load_settings(quantization="FP8").quantization == "fp8"
    path = checkpoint("gemma3")
    with LLM(str(path), backend="custom-cpu", device="cpu", dtype="float32", quantization="fp8") as llm:
        assert isinstance(llm.engine.backend.model.layers[0].mlp.up_proj, Fp8Linear)
        assert len(llm.generate([[2, 5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    for backend in ("hf", "mlx"):
        settings = CoreSettings(model=str(path), backend=backend, device="cpu", quantization="fp8")
        with pytest.raises(ConfigurationError, match=rf"QUANTIZATION=fp8: backend '{backend}.*' does not support it"):
            build_engine(settings)


def test_devices_without_fp8_matmuls_are_refused_naming_device_and_capability(monkeypatch) -> None:
    from gemmaserve_custom_torch.models.quantization import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigurationError, match=r"capability >= 8\.9.*NVIDIA A100-SXM4-80GB \(cuda:0\) has 8\.0"):
        check_fp8_device("cuda:0", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_fp8_device("cuda:0", torch.bfloat16)  # Ada: FP8 with bf16 outputs
    with pytest.raises(ConfigurationError, match=r"DTYPE=float32 on NVIDIA L4 .*set DTYPE=bfloat16"):
        check_fp8_device("cuda:0", torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device("cuda:0", torch.float32)  # Hopper: cuBLAS writes fp32 too
    with pytest.raises(ConfigurationError, match="not on mps"):
        check_fp8_device("mps", torch.bfloat16)
    check_fp8_device("cpu", torch.float32)


def test_cuda_shape_rule_names_the_projections(checkpoint) -> None:
    from gemmaserve_custom_torch.models.quantization import check_fp8_shapes

    model = GemmaForCausalLM.from_hf(checkpoint("moe"), dtype=torch.float32, quantization="fp8")
    with pytest.raises(ConfigurationError, match=r"multiples of 16; layers\.0\.self_attn\.q_proj \[64, 40\]"):
        check_fp8_shapes(model)


def test_online_quantization_frees_each_model_dtype_layer_as_it_goes(checkpoint, monkeypatch) -> None:
    """Peak memory of QUANTIZATION=fp8 is the model-dtype weights plus one projection's copies (what lets 31B's
    bf16 checkpoint quantize on an 80 GB GPU): when a projection is quantized, every one replaced before it is
    already gone."""
    import gc
    import weakref

    from gemmaserve_custom_torch.models import quantization

    model = GemmaForCausalLM.from_hf(checkpoint("dense_ple_shared"), dtype=torch.float32)
    gc.collect()
    replaced: list[weakref.ref[torch.nn.Module]] = []
    alive_at_call: list[int] = []
    original = quantization.Fp8Linear.from_linear.__func__

    def watched(cls: type, source: torch.nn.Linear) -> Fp8Linear:
        alive_at_call.append(sum(ref() is not None for ref in replaced))
        replaced.append(weakref.ref(source))
        return original(cls, source)

    monkeypatch.setattr(quantization.Fp8Linear, "from_linear", classmethod(watched))
    count = quantization.quantize_fp8(model)
    assert count >= len(alive_at_call) > 4
    assert alive_at_call == [0] * len(alive_at_call), alive_at_call  # no reference cycle holds a replaced layer


def test_quantizing_after_fusion_is_refused(checkpoint) -> None:
    from gemmaserve_custom_torch.models.fusion import fuse_projections
    from gemmaserve_custom_torch.models.quantization import quantize_fp8

    model = GemmaForCausalLM.from_hf(checkpoint("gemma3"), dtype=torch.float32)
    fuse_projections(model)
    with pytest.raises(ValueError, match="quantize first, then fuse"):
        quantize_fp8(model)


def test_scheme_targets_and_ignore_match_class_names_suffixes_and_regexes() -> None:
    raw = _scheme(ignore=["lm_head", "re:.*router.*", "re:.*layers\\.1\\.mlp.*"])
    raw["config_groups"]["group_0"]["targets"] = ["re:.*(q|k|v|o)_proj$", "re:.*mlp\\..*_proj$", "per_layer_projection"]
    scheme = parse_scheme(raw)
    name = "model.language_model.layers.{}.{}"
    assert scheme.quantizes(name.format(0, "self_attn.q_proj"))
    assert scheme.quantizes(name.format(0, "mlp.down_proj"))
    assert scheme.quantizes(name.format(3, "per_layer_projection"))  # a dotted-suffix module name
    assert not scheme.quantizes(name.format(1, "mlp.gate_proj"))  # ignored by regex
    assert not scheme.quantizes(name.format(0, "router.proj"))
    assert not scheme.quantizes(name.format(0, "per_layer_input_gate"))  # not targeted
    assert parse_scheme(_scheme()).quantizes("model.layers.0.router.proj") is False  # "Linear" minus the ignore list
    assert parse_scheme(_scheme()).quantizes("model.layers.0.mlp.up_proj")
