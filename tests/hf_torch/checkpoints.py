"""Tiny random HF checkpoints for the hf_torch tests, written at test time with ``save_pretrained``.

- :func:`build_tiny_gemma4`: a Gemma 4 text model with every feature the backend must handle (sliding
  and full layers with two head dims, KV sharing over the last 3 layers, per-layer embeddings,
  double-wide MLP, final softcap 30, sliding window 8), saved hub-style (``global_head_dim`` in
  config.json, ``per_layer_config`` removed) with a tokenizer and a chat template.
- :func:`build_tiny_llama`: a Llama-style model (one head dim, no sliding, no sharing), no chat template.

Weights are random but perturbed away from their init so norms and scales matter; seeds are fixed.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["build_tiny_gemma4", "build_tiny_llama", "build_tokenizer", "SLIDING_WINDOW", "CHAT_TEMPLATE"]

VOCAB_SIZE = 512
SLIDING_WINDOW = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a serving engine batches requests and caches their prefixes",
    "gemma models use sliding window attention and shared key value layers",
    "hello world, this is a tiny tokenizer trained on the spot for tests",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation . , ; : ! ? ( ) [ ] { }",
    "user model system assistant turn start end of text",
] * 20


def build_tokenizer(path: Path, *, chat_template: str | None) -> None:
    """Train a byte-level BPE tokenizer (vocab 512; ids 0/1/2 = pad/eos/bos) and save it to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))


def _perturb(model: object, seed: int) -> None:
    """Move weights away from init: norm-like weights 1 + 0.3 randn, others 0.05 randn (fixed seed)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(0.05 * noise)


def build_tiny_gemma4(path: Path | str) -> Path:
    """Write the tiny Gemma 4 checkpoint (hub-style config.json) plus tokenizer into ``path``."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    path = Path(path)
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        sliding_window=SLIDING_WINDOW,
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB_SIZE,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
    )
    model = Gemma4ForCausalLM(config)
    _perturb(model, seed=1)
    model.save_pretrained(str(path))
    config_path = path / "config.json"
    raw = json.loads(config_path.read_text())
    raw.pop("per_layer_config", None)  # hub style: the global head dim is a plain field
    raw["global_head_dim"] = 32
    config_path.write_text(json.dumps(raw, indent=2))
    build_tokenizer(path, chat_template=CHAT_TEMPLATE)
    return path


def build_tiny_llama(path: Path | str) -> Path:
    """Write a tiny Llama-style checkpoint (GQA, one head dim) plus tokenizer without chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    _perturb(model, seed=2)
    model.save_pretrained(str(path))
    build_tokenizer(path, chat_template=None)
    return path
