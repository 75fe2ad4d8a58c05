"""Parity of the hand-written Gemma forward (custom_torch) with transformers' eager Gemma 3 / Gemma 4.

Reference: `AutoModelForCausalLM.from_pretrained(..., attn_implementation="eager", experts_implementation="eager")`
on CPU. Checkpoints are tiny random ones (tests/tiny_checkpoints.py) with sliding_window W=8.

What is asserted, and the tolerances found:
* Full-sequence logits (prefill) are bitwise equal (`torch.equal`) in fp32 and bf16, for prompts shorter than
  the window (6 tokens) and several windows long (40 tokens).
* Greedy decode through `ContiguousKVContext` (prefill, then one token per step) gives the same tokens as
  `generate(do_sample=False)`. Its per-step logits match within DECODE_ATOL: every decode step is bitwise
  equal; only the first generated token of KV-sharing models differs (<= 1e-6 in fp32), because transformers'
  `generate` runs the KV-shared layers of the prefill on the last position only (different GEMM shapes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import VOCAB_SIZE, build_tiny_gemma3, build_tiny_gemma4, wrap_as_multimodal
from gemmaserve_custom_torch.models import (
    ContiguousKVContext,
    GemmaForCausalLM,
    GemmaTextConfig,
    build_attention_mask,
)
from gemmaserve_custom_torch.models.config import FULL, SLIDING

VARIANTS = ["gemma4", "gemma4_k_eq_v", "gemma4_moe", "gemma3"]
SHORT, LONG = 6, 40  # W = 8
DECODE_ATOL = 1e-5  # fp32 logits of HF generate vs our prefill + decode; observed max 8e-7 (first token only)

HFLoader = Callable[[Path, torch.dtype], torch.nn.Module]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny models are latency-bound; with 2 OpenMP threads on a busy 2-core box they run ~20x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _prompt(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _prefill_logits(model: GemmaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    ctx = ContiguousKVContext(model.config)
    return model(ids, ctx.next_positions(*ids.shape), ctx)


@torch.no_grad()
def _greedy(model: GemmaForCausalLM, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill + one-token decode steps through ContiguousKVContext -> (tokens [B, steps], per-step logits)."""
    ctx = ContiguousKVContext(model.config)
    logits = model(ids, ctx.next_positions(*ids.shape), ctx, logits_to_keep=1)[:, -1]
    tokens, all_logits = [], []
    for _ in range(steps):
        all_logits.append(logits)
        tokens.append(logits.argmax(-1))
        step_ids = tokens[-1][:, None]
        logits = model(step_ids, ctx.next_positions(*step_ids.shape), ctx, logits_to_keep=1)[:, -1]
    return torch.stack(tokens, dim=1), all_logits


@torch.no_grad()
def _hf_greedy(hf: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, ids.shape[1] :], list(out.logits)


# ---- config ------------------------------------------------------------------------------------------------


def test_config_hub_style_and_per_layer_config_agree(tmp_path: Path, tiny_checkpoint) -> None:
    """transformers 5.24 saves `per_layer_config`; Hub checkpoints carry `global_head_dim`: same geometry."""
    k_eq_v = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
    for name, overrides in (("gemma4", {}), ("gemma4_k_eq_v", k_eq_v)):
        hub = GemmaTextConfig.from_pretrained(tiny_checkpoint(name))
        saved = build_tiny_gemma4(tmp_path / name, hub_style=False, **overrides)
        assert "per_layer_config" in json.loads((saved / "config.json").read_text())
        assert GemmaTextConfig.from_pretrained(saved) == hub

    cfg = GemmaTextConfig.from_pretrained(tiny_checkpoint("gemma4"))
    assert cfg.layer_types == (SLIDING, SLIDING, FULL) * 2
    assert cfg.head_dims == (16, 16, 32, 16, 16, 32)
    assert cfg.num_kv_heads == (2,) * 6
    assert cfg.kv_source_layer == (0, 1, 2, 1, 1, 2)
    assert cfg.mlp_widths == (128, 128, 128, 256, 256, 256)
    assert (cfg.ple_dim, cfg.attention_scale, cfg.norm_style, cfg.final_logit_softcapping) == (16, 1.0, "w", 30.0)
    assert cfg.rope[FULL].rope_type == "proportional" and cfg.rope[FULL].partial_rotary_factor == 0.25

    kv = GemmaTextConfig.from_pretrained(tiny_checkpoint("gemma4_k_eq_v"))
    assert kv.k_eq_v == (False, False, True, False, False, True)
    assert kv.num_kv_heads == (2, 2, 1, 2, 2, 1)


