"""From a validated request body to what the engine needs: prompt token ids and SamplingParams.

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for completions; for chat
``max_tokens`` defaults to ``DEFAULT_MAX_TOKENS`` capped by the rest of the context (admission reserves KV for
prompt + ``max_tokens``, so a default of "the rest of the context" let a few chats hold the whole KV budget and
keep every other request queued). Tokenizer errors (no chat template, ...) and SamplingParams
errors become :class:`APIError` 400 naming the field.

Everything here runs on the caller's thread (the event loop for small bodies, a preparation thread for large
ones). Given a :class:`~gemmaserve.render_pool.RenderPool`, chats and prompts of at least
:data:`~gemmaserve.render_pool.RENDER_POOL_MIN_CHARS` characters are rendered and tokenized in its worker
processes instead (this thread waits, without the GIL), with the same token ids and the same errors.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gemmaserve.engine.validation import check_text_can_fit, truncate_prompt, truncation_tail
from gemmaserve.errors import InvalidRequestError, PromptTooLongError
from gemmaserve.render_pool import RENDER_POOL_MIN_CHARS, RenderWorkerDied
from gemmaserve.tools.constraints import strict_calls_constraint, tool_call_constraint
from gemmaserve.tools.parsers import (GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, GEMMA4_CHANNEL_CLOSE, GEMMA4_CHANNEL_OPEN,
                                      GEMMA4_STRING)
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.server.errors import APIError, constraint_error, guess_param
from gemmaserve.server.generation import Prepared
from gemmaserve.server.protocol import check_message_count

if TYPE_CHECKING:
    from gemmaserve.backend import Tokenizer
    from gemmaserve.render_pool import RenderPool
    from gemmaserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
    from gemmaserve.structured.spec import StructuredOutputs

__all__ = ["prepare_completion", "prepare_chat", "default_max_tokens_for", "tokenize_text", "render_chat",
           "chat_stop_token_ids", "with_chat_stops", "COMPLETION_DEFAULT_MAX_TOKENS"]

COMPLETION_DEFAULT_MAX_TOKENS = 16


def _refuse_text_that_cannot_fit(chars: int, tokenizer: Tokenizer, context_limit: int, param: str) -> None:
    try:
        check_text_can_fit(chars, tokenizer, context_limit, param)
    except PromptTooLongError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None


def _refuse_prompt_that_cannot_fit(count: int, context_limit: int, param: str, which: str = "the prompt") -> None:
    """A prompt of ``count`` tokens that leaves no room for one output token is refused here, off the event loop
    for a large body (the engine's own check scans the ids on the loop: ~0.5 s for 7 million of them). ``which``
    names it (a batch's prompt by its position)."""
    if count >= context_limit:
        raise APIError(400, f"{which} is {count} tokens; a request here holds at most {context_limit} tokens of "
                       "prompt and output (the least of the maximum model length, MAX_ACTIVE_KV_TOKENS and what the "
                       f"KV pool holds for one request), so shorten the prompt to under {context_limit} tokens",
                       param=param, code="context_length_exceeded")


def prepare_completion(body: CompletionRequest, tokenizer: Tokenizer, context_limit: int,
                       pool: RenderPool | None = None, index: int = 0) -> Prepared:
    """Tokenize prompt ``index`` of the body (a string, with the tokenizer's special tokens unless
    ``add_special_tokens`` is false; a token-id list is taken as is) and build the params. A text prompt that cannot
    fit ``context_limit`` is refused before it is tokenized (with ``truncate_prompt_tokens``, only its
    :func:`~gemmaserve.engine.validation.truncation_tail` is tokenized); a long one is tokenized in ``pool``."""
    prompt = body.prompt[index]
    special = body.add_special_tokens is not False
    keep = body.truncate_prompt_tokens
    if keep is not None and isinstance(prompt, str):
        prompt = truncation_tail(prompt, tokenizer, context_limit)
    prompt_ids = (tokenize_text(prompt, tokenizer, context_limit, add_special_tokens=special, pool=pool,
                                fit_check=keep is None) if isinstance(prompt, str) else list(prompt))
    prompt_ids = truncate_prompt(prompt_ids, keep, context_limit)
    if not prompt_ids:
        raise APIError(400, "the prompt tokenizes to zero tokens; send a non-empty prompt", param="prompt",
                       code="invalid_value")
    _refuse_prompt_that_cannot_fit(len(prompt_ids), context_limit, "prompt",
                                   f"prompt {index} of the batch" if len(body.prompt) > 1 else "the prompt")
    max_tokens = body.requested_max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
    params = dataclasses.replace(_sampling(body, max_tokens), logprobs=body.logprobs)
    return Prepared(prompt_ids, params, body.stop_strings, body.logprobs is not None, "prompt",
                    constraint_field=body.constraint_field)


def prepare_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, context_limit: int,
                 default_max_tokens: int = 0, tool_call_parser: str = "auto", reasoning_parser: str = "",
                 pool: RenderPool | None = None, eos_token_ids: Sequence[int] = (),
                 exclude_tools_when_none: bool = False) -> Prepared:
    """Render the messages with the model's chat template; without ``max_tokens`` the request may generate
    ``default_max_tokens`` tokens, or fewer if the rest of ``context_limit`` is smaller (0: the rest of it).
    With ``tools`` (and ``tool_choice`` other than ``"none"``) the template gets them, the reply is read with
    the tool-call parser, and ``"required"`` or a named function constrains the reply to a call; with ``"none"``
    the template gets them too (vLLM's default) unless ``exclude_tools_when_none``, and the reply is plain content. A long chat
    is rendered in ``pool`` (see :func:`render_chat`). ``eos_token_ids``: unused (kept for callers; the text of
    the EOS or stop token that ends a reply is left out of it by :func:`~gemmaserve.detokenize.hides_stop_token`)."""
    body.check_generation_prompt()
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs: true (the alternatives come with the "
                       "sampled tokens' logprobs)", param="top_logprobs", code="invalid_value")
    mode = body.tool_mode
    options = body.template_options
    parser = None
    if mode is not None:
        options = {**options, "tools": body.tool_functions}
        parser = resolve_tool_parser(tokenizer, tool_call_parser)
    elif body.tools and not exclude_tools_when_none and _template_takes(tokenizer, "tools"):
        options = {**options, "tools": body.tool_functions}  # tool_choice "none": the model knows them, calls none
    prompt_ids = render_chat([message.as_template_dict() for message in body.messages], tokenizer, context_limit,
                             options, pool)
    prompt_ids = truncate_prompt(prompt_ids, body.truncate_prompt_tokens, context_limit)
    _refuse_prompt_that_cannot_fit(len(prompt_ids), context_limit, "messages")
    max_tokens = body.requested_max_tokens or default_max_tokens_for(len(prompt_ids), context_limit,
                                                                      default_max_tokens)
    params = with_chat_stops(_sampling(body, max_tokens), tokenizer)
    params = dataclasses.replace(params, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    constraint_field = body.constraint_field
    constraint = _tool_constraint(body, mode, parser or "json", params.structured_outputs is not None)
    if constraint is not None and constraint.opening is not None and reasoning_parser:
        raise APIError(400, "tools with strict: true under tool_choice \"auto\" with the json tool-call parser are "
                       "decided by how the reply opens, which a reasoning channel before it would hide; turn the "
                       "reasoning parser off, use the gemma4 tool-call parser, or leave strict unset",
                       param="tools", code="invalid_value")
    if constraint is not None:
        try:
            params = dataclasses.replace(params, structured_outputs=constraint)
        except InvalidRequestError as exc:  # min_tokens, allowed_token_ids
            raise APIError(400, str(exc), param=guess_param(str(exc), "tools") or "tools",
                           code="invalid_value") from None
        constraint_field = "tools"
    markers = ((GEMMA4_CALL_OPEN, GEMMA4_CALL_CLOSE, GEMMA4_STRING) if parser == "gemma4" else ()) + (
        (GEMMA4_CHANNEL_OPEN, GEMMA4_CHANNEL_CLOSE) if reasoning_parser else ())
    shown = frozenset(marker_ids(tokenizer, markers)) if params.skip_special_tokens else frozenset()
    if body.include_reasoning is False and not reasoning_parser:
        raise APIError(400, "include_reasoning: false needs the server's --reasoning-parser (REASONING_PARSER): "
                       "without it the reasoning channel is part of the content and cannot be left out; leave "
                       "include_reasoning unset or true", param="include_reasoning", code="invalid_value")
    return Prepared(prompt_ids, params, body.stop_strings, bool(body.logprobs), "messages", parser,
                    body.parallel_tool_calls is not False, reasoning_parser or None, constraint_field,
                    mode == "function", shown, body.include_reasoning is not False)


def _tool_constraint(body: ChatCompletionRequest, mode: str | None, parser: str,
                     constrained: bool) -> StructuredOutputs | None:
    """The constraint the tools put on the reply: a call (``tool_choice`` ``"required"`` or a named function), or
    under ``"auto"`` the strict functions' calls; None when they put none. APIError 400 for tools the constraint
    cannot be built from, or beside the request's own constraint (``constrained``: response_format /
    structured_outputs)."""
    functions = [tool["function"] for tool in body.tool_functions]
    forced = mode in ("required", "function")
    name = body.tool_choice_function if forced else None
    if forced and constrained:
        what = "required" if name is None else f"naming function {name!r}"
        raise APIError(400, f"tool_choice {what} constrains the reply to a tool call; it cannot be combined "
                       "with response_format / structured_outputs", param="tool_choice", code="invalid_value")
    try:
        if forced:
            return tool_call_constraint(functions, name, parser, body.parallel_tool_calls is not False)
        constraint = (strict_calls_constraint(functions, parser, body.parallel_tool_calls is not False)
                      if mode == "auto" else None)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="tools", code="invalid_value") from None
    if constraint is not None and constrained:
        raise APIError(400, "tools with strict: true under tool_choice \"auto\" hold the reply's calls to their "
                       "schemas; they cannot be combined with response_format / structured_outputs (leave strict "
                       "unset, or drop the response format)", param="tools", code="invalid_value")
    return constraint


def marker_ids(tokenizer: Tokenizer, markers: Sequence[str]) -> list[int]:
    """The ids of the ``markers`` the vocabulary holds as single tokens (the parsers' markers are special tokens:
    the text shows them although it hides every other special token)."""
    ids = []
    for marker in markers:
        try:
            encoded = tokenizer.encode(marker, add_special_tokens=False)
        except Exception:
            continue
        if len(encoded) == 1:
            ids.append(int(encoded[0]))
    return ids


def resolve_tool_parser(tokenizer: Tokenizer, setting: str) -> str:
    """``--tool-call-parser`` for this tokenizer: ``auto`` is gemma4 when ``<|tool_call>`` is one token of the
    vocabulary, else json."""
    if setting != "auto":
        return setting
    try:
        ids = tokenizer.encode(GEMMA4_CALL_OPEN, add_special_tokens=False)
    except Exception:
        return "json"
    return "gemma4" if len(ids) == 1 else "json"


def chat_stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens that end an assistant turn in the tokenizer's chat template (``<end_of_turn>`` for Gemma): a
    chat ends there, as at EOS (see :attr:`gemmaserve.hf_tokenizer.HFTokenizerAdapter.chat_stop_token_ids`)."""
    return tuple(int(token) for token in getattr(tokenizer, "chat_stop_token_ids", ()) or ())


def with_chat_stops(params: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """``params`` ending also at the chat template's end-of-turn tokens (:func:`chat_stop_token_ids`), unless
    ``ignore_eos``: what a chat reply is generated with, on the server and in ``LLM.chat``. Those not among
    ``params.stop_token_ids`` are appended and named in ``chat_stop_token_ids``, so they do not count toward the
    request's ``MAX_STOP_TOKEN_IDS``."""
    if params.chat_stop_token_ids:  # already merged
        return params
    given = params.stop_token_ids
    ends = () if params.ignore_eos else chat_stop_token_ids(tokenizer)
    added = tuple(dict.fromkeys(token for token in ends if token not in given))
    if not added:
        return params
    return dataclasses.replace(params, stop_token_ids=(*given, *added), chat_stop_token_ids=added)


def tokenize_text(text: str, tokenizer: Tokenizer, context_limit: int, *, add_special_tokens: bool = True,
                  pool: RenderPool | None = None, fit_check: bool = True) -> list[int]:
    """``text``'s token ids; text that cannot fit ``context_limit`` is refused before it is tokenized (unless not
    ``fit_check``: a prompt to be truncated; the request body's size bounds it). Text of at least
    ``RENDER_POOL_MIN_CHARS`` characters is tokenized in ``pool`` when one is given."""
    if fit_check:
        _refuse_text_that_cannot_fit(len(text), tokenizer, context_limit, "prompt")
    if pool is not None and len(text) >= RENDER_POOL_MIN_CHARS and pool.serves(tokenizer):
        try:
            return pool.encode(text, add_special_tokens=add_special_tokens)
        except RenderWorkerDied as exc:
            raise APIError(500, f"internal server error: {exc}; retry the request") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_chat(messages: list[dict[str, Any]], tokenizer: Tokenizer, context_limit: int,
                options: dict[str, Any] | None = None, pool: RenderPool | None = None) -> list[int]:
    """The chat template applied to ``messages`` (with the generation prompt); 400 without a template, for
    messages that cannot fit ``context_limit`` (checked before rendering) or that render to nothing. ``options``:
    ``apply_chat_template`` keywords (``add_generation_prompt``, ``continue_final_message``, ``template_kwargs``)
    and ``tools`` (the template's ``tools`` variable, passed among ``template_kwargs``), given only when they differ
    from the default; a tokenizer that does not take one is a 400 naming its request field.
    Messages of at least ``RENDER_POOL_MIN_CHARS`` characters are rendered in ``pool`` (a copy of
    ``tokenizer`` in a worker process) when one is given and still :meth:`~RenderPool.serves` it; a worker that
    dies twice is a 500."""
    options = options or {}
    _check_template_options(tokenizer, options)
    if not tokenizer.has_chat_template:
        raise APIError(
            400,
            "this model has no chat template, so chat messages cannot be rendered; "
            "use /v1/completions with a plain prompt, or serve a checkpoint whose tokenizer_config.json "
            "has a chat_template",
            param="messages",
            code="no_chat_template",
        )
    chars = _check_template_input(messages, options, tokenizer, context_limit)
    pooled = pool is not None and chars >= RENDER_POOL_MIN_CHARS and pool.serves(tokenizer)
    render = pool.apply_chat_template if pool is not None and pooled else tokenizer.apply_chat_template
    keywords = {name: value for name, value in options.items() if name != "tools"}
    if "tools" in options:
        keywords["template_kwargs"] = {**options.get("template_kwargs", {}), "tools": options["tools"]}
    try:
        prompt_ids = render(messages, **keywords)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_value") from None
    except RenderWorkerDied as exc:
        raise APIError(500, f"internal server error: {exc}; retry the request") from None
    if not prompt_ids:
        raise APIError(400, "the chat template rendered these messages to zero tokens", param="messages",
                       code="invalid_value")
    return prompt_ids


def _check_template_input(messages: list[dict[str, Any]], options: dict[str, Any], tokenizer: Tokenizer,
                          context_limit: int) -> int:
    """The characters of everything the template can render (messages' fields, tools, ``chat_template_kwargs``),
    counted before rendering; 400 (``context_length_exceeded``, naming the part holding the most) when there are
    more messages than ``context_limit`` or more characters than it can hold at the tokenizer's longest token
    (``max_token_chars``; no character bound for a tokenizer that does not tell it)."""
    check_message_count(len(messages), context_limit)
    longest = getattr(tokenizer, "max_token_chars", None)
    bounded = isinstance(longest, int) and not isinstance(longest, bool) and longest > 0
    limit = context_limit * longest if bounded else sys.maxsize
    parts = {"tools": options.get("tools"), "chat_template_kwargs": options.get("template_kwargs")}
    counts = {"messages": sum(_rendered_chars(value, limit) for message in messages for value in message.values())}
    for name, value in parts.items():
        counts[name] = _rendered_chars(value, limit - counts["messages"])
    total = sum(counts.values())
    if total > limit:
        param = max(counts, key=lambda name: counts[name])
        raise APIError(400, f"the chat template's input (the messages' contents and other fields, tools, "
                       f"chat_template_kwargs) has more than {limit} characters: even at {longest} characters per "
                       f"token (this tokenizer's longest token) that is more than the model's {context_limit}-token "
                       f"context; most of it is in {param}: shorten it", param=param, code="context_length_exceeded")
    return total


def _rendered_chars(value: Any, budget: int) -> int:
    """The characters ``value`` (JSON data) takes when a template writes it out whole, counted low (what a refusal
    may rely on): the length of every string (object keys included), the digits of numbers, 1 per container,
    null or bool; quotes and separators are not counted. Stops counting once past ``budget`` (iterative: no
    recursion limit)."""
    total = 0
    stack = [value]
    while stack and total <= budget:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += 1
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 1
            stack.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 2  # digits (and sign), without str(): huge ints cannot be printed
        elif isinstance(item, float):
            total += len(repr(item))
        else:
            total += 1
    return total


_OPTION_FIELDS = {"add_generation_prompt": "add_generation_prompt", "continue_final_message": "continue_final_message",
                  "template_kwargs": "chat_template_kwargs", "tools": "tools"}
_KEYWORDS = {"tools": "template_kwargs"}
"""Options that reach ``apply_chat_template`` through another keyword."""


def _template_takes(tokenizer: Tokenizer, option: str) -> bool:
    """Whether this backend's tokenizer's ``apply_chat_template`` takes ``option`` (the core protocol's
    ``apply_chat_template(messages)`` takes none; :class:`~gemmaserve.hf_tokenizer.HFTokenizerAdapter` takes all)."""
    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):
        return False
    return (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
            or _KEYWORDS.get(option, option) in parameters)


