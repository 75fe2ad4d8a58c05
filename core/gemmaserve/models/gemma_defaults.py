"""What transformers' ``Gemma4TextConfig`` / ``Gemma3TextConfig`` (5.24) take for the fields a ``config.json`` may
omit, and the layer types they derive, in one place for every backend that reads a Gemma checkpoint without
transformers (custom_torch's config parser; the mlx backend, whose mlx_lm has defaults of its own that differ:
``num_kv_shared_layers`` 20, ``use_double_wide_mlp``, a softcap of 30, Gemma 3's 512-token window). Plain data:
importing this pulls in nothing heavy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["GEMMA3_TEXT_DEFAULTS", "GEMMA4_DEFAULT_ROPE", "GEMMA4_TEXT_DEFAULTS", "bidirectional_problem",
           "gemma_layer_types"]

_SHARED: dict[str, Any] = {  # the two classes' common defaults
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "rope_parameters": None,
    "attention_bias": False,
    "layer_types": None,
    "final_logit_softcapping": None,
}
GEMMA4_TEXT_DEFAULTS: dict[str, Any] = {
    **_SHARED,
    "vocab_size": 262_144,
    "num_hidden_layers": 30,
    "global_head_dim": 512,
    "num_global_key_value_heads": None,
    "sliding_window": 512,
    "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
}
GEMMA4_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    **_SHARED,
    "vocab_size": 262_208,
    "num_hidden_layers": 26,
    "rope_scaling": None,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "use_bidirectional_attention": False,
}


def bidirectional_problem(config: dict[str, Any]) -> str | None:
    """Why a checkpoint cannot be served for generation because its text model attends bidirectionally over the
    whole sequence (Gemma 4's ``use_bidirectional_attention: "all"``, Gemma 3's ``true``: embedding-style models),
    or None (``"vision"``, which is bidirectional over image tokens only, is fine for text)."""
    inner = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = inner.get("use_bidirectional_attention")
    if value == "all" or value is True:
        return (f"{config.get('model_type')} checkpoint with use_bidirectional_attention={value!r} attends "
                "bidirectionally over the whole sequence (an embedding model); gemmaserve generates causally, so its "
                "tokens would not be the model's: it cannot serve it")
    return None


def gemma_layer_types(family: str, num_layers: int, layer_types: Sequence[str] | None,
                      sliding_window_pattern: int | None = None) -> list[str]:
    """The layer types transformers resolves: ``layer_types`` as given, or (None) every ``pattern``-th layer full
    and the rest sliding (Gemma 4: a pattern of 6; Gemma 3: ``sliding_window_pattern``, default 6); a Gemma 4
    model's last layer is always full attention (transformers forces it). ``family``: "gemma3" or "gemma4"."""
    if layer_types is None:
        pattern = 6 if family == "gemma4" else int(sliding_window_pattern or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    types = list(layer_types)
    if family == "gemma4" and types and types[-1] != "full_attention":
        types[-1] = "full_attention"
    return types
