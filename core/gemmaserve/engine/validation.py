"""Admission checks that need no scheduler state, and the mapping of backend failures to errors.

Pure functions: safe from any thread (the engine validates on the submitting thread so the server
can answer 4xx synchronously).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gemmaserve.errors import (BackendStepError, GemmaserveError, InvalidRequestError, KVCapacityError,
                               PromptTooLongError)

if TYPE_CHECKING:
    from gemmaserve.backend import InferenceBackend
    from gemmaserve.engine.request import Request

__all__ = ["validate_request", "backend_error", "check_text_can_fit", "truncate_prompt", "truncation_tail"]


def check_text_can_fit(chars: int, tokenizer: object, context_limit: int, what: str = "prompt") -> None:
    """Raise :class:`PromptTooLongError` for text that cannot fit ``context_limit`` tokens whatever it tokenizes
    to, so it is refused before it is tokenized: a token covers at most the tokenizer's longest vocabulary
    entry (``tokenizer.max_token_chars``), so ``chars`` characters are at least ``chars / max_token_chars``
    tokens. No-op for tokenizers that do not tell their longest entry."""
    longest = getattr(tokenizer, "max_token_chars", None)
    if isinstance(longest, int) and not isinstance(longest, bool) and longest > 0 and chars > context_limit * longest:
        raise PromptTooLongError(
            f"the {what} has {chars} characters: even at {longest} characters per token (this tokenizer's longest "
            f"token) that is more than the model's {context_limit}-token context; shorten it"
        )


def truncation_tail(text: str, tokenizer: object, context_limit: int) -> str:
    """The part of a text prompt to tokenize for ``truncate_prompt_tokens`` (which keeps at most ``context_limit``
    of its last tokens): all of it, unless it is longer than ``context_limit`` tokens of the tokenizer's longest
    entry could be (``tokenizer.max_token_chars``, as :func:`check_text_can_fit`), whatever it tokenizes to: then
    its last that many characters, and 64 tokens' worth more. The kept tokens lie within them; only a run whose
    tokens depend on where it starts (text repeating with a short period, ``"ab" * n``, over the cut and up to the
    end) can come out otherwise. Tokenizing a
    16 MB prompt to keep its last 8 tokens took 30 s of a render worker; this bounds it by what a prompt that is
    not truncated may cost."""
    longest = getattr(tokenizer, "max_token_chars", None)
    if not isinstance(longest, int) or isinstance(longest, bool) or longest <= 0:
        return text
    bound = (context_limit + 64) * longest
    return text[len(text) - bound:] if len(text) > bound else text


def truncate_prompt(prompt_ids: Sequence[int], keep: int | None, limit: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` ids of the prompt (-1: the last ``limit``, the most a
    request may hold; None: all of them)."""
    ids = list(prompt_ids)
    if keep is None:
        return ids
    keep = limit if keep == -1 else keep
    return ids[len(ids) - keep:] if len(ids) > keep else ids


def validate_request(
    request: Request, backend: InferenceBackend, max_model_len: int, max_active_kv_tokens: int
) -> None:
    """Raise :class:`InvalidRequestError` (or :class:`PromptTooLongError`) if ``request`` can never run:
    empty prompt, token ids (prompt, ``logit_bias``, ``stop_token_ids``) outside ``[0, vocab_size)``, logprobs the
    backend cannot give, or prompt + max_tokens over the model length or over MAX_ACTIVE_KV_TOKENS."""
    if request.params.max_tokens is None:
        raise InvalidRequestError("max_tokens=None (up to the end of the context) is resolved by gemmaserve.LLM; an "
                                  "engine request takes an integer max_tokens >= 1")
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if num_prompt == 0:
        raise InvalidRequestError("the prompt is empty; send at least one token")
    vocab_size = backend.model_info.vocab_size
    if set(map(type, prompt)) != {int} or min(prompt) < 0 or max(prompt) >= vocab_size:  # C speed when valid
        for position, token_id in enumerate(prompt):  # name the first bad one
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"prompt token {token_id!r} at position {position} is not a valid token id; "
                    f"token ids are integers in [0, {vocab_size})"
                )
    keep = request.params.truncate_prompt_tokens
    if keep is not None and keep != -1 and num_prompt > keep:
        raise InvalidRequestError(f"the prompt has {num_prompt} tokens, more than truncate_prompt_tokens={keep}: an "
                                  "engine request takes its prompt as it is; truncate it first (gemmaserve.LLM and the "
                                  "HTTP server do, with gemmaserve.engine.validation.truncate_prompt)")
    if request.params.n != 1:
        raise InvalidRequestError(
            f"an engine request is one sample, got n={request.params.n}: submit params.for_sample(i) for each sample "
            "(gemmaserve.LLM and the HTTP server do this for n > 1)"
        )
    for token_id, _ in request.params.logit_bias:
        if token_id >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token {token_id}, outside the vocabulary; token ids are integers in [0, {vocab_size})"
            )
    for token_id in request.params.stop_token_ids:
        if token_id >= vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids names token {token_id}, outside the vocabulary of {vocab_size} tokens; token ids are "
                f"integers in [0, {vocab_size})"
            )
    if request.want_logprobs and not backend.capabilities.logprobs:
        raise InvalidRequestError(f"the backend serving {backend.model_info.name!r} cannot return logprobs; do not "
                                  "request them")
    if request.params.logprobs and not backend.capabilities.top_logprobs:
        raise InvalidRequestError(f"the backend serving {backend.model_info.name!r} returns only the sampled "
                                  f"token's logprob: logprobs={request.params.logprobs} asks for alternatives; send "
                                  "logprobs=0 (completions) or top_logprobs=0 (chat), or use another backend")
    max_tokens = request.params.max_tokens
    total = num_prompt + max_tokens
    pool = backend.max_request_tokens()
    for limit, name, error in ((max_model_len, "the maximum model length", PromptTooLongError),
                               (max_active_kv_tokens, "MAX_ACTIVE_KV_TOKENS", PromptTooLongError),
                               (pool, "what one request can hold in the backend's KV pool", KVCapacityError)):
        if limit is not None and total > limit:
            if num_prompt >= limit:
                hint = f"shorten the prompt to under {limit} tokens"
            else:
                hint = f"lower max_tokens to at most {limit - num_prompt} or shorten the prompt"
            raise error(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds "
                f"{name} ({limit}); {hint}"
            )


def backend_error(exc: BaseException, phase: str) -> GemmaserveError:
    """The error a request fails with: gemmaserve errors as they are (e.g. KVCapacityError), anything
    else wrapped in :class:`BackendStepError` naming the phase."""
    if isinstance(exc, GemmaserveError):
        return exc
    return BackendStepError(f"backend failed during {phase}: {type(exc).__name__}: {exc}")
