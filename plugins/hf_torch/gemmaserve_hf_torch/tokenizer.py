"""Tokenizer of the hf backend: the core adapter over the checkpoint's transformers tokenizer."""

from __future__ import annotations

from pathlib import Path

from gemmaserve.hf_tokenizer import HFTokenizerAdapter, load_hf_tokenizer

__all__ = ["HFTokenizer", "load_tokenizer"]

HFTokenizer = HFTokenizerAdapter


def load_tokenizer(path: Path, *, trust_remote_code: bool) -> HFTokenizerAdapter:
    """Load the checkpoint's tokenizer; raises ModelLoadError if it has none."""
    return load_hf_tokenizer(path, trust_remote_code=trust_remote_code)
