"""`HFTokenizer`: the core ``Tokenizer`` protocol over the checkpoint's transformers tokenizer
(text <-> ids only; the model itself never touches transformers)."""

from __future__ import annotations

from pathlib import Path

from gemmaserve.hf_tokenizer import HFTokenizerAdapter, load_hf_tokenizer

__all__ = ["HFTokenizer"]


class HFTokenizer(HFTokenizerAdapter):
    """The core adapter, loadable from a checkpoint folder."""

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFTokenizer:
        """Load from ``path``; raises ModelLoadError if the folder has no usable tokenizer."""
        loaded = load_hf_tokenizer(path)
        return cls(loaded.hf, loaded.model_name)
