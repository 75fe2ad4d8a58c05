"""The core :class:`~gemmaserve.backend.Tokenizer` protocol over a Hugging Face tokenizer object.

Shared by every backend that tokenizes with transformers (hf_torch, custom_torch, mlx). Duck-typed:
this module never imports transformers; :func:`load_hf_tokenizer` imports it when called.
"""

from __future__ import annotations

import functools
import importlib

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gemmaserve.errors import ConfigurationError, InvalidRequestError, ModelLoadError

__all__ = [
    "GEMMA_CHAT_TEMPLATE", "TURN_END_TOKENS", "HFTokenizerAdapter", "load_hf_tokenizer", "read_chat_template",
    "configure_chat_template",
]

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] in ('system', 'developer') and messages | length > 1 -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/... "
    "(after an optional first system message)') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
"""The Gemma turn format (Gemma 2 / 3's own template, for text): ``<start_of_turn>user\\n...<end_of_turn>\\n``
per message, a first system message prefixed to the first user turn, ``<start_of_turn>model\\n`` as the
generation prompt. Used for a Gemma-family tokenizer (one whose vocabulary holds ``<start_of_turn>`` and
``<end_of_turn>``) that ships no chat template, such as the default model converted from its GGUF."""

TURN_END_TOKENS = ("<end_of_turn>", "<turn|>", "<|im_end|>", "<|eot_id|>", "<|end|>")
"""Tokens that end an assistant turn in common chat templates; one that the template in use writes and that is
a single vocabulary token stops a chat generation (:attr:`HFTokenizerAdapter.chat_stop_token_ids`)."""


