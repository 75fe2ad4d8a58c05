"""Offline Python API in the style users know from vLLM::

    from gemmaserve import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", backend="hf", device="cpu")
    for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
        print(out.text, out.cached_tokens)

``LLM`` owns an engine (scheduler thread + backend); prompts given together are batched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from gemmaserve.detokenize import IncrementalDetokenizer
from gemmaserve.errors import InvalidRequestError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings, load_settings

if TYPE_CHECKING:
    from gemmaserve.engine.engine import Engine
    from gemmaserve.engine.request import RequestMetrics, RequestOutput

__all__ = ["LLM", "CompletionOutput", "StreamChunk", "PromptInput"]

PromptInput = Union[str, Sequence[int]]
"""A prompt: text (tokenized with the model's tokenizer) or a list of token IDs."""


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One prompt's result. ``cached_tokens`` = the backend's ``last_cache_hit_tokens``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int
    metrics: RequestMetrics | None = None
    error: str | None = None
    logprobs: list[float] | None = None


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """A streaming step: new token IDs, the text they completed, and the final output at the end."""

    token_ids: list[int]
    text: str
    finished: bool
    output: CompletionOutput | None = None


class LLM:
    """Load a model with the selected backend and generate. Thread-safe; close() or use ``with``."""

    def __init__(
        self,
        model: str | None = None,
        backend: str | None = None,
        device: str | None = None,
        *,
        settings: CoreSettings | None = None,
        engine: Engine | None = None,
        **overrides: Any,
    ) -> None:
        from gemmaserve.engine.factory import build_engine

        self.settings = settings or load_settings(model=model, backend=backend, device=device, **overrides)
        self.engine = engine if engine is not None else build_engine(self.settings)
        self.engine.start()
        self.tokenizer = self.engine.backend.tokenizer

    # -- prompts ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Text is tokenized; a list of ints is taken as token IDs. Raises InvalidRequestError for
        empty text, text that is not valid Unicode (lone surrogates), or a list holding a non-int."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            _check_unicode(prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence):
            for position, token in enumerate(prompt):
                if isinstance(token, bool) or not isinstance(token, int):
                    raise InvalidRequestError(
                        f"prompt token {token!r} at position {position} is not an int; a prompt is a string "
                        "or a list of integer token IDs"
                    )
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt must be a string or a list of token IDs (ints), got {type(prompt).__name__}"
        )

    def _normalize(self, prompts: PromptInput | Sequence[PromptInput]) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            return [self.encode_prompt(prompts)]  # type: ignore[arg-type]
        if not isinstance(prompts, Sequence) or not prompts:
            raise InvalidRequestError("prompts must be a string, a token-ID list, or a non-empty list of them")
        return [self.encode_prompt(p) for p in prompts]  # type: ignore[arg-type]

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (batched together); outputs are in prompt order."""
        encoded = self._normalize(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(encoded)
        if len(params_list) != len(encoded):
            raise InvalidRequestError(f"{len(params_list)} SamplingParams given for {len(encoded)} prompts")
        for item in params_list:
            _check_params(item)
        outputs = self.engine.generate([ids for _, ids in encoded], params_list)
        return [self._to_completion(text, out) for (text, _), out in zip(encoded, outputs)]

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield text as it is generated. Stopping the iteration early cancels the request."""
        text, prompt_ids = self.encode_prompt(prompt)
        params = sampling_params or SamplingParams()
        _check_params(params)
        handle = self.engine.submit(prompt_ids, params)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids)
        finished = False
        try:
            for event in handle:
                delta = detok.add(event.new_token_ids).text
                if event.finished:
                    delta += detok.flush()
                    finished = True
                    yield StreamChunk(list(event.new_token_ids), delta, True, self._to_completion(text, event.output))
                    return
                yield StreamChunk(list(event.new_token_ids), delta, False)
        finally:
            if not finished:
                handle.cancel()

    def _to_completion(self, prompt_text: str | None, out: RequestOutput) -> CompletionOutput:
        return CompletionOutput(
            request_id=out.request_id,
            prompt=prompt_text,
            prompt_token_ids=list(out.prompt_token_ids),
            token_ids=list(out.token_ids),
            text=self.tokenizer.decode(out.token_ids),
            finish_reason=str(out.finish_reason),
            cached_tokens=out.cached_tokens,
            metrics=out.metrics,
            error=out.error,
            logprobs=out.logprobs,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread and release the backend. Idempotent."""
        self.engine.shutdown()
        self.engine.backend.close()  # idempotent; the engine closes a backend it owns as well

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_unicode(text: str) -> None:
    """Raise InvalidRequestError if ``text`` cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"prompt is not valid Unicode text: {exc.object[exc.start:exc.end]!r} at position {exc.start} is a "
            "lone surrogate; send text that encodes as UTF-8"
        ) from None


def _check_params(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be SamplingParams objects, got {type(params).__name__}")