def test_config_gemma3_legacy_fields_and_defaults() -> None:
    """A sparse Hub-style Gemma 3 wrapper config resolves like transformers (defaults, legacy RoPE fields)."""
    raw = {
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "num_hidden_layers": 12,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
    }
    cfg = GemmaTextConfig.from_dict(raw, generation_config={"eos_token_id": [1, 106, 107]})
    assert cfg.family == "gemma3" and cfg.is_multimodal_wrapper
    assert cfg.layer_types == ((SLIDING,) * 5 + (FULL,)) * 2
    assert cfg.attention_scale == 256**-0.5 and cfg.norm_style == "one_plus_w"
    assert cfg.rope[FULL].rope_type == "linear" and cfg.rope[FULL].factor == 8.0 and cfg.rope[FULL].theta == 1e6
    assert cfg.rope[SLIDING].theta == 1e4 and cfg.rope[SLIDING].rope_type == "default"
    assert cfg.eos_token_ids == (1, 106, 107)
    assert cfg.vocab_size == 262_208 and cfg.head_dims == (256,) * 12 and cfg.final_logit_softcapping is None


def test_config_rejects_unsupported_model_type() -> None:
    with pytest.raises(ValueError, match="gemma4_text, gemma4, gemma3_text, gemma3"):
        GemmaTextConfig.from_dict({"model_type": "llama"})


