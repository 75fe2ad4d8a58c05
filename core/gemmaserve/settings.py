"""Core settings, read from the environment, a ``.env`` file and CLI flags (pydantic-settings).

Env names are the seed's: ``BACKEND``, ``DEVICE``, ``MODEL``, ``MAX_ACTIVE_KV_TOKENS``... Each plugin
defines its own settings class for its own variables (``CUSTOM_BACKEND_*``, ``COMPILE_MODEL``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AliasChoices, Field, ValidationError, field_serializer, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gemmaserve.errors import ConfigurationError
from gemmaserve.kv.events import KVEventsConfig, parse_kv_events_config

__all__ = ["CoreSettings", "split_list", "build_settings", "env_alias", "load_settings", "format_validation_error",
           "DEVICE_CHOICES", "DTYPE_CHOICES"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def env_alias(name: str) -> AliasChoices:
    """A settings field read from ``NAME`` or ``GEMMASERVE_NAME`` (core and plugin settings alike)."""
    return AliasChoices(name, f"GEMMASERVE_{name}")


class CoreSettings(BaseSettings):
    """Engine-wide settings. Every field can be set as an env var (its upper-case name, or with a
    ``GEMMASERVE_`` prefix) or as a CLI flag."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=True)

    backend: str = Field(
        "auto",
        validation_alias=env_alias("BACKEND"),
        description="Backend name (see `gemmaserve backends`) or 'auto'. Wins over device auto-detection.",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", validation_alias=env_alias("DEVICE"), description="Device: auto (cuda > mps > cpu), cpu, cuda or mps."
    )
    model: str | None = Field(
        None,
        validation_alias=env_alias("MODEL"),
        description="Path to a Hugging Face checkpoint directory. Unset: the embedded default model.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        validation_alias=env_alias("DTYPE"),
        description="Model dtype; auto = bfloat16 on GPUs and on CPUs with bfloat16 matmul instructions "
        "(AVX512_BF16 or AMX), float32 on other CPUs.",
    )
    quantization: Literal["fp8", "int8"] | None = Field(
        None, validation_alias=env_alias("QUANTIZATION"),
        description="Weight quantization (vLLM's --quantization): fp8 = float8_e4m3fn weights with per-output-channel "
        "scales and dynamic per-token FP8 activations, quantized at load from a bf16/fp32 checkpoint (custom-cpu, "
        "custom-cuda on compute capability >= 8.9; docs/architecture.md#fp8-weights); int8 = int8 weights per "
        "output channel times int8 activations per token on fbgemm, quantized at load (hf on the CPU). Unset: "
        "weights load in DTYPE, except a compressed-tensors FP8 checkpoint, whose FP8 weights load as they are.",
    )
    max_active_kv_tokens: int = Field(
        65536,
        ge=1,
        validation_alias=env_alias("MAX_ACTIVE_KV_TOKENS"),
        description="Upper bound on the KV tokens (prompt + max_tokens) of all admitted requests together.",
    )
    kv_block_size: int = Field(16, ge=1, le=1024, validation_alias=env_alias("KV_BLOCK_SIZE"), description="Tokens per KV block.")
    prefix_cache_blocks: int = Field(
        2048, ge=0, validation_alias=env_alias("PREFIX_CACHE_BLOCKS"),
        description="Blocks in the core prefix-cache pool (backends using the core CacheManager); 0 disables it.",
    )
    max_batch_size: int = Field(64, ge=1, validation_alias=env_alias("MAX_BATCH_SIZE"), description="Max concurrent decoding rows.")
    max_model_len: int | None = Field(
        None, ge=1, validation_alias=env_alias("MAX_MODEL_LEN"),
        description="Max prompt + output tokens per request; unset = the model's own limit.",
    )
    prefill_chunk_tokens: int = Field(
        512, ge=1, validation_alias=env_alias("PREFILL_CHUNK_TOKENS"),
        description="Max prompt tokens prefilled per request per scheduler tick (chunked prefill).",
    )
    mixed_prefill_chunk_tokens: int = Field(
        128, ge=0, validation_alias=env_alias("MIXED_PREFILL_CHUNK_TOKENS"),
        description="Prompt tokens a tick that also decodes spends at most: max(this, what the admitted prompts "
        "need to finish within 8 ticks of arriving) (0 = off: the whole MAX_NUM_BATCHED_TOKENS budget). "
        "Fewer prompt tokens beside decoding rows shorten those rows' inter-token gaps while steady arrivals are "
        "spread over a few ticks; a burst, or a prompt that waited for admission, still gets the full budget. "
        "Of 0, 128, 256 and 512, 128 gave the lowest inter-token latency p99 / p50 under Poisson arrivals on an H100 "
        "(docs/benchmarks.md run 30, whose later passes hit the prefix cache: to be measured again); it costs time "
        "to first token.",
    )
    max_num_batched_tokens: int = Field(
        8192, ge=1, validation_alias=env_alias("MAX_NUM_BATCHED_TOKENS"),
        description="Token budget of one scheduler tick: one token per decoding row first, then prefill chunks "
        "of waiting requests in arrival order until the budget is spent (must be >= MAX_BATCH_SIZE).",
    )
    async_scheduling: bool = Field(
        True, validation_alias=env_alias("ASYNC_SCHEDULING"),
        description="Launch the next decode step before the host has read the current one's tokens (backends that "
        "declare async_decode): the host's bookkeeping of step k overlaps the device running step k+1. "
        "0 = every tick waits for its tokens before the next one is planned.",
    )
    max_waiting_requests: int = Field(
        1024, ge=1, validation_alias=env_alias("MAX_WAITING_REQUESTS"),
        description="Queue bound; beyond it new requests are refused as overloaded (HTTP 429).",
    )
    api_key: str | None = Field(
        None, min_length=1, validation_alias=AliasChoices("API_KEY", "GEMMASERVE_API_KEY", "VLLM_API_KEY"),
        description="HTTP server: require 'Authorization: Bearer <key>' on every endpoint but /health and /metrics.",
    )
    allowed_hosts: str = Field(
        "", validation_alias=env_alias("ALLOWED_HOSTS"),
        description="HTTP server: Host names (comma-separated or a JSON list) accepted besides the loopback names "
        "(which are the only "
        "ones accepted when bound to a loopback address: no DNS rebinding); empty and not on loopback = any host.",
    )
    allowed_origins: str = Field(
        "", validation_alias=env_alias("ALLOWED_ORIGINS"),
        description="HTTP server: browser origins (comma-separated or a JSON list) allowed by CORS ('*' = any); "
        "empty = CORS off.",
    )
    enable_debug_endpoints: bool = Field(
        False, validation_alias=env_alias("ENABLE_DEBUG_ENDPOINTS"),
        description="HTTP server: serve /debug/kv and the /docs and /redoc pages.",
    )
    host: str = Field("127.0.0.1", validation_alias=env_alias("HOST"), description="HTTP server bind address.")
    port: int = Field(8000, ge=0, le=65535, validation_alias=env_alias("PORT"), description="HTTP server port.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", validation_alias=env_alias("LOG_LEVEL"), description="Logging level."
    )
    timeout_keep_alive: float = Field(
        5.0, gt=0, validation_alias=AliasChoices("TIMEOUT_KEEP_ALIVE", "GEMMASERVE_TIMEOUT_KEEP_ALIVE",
                                                 "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"),
        description="HTTP server: seconds a connection may stay silent before its first request or between "
        "requests before it is closed (uvicorn's timeout_keep_alive).",
    )
    client_header_timeout: float = Field(
        10.0, gt=0, validation_alias=env_alias("CLIENT_HEADER_TIMEOUT"),
        description="HTTP server: seconds from a request's first byte to the end of its headers (408 and close after).",
    )
    client_body_timeout: float = Field(
        60.0, gt=0, validation_alias=env_alias("CLIENT_BODY_TIMEOUT"),
        description="HTTP server: seconds from the end of a request's headers to the end of its body (408 and close).",
    )
    limit_concurrency: int = Field(
        2048, ge=1, validation_alias=env_alias("LIMIT_CONCURRENCY"),
        description="HTTP server: most connections served at once; a request on one beyond is answered 503 "
        "(uvicorn's limit_concurrency). Lowered to fit the file-descriptor limit.",
    )
    engine_iteration_timeout_s: float = Field(
        60.0, gt=0, validation_alias=AliasChoices("ENGINE_ITERATION_TIMEOUT_S", "GEMMASERVE_ENGINE_ITERATION_TIMEOUT_S",
                                                  "VLLM_ENGINE_ITERATION_TIMEOUT_S"),
        description="HTTP server: seconds one part of an engine tick (a backend call) may run before /health answers "
        "503 engine_unavailable (a hung backend call); the step itself is not interrupted.",
    )
    max_buffered_body_bytes: int = Field(
        256 * 2**20, ge=1, validation_alias=env_alias("MAX_BUFFERED_BODY_BYTES"),
        description="HTTP server: request-body bytes all connections together may hold while receiving (a body "
        "counts the bytes it has received, not its declared Content-Length); a chunk beyond it gets 503 "
        "body_budget_exhausted with Retry-After.",
    )
    stream_stall_timeout_s: float = Field(
        60.0, gt=0, validation_alias=env_alias("STREAM_STALL_TIMEOUT_S"),
        description="HTTP server: seconds a streaming response may wait on a client that takes no byte of what is "
        "buffered for it; then its request is cancelled (its KV freed) and the connection closed.",
    )
    allowed_headers: str = Field(
        "*", validation_alias=env_alias("ALLOWED_HEADERS"),
        description="HTTP server: request headers (comma-separated or a JSON list) CORS allows ('*' = any); only "
        "with ALLOWED_ORIGINS.",
    )
    allowed_methods: str = Field(
        "GET,POST", validation_alias=env_alias("ALLOWED_METHODS"),
        description="HTTP server: methods (comma-separated or a JSON list) CORS allows ('*' = any); only with "
        "ALLOWED_ORIGINS.",
    )
    allow_credentials: bool = Field(
        False, validation_alias=env_alias("ALLOW_CREDENTIALS"),
        description="HTTP server: CORS lets pages send cookies / HTTP auth (Access-Control-Allow-Credentials); "
        "refused with ALLOWED_ORIGINS='*'.",
    )
    shutdown_timeout: float = Field(
        10.0, ge=0, validation_alias=env_alias("SHUTDOWN_TIMEOUT"),
        description="HTTP server: on SIGTERM/SIGINT, seconds running requests get to finish (new ones are refused) "
        "before the rest are cancelled.",
    )
    default_max_tokens: int = Field(
        2048, ge=0, validation_alias=env_alias("DEFAULT_MAX_TOKENS"),
        description="HTTP server: max_tokens of a chat request that sends none, capped by the rest of the context "
        "(0 = the rest of the context). Completions default to 16, as OpenAI's.",
    )
    chat_template: str | None = Field(
        None, validation_alias=env_alias("CHAT_TEMPLATE"),
        description="Chat template (vLLM's --chat-template): a Jinja template file, or the template itself; "
        "replaces the checkpoint's own. Unset: the checkpoint's template (Gemma's turn format for a Gemma tokenizer "
        "without one).",
    )
    tool_call_parser: Literal["auto", "gemma4", "json"] = Field(
        "auto", validation_alias=env_alias("TOOL_CALL_PARSER"),
        description="HTTP server: how tool calls are read from a chat reply (vLLM's --tool-call-parser): gemma4 "
        "(<|tool_call>call:NAME{...}<tool_call|>), json ({\"name\": ..., \"arguments\": {...}}), or auto: gemma4 when "
        "the tokenizer has Gemma 4's <|tool_call> token, else json.",
    )
    exclude_tools_when_tool_choice_none: bool = Field(
        False, validation_alias=env_alias("EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE"),
        description="HTTP server: with tool_choice \"none\" the chat template does not get the request's tools "
        "(vLLM's --exclude-tools-when-tool-choice-none); off: it gets them, and the reply is read as plain content.",
    )
    reasoning_parser: Literal["", "gemma4"] = Field(
        "", validation_alias=env_alias("REASONING_PARSER"),
        description="HTTP server: gemma4 moves Gemma 4's reasoning channel (<|channel>thought...<channel|>) of a chat "
        "reply into message.reasoning (and reasoning_content; vLLM's --reasoning-parser); empty = off (the channel "
        "is content).",
    )
    render_processes: int = Field(
        -1, ge=-1, validation_alias=env_alias("RENDER_PROCESSES"),
        description="HTTP server: worker processes that render chat templates and tokenize long prompts (4096 "
        "characters or more) off the event loop's GIL; -1 = min(4, CPU count), 0 = none (the preparation threads do it).",
    )
    kv_events_config: Annotated[KVEventsConfig | None, NoDecode] = Field(
        None, validation_alias=env_alias("KV_EVENTS_CONFIG"),
        description="KV-cache events for KV-aware routers (vLLM's --kv-events-config): a JSON object of vLLM's "
        "KVEventsConfig keys, e.g. {\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}; the prefix "
        "cache's BlockStored / BlockRemoved / AllBlocksCleared go out in vLLM's ZMQ + msgpack format "
        "(docs/kv-events.md). Unset: no events.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, validation_alias=env_alias("TENSOR_PARALLEL_SIZE"),
        description="Split the model over this many devices (vLLM's --tensor-parallel-size): one engine process "
        "drives N ranks, N-1 of them worker processes, over torch.distributed (gloo on CPU, NCCL on GPUs "
        "cuda:0..N-1). Only backends that declare it (custom-cpu, custom-cuda) accept N > 1 (docs/scaling.md).",
    )
    enable_expert_parallel: bool = Field(
        False, validation_alias=env_alias("ENABLE_EXPERT_PARALLEL"),
        description="Under tensor parallel, split MoE experts whole over the ranks (vLLM's --enable-expert-parallel): "
        "each rank holds E/N experts and computes only the tokens routed to them, instead of a slice of every "
        "expert's width; one all-reduce per MoE block either way. MoE models only; custom-cpu / custom-cuda "
        "(docs/scaling.md).",
    )
    data_parallel_rank: int = Field(
        0, ge=0, validation_alias=env_alias("DATA_PARALLEL_RANK"),
        description="This replica's index among data-parallel replicas (vLLM's --data-parallel-rank; `serve "
        "--data-parallel-size N` sets it per replica): stamped on its KV events, whose endpoints it offsets as vLLM "
        "does (port + rank).",
    )
    served_model_name: str = Field(
        "", validation_alias=env_alias("SERVED_MODEL_NAME"),
        description="HTTP server: comma-separated model names to serve under (vLLM's --served-model-name): "
        "/v1/models lists them, requests may name any, responses name the first; empty = the checkpoint folder's name.",
    )

    @field_validator("backend")
    @classmethod
    def _normalize_backend(cls, value: str) -> str:
        value = value.strip().lower().replace("_", "-")
        if not value:
            raise ValueError("BACKEND must not be empty; use 'auto' or a name from `gemmaserve backends`")
        return value

    @field_validator("kv_events_config", mode="plain")
    @classmethod
    def _parse_kv_events_config(cls, value: Any) -> KVEventsConfig | None:
        try:
            return parse_kv_events_config(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None

    @field_serializer("kv_events_config")
    def _dump_kv_events_config(self, value: KVEventsConfig | None) -> dict[str, Any] | None:
        return None if value is None else dataclasses.asdict(value)

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        """A blank bind address would listen on every interface: say so instead of doing it."""
        if not value.strip():
            raise ValueError("the bind address is empty; give one, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 "
                             "(every IPv4 interface)")
        return value

    @field_validator("device", "dtype", "log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("quantization", mode="before")
    @classmethod
    def _no_quantization(cls, value: Any) -> Any:
        """"" and "none" (any case) mean unset, as vLLM's --quantization default."""
        if isinstance(value, str):
            value = value.strip().lower()
            return None if value in ("", "none") else value
        return value

    @model_validator(mode="after")
    def _budget_holds_the_batch(self) -> CoreSettings:
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError(
                f"MAX_NUM_BATCHED_TOKENS={self.max_num_batched_tokens} is below MAX_BATCH_SIZE={self.max_batch_size}: "
                "a tick of full decoding rows would leave no token for prefill; raise MAX_NUM_BATCHED_TOKENS or "
                "lower MAX_BATCH_SIZE"
            )
        return self

    @model_validator(mode="after")
    def _no_credentials_for_any_origin(self) -> CoreSettings:
        """Credentials with every origin allowed would let any site act as the browser's user."""
        try:
            origins = split_list(self.allowed_origins, "ALLOWED_ORIGINS")
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None
        if self.allow_credentials and "*" in origins:
            raise ValueError("ALLOW_CREDENTIALS=1 with ALLOWED_ORIGINS='*' would let every web site send requests "
                             "with the user's cookies and read the answers; list the trusted origins instead of '*'")
        return self


def split_list(value: str, name: str = "the value") -> list[str]:
    """The entries of a list setting, given comma-separated (``a,b``) or as vLLM's JSON list (``["a", "b"]``):
    stripped, empty ones dropped. A value starting with '[' that is not a JSON list of strings without commas is a
    ConfigurationError naming ``name`` (it would otherwise be one bogus entry)."""
    text = value.strip()
    if not text.startswith("["):
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        items = json.loads(text)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) and "," not in item for item in items):
        raise ConfigurationError(
            f"{name}={value!r} starts with '[' but is not a JSON list of strings without commas; give vLLM's JSON "
            "list, e.g. '[\"https://a.com\", \"https://b.com\"]', or comma-separated values, e.g. "
            "'https://a.com,https://b.com'")
    return [item.strip() for item in items if item.strip()]


SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def build_settings(
    settings_class: type[SettingsT], overrides: dict[str, Any], *, title: str = "settings", env_prefix: str = ""
) -> SettingsT:
    """``settings_class`` from env/.env with ``overrides`` (CLI flags; None values ignored) on top.

    The one construction path for core and plugin settings. Raises :class:`ConfigurationError`
    listing every invalid field with the value given and what is accepted.
    """
    given = _environment(settings_class, title)  # raises first for a .env that is not UTF-8
    if env_prefix:
        check_prefixed_names(settings_class, env_prefix, title, given)
    check_spellings_agree(settings_class, title, given)
    clean = {key: value for key, value in overrides.items() if value is not None}
    fields = settings_class.model_fields
    known = {*fields, *(f.alias for f in fields.values() if f.alias)}
    unknown = sorted(key for key in clean if key not in known)
    if unknown:  # the class ignores extra keys (the environment holds other programs' variables): refuse them here
        raise ConfigurationError(f"{title}: no setting named {', '.join(unknown)}; accepted: {', '.join(sorted(fields))}")
    try:
        return settings_class(**clean)
    except ValidationError as exc:
        names = _names_given(settings_class, given)
        message = format_validation_error(exc, title=title, env_prefix=env_prefix, names=names)
        raise ConfigurationError(message) from None


