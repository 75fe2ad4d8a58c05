"""Offline Python API in the style users know from vLLM::

    from gemmaserve import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", backend="hf", device="cpu")
    for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
        print(out.text, out.cached_tokens)

``LLM`` owns an engine (scheduler thread + backend); prompts given together are batched. ``LLM.chat`` renders
messages with the model's chat template first. The output of one prompt is vLLM's ``RequestOutput`` and its
first ``CompletionOutput`` in one object (``out.text`` or ``out.outputs[0].text``).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypedDict, Union

from gemmaserve.detokenize import IncrementalDetokenizer, detokenize, hides_stop_token
from gemmaserve.engine.request import FinishReason
from gemmaserve.engine.validation import check_text_can_fit, truncate_prompt
from gemmaserve.errors import ConfigurationError, InvalidRequestError, LLMClosedError, PromptTooLongError
from gemmaserve.sampling_params import SamplingParams, primary_eos_ids
from gemmaserve.settings import CoreSettings, load_settings

if TYPE_CHECKING:
    from gemmaserve.engine.engine import Engine
    from gemmaserve.engine.request import RequestEvent, RequestMetrics, RequestOutput

__all__ = ["LLM", "CompletionOutput", "SampleOutput", "Logprob", "StreamChunk", "PromptInput", "TextPrompt",
           "TokensPrompt", "LLMClosedError"]


class TextPrompt(TypedDict):
    """vLLM's text prompt: ``{"prompt": "..."}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token prompt: ``{"prompt_token_ids": [...]}``."""

    prompt_token_ids: list[int]


PromptInput = Union[str, Sequence[int], TextPrompt, TokensPrompt]
"""A prompt: text (tokenized with the model's tokenizer), a list of token IDs, or vLLM's ``{"prompt": text}`` /
``{"prompt_token_ids": [...]}``."""

_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its 1-based rank by log-probability among the step's
    alternatives (None for a sampled token outside the returned top-k: full-vocabulary ranks are not computed),
    and its text (the token decoded alone, special tokens shown)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One prompt's result: vLLM's ``RequestOutput`` (``prompt``, ``prompt_token_ids``, ``outputs``, ``finished``,
    ``num_cached_tokens``) and its first ``CompletionOutput`` (``text``, ``token_ids``, ``finish_reason``,
    ``stop_reason``, ``logprobs``, ``cumulative_logprob``, ``index``) in one object. ``cached_tokens`` = the
    backend's ``last_cache_hit_tokens``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int
    metrics: RequestMetrics | None = None
    error: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    """vLLM's shape, with ``SamplingParams(logprobs=k)``: per generated token, ``{token id: Logprob}`` holding the
    sampled token and the k most likely ones (``out.logprobs[i][token_ids[i]].logprob``)."""
    token_logprobs: list[float] | None = None
    """With ``SamplingParams(logprobs=k)``: each generated token's log-probability (the flat list)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``logprobs`` = k > 0: per token, the k most likely ``(token id, logprob)`` pairs, most likely first."""
    cumulative_logprob: float | None = None
    """With ``SamplingParams(logprobs=k)``: the sum of the generated tokens' log-probabilities (vLLM's); else None."""
    stop_reason: int | str | None = None
    """vLLM's: the stop string that matched, or the ``stop_token_ids`` token that ended the output; None for EOS,
    ``length`` and the rest."""
    index: int = 0
    """This sample's index among the prompt's ``n`` samples."""
    samples: tuple[CompletionOutput, ...] = ()
    """With ``SamplingParams(n > 1)``: every sample of the prompt (this object is sample 0); see :attr:`outputs`."""

    @property
    def outputs(self) -> list[SampleOutput]:
        """The prompt's samples in index order, as vLLM's ``RequestOutput.outputs`` (one when n = 1): each a
        :class:`SampleOutput`, vLLM's ``CompletionOutput``, with this object's fields (its own for n > 1)."""
        return [SampleOutput(*(getattr(sample, name) for name in _FIELDS)) for sample in (self.samples or (self,))]

    @property
    def finished(self) -> bool:
        """vLLM's ``RequestOutput.finished``: always True (``generate`` returns finished outputs). On the samples
        in :attr:`outputs` it is vLLM's ``CompletionOutput.finished()``, a method."""
        return True

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's name for :attr:`cached_tokens`."""
        return self.cached_tokens

    @property
    def prompt_logprobs(self) -> None:
        """vLLM's ``RequestOutput.prompt_logprobs``: always None (``SamplingParams(prompt_logprobs=...)`` is
        refused)."""
        return None


