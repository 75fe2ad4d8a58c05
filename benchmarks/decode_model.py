"""Model side of benchmarks/decode.py: the Gemma 4 E2B (or a tiny) config, seeded random weights built in
memory (transformers model first, then the custom model sharing its tensors), the HBM roofline of one
decode step, and the device-to-device copy bandwidth that roofline divides by.
"""

from __future__ import annotations

import time
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
    expected = set(model.state_dict())
    state = {}
    for key, tensor in hf_model.state_dict().items():
        local = key.removeprefix("model.")
        if local in expected:
            state[local] = tensor
    missing = expected - set(state)
    if missing:
        raise RuntimeError(f"the transformers model lacks {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


@dataclass(frozen=True)
class Roofline:
    """Bytes one decode step must read: every matmul weight once (LM head included, lookup tables not),
    gathered embedding + PLE rows, each row's visible K/V in every layer, and the logits written."""

    weight_bytes: int
    row_bytes: int  # embedding + PLE rows + logits of one row
    kv_bytes_per_token: dict[str, int]  # per layer type, summed over the layers that read it
    window: int

    def step_bytes(self, batch: int, context: int) -> int:
        kv = self.kv_bytes_per_token[FULL] * context + self.kv_bytes_per_token[SLIDING] * min(context, self.window)
        return self.weight_bytes + batch * (self.row_bytes + kv)


def roofline(model: Any) -> Roofline:
    config = model.config
    item = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()  # FP8 weights: 1 byte
                  if p.dim() == 2 and not name.startswith("embed_tokens_per_layer"))
    row = (config.hidden_size + config.num_hidden_layers * config.ple_dim) * item + config.vocab_size * item
    kv = {SLIDING: 0, FULL: 0}
    for i in range(config.num_hidden_layers):
        kv[config.layer_types[i]] += 2 * config.num_kv_heads[i] * config.head_dims[i] * item
    return Roofline(weights, row, kv, config.sliding_window or 0)


def copy_bandwidth(device: str, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of ``reps`` copies."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    times = sorted(times[3:])
    return 2 * src.numel() * src.element_size() / times[len(times) // 2]