def _names_given(settings_class: type[BaseSettings], given: dict[str, str]) -> dict[tuple[str, str], str]:
    """(first spelling, value) -> the spelling of that setting set in ``given`` with that value, for the settings
    read under several names (``MAX_BATCH_SIZE`` / ``GEMMASERVE_MAX_BATCH_SIZE``): an error names the one set."""
    out: dict[tuple[str, str], str] = {}
    for field in settings_class.model_fields.values():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names = [str(choice).upper() for choice in alias.choices if isinstance(choice, str)]
            for name in names:
                if name in given:
                    out.setdefault((names[0], given[name]), name)
    return out


def _environment(settings_class: type[BaseSettings], title: str) -> dict[str, str]:
    """The variables pydantic-settings reads for ``settings_class``: the ``.env`` file's, then the environment's
    on top, names upper-cased (they compare case-insensitively)."""
    import os

    merged: dict[str, str] = {}
    env_file = settings_class.model_config.get("env_file")
    if isinstance(env_file, str) and os.path.isfile(env_file):
        from dotenv import dotenv_values

        try:
            merged.update({key.upper(): value or "" for key, value in dotenv_values(env_file).items()})
        except UnicodeDecodeError as exc:
            raise ConfigurationError(f"cannot read {title} from .env: it is not UTF-8 text ({exc})") from None
    merged.update({key.upper(): value for key, value in os.environ.items()})
    return merged