class SampleOutput(CompletionOutput):
    """One sample of :attr:`CompletionOutput.outputs`: vLLM's ``CompletionOutput``, whose ``finished()`` is a
    method (``out.outputs[0].finished()``), where the prompt's output has vLLM's ``RequestOutput.finished``, a
    bool (``out.finished``). Every field is the sample's; it equals a :class:`CompletionOutput` with the same fields
    (``out.outputs == [out]`` when n = 1)."""

    __slots__ = ()

    def finished(self) -> bool:  # type: ignore[override]  # vLLM's CompletionOutput.finished() is a method
        """vLLM's ``CompletionOutput.finished()``: always True (outputs are final)."""
        return True

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _FIELDS)

    __hash__ = CompletionOutput.__hash__


_FIELDS = tuple(field.name for field in fields(CompletionOutput))


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

        self._closed = False
        overrides = _vllm_aliases(overrides)
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
        if overrides.get("enable_prefix_caching") is True:
            check_prefix_caching(self.settings, "LLM(enable_prefix_caching=True)",
                                 "prefix_cache_blocks / PREFIX_CACHE_BLOCKS")
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
    def get_tokenizer(self) -> Any:
        """vLLM's ``LLM.get_tokenizer()``: the model's Hugging Face tokenizer (``tok(text)``, ``len(tok)``,
        ``eos_token_id``, ``batch_decode``, ``apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)``
        ...), rendering chats with the template this LLM uses (``LLM(chat_template=...)`` / ``CHAT_TEMPLATE``, the
        checkpoint's own, or Gemma's default turn format): ``HFTokenizerAdapter.as_hf``. Every shipped backend
        (hf, custom-*, mlx) tokenizes with Hugging Face; a backend whose tokenizer is not a Hugging Face one (the
        test ReferenceBackend, a third-party plugin) returns its own tokenizer (gemmaserve's ``Tokenizer``
        protocol: ``encode``, ``decode``, ``apply_chat_template(messages)``). gemmaserve's adapter stays
        ``LLM.tokenizer``."""
        as_hf = getattr(self.tokenizer, "as_hf", None)
        return as_hf() if callable(as_hf) else self.tokenizer

    def encode_prompt(self, prompt: PromptInput, *, fit_check: bool = True) -> tuple[str | None, list[int]]:
        """Text is tokenized; a list of ints is taken as token IDs; vLLM's ``{"prompt": text}`` and
        ``{"prompt_token_ids": [...]}`` are read as those. Raises InvalidRequestError for
        empty text, text that is not valid Unicode (lone surrogates), a list holding a non-int or an id outside
        the vocabulary, a prompt dict with other keys (multimodal data: only text prompts are supported), and
        PromptTooLongError, before tokenizing, for text that cannot fit the model's context (unless not
        ``fit_check``: a prompt to be truncated, ``truncate_prompt_tokens``)."""
        self._check_open()
        if isinstance(prompt, Mapping):
            return self._encode_prompt_dict(prompt, fit_check)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            _check_unicode(prompt)
            if fit_check:
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

    def _encode_prompt_dict(self, prompt: Mapping[str, Any], fit_check: bool) -> tuple[str | None, list[int]]:
        """vLLM's TextPrompt / TokensPrompt: ``prompt`` (text) or ``prompt_token_ids`` (when both are given, the
        ids are the prompt and the text names it, as vLLM); any other key is refused by name."""
        for key, value in prompt.items():
            if key in _MULTIMODAL_KEYS and value is not None:
                raise InvalidRequestError(f"prompt key {key!r}: only text prompts are supported (a prompt dict "
                                          "holds 'prompt' or 'prompt_token_ids')")
            if key == "cache_salt" and value is not None:
                raise InvalidRequestError("prompt key 'cache_salt' is not supported: the prefix cache is shared by "
                                          "every request; drop it")
            if key not in (*_PROMPT_KEYS, *_MULTIMODAL_KEYS, "cache_salt"):
                raise InvalidRequestError(f"unknown prompt key {key!r}; a prompt dict holds 'prompt' (text) or "
                                          "'prompt_token_ids' (a list of ints)")
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InvalidRequestError(f"prompt dict: 'prompt' must be a string, got {type(text).__name__}")
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, Mapping)) or not isinstance(ids, Sequence):
                raise InvalidRequestError(f"prompt dict: 'prompt_token_ids' must be a list of ints, got "
                                          f"{type(ids).__name__}")
            return text, self.encode_prompt(list(ids))[1]
        if "prompt" not in prompt:
            raise InvalidRequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (a list of ints)")
        if not isinstance(prompt["prompt"], str):
            raise InvalidRequestError(f"prompt dict: 'prompt' must be a string, got {type(prompt['prompt']).__name__}"
                                      "; use 'prompt_token_ids' for token IDs")
        return self.encode_prompt(prompt["prompt"], fit_check=fit_check)

    def _normalize(self, prompts: PromptInput | Sequence[PromptInput],
                   fit_check: bool = True) -> list[tuple[str | None, list[int]]]:
        if _is_one_prompt(prompts):
            return [self.encode_prompt(prompts, fit_check=fit_check)]  # type: ignore[arg-type]  # refused there
        if not isinstance(prompts, Sequence) or not prompts:
            raise InvalidRequestError("prompts must be a string, a token-ID list, a prompt dict, or a non-empty list "
                                      "of them")
        return [self.encode_prompt(p, fit_check=fit_check) for p in prompts]  # type: ignore[arg-type]

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (batched together); outputs are in prompt order. A prompt whose params have
        ``n`` > 1 runs n samples (``SamplingParams.for_sample``; they share its prefill through the prefix cache);
        its output is sample 0 and holds all of them in ``outputs``. ``use_tqdm`` (vLLM's) is accepted, a bool or
        a callable; no progress bar is shown. vLLM's ``lora_request``, ``priority`` (one per prompt) and
        ``tokenization_kwargs`` are accepted at the values that change nothing (None; ``priority`` all zeros;
        ``tokenization_kwargs`` empty); any other is an InvalidRequestError naming it."""
        _check_use_tqdm(use_tqdm)
        zeros = isinstance(priority, Sequence) and not isinstance(priority, (str, bytes)) and all(
            _is_one_of(entry, (0,)) for entry in priority)  # vLLM's default priority, one per prompt
        _check_call_options("generate", lora_request=lora_request, priority=None if zeros else priority,
                            tokenization_kwargs=tokenization_kwargs)
        listed = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params]
        truncating = any(isinstance(p, SamplingParams) and p.truncate_prompt_tokens is not None for p in listed)
        encoded = self._normalize(prompts, fit_check=not truncating)  # a prompt to be truncated may be any length
        if priority is not None and len(priority) != len(encoded):
            raise InvalidRequestError(f"LLM.generate: priority has {len(priority)} entries for {len(encoded)} "
                                      "prompts; give one per prompt")
        return self._generate(encoded, sampling_params)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Any = None,
    ) -> list[CompletionOutput]:
        """vLLM's ``LLM.chat`` (its parameters, in its order): render each conversation (a list of ``{"role",
        "content"}`` messages; a list of conversations gives one output each) with the chat template
        (``chat_template`` for this call, a file path or the template text; else ``LLM(chat_template=...)`` /
        ``CHAT_TEMPLATE``; else the tokenizer's own), then :meth:`generate`. Messages are read as the HTTP server
        reads them (``ChatMessage``): a content list of text parts reaches the template as one string (joined with
        newlines: vLLM's ``"string"`` content format, so ``chat_template_content_format`` takes ``"auto"`` or
        ``"string"``), an assistant message's ``tool_calls[].function.arguments`` (JSON text) as an object; other
        content parts (images...) and unknown message fields are refused. ``tools`` and ``chat_template_kwargs``
        reach the template; a ``chat_template_kwargs`` key that LLM.chat sets itself (``add_generation_prompt``,
        ``tokenize``, ``messages``...: ``RESERVED_TEMPLATE_KWARGS``) is refused by name. The reply also ends at the
        template's end-of-turn token (unless ``ignore_eos``), as on the HTTP server; it is not parsed (no tool calls
        or reasoning split out). Raises InvalidRequestError (PromptTooLongError) naming the problem."""
        from gemmaserve.server.prepare import with_chat_stops

        self._check_open()
        _check_use_tqdm(use_tqdm)
        _check_call_options("chat", lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs,
                            chat_template_content_format=chat_template_content_format)
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise InvalidRequestError(f"LLM.chat: {name} must be a bool, got {type(flag).__name__}")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("LLM.chat: continue_final_message=True continues the last message, so it takes "
                                      "add_generation_prompt=False")
        conversations = _conversations(messages)
        kwargs = _template_kwargs(chat_template_kwargs)
        rendered = [_template_messages(conversation, f"conversation {index}, " if len(conversations) > 1 else "")
                    for index, conversation in enumerate(conversations)]
        tokenizer = self.tokenizer if chat_template is None else self._tokenizer_with_template(chat_template)
        options: dict[str, Any] = {}
        if not add_generation_prompt:
            options["add_generation_prompt"] = False
        if continue_final_message:
            options["continue_final_message"] = True
        if kwargs:
            options["template_kwargs"] = kwargs
        if tools is not None:
            options["tools"] = tools
        for index, conversation in enumerate(rendered):
            _check_unicode_strings(conversation, "LLM.chat: the messages" + (
                f" of conversation {index}" if len(rendered) > 1 else ""))
        _check_unicode_strings([tools, kwargs], "LLM.chat: tools / chat_template_kwargs")
        encoded = [self._render(conversation, tokenizer, options) for conversation in rendered]
        params = SamplingParams() if sampling_params is None else sampling_params
        many = isinstance(params, Sequence)
        params_list = list(params) if many else [params] * len(encoded)  # type: ignore[arg-type,list-item]
        for item in params_list:
            _check_params(item)
        with_ends = [with_chat_stops(item, tokenizer) for item in params_list]
        return self._generate(encoded, with_ends if many else with_ends[0] if with_ends else params)

    def _tokenizer_with_template(self, template: str) -> Any:
        """A copy of the tokenizer rendering chats with ``template`` (a file path or the template text, as
        ``CHAT_TEMPLATE``); ConfigurationError from the tokenizer becomes InvalidRequestError."""
        import copy

        from gemmaserve.hf_tokenizer import configure_chat_template, read_chat_template

        try:
            text = read_chat_template(template)
            tokenizer = copy.copy(self.tokenizer)
            configure_chat_template(tokenizer, text)
        except ConfigurationError as exc:
            raise InvalidRequestError(f"LLM.chat(chat_template=...): {exc}") from None
        return tokenizer

    def _render(self, conversation: list[dict[str, Any]], tokenizer: Any,
                options: dict[str, Any]) -> tuple[str, list[int]]:
        """(the rendered prompt's text, its token ids) of ``conversation`` (from :func:`_template_messages`), through
        the server's :func:`render_chat` (same checks); its HTTP errors become InvalidRequestError /
        PromptTooLongError."""
        from gemmaserve.server.errors import APIError
        from gemmaserve.server.prepare import render_chat

        try:
            ids = render_chat(conversation, tokenizer, self.engine.scheduler.max_model_len, options)
        except APIError as exc:
            error = PromptTooLongError if exc.code == "context_length_exceeded" else InvalidRequestError
            raise error(exc.message.replace("use /v1/completions with", "use LLM.generate with")) from None
        return tokenizer.decode(ids, skip_special_tokens=False), ids

    def _generate(self, encoded: list[tuple[str | None, list[int]]],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[CompletionOutput]:
        self._check_open()
        params = SamplingParams() if sampling_params is None else sampling_params
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(encoded)
        if len(params_list) != len(encoded):
            raise InvalidRequestError(f"{len(params_list)} SamplingParams given for {len(encoded)} prompts")
        for item in params_list:
            _check_params(item)
        limit = self.engine.scheduler.request_token_limit
        encoded = [(text, truncate_prompt(ids, item.truncate_prompt_tokens, limit))
                   for (text, ids), item in zip(encoded, params_list)]
        runs = [(text, ids, self._up_to_context(item.for_sample(i), ids)) for (text, ids), item
                in zip(encoded, params_list) for i in range(item.n)]
        if not any(item.stop for item in params_list):  # decoded once at the end, on this thread
            outputs = self.engine.generate([ids for _, ids, _ in runs], [sample for _, _, sample in runs])
            results = [self._to_completion(text, out, sample) for (text, _, sample), out in zip(runs, outputs)]
            return _by_prompt(results, [item.n for item in params_list])
        watchers = [_StopWatcher(self.engine, self.tokenizer, ids, sample, callbacks=True) for _, ids, sample in runs]
        handles = self.engine.submit_many([ids for _, ids, _ in runs], [sample for _, _, sample in runs],
                                          [watcher.request_id for watcher in watchers],
                                          [watcher.on_event for watcher in watchers], wait_for_room=True,
                                          keep_events=False)
        for watcher, handle in zip(watchers, handles):
            watcher.handle = handle
        try:
            results = [self._to_completion(text, watcher.result(), sample, watcher)
                       for (text, _, sample), watcher in zip(runs, watchers)]
            return _by_prompt(results, [item.n for item in params_list])
        except BaseException:
            for watcher in watchers:
                watcher.handle.cancel()
            raise

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield text as it is generated. Stopping the iteration early cancels the request."""
        if not _is_one_prompt(prompt) and isinstance(prompt, Sequence):
            raise InvalidRequestError(f"stream() takes one prompt (a string, a token-ID list or a prompt dict), got "
                                      f"a list of {len(prompt)} prompts: call stream() for each, or generate() for "
                                      "all of them")
        params = SamplingParams() if sampling_params is None else sampling_params
        _check_params(params)
        keep = params.truncate_prompt_tokens
        text, prompt_ids = self.encode_prompt(prompt, fit_check=keep is None)
        prompt_ids = truncate_prompt(prompt_ids, keep, self.engine.scheduler.request_token_limit)
        if params.n != 1:
            raise InvalidRequestError(f"stream() yields one sample; got n={params.n}: use generate() for n > 1, "
                                      "or stream each params.for_sample(i)")
        params = self._up_to_context(params, prompt_ids)
        watcher = _StopWatcher(self.engine, self.tokenizer, prompt_ids, params)
        handle = watcher.handle = self.engine.submit(prompt_ids, params, watcher.request_id)
        finished = False
        try:
            for event in handle:
                new_ids, delta = watcher.on_tokens(event.new_token_ids, hides_stop_token(event.output, params))
                if watcher.stopped:  # a stop string matched: end here; the engine request is cancelled
                    finished = True
                    output = watcher.result()
                    yield StreamChunk(new_ids, delta, True, self._to_completion(text, output, params, watcher))
                    return
                if event.finished:
                    delta += watcher.flush()
                    finished = True
                    yield StreamChunk(new_ids, delta, True,
                                      self._to_completion(text, event.output, params, watcher))
                    return
                yield StreamChunk(new_ids, delta, False)
        finally:
            if not finished:
                handle.cancel()

    def _to_completion(self, prompt_text: str | None, out: RequestOutput, params: SamplingParams,
                       watcher: _StopWatcher | None = None) -> CompletionOutput:
        """One engine request's output: with stop strings as ``watcher`` saw it, cut after the token that completed
        a match (``finish_reason`` ``stop``, ``stop_reason`` the string); the text of the EOS / stop token that
        ended it left out unless ``include_stop_str_in_output`` (vLLM's rules)."""
        token_ids, reason, metrics = list(out.token_ids), str(out.finish_reason), out.metrics
        flat, top = out.logprobs, out.top_logprobs
        stop_reason: int | str | None = None
        if watcher is not None and watcher.stop_string is not None and reason != "error":
            token_ids, reason, stop_reason = watcher.token_ids, "stop", watcher.stop_string
            flat = None if flat is None else flat[: len(token_ids)]
            top = None if top is None else top[: len(token_ids)]
            metrics = replace(metrics, num_output_tokens=len(token_ids))
        else:
            stop_reason = params.stop_reason(out.stop_token_id, primary_eos_ids(
                self.tokenizer, self.engine.backend.model_info.eos_token_ids))
        if watcher is not None:
            text = watcher.text
        else:
            shown = token_ids[:-1] if hides_stop_token(out, params) else token_ids
            text = detokenize(self.tokenizer, shown, prompt_ids=out.prompt_token_ids,
                              skip_special_tokens=params.skip_special_tokens)
        return CompletionOutput(
            request_id=out.request_id,
            prompt=prompt_text,
            prompt_token_ids=list(out.prompt_token_ids),
            token_ids=token_ids,
            text=text,
            finish_reason=reason,
            cached_tokens=out.cached_tokens,
            metrics=metrics,
            error=out.error,
            logprobs=None if flat is None else self._logprob_dicts(token_ids, flat, top),
            token_logprobs=flat,
            top_logprobs=top,
            cumulative_logprob=None if flat is None else float(sum(flat)),
            stop_reason=stop_reason,
        )

    def _logprob_dicts(self, token_ids: Sequence[int], flat: Sequence[float],
                       top: Sequence[Sequence[tuple[int, float]]] | None) -> list[dict[int, Logprob]]:
        """vLLM's ``logprobs``: per position, the sampled token then the top-k alternatives (rank 1 = most likely;
        the sampled token takes its rank among them, None when it is not one of them)."""
        texts: dict[int, str] = {}

        def text(token_id: int) -> str:
            if token_id not in texts:
                texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return texts[token_id]

        dicts = []
        for position, (token_id, logprob) in enumerate(zip(token_ids, flat)):
            alternatives = list(top[position]) if top is not None and position < len(top) else []
            ranks = {alt: rank for rank, (alt, _) in enumerate(alternatives, 1)}
            entry = {token_id: Logprob(logprob, ranks.get(token_id), text(token_id))}
            for rank, (alt, value) in enumerate(alternatives, 1):
                if alt != token_id:
                    entry[alt] = Logprob(value, rank, text(alt))
            dicts.append(entry)
        return dicts

    def _up_to_context(self, params: SamplingParams, prompt_ids: Sequence[int]) -> SamplingParams:
        """``max_tokens=None`` (vLLM's offline meaning) as the rest of what the request may hold after the prompt
        (the context, within ``max_active_kv_tokens`` and the backend's KV pool: ``request_token_limit``), at least
        1: a prompt that fills it is then refused as too long."""
        if params.max_tokens is not None:
            return params
        limit = self.engine.scheduler.request_token_limit
        room = limit - len(prompt_ids)
        if 0 < room < params.min_tokens:
            raise InvalidRequestError(f"min_tokens={params.min_tokens} cannot be met: max_tokens=None leaves {room} "
                                      f"tokens after the {len(prompt_ids)}-token prompt (this model's requests hold "
                                      f"{limit}); lower min_tokens or shorten the prompt")
        return replace(params, max_tokens=max(1, room))

    def beam_search(self, *args: Any, **kwargs: Any) -> list[CompletionOutput]:
        """vLLM's ``LLM.beam_search``: not implemented (gemmaserve samples each sequence on its own). Raises
        InvalidRequestError saying what to use instead."""
        raise InvalidRequestError("LLM.beam_search is not supported: gemmaserve has no beam search; use generate() "
                                  "with SamplingParams(n=k, temperature=...) for k samples, or greedy decoding")

    def _check_open(self) -> None:
        if self._closed:
            raise LLMClosedError("this LLM was closed (close() or the end of its `with` block); create a new LLM to "
                                 "generate again")

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread and release the backend (and the KV-event publisher it owns). Idempotent; later
        calls to generate, chat or stream raise :class:`LLMClosedError`."""
        self._closed = True
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
    the stop string unless ``include_stop_str_in_output``; without the text of an EOS / stop token that ended
    the request, likewise)."""

    def __init__(self, engine: Engine, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams, *,
                 callbacks: bool = False) -> None:
        self.engine = engine
        self.params = params
        self.request_id = uuid.uuid4().hex  # known before submit: the first event may beat submit's return
        self.callbacks = callbacks
        self.handle: Any = None
        self.detok = IncrementalDetokenizer(tokenizer, params.stop, prompt_ids=prompt_ids,
                                            min_tokens=params.min_tokens,
                                            skip_special_tokens=params.skip_special_tokens,
                                            include_stop_str=params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.stopped = False
        self._flushed = ""
        self._seen_final = threading.Event()

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, if one did."""
        return self.detok.stop_string

    def on_tokens(self, new_token_ids: Sequence[int], hide_last: bool = False) -> tuple[list[int], str]:
        """Feed tokens; returns (the tokens kept, the new final text). Cancels the request on a match.
        ``hide_last``: the last token is the EOS / stop token that ended the request: kept, its text not fed."""
        was_stopped = self.stopped
        fed = new_token_ids[:-1] if hide_last and new_token_ids else new_token_ids
        consumed, delta = self.detok.add_until_stop(fed)
        kept = list(new_token_ids[:consumed + (1 if hide_last and not delta.stopped and new_token_ids else 0)])
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
            self.on_tokens(event.new_token_ids, hides_stop_token(event.output, self.params))
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


_VLLM_ALIASES = {"max_num_seqs": "max_batch_size"}
"""vLLM's names of ``LLM(...)`` keywords for core settings with the same meaning (as ``gemmaserve serve`` takes
``--max-num-seqs``)."""


def _vllm_aliases(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with vLLM's names (:data:`_VLLM_ALIASES`) renamed to gemmaserve's; both names given with
    different values is a ConfigurationError."""
    out = dict(options)
    for alias, name in _VLLM_ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if name in out and out[name] != value:
                raise ConfigurationError(f"LLM({alias}={value!r}, {name}={out[name]!r}): {alias} is vLLM's name for "
                                         f"{name}; give one of them")
            out[name] = value
    return out


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
            problem = _not_implemented("LLM", name, value, VLLM_OPTIONS_NOT_IMPLEMENTED[name])
            if problem is None:
                continue
            raise ConfigurationError(problem)
        candidates = (*_LLM_PARAMETERS, *known, *VLLM_OPTIONS_NOT_IMPLEMENTED)
        close = get_close_matches(name, candidates, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else (
            "; it takes model, backend, device, settings, engine and the core settings (see docs/settings.md)")
        raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")


def _is_one_of(value: object, accepted: Sequence[Any]) -> bool:
    """``value`` is one of ``accepted`` (the same object, or equal and of the same type: ``1`` is not ``True``)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in accepted)


def check_prefix_caching(settings: CoreSettings, given: str, setting: str) -> None:
    """ConfigurationError when vLLM's "enable prefix caching" (``given``: as the caller spelled it) comes with the
    core prefix cache turned off (``settings.prefix_cache_blocks`` 0; ``setting``: that setting's names): both
    cannot hold, and caching would silently stay off. (The custom backends always cache and ignore the setting;
    the combination is refused for them too, as it contradicts itself.)"""
    if settings.prefix_cache_blocks == 0:
        default = CoreSettings.model_fields["prefix_cache_blocks"].default
        raise ConfigurationError(f"{given} asks for prefix caching, but {setting} is 0, which turns the prefix cache "
                                 f"off (the hf and mlx backends' core cache): unset {setting} (default {default} "
                                 f"blocks) or set it above 0 to cache, or drop {given} to run without")


CALL_OPTIONS_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "lora_request": ((None,), "LoRA adapters are not supported"),
    "priority": ((None,), "requests are served first come, first served: priority scheduling is not implemented "
                 "(a list of zeros, one per prompt, is accepted too)"),
    "tokenization_kwargs": ((None, {}), "text prompts are tokenized with the tokenizer's defaults; tokenize them "
                            "yourself and pass {'prompt_token_ids': [...]}"),
    "chat_template_content_format": (("auto", "string"), "each message's content reaches the template as one string, "
                                     "text parts joined with newlines (vLLM's 'string' format)"),
    "mm_processor_kwargs": ((None,), "only text prompts are supported"),
}
"""Options of vLLM's ``LLM.generate`` / ``LLM.chat`` that gemmaserve does not implement: accepted at the values
listed (which mean what gemmaserve does anyway), anything else an InvalidRequestError naming the option."""


def _check_call_options(method: str, **options: Any) -> None:
    """InvalidRequestError for the first of ``options`` (vLLM's ``LLM.<method>`` keywords in
    :data:`CALL_OPTIONS_NOT_IMPLEMENTED`) given at a value gemmaserve does not implement, naming it, why, and the
    values accepted."""
    for name, value in options.items():
        problem = _not_implemented(f"LLM.{method}", name, value, CALL_OPTIONS_NOT_IMPLEMENTED[name])
        if problem is not None:
            raise InvalidRequestError(problem)


def _not_implemented(call: str, name: str, value: object, rule: tuple[tuple[Any, ...], str]) -> str | None:
    """The refusal of vLLM's option ``name`` given to ``call`` at ``value`` (``rule``: the values accepted because
    they change nothing, and why others are not implemented), or None when ``value`` is one of those."""
    accepted, why = rule
    if _is_one_of(value, accepted):
        return None
    shown = " or ".join(repr(a) for a in accepted)
    return f"{call}({name}={_shown(value)}) is not implemented by gemmaserve ({why}); leave it unset or {shown}"


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _template_kwargs(chat_template_kwargs: object) -> dict[str, Any]:
    """``LLM.chat``'s ``chat_template_kwargs`` as a dict; a key LLM.chat passes to the template itself (the server's
    ``RESERVED_TEMPLATE_KWARGS``) is an InvalidRequestError naming it. (vLLM's own precedence for them changed
    between versions, and one of the two sides was always dropped silently.)"""
    from gemmaserve.server.protocol import RESERVED_TEMPLATE_KWARGS

    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(key, str) for key in chat_template_kwargs):
        raise InvalidRequestError(f"LLM.chat: chat_template_kwargs must be a dict of template variables (str keys), "
                                  f"got {_shown(chat_template_kwargs)}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs))
    if reserved:
        own = [name for name in reserved if name in ("add_generation_prompt", "continue_final_message",
                                                     "chat_template", "tools")]
        hint = f"; pass {', '.join(own)} as LLM.chat's argument{'s' if len(own) > 1 else ''}" if own else ""
        raise InvalidRequestError(f"LLM.chat: chat_template_kwargs cannot set {', '.join(reserved)}: LLM.chat passes "
                                  f"{'them' if len(reserved) > 1 else 'it'} to the chat template itself{hint}")
    return dict(chat_template_kwargs)


def _template_messages(conversation: Sequence[Mapping[str, Any]], where: str = "") -> list[dict[str, Any]]:
    """The messages as the chat template sees them, read by the HTTP server's message model (``ChatMessage``: text
    content parts joined, tool-call arguments parsed to objects, other parts and unknown fields refused). A bad
    message is an InvalidRequestError naming it (``where`` prefixes its index: ``conversation 1, ``) and the
    problem."""
    from pydantic import ValidationError

    from gemmaserve.server.errors import APIError
    from gemmaserve.server.protocol import ChatMessage

    messages = []
    for index, message in enumerate(conversation):
        try:
            messages.append(ChatMessage.model_validate(dict(message)).as_template_dict())
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            field = ".".join(str(part) for part in error.get("loc", ()))
            problem = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
            if error.get("type") not in ("value_error", "missing"):
                problem += f" (got {_shown(error.get('input'))})"
            raise InvalidRequestError(f"LLM.chat: {where}message {index}"
                                      f"{f' field {field!r}' if field else ''}: {problem}") from None
        except APIError as exc:
            raise InvalidRequestError(f"LLM.chat: {where}message {index}: {exc.message}") from None
    return messages


def _check_unicode(text: str) -> None:
    """Raise InvalidRequestError if ``text`` cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"prompt is not valid Unicode text: {exc.object[exc.start:exc.end]!r} at position {exc.start} is a "
            "lone surrogate; send text that encodes as UTF-8"
        ) from None


