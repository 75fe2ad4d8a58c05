"""The reference backend's toy "model" and tokenizer: pure, deterministic, dependency-free.

- A KV entry is ``KVEntry(token, position)``.
- Next-token logits are a hash of the row's WHOLE KV (every entry, in order), spread over the
  vocabulary. Any missing, extra, reordered or mis-positioned entry changes the logits, so KV bugs
  (bad splicing, padding counted as real tokens, wrong cache copies) change the generated tokens.
- :class:`CharTokenizer` maps characters to ids after five special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from gemmaserve.errors import InvalidRequestError

__all__ = ["KVEntry", "next_token_logits", "CharTokenizer", "PAD_ID", "BOS_ID", "EOS_ID", "SOT_ID", "EOT_ID"]

PAD_ID, BOS_ID, EOS_ID, SOT_ID, EOT_ID = 0, 1, 2, 3, 4
_SPECIALS = ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-:;\n()"
_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3


class KVEntry(NamedTuple):
    """The toy model's KV for one token: a pure function of (token, position)."""

    token: int
    position: int


def _mix(state: int, a: int, b: int) -> int:
    state = ((state ^ a) * _PRIME) & _MASK
    state = ((state ^ b) * _PRIME) & _MASK
    return state ^ (state >> 29)


def next_token_logits(entries: Sequence[KVEntry], vocab_size: int) -> list[float]:
    """Logits over ``vocab_size`` tokens as a hash of every entry of one row's KV, in order."""
    state = 0xCBF29CE484222325
    for token, position in entries:
        state = _mix(state, token + 1, position + 1)
    return [((_mix(state, v, 0x9E3779B9) >> 20) % 10007) / 1000.0 for v in range(vocab_size)]


class CharTokenizer:
    """Lower-cased characters of a small alphabet, after the special tokens; unknown characters map
    to ``?``. Chat template: ``<bos>`` then ``<start_of_turn>{role}\\n{content}<end_of_turn>\\n`` per
    message, then ``<start_of_turn>model\\n``. Stateless, so thread-safe."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < len(_SPECIALS) + 1:
            raise ValueError(f"vocab_size must be >= {len(_SPECIALS) + 1}, got {vocab_size}")
        self.vocab_size = vocab_size
        chars = _ALPHABET[: vocab_size - len(_SPECIALS)]
        self._char_to_id = {char: index + len(_SPECIALS) for index, char in enumerate(chars)}
        self._id_to_char = {index: char for char, index in self._char_to_id.items()}
        self._unknown = self._char_to_id.get("?", len(_SPECIALS))

    max_token_chars = 1
    """Every token is one character (special tokens never come from text)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [self._char_to_id.get(char, self._unknown) for char in text.lower()]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        for token_id in token_ids:
            if token_id in self._id_to_char:
                parts.append(self._id_to_char[token_id])
            elif not skip_special_tokens:
                parts.append(_SPECIALS[token_id] if 0 <= token_id < len(_SPECIALS) else f"<unused{token_id}>")
        return "".join(parts)

    def tokenizer_json(self) -> str:
        """This vocabulary as a Hugging Face ``tokenizer.json`` (a word-level model over single characters, the
        special tokens as added tokens): what structured output compiles its grammars against."""
        import json

        vocab = {**{name: i for i, name in enumerate(_SPECIALS)}, **self._char_to_id}
        added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for i, name in enumerate(_SPECIALS)]
        return json.dumps({
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Lowercase"},
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
            "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": [  # sentencepiece style: token strings are their text
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "?"},
        })

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        ids = [BOS_ID]
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise InvalidRequestError(f"each chat message needs 'role' and 'content', got {message!r}")
            text = f"{message['role']}\n{message['content']}"
            ids += [
                SOT_ID,
                *self.encode(text, add_special_tokens=False),
                EOT_ID,
                *self.encode("\n", add_special_tokens=False),
            ]
        return [*ids, SOT_ID, *self.encode("model\n", add_special_tokens=False)]

    @property
    def has_chat_template(self) -> bool:
        return True