def check_prefixed_names(settings_class: type[BaseSettings], env_prefix: str, title: str,
                         given: dict[str, str]) -> None:
    """Raise ConfigurationError for every variable of the environment or the ``.env`` file that starts with
    ``env_prefix`` but names no setting of ``settings_class`` (a misspelt variable would otherwise be ignored:
    ``CUSTOM_BACKEND_CUDA_GRAPHS=0`` leaves the graphs on), with the closest accepted name. ``given``: the
    variables, :func:`_environment`."""
    _refuse_unknown(env_prefix, {f"{env_prefix}{name}".upper() for name in settings_class.model_fields}, title, given)


OTHER_GEMMASERVE_VARIABLES = ("GEMMASERVE_CACHE_DIR", "GEMMASERVE_HYPOTHESIS_RANDOM")
"""``GEMMASERVE_*`` variables read outside the settings classes: the model cache root
(``gemmaserve.models.default_model``) and the test suite's switch to fresh hypothesis examples (tests/conftest.py)."""


def env_names(settings_class: type[BaseSettings]) -> set[str]:
    """Every environment name (upper case) ``settings_class`` reads: each field's alias choices, else its name
    under the class's ``env_prefix``."""
    prefix = str(settings_class.model_config.get("env_prefix") or "")
    names: set[str] = set()
    for name, field in settings_class.model_fields.items():
        alias = field.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias or f"{prefix}{name}"]
        names.update(str(choice).upper() for choice in choices if isinstance(choice, str))
    return names


