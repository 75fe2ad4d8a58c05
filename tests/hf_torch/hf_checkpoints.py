"""Checkpoints for the hf_torch tests, written at test time (never downloaded).

The Gemma 4 checkpoint comes from ``tests/tiny_checkpoints.py::build_tiny_gemma4`` (every
Gemma 4 text feature: sliding + full layers with head dims 16 / 32, KV sharing over the last 3
layers, PLE, double-wide MLP, softcap 30, sliding window 8, hub-style config.json); this module
adds a chat template to it. The Llama-style checkpoint (one head dim, GQA, no sliding, no sharing,
no chat template) is the shared ``build_tiny_llama`` with a 128-token context.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "shared_checkpoints",
    "build_gemma4_checkpoint",
    "build_llama_checkpoint",
    "hf_greedy",
    "CHAT_TEMPLATE",
    "SLIDING_WINDOW",
]

SLIDING_WINDOW = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}model:{% endif %}"
)


def shared_checkpoints() -> ModuleType:
    """The shared tiny-checkpoint builders (``tests/tiny_checkpoints.py``)."""
    import tiny_checkpoints

    return tiny_checkpoints


def build_gemma4_checkpoint(path: Path) -> Path:
    """The shared tiny Gemma 4 checkpoint plus a chat template."""
    from transformers import AutoTokenizer

    shared_checkpoints().build_tiny_gemma4(path)
    assert shared_checkpoints().GEMMA4_BASE["sliding_window"] == SLIDING_WINDOW
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def build_llama_checkpoint(path: Path) -> Path:
    """The shared tiny Llama-style checkpoint with a 128-token context (the hf tests' length limits)."""
    return shared_checkpoints().build_tiny_llama(path, max_position_embeddings=128)


def hf_greedy(model: Any, prompt: list[int] | tuple[int, ...], num_tokens: int) -> list[int]:
    """``model.generate(do_sample=False)`` continuation of ``prompt``: exactly ``num_tokens`` tokens
    (EOS does not stop it), with transformers' own default cache."""
    import torch

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # None would fall back to the model's EOS and stop early
    config.pad_token_id = 0
    config.max_new_tokens = num_tokens
    config.do_sample = False
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, generation_config=config)
    assert out.shape[1] == len(prompt) + num_tokens
    return [int(t) for t in out[0, len(prompt) :].tolist()]
