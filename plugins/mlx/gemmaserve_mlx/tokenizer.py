"""The core ``Tokenizer`` protocol over the Hugging Face tokenizer that mlx_lm loads."""

from __future__ import annotations

from typing import Any

from gemmaserve.hf_tokenizer import HFTokenizerAdapter

__all__ = ["MlxTokenizer"]


class MlxTokenizer(HFTokenizerAdapter):
    """Text <-> token IDs. Wraps the HF tokenizer inside mlx_lm's ``TokenizerWrapper`` (not copied)."""

    def __init__(self, wrapper: Any, model_name: str) -> None:
        super().__init__(getattr(wrapper, "_tokenizer", wrapper), model_name)
        self._wrapper = wrapper

    @property
    def hf_tokenizer(self) -> Any:
        return self.hf

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids mlx_lm collected (tokenizer + generation_config), sorted."""
        ids = getattr(self._wrapper, "eos_token_ids", None) or ()
        if not ids and self.hf.eos_token_id is not None:
            ids = (self.hf.eos_token_id,)
        return tuple(sorted(int(i) for i in ids))
