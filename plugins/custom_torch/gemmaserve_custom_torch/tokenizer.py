"""`HFTokenizer`: the core ``Tokenizer`` protocol over a transformers ``AutoTokenizer`` (text <-> ids only)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemmaserve.errors import InvalidRequestError, ModelLoadError

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """Wraps the tokenizer saved in a checkpoint folder. Stateless after construction; thread-safe as far
    as the underlying fast tokenizer is."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFTokenizer:
        """Load from ``path``; raises ModelLoadError if the folder has no usable tokenizer."""
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(str(path)))
        except Exception as exc:  # transformers raises OSError/ValueError/... depending on what is missing
            raise ModelLoadError(f"cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}") from exc

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template plus the generation prompt.
        Raises InvalidRequestError if the model has no chat template or the messages do not fit it."""
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt (completions) instead of chat messages"
            )
        try:
            ids = self._tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
        except Exception as exc:  # jinja raises TemplateError for messages the template rejects
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
