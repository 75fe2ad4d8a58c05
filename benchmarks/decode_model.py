"""Model side of benchmarks/decode.py: the Gemma 4 configs (E2B, E4B, 26B-A4B, 31B, each with a tiny CPU
variant), seeded random weights built in memory (transformers model first, directly on the device, then the
custom model sharing its tensors), the HBM roofline of one decode step (divided by ``timing.copy_bandwidth``),
and the KV capacity report (the backend's own pool accounting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SLIDING, FULL = "sliding_attention", "full_attention"

# gemma4-spec.md §4, E2B column (text decoder); max_position_embeddings only bounds the decode tables
E2B: dict[str, Any] = {
    "vocab_size": 262144, "vocab_size_per_layer_input": 262144, "hidden_size": 1536, "intermediate_size": 6144,
    "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
    "global_head_dim": 512, "layer_types": [SLIDING] * 4 + [FULL], "sliding_window": 512,
    "num_kv_shared_layers": 20, "hidden_size_per_layer_input": 256, "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "max_position_embeddings": 2048, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
}
# --quick: every E2B feature at toy size (runs on a CPU in seconds)
TINY: dict[str, Any] = {
    **E2B, "vocab_size": 512, "vocab_size_per_layer_input": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 10, "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32,
    "sliding_window": 16, "num_kv_shared_layers": 4, "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 256,
}
# The bigger Gemma 4 text decoders: gemma4-spec.md §4, the same numbers as the e4b / 26b-a4b / 31b presets of
# shared/tools/vllm-peer/vllm_peer_bench.py (so figures compare with vLLM at these shapes); max_position_embeddings
# again only bounds the decode tables (decode.py raises it for longer workloads).
E4B: dict[str, Any] = {
    **E2B, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42, "num_attention_heads": 8,
    "num_key_value_heads": 2, "layer_types": [SLIDING] * 5 + [FULL], "sliding_window": 512,
    "num_kv_shared_layers": 18, "hidden_size_per_layer_input": 256, "use_double_wide_mlp": False,
}
_NO_PLE: dict[str, Any] = {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "use_double_wide_mlp": False}
A26B: dict[str, Any] = {  # 26B-A4B: dense MLP 2112 + 128-expert top-8 MoE (704 each); K=V full layers
    **E2B, **_NO_PLE, "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
    "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
    "layer_types": [SLIDING] * 5 + [FULL], "sliding_window": 1024, "attention_k_eq_v": True,
    "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
}
G31B: dict[str, Any] = {  # 31B: dense; K=V full layers with 4 global KV heads
    **E2B, **_NO_PLE, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60,
    "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4,
    "layer_types": [SLIDING] * 5 + [FULL], "sliding_window": 1024, "attention_k_eq_v": True,
}
# Toy variants (--quick): the same features (E4B: PLE + KV sharing; 26B-A4B: MoE + K=V + global KV heads;
# 31B: K=V + global KV heads) at CPU size.
_TOY: dict[str, Any] = {"vocab_size": 512, "vocab_size_per_layer_input": 512, "hidden_size": 64,
                        "num_hidden_layers": 12, "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32,
                        "sliding_window": 16, "max_position_embeddings": 256}
E4B_TINY: dict[str, Any] = {**E4B, **_TOY, "intermediate_size": 128, "num_kv_shared_layers": 4,
                            "hidden_size_per_layer_input": 8}
A26B_TINY: dict[str, Any] = {**A26B, **_TOY, "intermediate_size": 48, "num_key_value_heads": 2,
                             "num_global_key_value_heads": 1, "num_experts": 8, "top_k_experts": 2,
                             "moe_intermediate_size": 16}
G31B_TINY: dict[str, Any] = {**G31B, **_TOY, "intermediate_size": 128, "num_key_value_heads": 2,
                             "num_global_key_value_heads": 1}
# --config name -> (label, full-size dict, --quick dict)
CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "e2b": ("E2B", E2B, TINY), "e4b": ("E4B", E4B, E4B_TINY), "26b-a4b": ("26B-A4B", A26B, A26B_TINY),
    "31b": ("31B", G31B, G31B_TINY),
}


class IdsOnlyTokenizer:
    """The benchmark sends token ids only; text calls are a bug here."""

    has_chat_template = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError("the benchmark model has no tokenizer")

    def decode(self, token_ids: Any, *, skip_special_tokens: bool = True) -> str:
        raise NotImplementedError("the benchmark model has no tokenizer")

    def apply_chat_template(self, messages: Any) -> list[int]:
        raise NotImplementedError("the benchmark model has no tokenizer")


def hf_config(base: dict[str, Any]) -> Any:
    from transformers import Gemma4TextConfig

    raw = dict(base)
    raw["layer_types"] = [raw["layer_types"][i % len(raw["layer_types"])] for i in range(raw["num_hidden_layers"])]
    return Gemma4TextConfig(**raw)


def build_hf_model(base: dict[str, Any], device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """transformers' Gemma4ForCausalLM with its own seeded random init, built directly on ``device`` in ``dtype``."""
    from transformers import Gemma4ForCausalLM

    config = hf_config(base)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Gemma4ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def custom_from_hf(hf_model: torch.nn.Module) -> Any:
    """The custom GemmaForCausalLM over the same tensors as ``hf_model`` (no copy; shared-KV layers' unused
    k/v weights are skipped)."""
    from gemmaserve_custom_torch.models.config import GemmaTextConfig
    from gemmaserve_custom_torch.models.gemma import GemmaForCausalLM

    config = GemmaTextConfig.from_dict(hf_model.config.to_dict())
    dtype = next(hf_model.parameters()).dtype
    model = GemmaForCausalLM(config, device="meta", dtype=dtype)
    state = _shared_state(hf_model, set(model.state_dict()))
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def _shared_state(hf_model: torch.nn.Module, expected: set[str]) -> dict[str, torch.Tensor]:
    """The custom model's state-dict names -> ``hf_model``'s tensors (the same objects)."""
    state = {}
    for key, tensor in hf_model.state_dict(keep_vars=True).items():
        local = key.removeprefix("model.")
        if local in expected:
            state[local] = tensor
    missing = expected - set(state)
    if missing:
        raise RuntimeError(f"the transformers model lacks {sorted(missing)[:5]}")
    return state


