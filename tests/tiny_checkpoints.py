"""Tiny random Gemma checkpoints (plus a tiny tokenizer) for tests. Never downloads anything.

Builders write a Hugging Face checkpoint folder with transformers' `save_pretrained` and return its path:

* `build_tiny_gemma4(path, **overrides)`: every Gemma 4 text feature (sliding + full layers with head dims
  16 / 32, KV sharing over the last 3 layers, PLE, double-wide MLP, softcap 30, sliding_window 8);
  config.json in Hub style (`global_head_dim`, no `per_layer_config`) unless `hub_style=False`.
* `build_tiny_gemma4_k_eq_v(path)`: K=V on full layers with one global KV head.
* `build_tiny_gemma4_moe(path)`: K=V plus the 26B-style MoE block (4 experts, top 2), no PLE / sharing.
* `build_tiny_gemma3(path)`: Gemma 3 text (1+w norms, query_pre_attn_scalar 24, linear RoPE on full layers).
* `wrap_as_multimodal(src, dst)`: the same weights as a `gemma4` / `gemma3` wrapper checkpoint.

Weights are random but perturbed so porting mistakes show (norm weights 1 + 0.3·randn, layer_scalar
0.5 + rand, other weights 0.05·randn), seeded, so a given call always writes the same checkpoint.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

VOCAB_SIZE = 512
_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0, 1, 2, 3 = the configs' pad / eos / bos
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Gemma is a family of lightweight open models built from the same research as Gemini.",
    "Sliding window attention lets each token see only a fixed number of previous tokens.",
    "A key value cache stores the keys and values of past tokens so decoding is fast.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his dog.",
    "Numbers like 1234567890 and symbols such as {}[]()<>+-*/=!?.,;:'\" appear in code and text.",
    "def forward(self, x):\n    return self.down(self.act(self.gate(x)) * self.up(x))\n",
]

GEMMA4_BASE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "sliding_window": 8,
    "num_kv_shared_layers": 3,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB_SIZE,
    "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
}

GEMMA3_BASE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "sliding_window": 8,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
    },
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
}


@functools.lru_cache(maxsize=4)
def _train_tokenizer_json(extra_special_tokens: tuple[str, ...] = ()) -> str:
    """A byte-level BPE with VOCAB_SIZE entries, trained on _CORPUS (deterministic, ~10 ms)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=_SPECIAL_TOKENS + list(extra_special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


GEMMA4_TOOL_TOKENS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>")
"""Gemma 4's tool-call markers, for a tokenizer that carries them (``save_tiny_tokenizer(path, GEMMA4_TOOL_TOKENS)``)."""


def save_tiny_tokenizer(path: str | Path, extra_special_tokens: tuple[str, ...] = ()) -> None:
    """Write tokenizer.json + tokenizer_config.json loadable by `AutoTokenizer.from_pretrained(path)`;
    ``extra_special_tokens`` become special tokens right after the four standard ones."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(tuple(extra_special_tokens))),
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(path))


def _perturb_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            if not tensor.is_floating_point():
                continue
            shape = tensor.shape
            if name.endswith("layer_scalar"):
                value = 0.5 + torch.rand(shape, generator=gen)
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                value = 1.0 + 0.3 * torch.randn(shape, generator=gen)
            else:
                value = 0.05 * torch.randn(shape, generator=gen)
            tensor.copy_(value.to(tensor.dtype))


def _hub_style_config(path: Path, global_head_dim: int, num_global_key_value_heads: int | None) -> None:
    """Rewrite config.json as Hub checkpoints have it: `global_head_dim` instead of `per_layer_config`."""
    config_file = path / "config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("per_layer_config", None)
    raw["global_head_dim"] = global_head_dim
    raw["num_global_key_value_heads"] = num_global_key_value_heads
    config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def build_tiny_gemma4(
    path: str | Path, *, seed: int = 0, hub_style: bool = True, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Save a tiny random `Gemma4ForCausalLM` (fp32) + tokenizer to `path`; `overrides` patch GEMMA4_BASE."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    path = Path(path)
    kwargs = {**GEMMA4_BASE, **overrides}
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**kwargs))
    _perturb_(model, seed)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **save_kwargs)
    if hub_style:
        _hub_style_config(path, kwargs["global_head_dim"], kwargs.get("num_global_key_value_heads"))
    save_tiny_tokenizer(path)
    return path


def build_tiny_gemma4_k_eq_v(path: str | Path, **overrides: Any) -> Path:
    """K=V on full layers (no v_proj there) with a single global KV head, plus all build_tiny_gemma4 features."""
    return build_tiny_gemma4(path, **{"attention_k_eq_v": True, "num_global_key_value_heads": 1, **overrides})


def build_tiny_gemma4_moe(path: str | Path, **overrides: Any) -> Path:
    """26B-A4B-like: dense MLP plus a 4-expert top-2 MoE block, K=V, no PLE and no KV sharing."""
    moe = {
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
        "intermediate_size": 32,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
    }
    return build_tiny_gemma4(path, **{**moe, **overrides})


def build_tiny_gemma3(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random `Gemma3ForCausalLM` (fp32) + tokenizer to `path`; `overrides` patch GEMMA3_BASE."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**GEMMA3_BASE, **overrides}))
    _perturb_(model, seed)
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


_WRAPPER_TYPES = {"gemma4_text": "gemma4", "gemma3_text": "gemma3"}


def build_tiny_llama(path: str | Path, *, seed: int = 0, max_position_embeddings: int = 1024) -> Path:
    """Save a tiny random Llama-style model (3 layers, GQA 4/2 heads, head dim 16, one head dim, full attention
    everywhere, untied head) + tokenizer to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_position_embeddings, rope_theta=10_000.0,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    _perturb_(model, seed)
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


def wrap_as_multimodal(
    src: str | Path,
    dst: str | Path,
    *,
    text_prefix: str = "model.language_model.",
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Copy a text-only checkpoint as a multimodal-wrapper one: config `{"model_type": "gemma4"|"gemma3",
    "text_config": {...}}`, weights renamed from `model.` to `text_prefix`, plus `extra` tensors (e.g. fake
    vision weights or the unused K/V of KV-shared layers) stored under their given names."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    text_config = json.loads((src / "config.json").read_text())
    wrapper_type = _WRAPPER_TYPES[text_config["model_type"]]
    wrapper = {
        "model_type": wrapper_type,
        "architectures": [f"{wrapper_type.capitalize()}ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": {"model_type": "fake_vision"},
        "eos_token_id": [1, 106] if wrapper_type == "gemma4" else 1,
        "tie_word_embeddings": True,
    }
    (dst / "config.json").write_text(json.dumps(wrapper, indent=2) + "\n")
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {text_prefix + key.removeprefix("model."): value for key, value in tensors.items()}
    renamed.update(extra or {})
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst
