"""Offline Python API in the style users know from vLLM::

    from gemmaserve import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", backend="hf", device="cpu")
    for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
        print(out.text, out.cached_tokens)

``LLM`` owns an engine (scheduler thread + backend); prompts given together are batched.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Union

from gemmaserve.detokenize import IncrementalDetokenizer
from gemmaserve.engine.request import FinishReason
from gemmaserve.engine.validation import check_text_can_fit
from gemmaserve.errors import ConfigurationError, InvalidRequestError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings, load_settings

if TYPE_CHECKING:
    from gemmaserve.engine.engine import Engine
    from gemmaserve.engine.request import RequestEvent, RequestMetrics, RequestOutput

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
    """With ``SamplingParams(logprobs=k)``: each generated token's log-probability."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``logprobs`` = k > 0: per token, the k most likely ``(token id, logprob)`` pairs, most likely first."""
    index: int = 0
    """This sample's index among the prompt's ``n`` samples."""
    samples: tuple[CompletionOutput, ...] = ()
    """With ``SamplingParams(n > 1)``: every sample of the prompt (this object is sample 0); see :attr:`outputs`."""

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The prompt's samples in index order, as vLLM's ``RequestOutput.outputs``: ``[self]`` when n = 1."""
        return list(self.samples) if self.samples else [self]


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
        from gemmaserve.hf_tokenizer import configure_chat_template, read_chat_template

        _check_options(overrides)
        if settings is not None and not isinstance(settings, CoreSettings):
            raise TypeError(f"LLM(settings=...) takes a gemmaserve.settings.CoreSettings, got "
                            f"{type(settings).__name__}; pass its fields as keywords instead (LLM(model=..., ...))")
        given = sorted([*(name for name in overrides if name in CoreSettings.model_fields),
                        *(name for name, value in (("model", model), ("backend", backend), ("device", device))
                          if value is not None)])
        if settings is not None and given:
            raise TypeError(f"LLM(settings=...) takes no other settings, got {', '.join(given)}; put them in the "
                            "CoreSettings (settings.model_copy(update={...})) or drop settings=")
        if engine is not None and given:
            raise TypeError(f"LLM(engine=...) serves that engine as it was built and takes no other settings, got "
                            f"{', '.join(given)}; build the engine with them (gemmaserve.engine.factory.build_engine) "
                            "or drop engine=")
        chosen = {name: value for name, value in overrides.items() if name not in VLLM_OPTIONS_NOT_IMPLEMENTED}
        if settings is None and engine is not None:
            settings = engine.settings
        self.settings = settings or load_settings(model=model, backend=backend, device=device, **chosen)
        if "log_level" in self.settings.model_fields_set:  # given (keyword or LOG_LEVEL): gemmaserve's own loggers
            _apply_log_level(self.settings.log_level)
        template = read_chat_template(self.settings.chat_template) if self.settings.chat_template else None
        self.engine = engine if engine is not None else build_engine(self.settings)
        try:
            if template is not None:
                configure_chat_template(self.engine.backend.tokenizer, template)
        except BaseException:
            if engine is None:
                self.engine.shutdown()
            raise
        self.engine.start()
        self.tokenizer = self.engine.backend.tokenizer

    # -- prompts ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Text is tokenized; a list of ints is taken as token IDs. Raises InvalidRequestError for
        empty text, text that is not valid Unicode (lone surrogates), a list holding a non-int or an id outside
        the vocabulary, and
        PromptTooLongError, before tokenizing, for text that cannot fit the model's context."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            _check_unicode(prompt)
            check_text_can_fit(len(prompt), self.tokenizer, self.engine.scheduler.max_model_len)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise InvalidRequestError(f"a prompt must be a string or a list of token IDs (ints), got "
                                      f"{type(prompt).__name__} (its bytes are not token IDs): decode it to str")
        if isinstance(prompt, Sequence):
            vocab_size = self.engine.backend.model_info.vocab_size
            for position, token in enumerate(prompt):
                if isinstance(token, bool) or not isinstance(token, int):
                    raise InvalidRequestError(
                        f"prompt token {token!r} at position {position} is not an int; a prompt is a string "
                        "or a list of integer token IDs"
                    )
                # checked here, not only at submit: the stop-string detokenizer decodes the prompt first, and
                # Hugging Face tokenizers raise OverflowError on a negative id
                if not 0 <= token < vocab_size:
                    raise InvalidRequestError(
                        f"prompt token {token!r} at position {position} is not a valid token id; "
                        f"token ids are integers in [0, {vocab_size})"
                    )
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt must be a string or a list of token IDs (ints), got {type(prompt).__name__}"
        )

    def _normalize(self, prompts: PromptInput | Sequence[PromptInput]) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (bytes, bytearray, memoryview)):
            return [self.encode_prompt(prompts)]  # type: ignore[arg-type]  # refused there, with the reason
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
        """Generate for every prompt (batched together); outputs are in prompt order. A prompt whose params have
        ``n`` > 1 runs n samples (``SamplingParams.for_sample``; they share its prefill through the prefix cache);
        its output is sample 0 and holds all of them in ``outputs``."""
        encoded = self._normalize(prompts)
        params = SamplingParams() if sampling_params is None else sampling_params
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(encoded)
        if len(params_list) != len(encoded):
            raise InvalidRequestError(f"{len(params_list)} SamplingParams given for {len(encoded)} prompts")
        for item in params_list:
            _check_params(item)
        runs = [(text, ids, item.for_sample(i)) for (text, ids), item in zip(encoded, params_list)
                for i in range(item.n)]
        if not any(item.stop for item in params_list):
            outputs = self.engine.generate([ids for _, ids, _ in runs], [sample for _, _, sample in runs])
            results = [self._to_completion(text, out) for (text, _, _), out in zip(runs, outputs)]
            return _by_prompt(results, [item.n for item in params_list])
        watchers = [_StopWatcher(self.engine, self.tokenizer, ids, sample.stop, callbacks=True,
                                 min_tokens=sample.min_tokens) for _, ids, sample in runs]
        handles = self.engine.submit_many([ids for _, ids, _ in runs], [sample for _, _, sample in runs],
                                          [watcher.request_id for watcher in watchers],
                                          [watcher.on_event for watcher in watchers], wait_for_room=True,
                                          keep_events=False)
        for watcher, handle in zip(watchers, handles):
            watcher.handle = handle
        try:
            results = [self._to_completion(text, watcher.result(), watcher)
                       for (text, _, _), watcher in zip(runs, watchers)]
            return _by_prompt(results, [item.n for item in params_list])
        except BaseException:
            for watcher in watchers:
                watcher.handle.cancel()
            raise

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield text as it is generated. Stopping the iteration early cancels the request."""
        text, prompt_ids = self.encode_prompt(prompt)
        params = SamplingParams() if sampling_params is None else sampling_params
        _check_params(params)
        if params.n != 1:
            raise InvalidRequestError(f"stream() yields one sample; got n={params.n}: use generate() for n > 1, "
                                      "or stream each params.for_sample(i)")
        watcher = _StopWatcher(self.engine, self.tokenizer, prompt_ids, params.stop, min_tokens=params.min_tokens)
        handle = watcher.handle = self.engine.submit(prompt_ids, params, watcher.request_id)
        finished = False
        try:
            for event in handle:
                new_ids, delta = watcher.on_tokens(event.new_token_ids)
                if watcher.stopped:  # a stop string matched: end here; the engine request is cancelled
                    finished = True
                    output = watcher.result()
                    yield StreamChunk(new_ids, delta, True, self._to_completion(text, output, watcher))
                    return
                if event.finished:
                    delta += watcher.flush()
                    finished = True
                    yield StreamChunk(new_ids, delta, True, self._to_completion(text, event.output, watcher))
                    return
                yield StreamChunk(new_ids, delta, False)
        finally:
            if not finished:
                handle.cancel()

    def _to_completion(
        self, prompt_text: str | None, out: RequestOutput, watcher: _StopWatcher | None = None
    ) -> CompletionOutput:
        token_ids, text, reason = list(out.token_ids), None, str(out.finish_reason)
        logprobs, top = out.logprobs, out.top_logprobs
        if watcher is not None and watcher.stop:
            text = watcher.text
            if watcher.stopped and reason != "error":  # cut after the token that completed the stop string
                token_ids, reason = watcher.token_ids, "stop"
                logprobs = None if logprobs is None else logprobs[: len(token_ids)]
                top = None if top is None else top[: len(token_ids)]
        return CompletionOutput(
            request_id=out.request_id,
            prompt=prompt_text,
            prompt_token_ids=list(out.prompt_token_ids),
            token_ids=token_ids,
            text=self.tokenizer.decode(token_ids) if text is None else text,
            finish_reason=reason,
            cached_tokens=out.cached_tokens,
            metrics=out.metrics,
            error=out.error,
            logprobs=logprobs,
            top_logprobs=top,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread and release the backend (and the KV-event publisher it owns). Idempotent."""
        self.engine.shutdown()
        self.engine.backend.close()  # idempotent; the engine closes a backend it owns as well

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _StopWatcher:
    """Stop strings of one request: detokenizes its tokens as they arrive (on the engine thread via
    :meth:`on_event`, or on the caller's via :meth:`on_tokens`) and cancels the engine request with reason
    ``stop`` at the first match. ``token_ids`` / ``text`` are the output up to the match (the text without
    the stop string)."""

    def __init__(self, engine: Engine, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str], *,
                 callbacks: bool = False, min_tokens: int = 0) -> None:
        self.engine = engine
        self.stop = tuple(stop)
        self.request_id = uuid.uuid4().hex  # known before submit: the first event may beat submit's return
        self.callbacks = callbacks
        self.handle: Any = None
        self.detok = IncrementalDetokenizer(tokenizer, self.stop, prompt_ids=prompt_ids, min_tokens=min_tokens)
        self.token_ids: list[int] = []
        self.stopped = False
        self._flushed = ""
        self._seen_final = threading.Event()

    @property
    def text(self) -> str:
        return self.detok.text

    def on_tokens(self, new_token_ids: Sequence[int]) -> tuple[list[int], str]:
        """Feed tokens; returns (the tokens kept, the new final text). Cancels the request on a match."""
        was_stopped = self.stopped
        consumed, delta = self.detok.add_until_stop(new_token_ids)
        kept = list(new_token_ids[:consumed])
        self.token_ids += kept
        self.stopped = delta.stopped
        if self.stopped and not was_stopped:
            self.engine.cancel(self.request_id, reason=FinishReason.STOP)
        return kept, delta.text

    def flush(self) -> str:
        """At the end without a match so far: release the held-back tail (it may still hold a match)."""
        if not self.stopped:
            self._flushed = self.detok.flush()
            self.stopped = self.detok.stopped
        return self._flushed

    def on_event(self, event: RequestEvent) -> None:
        """Engine-thread callback (``Engine.submit(on_event=...)``). The final event always releases
        :meth:`result`, even if detokenizing raised (the engine logs callback exceptions)."""
        try:
            self.on_tokens(event.new_token_ids)
            if event.finished:
                self.flush()
        finally:
            if event.finished:
                self._seen_final.set()

    def result(self) -> RequestOutput:
        """The engine's final output; with callbacks, once :meth:`on_event` has seen it too (the engine
        runs a request's callback right after completing its handle)."""
        output = self.handle.result()
        if self.callbacks:
            self._seen_final.wait()
        return output


VLLM_OPTIONS_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "pipeline_parallel_size": ((1,), "one process drives one device"),
    "data_parallel_size": ((1,), "run one LLM per device"),
    "distributed_executor_backend": ((None,), "one process drives one device"),
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the model dtype"),
    "tokenizer": ((None,), "the tokenizer is the checkpoint's own (point `model` at a folder holding both)"),
    "tokenizer_mode": (("auto",), "the checkpoint's fast tokenizer is used"),
    "skip_tokenizer_init": ((False,), "the checkpoint's tokenizer is always loaded"),
    "revision": ((None,), "`model` is a local folder; nothing is downloaded"),
    "tokenizer_revision": ((None,), "`model` is a local folder; nothing is downloaded"),
    "download_dir": ((None,), "`model` is a local folder; nothing is downloaded"),
    "trust_remote_code": ((False,), "set TRUST_REMOTE_CODE for the hf backend"),
    "seed": ((None,), "seed each request with SamplingParams(seed=...)"),
    "gpu_memory_utilization": ((None,), "KV memory is sized by max_active_kv_tokens"),
    "swap_space": ((None, 0), "the KV cache is not swapped to the host"),
    "cpu_offload_gb": ((None, 0), "weights stay on the device"),
    "enforce_eager": ((None, False), "CUDA graphs are a custom-cuda plugin setting"),
    "max_num_seqs": ((None,), "use max_batch_size"),
    "max_seq_len_to_capture": ((None,), "CUDA graph sizes are a custom-cuda plugin setting"),
    "enable_prefix_caching": ((None, True), "prefix caching is on by default; prefix_cache_blocks=0 "
                              "(PREFIX_CACHE_BLOCKS) turns the core cache off for the hf and mlx backends"),
    "enable_lora": ((None, False), "LoRA adapters are not supported"),
    "speculative_config": ((None,), "speculative decoding is not supported"),
    "limit_mm_per_prompt": ((None,), "only text prompts are supported"),
    "hf_overrides": ((None,), "the checkpoint's config.json is used as is"),
}
"""Options of vLLM's ``LLM(...)`` that gemmaserve does not implement: each accepted only at the value that means
what gemmaserve does anyway (and then not passed on: no setting holds it); anything else is a ConfigurationError
(never silently ignored)."""

_LLM_PARAMETERS = ("model", "backend", "device", "settings", "engine")
_SERVER_ONLY = tuple(name for name, field in CoreSettings.model_fields.items()
                     if (field.description or "").startswith("HTTP server"))
"""Core settings only the HTTP server reads (their descriptions begin "HTTP server"): an offline ``LLM(...)`` keyword
for one of them would do nothing."""


def _apply_log_level(level: str) -> None:
    """Set the ``gemmaserve`` loggers to ``level`` (for the process), with a stderr handler when logging is not
    configured at all (Python's fallback handler would show warnings only)."""
    logger = logging.getLogger("gemmaserve")
    logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def _check_options(options: dict[str, Any]) -> None:
    """Every keyword of ``LLM(...)`` beyond its parameters must be a core setting (``max_model_len``,
    ``max_batch_size``...); a vLLM option gemmaserve does not implement raises ConfigurationError unless it has the
    value that changes nothing, anything else TypeError naming close matches."""
    from difflib import get_close_matches

    known = tuple(CoreSettings.model_fields)
    for name, value in options.items():
        if name in _SERVER_ONLY:
            raise ConfigurationError(f"LLM({name}=...) configures the HTTP server (`gemmaserve serve`, "
                                     f"{name.upper()}); the offline LLM serves no HTTP: drop it")
        if name in known:
            continue
        if name in VLLM_OPTIONS_NOT_IMPLEMENTED:
            accepted, why = VLLM_OPTIONS_NOT_IMPLEMENTED[name]
            if any(value is a or (type(value) is type(a) and value == a) for a in accepted):
                continue
            shown = " or ".join(repr(a) for a in accepted)
            raise ConfigurationError(f"LLM({name}={value!r}) is not implemented by gemmaserve ({why}); leave it "
                                     f"unset or {shown}")
        candidates = (*_LLM_PARAMETERS, *known, *VLLM_OPTIONS_NOT_IMPLEMENTED)
        close = get_close_matches(name, candidates, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else (
            "; it takes model, backend, device, settings, engine and the core settings (see docs/settings.md)")
        raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")


def _check_unicode(text: str) -> None:
    """Raise InvalidRequestError if ``text`` cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"prompt is not valid Unicode text: {exc.object[exc.start:exc.end]!r} at position {exc.start} is a "
            "lone surrogate; send text that encodes as UTF-8"
        ) from None


def _by_prompt(results: list[CompletionOutput], counts: list[int]) -> list[CompletionOutput]:
    """Group the flat sample outputs back by prompt: one output per prompt, its samples in ``samples`` when the
    prompt asked for more than one."""
    grouped, start = [], 0
    for count in counts:
        chunk = results[start : start + count]
        start += count
        if count == 1:
            grouped.append(chunk[0])
        else:
            samples = tuple(replace(out, index=i) for i, out in enumerate(chunk))
            grouped.append(replace(samples[0], samples=samples))
    return grouped


def _check_params(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be SamplingParams objects, got {type(params).__name__}")