def _check_unicode_strings(value: Any, where: str) -> None:
    """Raise InvalidRequestError naming ``where`` if a string anywhere in ``value`` (dicts, lists, keys included)
    cannot be encoded as UTF-8 (a lone surrogate: the tokenizer would fail on it with a confusing error)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequestError(
                    f"{where} hold text that is not valid Unicode: {exc.object[exc.start:exc.end]!r} is a lone "
                    "surrogate; send text that encodes as UTF-8") from None
        elif isinstance(item, Mapping):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)


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


def _check_use_tqdm(use_tqdm: object) -> None:
    """vLLM's ``use_tqdm``: a bool or a callable making the bar (accepted; no bar is shown)."""
    if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
        raise InvalidRequestError(f"use_tqdm must be a bool or a callable, got {type(use_tqdm).__name__}")


def _is_one_prompt(value: object) -> bool:
    """True for a single prompt (text, a prompt dict, a non-empty list of ints, or bytes, refused later), False
    for a list of prompts or anything else."""
    if isinstance(value, (str, Mapping, bytes, bytearray, memoryview)):
        return True
    return isinstance(value, Sequence) and bool(value) and all(isinstance(t, int) for t in value)


def _conversations(messages: object) -> list[list[Mapping[str, Any]]]:
    """``LLM.chat``'s ``messages``: one conversation (a non-empty list of message dicts) or a non-empty list of
    them; anything else is an InvalidRequestError saying what is accepted."""
    accepted = "a list of messages ({'role': ..., 'content': ...}) or a list of such lists"
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(f"LLM.chat: messages must be {accepted}, got {type(messages).__name__}"
                                  + (" (empty)" if isinstance(messages, Sequence) and not messages else ""))
    if all(isinstance(message, Mapping) for message in messages):
        return [list(messages)]  # type: ignore[arg-type]
    conversations = []
    for index, conversation in enumerate(messages):
        if (isinstance(conversation, (str, Mapping)) or not isinstance(conversation, Sequence) or not conversation
                or not all(isinstance(message, Mapping) for message in conversation)):
            raise InvalidRequestError(f"LLM.chat: messages must be {accepted}; item {index} is not a non-empty list "
                                      "of message dicts")
        conversations.append(list(conversation))
    return conversations
