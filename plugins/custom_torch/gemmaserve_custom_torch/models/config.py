"""`GemmaTextConfig`: the text-stack geometry of a Gemma 3 / Gemma 4 checkpoint, resolved per layer.

`GemmaTextConfig.from_pretrained(path)` reads `config.json` (and `generation_config.json` when present) of a
Hugging Face checkpoint folder. `GemmaTextConfig.from_dict(raw)` parses an already-loaded `config.json` dict.

Accepted `model_type`s:

* `gemma4_text` (weights under `model.`), `gemma4` (multimodal wrapper: fields under `text_config`,
  weights under `model.language_model.`);
* `gemma3_text` (weights under `model.`), `gemma3` (wrapper: `text_config`; weights under
  `model.language_model.` as transformers >= 5 saves them, or `language_model.model.` as the Hub checkpoints do).

Missing fields take the defaults of the matching transformers config class, so sparse Hub configs (which
omit defaults) resolve the same way transformers resolves them. Everything per-layer is precomputed here so
the model and the attention contexts never re-derive geometry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gemmaserve.errors import WINDOW_OF_ONE
from gemmaserve.models.gemma_defaults import (
    GEMMA3_TEXT_DEFAULTS,
    GEMMA4_DEFAULT_ROPE,
    GEMMA4_TEXT_DEFAULTS,
    gemma_layer_types,
)

LayerType = Literal["sliding_attention", "full_attention"]
NormStyle = Literal["w", "one_plus_w"]
RopeType = Literal["default", "linear", "proportional"]
Family = Literal["gemma3", "gemma4"]

SLIDING: LayerType = "sliding_attention"
FULL: LayerType = "full_attention"
LAYER_TYPES: tuple[LayerType, ...] = (SLIDING, FULL)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("gemma4_text", "gemma4", "gemma3_text", "gemma3")
_TEXT_MODEL_TYPE: dict[str, str] = {"gemma4": "gemma4_text", "gemma3": "gemma3_text"}

@dataclass(frozen=True)
class RopeParams:
    """RoPE parameters of one layer type.

    `default`: θ^(-2i/d) over the full head dim (factor and partial factor ignored, as transformers does).
    `linear`: `default` divided by `factor`. `proportional` (Gemma 4 full layers): the first
    `int(partial_rotary_factor * d // 2)` frequencies θ^(-2i/d), the rest zero, all divided by `factor`.
    """

    rope_type: RopeType
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class GemmaTextConfig:
    """Resolved text-stack config; every per-layer tuple has `num_hidden_layers` entries. Immutable."""

    family: Family
    model_type: str  # as written in config.json (e.g. "gemma4" for the multimodal wrapper)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float
    layer_types: tuple[LayerType, ...]
    head_dims: tuple[int, ...]
    num_kv_heads: tuple[int, ...]
    k_eq_v: tuple[bool, ...]
    kv_source_layer: tuple[int, ...]  # i for a layer that stores K/V; the producer index for KV-shared layers
    mlp_widths: tuple[int, ...]
    rope: dict[str, RopeParams] = field(hash=False)  # keyed by layer type
    attention_scale: float
    norm_style: NormStyle  # "w": x̂·w with pow(ms+eps, -0.5) (Gemma 4); "one_plus_w": x̂·(1+w) with rsqrt (Gemma 3)
    has_v_norm: bool
    has_layer_scalar: bool
    embed_scale: float  # sqrt(hidden_size); rounded to the model dtype by the model, as transformers does
    final_logit_softcapping: float | None
    sliding_window: int | None  # W: a query sees keys with q - W < k <= q on sliding layers
    ple_dim: int  # hidden_size_per_layer_input; 0 = no per-layer embeddings
    ple_vocab_size: int
    moe_num_experts: int  # 0 = no MoE block
    moe_top_k: int
    moe_intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]

    # ---- derived views -------------------------------------------------------------------------------------

    @property
    def first_kv_shared_layer(self) -> int:
        """Index of the first layer that reuses another layer's K/V (== num_hidden_layers if none)."""
        for i, src in enumerate(self.kv_source_layer):
            if src != i:
                return i
        return self.num_hidden_layers

    def stores_kv(self, layer_idx: int) -> bool:
        """True when the layer computes (and a cache must keep) its own K/V."""
        return self.kv_source_layer[layer_idx] == layer_idx

    @property
    def kv_storing_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.stores_kv(i))

    def window_for_layer(self, layer_idx: int) -> int | None:
        """Sliding window W of the layer, or None for full attention."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None

    def head_dim_for_type(self, layer_type: str) -> int:
        return self.head_dims[self.layer_types.index(layer_type)]  # type: ignore[arg-type]

    @property
    def is_multimodal_wrapper(self) -> bool:
        return self.model_type in _TEXT_MODEL_TYPE

    # ---- parsing -------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> GemmaTextConfig:
        """Parse `<path>/config.json`; EOS ids also come from `<path>/generation_config.json` if present."""
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"No config.json in {folder}; expected a Hugging Face checkpoint folder.")
        raw = json.loads(config_file.read_text())
        gen_file = folder / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(raw, generation_config=generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> GemmaTextConfig:
        """Parse a `config.json` dict (top-level or wrapper). Raises ValueError for unsupported configs."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"Unsupported model_type {model_type!r}; gemmaserve's custom_torch Gemma model accepts "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        if model_type in _TEXT_MODEL_TYPE:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"config.json with model_type {model_type!r} has no 'text_config' object.")
            inner_type = text.get("model_type", _TEXT_MODEL_TYPE[model_type])
            if inner_type != _TEXT_MODEL_TYPE[model_type]:
                raise ValueError(
                    f"text_config.model_type is {inner_type!r}; expected {_TEXT_MODEL_TYPE[model_type]!r} "
                    f"inside a {model_type!r} config."
                )
        else:
            text = raw
        family: Family = "gemma4" if model_type.startswith("gemma4") else "gemma3"
        defaults = GEMMA4_TEXT_DEFAULTS if family == "gemma4" else GEMMA3_TEXT_DEFAULTS
        c = {**defaults, **text}
        outer = raw if text is not raw else {}

        _require(
            c["hidden_activation"] == "gelu_pytorch_tanh",
            f"hidden_activation {c['hidden_activation']!r} is not supported (only 'gelu_pytorch_tanh').",
        )
        _require(not c["attention_bias"], "attention_bias=true is not supported (Gemma checkpoints have no biases).")

        num_layers = int(c["num_hidden_layers"])
        layer_types = _parse_layer_types(c, family, num_layers)
        head_dims, kv_heads = _parse_head_geometry(c, family, layer_types)
        num_heads = int(c["num_attention_heads"])
        for i, kvh in enumerate(kv_heads):
            _require(
                kvh > 0 and num_heads % kvh == 0,
                f"layer {i}: num_attention_heads={num_heads} is not a multiple of its {kvh} KV heads.",
            )
        for t in set(layer_types):
            dims = {d for d, lt in zip(head_dims, layer_types) if lt == t}
            _require(len(dims) == 1, f"layers of type {t} have different head dims {sorted(dims)}; unsupported.")

        if family == "gemma4":
            k_eq_v = tuple(bool(c["attention_k_eq_v"]) and t == FULL for t in layer_types)
            kv_source = _kv_sources(layer_types, int(c["num_kv_shared_layers"]))
            double = bool(c["use_double_wide_mlp"])
            width = int(c["intermediate_size"])
            mlp_widths = tuple(width * (2 if double and kv_source[i] != i else 1) for i in range(num_layers))
            rope = _parse_rope_gemma4(c, layer_types)
            bidir = c["use_bidirectional_attention"]
            _require(
                bidir in (None, "vision"),
                f"use_bidirectional_attention={bidir!r} is not supported (only null or 'vision').",
            )
            ple_dim = int(c["hidden_size_per_layer_input"] or 0)
            moe = bool(c["enable_moe_block"])
            if moe:
                for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                    _require(c[key] is not None, f"enable_moe_block=true needs {key} in config.json.")
            attention_scale = 1.0
        else:
            k_eq_v = (False,) * num_layers
            kv_source = tuple(range(num_layers))
            mlp_widths = (int(c["intermediate_size"]),) * num_layers
            rope = _parse_rope_gemma3(c, layer_types)
            _require(
                not c["use_bidirectional_attention"],
                "use_bidirectional_attention=true (embedding-style Gemma 3) is not supported.",
            )
            ple_dim = 0
            moe = False
            attention_scale = float(c["query_pre_attn_scalar"]) ** -0.5

        window = c["sliding_window"]
        _require(window is None or SLIDING not in layer_types or int(window) >= 2,
                 f"sliding_window={window} is not supported: {WINDOW_OF_ONE}.")
        softcap = c["final_logit_softcapping"]
        tie = outer.get("tie_word_embeddings", c["tie_word_embeddings"])
        return cls(
            family=family,
            model_type=model_type,
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            rms_norm_eps=float(c["rms_norm_eps"]),
            layer_types=layer_types,
            head_dims=head_dims,
            num_kv_heads=kv_heads,
            k_eq_v=k_eq_v,
            kv_source_layer=kv_source,
            mlp_widths=mlp_widths,
            rope=rope,
            attention_scale=attention_scale,
            norm_style="w" if family == "gemma4" else "one_plus_w",
            has_v_norm=family == "gemma4",
            has_layer_scalar=family == "gemma4",
            embed_scale=float(c["hidden_size"]) ** 0.5,
            final_logit_softcapping=None if softcap is None else float(softcap),
            sliding_window=None if window is None else int(window),
            ple_dim=ple_dim,
            ple_vocab_size=int(c["vocab_size_per_layer_input"]) if ple_dim else 0,
            moe_num_experts=int(c["num_experts"]) if moe else 0,
            moe_top_k=int(c["top_k_experts"]) if moe else 0,
            moe_intermediate_size=int(c["moe_intermediate_size"]) if moe else 0,
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(c["max_position_embeddings"]),
            bos_token_id=c["bos_token_id"],
            pad_token_id=c["pad_token_id"],
            eos_token_ids=_eos_ids(outer.get("eos_token_id"), c["eos_token_id"], generation_config),
        )


