"""The core ``Tokenizer`` protocol over the Hugging Face tokenizer that mlx_lm loads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gemmaserve.errors import InvalidRequestError

__all__ = ["MlxTokenizer"]


class MlxTokenizer:
    """Text <-> token IDs. Wraps the HF tokenizer inside mlx_lm's ``TokenizerWrapper`` (not copied)."""

    def __init__(self, wrapper: Any, model_name: str) -> None:
        self._wrapper = wrapper
        self._hf = getattr(wrapper, "_tokenizer", wrapper)
        self._model_name = model_name

    @property
    def hf_tokenizer(self) -> Any:
        return self._hf

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids mlx_lm collected (tokenizer + generation_config), sorted."""
        ids = getattr(self._wrapper, "eos_token_ids", None) or ()
        if not ids and self._hf.eos_token_id is not None:
            ids = (self._hf.eos_token_id,)
        return tuple(sorted(int(i) for i in ids))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token IDs of ``messages`` plus the generation prompt. Raises InvalidRequestError if the model
        has no chat template or the template rejects the messages."""
        if not self.has_chat_template:
            raise InvalidRequestError(
                f"model {self._model_name!r} has no chat template; send a plain prompt to /v1/completions instead"
            )
        try:
            ids = self._hf.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # jinja raises its own types for bad roles/content
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from None
        return [int(i) for i in ids]