def _hf_slots(hf_model: torch.nn.Module, model: Any) -> list[tuple[torch.nn.Module, str, bool, str]]:
    """Every (module, attribute, is_parameter, custom name) of ``hf_model`` that holds a tensor the custom model
    was built over (tied ones included: transformers' ``lm_head.weight`` is ``embed_tokens.weight``)."""
    by_id = {id(t): name for name, t in _shared_state(hf_model, set(model.state_dict())).items()}
    slots = []
    for module in hf_model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for attr, tensor in table.items():
                if tensor is not None and id(tensor) in by_id:
                    slots.append((module, attr, is_param, by_id[id(tensor)]))
    return slots


def release_shared(hf_model: torch.nn.Module, model: Any) -> list[tuple[torch.nn.Module, str, bool, str]]:
    """Drop ``hf_model``'s references to the tensors it shares with the custom ``model`` (meta placeholders
    take their place), so that a load-time rewrite of the custom model (``fuse_projections`` concatenates q/k/v
    and gate/up into new tensors and re-points the old parameters at views) frees each original as it goes
    instead of keeping a second copy alive in ``hf_model``. ``hf_model`` cannot run until :func:`retie`."""
    slots = _hf_slots(hf_model, model)
    for module, attr, is_param, _ in slots:
        table = module._parameters if is_param else module._buffers
        meta = torch.empty_like(table[attr], device="meta")
        table[attr] = torch.nn.Parameter(meta, requires_grad=False) if is_param else meta
    return slots


def retie(slots: list[tuple[torch.nn.Module, str, bool, str]], model: Any) -> None:
    """Point the ``release_shared`` slots of the transformers model at the custom ``model``'s current tensors
    (the fused views after fusion: the same values, one copy)."""
    state = model.state_dict(keep_vars=True)
    for module, attr, is_param, name in slots:
        tensor = state[name]
        if is_param:
            module._parameters[attr] = (tensor if isinstance(tensor, torch.nn.Parameter)
                                        else torch.nn.Parameter(tensor, requires_grad=False))
        else:
            module._buffers[attr] = tensor


def held_bytes(*modules: torch.nn.Module | None) -> int:
    """Bytes of the distinct storages behind the parameters and buffers of ``modules`` (a tensor shared by
    two modules, or a view of another, counts once; meta tensors count nothing): what they hold in memory."""
    seen: dict[tuple[str, int], int] = {}
    for module in modules:
        if module is None:
            continue
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class Roofline:
    """Bytes one decode step must read: every matmul weight once (LM head included, lookup tables not; MoE
    experts: the ones the batch routes to, see :meth:`experts_read`), gathered embedding + PLE rows, each
    row's visible K/V in every layer, and the logits written."""

    weight_bytes: int  # dense matmul weights (every step reads all of them)
    row_bytes: int  # embedding + PLE rows + logits of one row
    kv_bytes_per_token: dict[str, int]  # per layer type, summed over the layers that read it
    window: int
    expert_bytes: int = 0  # one expert's gate_up + down weights (and FP8 scales), summed over the MoE layers
    num_experts: int = 0
    top_k: int = 0

    def experts_read(self, batch: int) -> float:
        """Distinct experts per MoE layer a decode step of ``batch`` rows reads: exactly top_k at N=1. For N > 1
        this is APPROXIMATE: E * (1 - (1 - k/E)^N), the expectation when every row picks its k experts uniformly
        at random and independently of the other rows (random weights route close to uniformly; a trained
        router is skewed, so it touches fewer distinct experts)."""
        if not self.num_experts:
            return 0.0
        if batch <= 1:
            return float(self.top_k)
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)

    def step_weight_bytes(self, batch: int) -> int:
        return self.weight_bytes + round(self.experts_read(batch) * self.expert_bytes)

    def step_bytes(self, batch: int, context: int) -> int:
        kv = self.kv_bytes_per_token[FULL] * context + self.kv_bytes_per_token[SLIDING] * min(context, self.window)
        return self.step_weight_bytes(batch) + batch * (self.row_bytes + kv)


def roofline(model: Any) -> Roofline:
    from gemmaserve_custom_torch.models.layers import MoEExperts

    config = model.config
    item = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()  # FP8 weights: 1 byte
                  if p.dim() == 2 and not name.startswith("embed_tokens_per_layer"))
    row = (config.hidden_size + config.num_hidden_layers * config.ple_dim) * item + config.vocab_size * item
    kv = {SLIDING: 0, FULL: 0}
    for i in range(config.num_hidden_layers):
        # K and V are both read, also on K=V layers: the pools keep V = v_norm(k) apart from K = rope(k_norm(k))
        kv[config.layer_types[i]] += 2 * config.num_kv_heads[i] * config.head_dims[i] * item
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]  # 3-D weights: not in ``weights``
    expert = sum(t.numel() * t.element_size() for m in experts
                 for t in (m.gate_up_proj, m.down_proj, m.gate_up_proj_scale, m.down_proj_scale) if t is not None)
    return Roofline(weights, row, kv, config.sliding_window or 0, expert // max(1, config.moe_num_experts),
                    config.moe_num_experts, config.moe_top_k)


# ---- KV capacity (the custom_torch backend's own pool accounting) ---------------------------------------------

def kv_request_blocks(config: Any, block_size: int, itemsize: int, num_tokens: int) -> dict[str, dict[str, int]]:
    """Per KV group of ``config`` (``kv.pools.kv_groups``: storing layers only, KV-shared layers store nothing):
    bytes of one block, bytes per token (one token in every storing layer of the group: K and V, also on K=V
    layers) and the blocks a request of ``num_tokens`` tokens reserves (``GroupGeometry.max_blocks``, the
    backend's admission footprint: sliding groups are bounded by the window)."""
    from gemmaserve_custom_torch.kv.pools import GroupGeometry, kv_groups

    out = {}
    for group in kv_groups(config):
        block = group.bytes_per_block(block_size, itemsize)
        out[group.name] = {"bytes_per_block": block, "bytes_per_token": block // block_size,
                           "blocks_per_request": GroupGeometry(block_size, group.window).max_blocks(num_tokens)}
    return out