# ---- helpers -----------------------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _parse_layer_types(c: dict[str, Any], family: Family, num_layers: int) -> tuple[LayerType, ...]:
    raw = c["layer_types"]
    if raw is not None:
        _require(len(raw) == num_layers, f"layer_types has {len(raw)} entries but num_hidden_layers={num_layers}.")
        for t in raw:
            _require(t in LAYER_TYPES, f"unknown layer type {t!r}; expected one of {LAYER_TYPES}.")
    return tuple(gemma_layer_types(family, num_layers, raw, c.get("sliding_window_pattern")))  # type: ignore[misc]


def _parse_head_geometry(
    c: dict[str, Any], family: Family, layer_types: tuple[LayerType, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-layer (head_dim, kv_heads). Gemma 4 accepts both `per_layer_config` (transformers >= 5.17 saves)
    and `global_head_dim` / `num_global_key_value_heads` (Hub checkpoints); `per_layer_config` wins, as in
    transformers."""
    base_dim = int(c["head_dim"])
    base_kv = int(c["num_key_value_heads"])
    head_dims = [base_dim] * len(layer_types)
    kv_heads = [base_kv] * len(layer_types)
    if family == "gemma3":
        return tuple(head_dims), tuple(kv_heads)
    per_layer = c.get("per_layer_config")
    if per_layer is not None:  # transformers' rule: when present (even empty) it replaces the global_* fields
        _require(isinstance(per_layer, dict), "per_layer_config must be an object keyed by layer index.")
        for key, overrides in per_layer.items():
            try:
                idx = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"per_layer_config key {key!r} is not a layer index.") from None
            _require(0 <= idx < len(layer_types), f"per_layer_config names layer {idx}, out of range.")
            unknown = set(overrides) - {"head_dim", "num_key_value_heads"}
            _require(not unknown, f"per_layer_config[{key}] overrides unsupported fields {sorted(unknown)}.")
            head_dims[idx] = int(overrides.get("head_dim", base_dim))
            kv_heads[idx] = int(overrides.get("num_key_value_heads", base_kv))
        return tuple(head_dims), tuple(kv_heads)
    global_dim = int(c["global_head_dim"])
    global_kv = c["num_global_key_value_heads"]
    for i, t in enumerate(layer_types):
        if t == FULL:
            head_dims[i] = global_dim
            if c["attention_k_eq_v"] and global_kv is not None:
                kv_heads[i] = int(global_kv)
    return tuple(head_dims), tuple(kv_heads)


def _kv_sources(layer_types: tuple[LayerType, ...], num_shared: int) -> tuple[int, ...]:
    """KV-shared layers (the last `num_shared`) read the last non-shared layer of their own type."""
    n = len(layer_types)
    _require(0 <= num_shared < n, f"num_kv_shared_layers={num_shared} must be in [0, {n}).")
    first = n - num_shared
    sources = list(range(n))
    for i in range(first, n):
        producers = [j for j in range(first) if layer_types[j] == layer_types[i]]
        _require(
            bool(producers), f"layer {i} ({layer_types[i]}) shares KV but no earlier non-shared layer has that type."
        )
        sources[i] = producers[-1]
    return tuple(sources)


def _rope_params(raw: dict[str, Any], where: str) -> RopeParams:
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    _require(
        rope_type in ("default", "linear", "proportional"),
        f"{where}: rope_type {rope_type!r} is not supported (default, linear, proportional).",
    )
    _require("rope_theta" in raw, f"{where}: missing rope_theta.")
    prf_raw = raw.get("partial_rotary_factor")
    prf = 1.0 if prf_raw is None else float(prf_raw)  # 0.0 is a factor (nothing rotated), not "unset"
    _require(0.0 <= prf <= 1.0, f"{where}: partial_rotary_factor={prf} must be in [0, 1].")
    if rope_type == "linear":
        _require(prf == 1.0, f"{where}: linear RoPE with partial_rotary_factor={prf} is not supported.")
    return RopeParams(
        rope_type=rope_type,
        theta=float(raw["rope_theta"]),
        partial_rotary_factor=prf,
        factor=float(raw.get("factor", 1.0) or 1.0),
    )


def _parse_rope_gemma4(c: dict[str, Any], layer_types: tuple[LayerType, ...]) -> dict[str, RopeParams]:
    nested = c["rope_parameters"] or GEMMA4_DEFAULT_ROPE
    out: dict[str, RopeParams] = {}
    for t in sorted(set(layer_types)):
        _require(isinstance(nested.get(t), dict), f"rope_parameters has no entry for layer type {t!r}.")
        out[t] = _rope_params(nested[t], f"rope_parameters[{t!r}]")
    return out


def _parse_rope_gemma3(c: dict[str, Any], layer_types: tuple[LayerType, ...]) -> dict[str, RopeParams]:
    """Nested `rope_parameters` (new saves) or legacy `rope_theta` / `rope_local_base_freq` / `rope_scaling`
    (Hub configs; `rope_scaling` applies to full-attention layers only)."""
    nested = c["rope_parameters"]
    if nested and any(t in nested for t in LAYER_TYPES):
        full = {**(nested.get(FULL) or {}), **(c["rope_scaling"] or {})}  # as transformers: rope_scaling wins
        sliding = dict(nested.get(SLIDING) or {})
    else:
        _require(not nested, "flat (non per-layer-type) rope_parameters are not supported for Gemma 3.")
        full = {"rope_type": "default", **(c["rope_scaling"] or {})}
        sliding = {"rope_type": "default"}
    full.setdefault("rope_theta", c["rope_theta"])
    sliding.setdefault("rope_theta", c["rope_local_base_freq"])
    by_type = {FULL: full, SLIDING: sliding}
    return {t: _rope_params(by_type[t], f"Gemma 3 RoPE ({t})") for t in sorted(set(layer_types))}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _eos_ids(outer: Any, text: Any, generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    """Union (order kept) of generation_config's, the wrapper's and the text config's eos_token_id."""
    ids: list[int] = []
    gen = generation_config.get("eos_token_id") if generation_config else None
    for source in (gen, outer, text):
        for tok in _as_id_list(source):
            if tok not in ids:
                ids.append(tok)
    return tuple(ids)