def _check_template_options(tokenizer: Tokenizer, options: dict[str, Any]) -> None:
    """400 naming the request field if this backend's tokenizer cannot take an option (:func:`_template_takes`)."""
    for option in options:
        if not _template_takes(tokenizer, option):
            field = _OPTION_FIELDS[option]
            raise APIError(400, f"{field} is not supported by this backend's tokenizer (its chat template takes "
                           "the messages only); leave it at its default", param=field, code="invalid_value")


def default_max_tokens_for(prompt_tokens: int, context_limit: int, default_max_tokens: int) -> int:
    """``max_tokens`` of a request that gives none: ``default_max_tokens`` (0 = no cap) within the rest of the
    context, at least 1 (a prompt that fills the context is then refused as too long)."""
    rest = max(1, context_limit - prompt_tokens)
    return min(rest, default_max_tokens) if default_max_tokens > 0 else rest


def _sampling(body: SamplingFields, max_tokens: int) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None else 0
    try:
        structured = body.structured
    except InvalidRequestError as exc:
        raise constraint_error(str(exc), body.constraint_field) from None
    try:
        return SamplingParams(
            structured_outputs=structured,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k == -1 else top_k,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            min_p=0.0 if body.min_p is None else body.min_p,
            min_tokens=0 if body.min_tokens is None else body.min_tokens,
            logit_bias=body.logit_bias or {},  # keys are JSON strings: SamplingParams reads and checks them
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
            frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
            bad_words=tuple(body.bad_words or ()),
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            # vLLM's fields; the request model holds them once protocol.py accepts values other than the default
            include_stop_str_in_output=bool(getattr(body, "include_stop_str_in_output", None)),
            skip_special_tokens=getattr(body, "skip_special_tokens", None) is not False,
        )
    except InvalidRequestError as exc:  # the protocol checks ranges first; this is a backstop
        raise APIError(400, str(exc), param=guess_param(str(exc), "body"), code="invalid_value") from None