class HFTokenizerAdapter:
    """Text <-> token IDs through a loaded transformers tokenizer. Thread-safe as far as the wrapped fast
    tokenizer is (:meth:`set_chat_template` is meant for start-up, before requests arrive).

    The chat template is, first one found: ``chat_template`` (``--chat-template``), the tokenizer's own, or
    :data:`GEMMA_CHAT_TEMPLATE` for a Gemma-family tokenizer without one (``chat_template_source`` says which:
    ``"configured"``, ``"tokenizer"``, ``"gemma-default"``, or None without a template)."""

    def __init__(self, hf_tokenizer: Any, model_name: str = "", chat_template: str | None = None) -> None:
        self.hf = hf_tokenizer
        self.model_name = model_name
        self._rust_decode = _stock_rust_decode(hf_tokenizer)
        self._tokenizer_json: str | None = None  # serialized once (~2 s for Gemma's 262k vocabulary)
        self.chat_template: str | None = None
        self.chat_template_source: str | None = None
        self.chat_stop_token_ids: tuple[int, ...] = ()
        self._as_hf: Any = None  # as_hf()'s copy of the tokenizer, made on its first call
        own = getattr(hf_tokenizer, "chat_template", None)
        if chat_template:
            self.set_chat_template(chat_template)
        elif own:
            self._use_template(own, "tokenizer")
        elif self.is_gemma_family:
            self._use_template(GEMMA_CHAT_TEMPLATE, "gemma-default")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:  # the same text without transformers' wrapper (~2.4 µs a call less)
            return str(self._rust_decode(list(token_ids), skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary's own strings of ``token_ids`` (``▁``-prefixed pieces, byte tokens as written), as
        transformers' ``convert_ids_to_tokens``: what vLLM's ``/tokenize`` returns as ``token_strs``."""
        return [str(token) for token in self.hf.convert_ids_to_tokens(list(token_ids))]

    def tokenizer_json(self) -> str:
        """The fast tokenizer's ``tokenizer.json`` text (added tokens included; padding and truncation off): the
        vocabulary structured output compiles against. Serialized on the first call and kept (the tokenizer does
        not change; ~2 s and 12 MB for Gemma's), so each engine over this tokenizer does not pay it again.
        Raises InvalidRequestError for a slow tokenizer."""
        if self._tokenizer_json is not None:
            return self._tokenizer_json
        import copy

        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequestError("structured output needs a fast (Rust) Hugging Face tokenizer; this model's "
                                      "tokenizer is a slow one")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self._tokenizer_json = str(backend.to_str())
        return self._tokenizer_json

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def set_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (Jinja text) from now on (``--chat-template``). Raises ValueError if it
        is empty or not valid Jinja."""
        if not isinstance(template, str) or not template.strip():
            raise ValueError("the chat template is empty")
        problem = jinja_problem(template)
        if problem is not None:
            raise ValueError(f"the chat template is not valid Jinja: {problem}")
        self._use_template(template, "configured")

    def _use_template(self, template: Any, source: str) -> None:
        self.chat_template = template
        self.chat_template_source = source
        self._as_hf = None
        text = template if isinstance(template, str) else " ".join(str(t) for t in dict(template).values())
        ids = []
        for token in TURN_END_TOKENS:
            token_id = self._single_token_id(token) if token in text else None
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        self.chat_stop_token_ids = tuple(ids)

    def _single_token_id(self, token: str) -> int | None:
        """The id of ``token`` if the vocabulary holds it as one token, else None."""
        try:
            ids = list(self.hf.encode(token, add_special_tokens=False))
        except Exception:
            return None
        unk = getattr(self.hf, "unk_token_id", None)
        return int(ids[0]) if len(ids) == 1 and ids[0] != unk else None

    def as_hf(self) -> Any:
        """The Hugging Face tokenizer, rendering chats with this adapter's template (what ``LLM.get_tokenizer()``
        returns, as vLLM's): the wrapped one itself when the template is its own (or there is none), else a shallow
        copy of it (sharing its vocabulary and Rust tokenizer) whose ``chat_template`` is the configured or
        Gemma default one, so ``apply_chat_template(messages, tokenize=False, ...)`` renders what gemmaserve does.
        The same object on every call until the template changes."""
        if self.chat_template_source in (None, "tokenizer"):
            return self.hf
        if self._as_hf is None:
            import copy

            view = copy.copy(self.hf)
            view.chat_template = self.chat_template
            self._as_hf = view
        return self._as_hf

    @property
    def _template_argument(self) -> str | None:
        """What transformers' ``chat_template=`` gets: the template text (None: the tokenizer's own named set)."""
        return self.chat_template if isinstance(self.chat_template, str) else None

    @functools.cached_property
    def is_gemma_family(self) -> bool:
        """The vocabulary holds ``<start_of_turn>`` and ``<end_of_turn>`` as single tokens (Gemma 1-3)."""
        return all(self._single_token_id(token) is not None for token in ("<start_of_turn>", "<end_of_turn>"))

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """Characters of the longest vocabulary entry (an upper bound on the text one token decodes to: byte
        and word-start markers are longer than what they stand for), or None if the vocabulary is hidden."""
        try:
            vocab = self.hf.get_vocab()
        except Exception:
            return None
        return max((len(piece) for piece in vocab), default=None)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's own EOS id (empty if it has none)."""
        eos = getattr(self.hf, "eos_token_id", None)
        return (int(eos),) if isinstance(eos, int) else ()

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token IDs of ``messages`` rendered with the chat template, plus the generation prompt unless
        ``add_generation_prompt`` is false. ``continue_final_message``: the last message is left open for the
        model to continue (transformers' option: the render is cut after its content). ``template_kwargs``:
        extra template variables. Raises InvalidRequestError if the model has no template, a message is
        malformed or the template refuses the messages."""
        if not self.has_chat_template:
            name = f"model {self.model_name!r}" if self.model_name else "this model"
            raise InvalidRequestError(
                f"{name} has no chat template; send a plain prompt to /v1/completions instead of chat messages"
            )
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidRequestError(
                    f"message {index} must be an object with a string 'role' and a 'content'; got {message!r}"
                )
        try:
            rendered = self.hf.apply_chat_template(
                list(messages), chat_template=self._template_argument, tokenize=True,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **dict(template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors (e.g. "roles must alternate") are the request's fault
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from None
        if isinstance(rendered, Mapping) or hasattr(rendered, "keys"):  # a BatchEncoding
            rendered = rendered["input_ids"]
        return [int(token) for token in rendered]


def jinja_problem(template: str) -> str | None:
    """Why ``template`` does not parse as Jinja in the syntax transformers renders chat templates with (a sandboxed
    environment with ``{% break %}`` / ``{% continue %}`` and ``{% generation %}`` blocks), or None (also when jinja2
    is not installed: transformers needs it to render and reports that itself)."""
    try:
        import jinja2.ext
        import jinja2.nodes
        import jinja2.sandbox
    except ImportError:
        return None

    class GenerationBlock(jinja2.ext.Extension):  # transformers' {% generation %}...{% endgeneration %} marks
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    try:
        extensions = [GenerationBlock, jinja2.ext.loopcontrols]
        jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=extensions).parse(template)
    except Exception as exc:  # jinja2.TemplateSyntaxError
        return str(exc)
    return None


def read_chat_template(value: str) -> str:
    """The template text of ``CHAT_TEMPLATE`` / ``--chat-template``, as vLLM's flag takes it: the path of a template
    file, or the template itself (text holding ``{`` or a newline). Raises ConfigurationError for a path that
    cannot be read, for text that is neither, and for a template that is not valid Jinja (before any model loads)."""
    try:
        path = Path(value).expanduser()
        is_file = path.is_file()
    except (OSError, ValueError):  # a long inline template is no valid path
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"CHAT_TEMPLATE: cannot read the template file {value!r} ({exc})") from None
        if not text.strip():
            raise ConfigurationError(f"CHAT_TEMPLATE: the template file {value!r} is empty")
        return _valid_jinja(text, f"the template file {value!r}")
    if "{" in value or "\n" in value:
        return _valid_jinja(value, "the template")
    raise ConfigurationError(
        f"CHAT_TEMPLATE / --chat-template {value!r} is neither a readable file nor a Jinja template; give the path "
        "of a template file, or the template itself (it holds {{ ... }} / {% ... %})"
    )


def _valid_jinja(text: str, what: str) -> str:
    problem = jinja_problem(text)
    if problem is not None:
        raise ConfigurationError(f"CHAT_TEMPLATE: {what} is not valid Jinja: {problem}")
    return text


def configure_chat_template(tokenizer: Any, template: str) -> None:
    """Make ``tokenizer`` render chats with ``template`` (text from :func:`read_chat_template`). Raises
    ConfigurationError if the backend's tokenizer cannot take a template or the template is not valid Jinja."""
    setter = getattr(tokenizer, "set_chat_template", None)
    if not callable(setter):
        raise ConfigurationError(
            f"CHAT_TEMPLATE / --chat-template is not supported by this backend's tokenizer "
            f"({type(tokenizer).__name__}); unset it, or use a backend whose tokenizer is a Hugging Face one"
        )
    try:
        setter(template)
    except ValueError as exc:
        raise ConfigurationError(f"CHAT_TEMPLATE / --chat-template: {exc}") from None


def load_hf_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> HFTokenizerAdapter:
    """Load the tokenizer files (and chat template, if any) of a local checkpoint directory.

    Raises ModelLoadError naming the files needed if the directory has no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {str(path)!r} ({type(exc).__name__}: {exc}); the directory needs "
            "tokenizer.json (or tokenizer.model) and tokenizer_config.json"
        ) from None
    if hf_tokenizer is None or not callable(getattr(hf_tokenizer, "encode", None)):
        raise ModelLoadError(f"{str(path)!r} has no usable tokenizer files (tokenizer.json / tokenizer.model)")
    return HFTokenizerAdapter(hf_tokenizer, Path(path).name)


def _stock_rust_decode(hf_tokenizer: Any) -> Any:
    """The Rust tokenizer's ``decode`` when transformers' ``decode`` would return exactly its text: a fast tokenizer
    whose ``decode`` / ``_decode`` are transformers' own (no model-specific override) and that runs no clean-up pass
    (``clean_up_tokenization_spaces`` off or None). None otherwise (then the wrapper decodes). The streaming detokenizer
    calls decode twice per token, on the server's event loop."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(hf_tokenizer, "clean_up_tokenization_spaces", True):  # None cleans nothing up
        return None
    stock: list[type] = []  # transformers' own classes (5.x and 4.x names); whichever this version has
    for module, name in (("transformers.tokenization_utils_base", "PreTrainedTokenizerBase"),
                         ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
                         ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast")):
        try:
            stock.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    for method in ("decode", "_decode"):
        owner = next((k for k in type(hf_tokenizer).__mro__ if method in vars(k)), None)
        if owner not in stock:
            return None
    return backend.decode
