"""Request checks both MLX backends share."""

from __future__ import annotations

from collections.abc import Sequence

from gemmaserve.errors import InvalidRequestError

__all__ = ["check_prompt"]


def check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """The prompt as a tuple; raises InvalidRequestError if empty or holding an ID outside the vocabulary."""
    prompt = tuple(prompt_ids)
    if not prompt:
        raise InvalidRequestError("the prompt is empty; send at least one token")
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(f"prompt token {token!r} is not a token ID of this model (0..{vocab_size - 1})")
    return prompt