def check_gemmaserve_variables(settings_classes: Iterable[type[BaseSettings]]) -> None:
    """Raise ConfigurationError for every ``GEMMASERVE_*`` variable of the environment or the ``.env`` file that
    no class of ``settings_classes`` (the core's and the installed backends' declared ones) reads and that is not
    one of :data:`OTHER_GEMMASERVE_VARIABLES`: ``GEMMASERVE_MAX_BATCH_SIZ=8`` would otherwise be ignored."""
    accepted = set(OTHER_GEMMASERVE_VARIABLES)
    for settings_class in settings_classes:
        accepted.update(name for name in env_names(settings_class) if name.startswith("GEMMASERVE_"))
    _refuse_unknown("GEMMASERVE_", accepted, "settings", _environment(CoreSettings, "settings"))


def _refuse_unknown(env_prefix: str, accepted: set[str], title: str, given: dict[str, str]) -> None:
    """ConfigurationError naming each variable of ``given`` under ``env_prefix`` outside ``accepted``, with the
    closest accepted name."""
    import difflib

    unknown = sorted(key for key in given if key.startswith(env_prefix.upper()) and key not in accepted)
    if unknown:
        lines = [f"invalid {title}: unknown variable(s); accepted: {', '.join(sorted(accepted))}"]
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(accepted), n=1)
            lines.append(f"  {key} is not a setting" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigurationError("\n".join(lines))


def check_spellings_agree(settings_class: type[BaseSettings], title: str, given: dict[str, str]) -> None:
    """Raise ConfigurationError when two spellings of one setting (``BACKEND`` and ``GEMMASERVE_BACKEND``,
    ``API_KEY`` and ``VLLM_API_KEY``) are both set to different values in ``given`` (:func:`_environment`): which
    one wins is not something a user should have to know."""
    clashes = []
    for field in settings_class.model_fields.values():
        alias = field.validation_alias
        if not isinstance(alias, AliasChoices):
            continue
        names = [str(choice).upper() for choice in alias.choices if isinstance(choice, str)]
        values = {name: given[name] for name in names if name in given}
        if len(set(values.values())) > 1:
            clashes.append(" and ".join(values))  # names only: a value may be a secret (API_KEY)
    if clashes:
        raise ConfigurationError(f"invalid {title}: one setting is given twice with different values: "
                                 f"{'; '.join(clashes)}; set only one of each")


def load_settings(**overrides: Any) -> CoreSettings:
    """Core settings from env/.env with ``overrides`` on top; see :func:`build_settings`."""
    return build_settings(CoreSettings, overrides)


def format_validation_error(exc: ValidationError, *, title: str = "settings", env_prefix: str = "",
                            names: dict[tuple[str, str], str] | None = None) -> str:
    """One line per bad field: its env name (``names``: the spelling set, by first spelling and value), the value
    given, what is accepted."""
    lines = [f"invalid {title}:"]
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"]).upper()
        location = (names or {}).get((location, str(error.get("input"))), location)
        where = f"{env_prefix}{location}={error.get('input')!r}: " if location else ""
        lines.append(f"  {where}{error['msg']}")
    return "\n".join(lines)