def kv_tokens_fitting(config: Any, itemsize: int, block_size: int, memory_bytes: int, max_rows: int) -> int:
    """The largest MAX_ACTIVE_KV_TOKENS whose default pool budget fits in ``memory_bytes``: the inverse of the
    backend's ``_budget_bytes`` (``ceil(tokens / block_size) + max_rows`` blocks of every KV group)."""
    from gemmaserve_custom_torch.kv.pools import kv_groups

    uniform = sum(g.bytes_per_block(block_size, itemsize) for g in kv_groups(config))
    return max(0, (memory_bytes // uniform - max_rows) * block_size)


def kv_capacity(config: Any, itemsize: int, block_size: int, memory_bytes: int, *, request_tokens: int = 4096,
                chunk_tokens: int = 512) -> dict[str, Any]:
    """How many concurrent ``request_tokens``-token requests the KV pools hold in ``memory_bytes``.

    ``max_concurrent_requests``: pools split to fit (per group, that many request footprints; the backend gets
    this split with CUSTOM_BACKEND_SLIDING_BLOCKS = ``sliding_blocks_for_max``). ``default_plan_requests``:
    what ``KVAdmission`` admits when the same memory is split by the backend's default planner
    (``kv.pools.plan_pools_for_settings``, what the backend calls) for a server configured for these requests:
    MAX_BATCH_SIZE = ``max_concurrent_requests``, MAX_ACTIVE_KV_TOKENS = that many times ``request_tokens``
    and MAX_MODEL_LEN = ``request_tokens`` (so the reference request length of the default split,
    ``default_plan_reference_tokens``, is ``request_tokens``), PREFILL_CHUNK_TOKENS = ``chunk_tokens``;
    ``default_plan_blocks``: that split."""
    from types import SimpleNamespace

    from gemmaserve.errors import ConfigurationError
    from gemmaserve_custom_torch.kv.pools import kv_groups, plan_pools_for_settings, reference_tokens

    groups = kv_request_blocks(config, block_size, itemsize, request_tokens)
    per_request = sum(g["bytes_per_block"] * g["blocks_per_request"] for g in groups.values())
    best = max(0, memory_bytes // per_request)
    out: dict[str, Any] = {
        "kv_bytes_per_token": {name: g["bytes_per_token"] for name, g in groups.items()},
        "kv_bytes_per_token_total": sum(g["bytes_per_token"] for g in groups.values()),
        "request_tokens": request_tokens, "kv_bytes_per_request": per_request,
        "kv_memory_bytes": memory_bytes, "max_concurrent_requests": best,
        "sliding_blocks_for_max": (best * groups[SLIDING]["blocks_per_request"]) if SLIDING in groups else None,
    }
    default, blocks, reference = None, None, None
    if best:
        settings = SimpleNamespace(max_batch_size=best, max_active_kv_tokens=best * request_tokens,
                                   prefill_chunk_tokens=chunk_tokens)
        max_len = request_tokens  # MAX_MODEL_LEN (the configs' max_position_embeddings only bound decode tables)
        try:
            blocks = plan_pools_for_settings(config, settings, block_size, itemsize, memory_bytes,
                                             sliding_blocks=None, max_len=max_len)
            reference = reference_tokens(kv_groups(config), block_size, itemsize, memory_bytes, max_rows=best,
                                         max_active_tokens=best * request_tokens, max_len=max_len)
            default = min(blocks[name] // g["blocks_per_request"] for name, g in groups.items())
        except ConfigurationError:  # a budget below one block per group: nothing fits
            default = 0
    out["default_plan_blocks"] = blocks
    out["default_plan_reference_tokens"] = reference
    out["default_plan_requests"] = default
    return out


def config_weight_bytes(base: dict[str, Any], itemsize: int = 2) -> int:
    """Bytes of every parameter of the custom model of ``base`` (embedding and PLE tables included: all of them
    live on the device), counted on the meta device (nothing allocated)."""
    from gemmaserve_custom_torch.models.config import GemmaTextConfig
    from gemmaserve_custom_torch.models.gemma import GemmaForCausalLM

    config = GemmaTextConfig.from_dict(hf_config(base).to_dict())
    model = GemmaForCausalLM(config, device="meta", dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters()) * itemsize


def capacity_table(memory_bytes: int, headroom_bytes: int, *, block_size: int = 16, request_tokens: int = 4096,
                   chunk_tokens: int = 512) -> dict[str, Any]:
    """:func:`kv_capacity` of every full-size config in bf16, in the memory left after its weights and
    ``headroom_bytes`` (activations, CUDA graphs, allocator slack) on a device of ``memory_bytes``."""
    from gemmaserve_custom_torch.models.config import GemmaTextConfig

    table = {}
    for name, (_, base, _) in CONFIGS.items():
        config = GemmaTextConfig.from_dict(hf_config(base).to_dict())
        weights = config_weight_bytes(base)
        left = max(0, memory_bytes - weights - headroom_bytes)
        table[name] = {"weight_bytes": weights, **kv_capacity(config, 2, block_size, left,
                                                              request_tokens=request_tokens,
                                                              chunk_tokens=chunk_tokens)}
    return table