@pytest.mark.parametrize("case", ["unrotated-full-layers", "empty-per-layer-config", "gemma3-rope-scaling-beside"])
def test_config_edge_values_read_as_transformers_reads_them(case: str, tmp_path: Path,
                                                            hf_reference: HFLoader) -> None:
    """``partial_rotary_factor: 0.0`` rotates nothing (it is not "unset"); a saved ``per_layer_config: {}`` (what
    transformers writes when the full layers' head dim equals ``head_dim``) overrides nothing, whatever the
    ``global_*`` defaults say. Prefill logits bitwise equal to transformers'."""
    if case == "unrotated-full-layers":
        rope = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.0}}
        path = build_tiny_gemma4(tmp_path / case, rope_parameters=rope)
        assert GemmaTextConfig.from_pretrained(path).rope[FULL].partial_rotary_factor == 0.0
    elif case == "gemma3-rope-scaling-beside":  # a legacy rope_scaling beside per-type rope_parameters: it wins
        path = build_tiny_gemma3(tmp_path / case)
        config = json.loads((path / "config.json").read_text())
        text = config.get("text_config", config)
        assert FULL in text["rope_parameters"]
        text["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
        (path / "config.json").write_text(json.dumps(config))
        assert GemmaTextConfig.from_pretrained(path).rope[FULL].factor == 8.0
    else:
        path = build_tiny_gemma4(tmp_path / case, hub_style=False, global_head_dim=16)
        saved = json.loads((path / "config.json").read_text())
        assert saved.get("per_layer_config") == {} and "global_head_dim" not in saved
        assert set(GemmaTextConfig.from_pretrained(path).head_dims) == {16}
    hf = hf_reference(path, torch.float32)
    model = GemmaForCausalLM.from_hf(path, dtype=torch.float32)
    ids = _prompt(2, SHORT, seed=3)
    with torch.no_grad():
        expected = hf(ids).logits
    assert torch.equal(_prefill_logits(model, ids), expected)


# ---- logits parity -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [SHORT, LONG])
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_logits_bitwise_fp32(variant: str, length: int, tiny_checkpoint, hf_reference: HFLoader) -> None:
    path = tiny_checkpoint(variant)
    hf = hf_reference(path, torch.float32)
    model = GemmaForCausalLM.from_hf(path, dtype=torch.float32)
    ids = _prompt(2, length, seed=length)
    with torch.no_grad():
        expected = hf(ids).logits
    assert torch.equal(_prefill_logits(model, ids), expected)


@pytest.mark.parametrize("variant", ["gemma4", "gemma4_k_eq_v", "gemma3"])
def test_greedy_decode_matches_hf_generate(variant: str, tiny_checkpoint, hf_reference: HFLoader) -> None:
    """40-token prompt (5 windows), 16 greedy steps, batch of 2."""
    path = tiny_checkpoint(variant)
    hf = hf_reference(path, torch.float32)
    model = GemmaForCausalLM.from_hf(path)
    ids = _prompt(2, LONG, seed=1)
    expected_tokens, expected_logits = _hf_greedy(hf, ids, 16)
    tokens, logits = _greedy(model, ids, 16)
    assert torch.equal(tokens, expected_tokens)
    for step, (ours, theirs) in enumerate(zip(logits, expected_logits)):
        torch.testing.assert_close(ours, theirs, atol=DECODE_ATOL, rtol=0, msg=f"step {step}")
        if step > 0:  # decode steps see exactly the keys transformers' sliding cache keeps
            assert torch.equal(ours, theirs), f"decode step {step} not bitwise equal"


@pytest.mark.parametrize("variant", ["gemma4", "gemma3"])
def test_bf16_matches_hf_bf16(variant: str, tiny_checkpoint, hf_reference: HFLoader) -> None:
    """from_hf(dtype=bf16) vs from_pretrained(dtype=bf16): bitwise prefill logits and equal greedy tokens."""
    path = tiny_checkpoint(variant)
    hf = hf_reference(path, torch.bfloat16)
    model = GemmaForCausalLM.from_hf(path, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    ids = _prompt(2, SHORT, seed=2)
    with torch.no_grad():
        assert torch.equal(_prefill_logits(model, ids), hf(ids).logits)
    expected_tokens, _ = _hf_greedy(hf, ids, 12)
    tokens, _ = _greedy(model, ids, 12)
    assert torch.equal(tokens, expected_tokens)


def test_to_bf16_keeps_rope_in_fp32(tiny_gemma4_dir: Path) -> None:
    """Casting an fp32-loaded model with .to(bf16) equals loading in bf16 (inv_freq stays fp32)."""
    cast = GemmaForCausalLM.from_hf(tiny_gemma4_dir).to(torch.bfloat16)
    loaded = GemmaForCausalLM.from_hf(tiny_gemma4_dir, dtype=torch.bfloat16)
    ids = _prompt(1, LONG, seed=3)
    assert torch.equal(_prefill_logits(cast, ids), _prefill_logits(loaded, ids))


def test_forward_hidden_compute_logits_and_logits_to_keep(tiny_gemma4_dir: Path) -> None:
    model = GemmaForCausalLM.from_hf(tiny_gemma4_dir)
    ids = _prompt(2, 10, seed=4)
    full = _prefill_logits(model, ids)
    assert full.shape == (2, 10, VOCAB_SIZE)
    ctx = ContiguousKVContext(model.config)
    with torch.no_grad():
        hidden = model.forward_hidden(ids, ctx.next_positions(2, 10), ctx)
        last = model.compute_logits(hidden[:, -1])
    assert hidden.shape == (2, 10, 64)
    torch.testing.assert_close(last, full[:, -1], atol=1e-6, rtol=0)
    ctx = ContiguousKVContext(model.config)
    with torch.no_grad():
        kept = model(ids, ctx.next_positions(2, 10), ctx, logits_to_keep=3)
    assert kept.shape == (2, 3, VOCAB_SIZE)
    torch.testing.assert_close(kept, full[:, -3:], atol=1e-6, rtol=0)


# ---- loading -----------------------------------------------------------------------------------------------


def test_gemma4_multimodal_wrapper_loads(tmp_path: Path, tiny_gemma4_dir: Path) -> None:
    """`gemma4` config with text_config and `model.language_model.` weights; vision weights and the (unused)
    K/V weights that real checkpoints carry for KV-shared layers are skipped."""
    text = GemmaForCausalLM.from_hf(tiny_gemma4_dir)
    extra = {"model.vision_tower.patch_embedder.weight": torch.zeros(4, 4)}
    for layer in (3, 4, 5):
        head_dim = text.config.head_dims[layer]
        extra[f"model.language_model.layers.{layer}.self_attn.k_proj.weight"] = torch.randn(2 * head_dim, 64)
        extra[f"model.language_model.layers.{layer}.self_attn.v_proj.weight"] = torch.randn(2 * head_dim, 64)
        extra[f"model.language_model.layers.{layer}.self_attn.k_norm.weight"] = torch.randn(head_dim)
    wrapped = GemmaForCausalLM.from_hf(wrap_as_multimodal(tiny_gemma4_dir, tmp_path / "mm", extra=extra))
    assert wrapped.config.model_type == "gemma4" and wrapped.config.eos_token_ids == (1, 106)
    assert wrapped.layers[4].self_attn.k_proj is None
    ids = _prompt(2, 12, seed=5)
    assert torch.equal(_prefill_logits(wrapped, ids), _prefill_logits(text, ids))


def test_gemma3_hub_wrapper_prefix_loads(tmp_path: Path, tiny_gemma3_dir: Path) -> None:
    """Hub Gemma 3 checkpoints store text weights under `language_model.model.`."""
    mm = wrap_as_multimodal(tiny_gemma3_dir, tmp_path / "mm", text_prefix="language_model.model.")
    ids = _prompt(1, 12, seed=6)
    expected = _prefill_logits(GemmaForCausalLM.from_hf(tiny_gemma3_dir), ids)
    assert torch.equal(_prefill_logits(GemmaForCausalLM.from_hf(mm), ids), expected)


def test_sharded_checkpoint_loads(tmp_path: Path, tiny_gemma4_dir: Path) -> None:
    sharded = build_tiny_gemma4(tmp_path / "sharded", max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = _prompt(1, 12, seed=7)
    assert torch.equal(
        _prefill_logits(GemmaForCausalLM.from_hf(sharded), ids),
        _prefill_logits(GemmaForCausalLM.from_hf(tiny_gemma4_dir), ids),
    )


def test_from_hf_reports_bad_checkpoints(tmp_path: Path, tiny_gemma4_dir: Path) -> None:
    (tmp_path / "config.json").write_bytes((tiny_gemma4_dir / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        GemmaForCausalLM.from_hf(tmp_path)
    extra = {"model.language_model.layers.0.self_attn.mystery.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="mystery"):
        GemmaForCausalLM.from_hf(wrap_as_multimodal(tiny_gemma4_dir, tmp_path / "mm", extra=extra))


# ---- attention context -------------------------------------------------------------------------------------


def test_build_attention_mask_window_and_padding() -> None:
    q = torch.tensor([5, 6])
    k = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6])
    causal = build_attention_mask(q, k, None)
    assert causal.tolist() == [[False] + [True] * 6 + [False], [False] + [True] * 7]
    windowed = build_attention_mask(q, k, 3)  # q - 3 < k <= q
    assert windowed.tolist() == [[False] * 4 + [True] * 3 + [False], [False] * 5 + [True] * 3]


def test_contiguous_context_rejects_misuse(tiny_gemma4_dir: Path) -> None:
    config = GemmaTextConfig.from_pretrained(tiny_gemma4_dir)
    ctx = ContiguousKVContext(config)
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="needs k and v"):
        ctx.attend(0, q, None, None)
    with pytest.raises(RuntimeError, match="layer 1"):
        ctx.attend(3, q, None, None)  # layer 3 reuses layer 1's KV, which has not run


def test_a_truncated_or_missing_weight_file_names_the_file(tmp_path: Path, tiny_gemma4_dir: Path) -> None:
    import shutil

    from gemmaserve.errors import ModelLoadError
    from gemmaserve.settings import CoreSettings
    from gemmaserve_custom_torch.backend import create_backend

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_gemma4_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors .*truncated or corrupt"):
        create_backend(str(truncated), "cpu", CoreSettings(model=str(truncated), device="cpu"))
    garbage = tmp_path / "garbage"
    shutil.copytree(tiny_gemma4_dir, garbage)
    (garbage / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        GemmaForCausalLM.from_hf(garbage)


def test_a_sliding_window_of_one_is_refused(tmp_path: Path) -> None:
    """transformers' generate keeps the whole cache for a window of 1 (its forward attends to the token alone), so no
    backend can match it: refused by name at load instead of serving tokens generate disagrees with."""
    path = build_tiny_gemma4(tmp_path / "w1", sliding_window=1)
    with pytest.raises(ValueError, match="sliding_window=1 is not supported"):
        GemmaTextConfig.from_pretrained(path)


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
def test_a_stored_head_wins_over_a_tie_in_the_config(family: str, tmp_path: Path, hf_reference: HFLoader) -> None:
    """config.json says ``tie_word_embeddings: true`` but the checkpoint stores its own, different ``lm_head``:
    transformers keeps the stored head ("we will NOT tie them"), so the custom model does too (it dropped the head
    and used the embedding: other logits from the first token)."""
    build = build_tiny_gemma4 if family == "gemma4" else build_tiny_gemma3
    path = build(tmp_path / family, tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    hf = hf_reference(path, torch.float32)
    model = GemmaForCausalLM.from_hf(path, dtype=torch.float32)
    assert model.lm_head is not None
    ids = _prompt(1, SHORT, seed=3)
    with torch.no_grad():
        assert torch.equal(_prefill_logits(model, ids), hf(ids).logits)
