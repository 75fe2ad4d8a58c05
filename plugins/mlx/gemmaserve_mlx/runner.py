"""Forward passes of an mlx_lm causal LM: prefill chunks (logits of the last token only) and
batched decode steps.

A prefill chunk of N tokens does not need N rows of vocabulary logits (262k wide for Gemma): the
runner splits the model into its decoder (``<lm>.model``) and head (``lm_head`` or the tied
embedding, then Gemma's final-logit soft-capping), and projects only the last position. The split
is checked once against the model's own forward; if they disagree the full forward is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

__all__ = ["ModelRunner"]

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs ``model`` over caches that implement mlx_lm's cache interface. Stateless itself."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._split = _find_split(model)
        if self._split is not None and not self._split_matches():
            logger.warning("decoder/head split of %s disagrees with its forward; using the full forward",
                           type(model).__module__)
            self._split = None

    @property
    def uses_split(self) -> bool:
        return self._split is not None

    def prefill(self, tokens: mx.array, cache: list[Any], *, want_logits: bool) -> mx.array | None:
        """Run ``tokens`` [1, N] through the model, appending to ``cache``. Returns the last token's
        logits [1, vocab] when ``want_logits`` (else None, skipping the head when possible)."""
        if self._split is None:
            logits = self.model(tokens, cache=cache)
            return logits[:, -1, :] if want_logits else None
        body, head = self._split
        hidden = body(tokens, cache=cache)  # without logits the caller evaluates only the caches
        return head(hidden[:, -1:, :])[:, -1, :] if want_logits else None

    def decode(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """One token per row: ``tokens`` [rows, 1] -> logits [rows, vocab]."""
        return self.model(tokens, cache=cache)[:, -1, :]

    def _split_matches(self) -> bool:
        """Head(decoder(x)) against the model's own forward, over the same positions (so the same
        kernels run and any dtype agrees to rounding noise; a missed soft-cap would not)."""
        assert self._split is not None
        tokens = mx.array([[0, 1, 2, 3]])
        full = self.model(tokens, cache=make_prompt_cache(self.model)).astype(mx.float32)
        body, head = self._split
        split = head(body(tokens, cache=make_prompt_cache(self.model))).astype(mx.float32)
        if split.shape != full.shape:
            return False
        close = mx.abs(full - split).max() <= 1e-5 * (1.0 + mx.abs(full).max())
        return bool(close.item())


def _find_split(model: nn.Module) -> tuple[Callable[..., mx.array], Callable[[mx.array], mx.array]] | None:
    language_model = getattr(model, "language_model", model)
    body = getattr(language_model, "model", None)
    embed = getattr(body, "embed_tokens", None)
    if not isinstance(body, nn.Module) or embed is None:
        return None
    lm_head = language_model.get("lm_head") if isinstance(language_model, dict) else None
    project: Callable[[mx.array], mx.array] = lm_head if lm_head is not None else embed.as_linear
    softcap = getattr(language_model, "final_logit_softcapping", None)

    def head(hidden: mx.array) -> mx.array:
        logits = project(hidden)
        if softcap:
            logits = mx.tanh(logits / softcap) * softcap
        return logits

    return body, head
