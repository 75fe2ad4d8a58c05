"""The core :class:`~gemmaserve.backend.Tokenizer` protocol over a Hugging Face tokenizer object.

Shared by every backend that tokenizes with transformers (hf_torch, custom_torch, mlx). Duck-typed:
this module never imports transformers; :func:`load_hf_tokenizer` imports it when called.
"""

from __future__ import annotations

import functools

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gemmaserve.errors import InvalidRequestError, ModelLoadError

__all__ = ["HFTokenizerAdapter", "load_hf_tokenizer"]


class HFTokenizerAdapter:
    """Text <-> token IDs through a loaded transformers tokenizer. Stateless after construction;
    thread-safe as far as the wrapped fast tokenizer is."""

    def __init__(self, hf_tokenizer: Any, model_name: str = "") -> None:
        self.hf = hf_tokenizer
        self.model_name = model_name

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """Characters of the longest vocabulary entry (an upper bound on the text one token decodes to: byte
        and word-start markers are longer than what they stand for), or None if the vocabulary is hidden."""
        try:
            vocab = self.hf.get_vocab()
        except Exception:
            return None
        return max((len(piece) for piece in vocab), default=None)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's own EOS id (empty if it has none)."""
        eos = getattr(self.hf, "eos_token_id", None)
        return (int(eos),) if isinstance(eos, int) else ()

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token IDs of ``messages`` rendered with the model's chat template plus the generation
        prompt. Raises InvalidRequestError if the model has no template or a message is malformed."""
        if not self.has_chat_template:
            name = f"model {self.model_name!r}" if self.model_name else "this model"
            raise InvalidRequestError(
                f"{name} has no chat template; send a plain prompt to /v1/completions instead of chat messages"
            )
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidRequestError(
                    f"message {index} must be an object with a string 'role' and a 'content'; got {message!r}"
                )
        try:
            rendered = self.hf.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
        except Exception as exc:  # jinja errors (e.g. "roles must alternate") are the request's fault
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from None
        if isinstance(rendered, Mapping) or hasattr(rendered, "keys"):  # a BatchEncoding
            rendered = rendered["input_ids"]
        return [int(token) for token in rendered]


def load_hf_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> HFTokenizerAdapter:
    """Load the tokenizer files (and chat template, if any) of a local checkpoint directory.

    Raises ModelLoadError naming the files needed if the directory has no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {str(path)!r} ({type(exc).__name__}: {exc}); the directory needs "
            "tokenizer.json (or tokenizer.model) and tokenizer_config.json"
        ) from None
    if hf_tokenizer is None or not callable(getattr(hf_tokenizer, "encode", None)):
        raise ModelLoadError(f"{str(path)!r} has no usable tokenizer files (tokenizer.json / tokenizer.model)")
    return HFTokenizerAdapter(hf_tokenizer, Path(path).name)
