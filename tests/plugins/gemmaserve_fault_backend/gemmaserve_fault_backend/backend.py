"""``FaultyBackend``: delegates every primitive to another backend and injects faults on request.

Configured through the environment (read once, when the backend is built):

- ``FAULT_INNER_BACKEND``: the wrapped backend's registry name (default ``custom-cpu``).
- ``FAULT_POISON``: comma-separated token ids, the *poison sequence*. A forward (prefill chunk or
  decode step) after which a row's context holds the poison sequence followed by at least
  ``FAULT_POISON_AFTER`` (default 2) more tokens raises :class:`InjectedFault`. The fault follows
  the request wherever its context is computed, like a data-dependent model bug: a prompt ending
  in the poison sequence streams a few tokens, then fails in its decode step and again when that
  step is retried alone. With ``FAULT_POISON_AFTER=0`` the prompt's own prefill fails.
- ``FAULT_AFTER_FORWARD`` (default 1): raise *after* the wrapped forward ran, so the KV it touched
  is left advanced (the worst case for whoever handles the error); 0 raises before it.
- ``FAULT_DECODE_DELAY_S`` (default 0): sleep this long in every decode step, and in every one-call tick
  (``forward_step``) with decoding rows (slows the engine so tests can catch requests while they wait).

Row contexts are tracked through the contract alone (token ids seen by ``prefill_lookup``,
``splice_into_batched``, ``decode_step_batched`` and ``remove_row_from_cache``), so any backend can
be wrapped. Not thread-safe beyond the wrapped backend's ``lock``, which it shares.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gemmaserve.backend import InferenceBackend, PrefillState, SampledTokens, StepOutput
from gemmaserve.errors import ConfigurationError
from gemmaserve.sampling_params import RowSampling

__all__ = ["FaultConfig", "FaultyBackend", "InjectedFault", "create_backend"]


class InjectedFault(RuntimeError):
    """The fault this backend injects."""


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """What to inject; see the module docstring for the environment variables."""

    poison: tuple[int, ...] = ()
    poison_after: int = 2
    after_forward: bool = True
    decode_delay_s: float = 0.0

    @classmethod
    def from_env(cls) -> FaultConfig:
        """Parse ``FAULT_*``; raises ConfigurationError naming a bad variable."""
        try:
            poison = tuple(int(t) for t in os.environ.get("FAULT_POISON", "").split(",") if t.strip())
            after = int(os.environ.get("FAULT_POISON_AFTER", "2"))
            after_forward = os.environ.get("FAULT_AFTER_FORWARD", "1") not in ("0", "false", "")
            delay = float(os.environ.get("FAULT_DECODE_DELAY_S", "0"))
        except ValueError as exc:
            raise ConfigurationError(f"bad FAULT_* setting: {exc}") from None
        if after < 0 or delay < 0:
            raise ConfigurationError("FAULT_POISON_AFTER and FAULT_DECODE_DELAY_S must be >= 0")
        return cls(poison, after, after_forward, delay)


class FaultyBackend(InferenceBackend):
    """Wraps ``inner`` (capabilities, model info, tokenizer and lock are the inner backend's)."""

    def __init__(self, inner: InferenceBackend, config: FaultConfig) -> None:
        super().__init__()
        self.inner = inner
        self.config = config
        self.lock = inner.lock
        self.capabilities = inner.capabilities
        self.model_info = inner.model_info
        self.tokenizer = inner.tokenizer
        self._row_prompts: dict[int, tuple[int, ...]] = {}  # id(row KV) -> its prompt, until spliced/freed
        self._batch_contexts: dict[int, list[list[int]]] = {}  # id(batch KV) -> each row's context
        self.faults_raised = 0

    # -- the fault ------------------------------------------------------------------------------
    def _check(self, contexts: Sequence[Sequence[int]]) -> None:
        poison, after = self.config.poison, self.config.poison_after
        if not poison:
            return
        for context in contexts:
            end = _find(context, poison)
            if end is not None and len(context) - end >= after:
                self.faults_raised += 1
                raise InjectedFault(
                    f"injected fault: a row's context holds the poison sequence {list(poison)} "
                    f"followed by {len(context) - end} tokens"
                )

    # -- prefix cache and prefill ---------------------------------------------------------------
    def set_cache_adapter(self, cache_manager: Any) -> None:
        self.inner.set_cache_adapter(cache_manager)

    def prefill_lookup(self, prompt_ids: Sequence[int]) -> PrefillState:
        state = self.inner.prefill_lookup(prompt_ids)
        self.last_cache_hit_tokens = self.inner.last_cache_hit_tokens
        self._row_prompts[id(state.kv)] = tuple(state.prompt_ids)
        return state

    def prefill_chunk(self, state: PrefillState, num_tokens: int) -> None:
        done = state.num_computed + max(0, min(num_tokens, state.num_remaining))
        context = [state.prompt_ids[:done]]
        if not self.config.after_forward:
            self._check(context)
        self.inner.prefill_chunk(state, num_tokens)
        self._check(context)

    def prefill_store(self, state: PrefillState) -> None:
        self.inner.prefill_store(state)

    def free_row_kv(self, kv: Any) -> None:
        self._row_prompts.pop(id(kv), None)
        self.inner.free_row_kv(kv)

    # -- batch ops ------------------------------------------------------------------------------
    def stack_caches_left_padded(self, rows: Sequence[Any]) -> Any:
        contexts = [list(self._row_prompts.pop(id(row), ())) for row in rows]
        batch = self.inner.stack_caches_left_padded(rows)
        self._batch_contexts[id(batch)] = contexts
        return batch

    def splice_into_batched(self, batched: Any, new_kv: Any, kv_len: int) -> Any:
        prompt = self._row_prompts.get(id(new_kv), ())
        batch = self.inner.splice_into_batched(batched, new_kv, kv_len)
        self._row_prompts.pop(id(new_kv), None)
        contexts = self._batch_contexts.pop(id(batched), []) if batched is not None else []
        contexts.append(list(prompt))
        self._batch_contexts[id(batch)] = contexts
        return batch

    def remove_row_from_cache(self, batched: Any, row_idx: int) -> None:
        self.inner.remove_row_from_cache(batched, row_idx)
        contexts = self._batch_contexts.get(id(batched), [])
        if 0 <= row_idx < len(contexts):
            contexts.pop(row_idx)
        if not contexts:
            self._batch_contexts.pop(id(batched), None)

    def decode_step_batched(self, batched: Any, input_ids: Sequence[int]) -> Any:
        contexts = self._batch_contexts.setdefault(id(batched), [])
        after = [[*context, token] for context, token in zip(contexts, input_ids)]
        if not self.config.after_forward:
            self._check(after)
        if self.config.decode_delay_s:
            time.sleep(self.config.decode_delay_s)
        logits = self.inner.decode_step_batched(batched, input_ids)
        for context, token in zip(contexts, input_ids):
            context.append(token)
        self._check(after)
        return logits

    def forward_step(self, states: Sequence[PrefillState], num_tokens: Sequence[int], batched: Any,
                     input_ids: Sequence[int]) -> StepOutput:
        """The inner one-call tick, with the decode rows checked as in :meth:`decode_step_batched` (a fault
        raises the call) and each chunk as in :meth:`prefill_chunk` (a fault is that chunk's error)."""
        contexts = self._batch_contexts.setdefault(id(batched), []) if batched is not None else []
        after = [[*context, token] for context, token in zip(contexts, input_ids)]
        if not self.config.after_forward:
            self._check(after)
        if self.config.decode_delay_s and input_ids:
            time.sleep(self.config.decode_delay_s)
        errors: list[Exception | None] = [None] * len(states)
        run = list(range(len(states)))
        if not self.config.after_forward:
            for i, (state, num) in enumerate(zip(states, num_tokens)):
                try:
                    self._check([state.prompt_ids[: state.num_computed + max(0, min(num, state.num_remaining))]])
                except InjectedFault as exc:
                    errors[i] = exc
            run = [i for i in run if errors[i] is None]
        out = self.inner.forward_step([states[i] for i in run], [num_tokens[i] for i in run], batched, input_ids)
        for context, token in zip(contexts, input_ids):
            context.append(token)
        self._check(after)
        for i, error in zip(run, out.prefill_errors):
            errors[i] = error
            if error is None:
                try:
                    self._check([states[i].prompt_ids[: states[i].num_computed]])
                except InjectedFault as exc:
                    errors[i] = exc
        return StepOutput(errors, out.decode_logits)

    def kv_length(self, kv: Any, row_idx: int | None = None) -> int:
        return self.inner.kv_length(kv, row_idx)

    def sample(self, logits: Any, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
        return self.inner.sample(logits, rows, want_logprobs=want_logprobs)

    # -- admission, stats, lifecycle --------------------------------------------------------------
    def kv_reserve(self, request_id: str, num_tokens: int) -> bool:
        return self.inner.kv_reserve(request_id, num_tokens)

    def kv_release(self, request_id: str) -> None:
        self.inner.kv_release(request_id)

    def kv_stats(self) -> dict[str, int]:
        return {**self.inner.kv_stats(), "faults_injected": self.faults_raised}

    @property
    def num_live_rows(self) -> int | None:
        return getattr(self.inner, "num_live_rows", None)

    def check_integrity(self) -> None:
        self.inner.check_integrity()

    def close(self) -> None:
        self.inner.close()


def _find(context: Sequence[int], pattern: Sequence[int]) -> int | None:
    """Index just past the first occurrence of ``pattern`` in ``context`` (None if absent)."""
    size = len(pattern)
    for start in range(len(context) - size + 1):
        if context[start] == pattern[0] and tuple(context[start : start + size]) == tuple(pattern):
            return start + size
    return None


def create_backend(model_path: str, device: str, settings: Any) -> FaultyBackend:
    """BackendSpec factory: build ``FAULT_INNER_BACKEND`` through its own factory and wrap it."""
    from gemmaserve.plugins import load_registry
    from gemmaserve.registry import resolve_dotted

    name = os.environ.get("FAULT_INNER_BACKEND", "custom-cpu")
    spec = load_registry().get(name)
    if spec is None or spec.name == "faulty":
        raise ConfigurationError(f"FAULT_INNER_BACKEND={name!r} is not an installed backend to wrap")
    inner = resolve_dotted(spec.factory)(model_path, device, settings)
    return FaultyBackend(inner, FaultConfig.from_env())
