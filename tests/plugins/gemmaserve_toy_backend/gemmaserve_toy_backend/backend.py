"""A complete, minimal InferenceBackend: the "model" scores the next token from the KV so far.

Row KV is a list of ``(token, position)`` pairs; a batch is a list of row KVs (no padding is needed
because attention here is a per-row reduction). It has no prefix cache
(``uses_core_cache_manager=False``), so every prompt is computed from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gemmaserve.backend import (
    BackendCapabilities,
    InferenceBackend,
    ModelInfo,
    PrefillState,
    SampledTokens,
)
from gemmaserve.engine.sampling_cpu import sample_rows
from gemmaserve.errors import InvalidRequestError
from gemmaserve.sampling_params import RowSampling

VOCAB_SIZE = 96  # printable ASCII: token = ord(char) - 32
EOS_TOKEN_ID = 0  # the space character doubles as EOS only when ignore_eos is False and it is sampled


class ByteTokenizer:
    """Printable-ASCII characters <-> token IDs."""

    has_chat_template = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [min(max(ord(ch) - 32, 0), VOCAB_SIZE - 1) for ch in text]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + t) for t in token_ids)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        raise InvalidRequestError("the toy backend's tokenizer has no chat template; use /v1/completions")


def _next_token_logits(kv: list[tuple[int, int]]) -> list[float]:
    """Deterministic scores: a hash of the whole KV picks a preferred token."""
    state = 17
    for token, position in kv:
        state = (state * 31 + token * 7 + position) % 1_000_003
    preferred = 1 + state % (VOCAB_SIZE - 1)
    return [8.0 if t == preferred else -((t * 13 + state) % 5) for t in range(VOCAB_SIZE)]


class ToyBackend(InferenceBackend):
    capabilities = BackendCapabilities(continuous_batching=True, uses_core_cache_manager=False, logprobs=True)

    def __init__(self, max_model_len: int = 4096) -> None:
        super().__init__()
        self.tokenizer = ByteTokenizer()
        self.model_info = ModelInfo("toy", VOCAB_SIZE, max_model_len, (EOS_TOKEN_ID,), "toy", "python", "cpu")

    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        self.last_cache_hit_tokens = 0
        return PrefillState(prompt_ids=tuple(prompt_ids), kv=[])

    def prefill_chunk(self, state: PrefillState, num_tokens: int) -> None:
        end = min(state.num_computed + num_tokens, len(state.prompt_ids))
        state.kv.extend((state.prompt_ids[p], p) for p in range(state.num_computed, end))
        state.num_computed = end
        if end == len(state.prompt_ids):
            state.last_logits = [_next_token_logits(state.kv)]

    def prefill_store(self, state: PrefillState) -> None:
        """No prefix cache: nothing to store."""

    def stack_caches_left_padded(self, rows: Sequence[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
        return list(rows)

    def splice_into_batched(self, batched: Any, new_kv: Any, kv_len: int) -> list[list[tuple[int, int]]]:
        batched = [] if batched is None else batched
        batched.append(new_kv)
        return batched

    def remove_row_from_cache(self, batched: list[list[tuple[int, int]]], row_idx: int) -> None:
        batched.pop(row_idx)

    def decode_step_batched(self, batched: list[list[tuple[int, int]]], input_ids: Sequence[int]) -> list[list[float]]:
        if len(input_ids) != len(batched):
            raise ValueError(f"{len(input_ids)} input ids for {len(batched)} rows")
        for row, token in zip(batched, input_ids):
            row.append((token, len(row)))
        return [_next_token_logits(row) for row in batched]

    def kv_length(self, kv: Any, row_idx: int | None = None) -> int:
        return len(kv if row_idx is None else kv[row_idx])

    def sample(self, logits: Any, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
        """The contract's sampling definition, written once in the core: logit_bias, penalties, bans, temperature,
        top-k / top-p / min-p and the seeded Gumbel pick (so a seed gives the same tokens on every backend)."""
        tokens, logprobs = sample_rows(logits, rows, want_logprobs=want_logprobs)
        return SampledTokens(tokens, logprobs)


def create_backend(model_path: str, device: str, settings: Any) -> ToyBackend:
    """BackendSpec factory. The toy model has no weights, so ``model_path`` is ignored."""
    return ToyBackend(max_model_len=settings.max_model_len or 4096)
