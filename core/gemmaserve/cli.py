"""The ``gemmaserve`` command line (also ``python -m gemmaserve``).

Settings come from env / ``.env``; flags given here override them.
"""

from __future__ import annotations

import argparse
import decimal
import difflib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gemmaserve import __version__
from gemmaserve.errors import ConfigurationError, GemmaserveError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings, load_settings

__all__ = ["main", "build_parser"]

DEMO_PREAMBLE = (
    "A short travel guide to Europe, written for first-time visitors who want the essentials before they go.\n\n"
)
DEMO_PROMPTS = (
    DEMO_PREAMBLE + "The capital of France is",
    DEMO_PREAMBLE + "The capital of Italy is",  # shares the preamble: its KV comes from the prefix cache
)


def _default(field: str) -> str:
    """CoreSettings' default of ``field`` as the help shows it."""
    value = CoreSettings.model_fields[field].default
    return "unset" if value is None else "empty" if value == "" else str(value)


def _env_flag(group: argparse._ArgumentGroup, flag: str, help_text: str, *aliases: str, **kwargs: Any) -> None:
    """A flag backed by a setting: the help names its env var and its default (the flag's own default is None:
    unset flags leave env / .env in charge). ``aliases``: other spellings of the same flag (vLLM's); two spellings
    given different values are refused (:class:`_OneValue`)."""
    field = flag.lstrip("-").replace("-", "_")
    if aliases and "action" not in kwargs:
        kwargs["action"] = _OneValue
    group.add_argument(flag, *aliases, dest=field, help=f"{help_text} (env {field.upper()}; default: "
                       f"{_default(field)})", **kwargs)


class _OneValue(argparse.Action):
    """Store a flag's value; a different value under another spelling of the same flag (``--max-batch-size 8
    --max-num-seqs 4``) is a usage error naming both, as ``LLM(max_batch_size=8, max_num_seqs=4)`` is (the same
    spelling given twice keeps the last value, argparse's rule)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given: dict[str, tuple[str, Any]] = namespace.__dict__.setdefault("_spellings", {})
        earlier = given.get(self.dest)
        if earlier is not None and earlier[0] != option_string and earlier[1] != values:
            parser.error(f"{earlier[0]} {earlier[1]} and {option_string} {values} set the same setting "
                         f"({self.dest.upper()}) to different values: give one of them")
        given[self.dest] = (str(option_string), values)
        setattr(namespace, self.dest, values)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (override env settings)")
    _env_flag(group, "--model", "checkpoint directory; unset = the embedded Gemma 3 270M")
    _env_flag(group, "--backend", "backend name or 'auto'; see `gemmaserve backends`")
    _env_flag(group, "--device", "auto, cpu, cuda or mps")
    _env_flag(group, "--dtype", "auto, float32, bfloat16 or float16")
    _env_flag(group, "--max-batch-size", "max concurrent decoding rows (--max-num-seqs: vLLM's name)", "--max-num-seqs",
              type=int)
    _env_flag(group, "--max-active-kv-tokens", "KV token budget of all admitted requests", type=int)
    _env_flag(group, "--max-model-len", "max prompt+output tokens per request, e.g. 8192, 8k (8000) or 8K (8192) as "
              "vLLM's; unset = the model's own", type=_token_count)
    _env_flag(group, "--max-num-batched-tokens", "token budget of one scheduler tick, decode rows first", type=int)
    _env_flag(group, "--tensor-parallel-size", "split the model over N devices with the custom backends: this "
              "process and N minus 1 workers over torch.distributed (docs/scaling.md)", "-tp", type=int, metavar="N")
    _env_flag(group, "--enable-expert-parallel", "with --tensor-parallel-size N: each rank holds E/N whole MoE "
              "experts instead of a slice of every expert (custom backends, MoE models)", action="store_true",
              default=None)
    _env_flag(group, "--quantization", "fp8: FP8 weights quantized at load (custom backends; compressed-tensors FP8 "
              "checkpoints load as FP8 without it); int8: int8 weights x int8 activations on the CPU (hf)")
    _env_flag(group, "--log-level", "debug, info, warning or error")
    group.add_argument("--trust-remote-code", action="store_true", default=None, help="let the hf backend run "
                       "model code shipped in the checkpoint folder (vLLM's flag; env TRUST_REMOTE_CODE; default: "
                       "off); the custom backends run no checkpoint code")


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def _token_count(value: str) -> int:
    """A token count as vLLM's ``--max-model-len`` takes it: ``8192``, ``8k`` (8000), ``25.6k`` (25600), ``8K``
    (8192); decimals only with the decimal suffixes k, m, g."""
    text = value.strip()
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    count = int(number) * scale if number.isascii() and number.isdigit() else None
    whole, dot, fraction = number.partition(".")
    if count is None and dot and scale in (10**3, 10**6, 10**9) and all(
            part.isascii() and part.isdigit() for part in (whole, fraction)):
        exact = decimal.Decimal(number) * scale  # exact: 1.1k is 1100, not float's 1100.0000000000002
        count = int(exact) if exact == exact.to_integral_value() else None
    if count is None:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens such as 8192, 8k (8000), 25.6k or 8K "
                                         f"(8192), got {value!r}")
    return count


def _apply_trust_remote_code(args: argparse.Namespace) -> None:
    """``--trust-remote-code`` as the hf plugin reads it: ``TRUST_REMOTE_CODE=1`` in this process's environment
    (inherited by tensor-parallel workers and data-parallel replicas)."""
    if getattr(args, "trust_remote_code", None):
        os.environ["TRUST_REMOTE_CODE"] = "1"


def _add_sampling_flags(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens, help="tokens to generate "
                       "(default: %(default)s)")
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy, up to 100 (default: 0; "
                       "--top-p, --top-k and --seed need it given)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off "
                       "(default: %(default)s)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def settings_from_args(args: argparse.Namespace) -> CoreSettings:
    _apply_trust_remote_code(args)
    return load_settings(
        model=args.model,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_active_kv_tokens=args.max_active_kv_tokens,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        quantization=args.quantization,
        log_level=args.log_level,
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    given = {} if args.temperature is None else {"temperature": args.temperature}  # unset: SamplingParams' greedy
    return SamplingParams(max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          ignore_eos=args.ignore_eos, **given)


def _setup_logging(settings: CoreSettings) -> None:
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


# -- commands -----------------------------------------------------------------------------------
def cmd_backends(args: argparse.Namespace) -> int:
    """Print the backend registry and the backend these settings select, with reasons. Exits 2 when no backend
    can be selected (the reason is printed)."""
    from gemmaserve.hardware import detect_devices
    from gemmaserve.plugins import load_registry
    from gemmaserve.selection import backend_statuses, select_backend

    settings = settings_from_args(args)
    registry = load_registry()
    report = detect_devices()
    print(f"devices: {', '.join(report.available)} (best: {report.best})")
    for device, why in sorted(report.unavailable.items()):
        print(f"  {device}: unavailable ({why})")
    rows = backend_statuses(settings, registry)
    headers = ("backend", "plugin", "devices", "available", "reason")
    table = [(r.name, r.plugin, ",".join(r.devices), "yes" if r.available else "no", r.reason or "") for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers[:-1])]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  " + headers[-1])
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    for plugin, error in sorted(registry.plugin_errors.items()):
        print(f"\nplugin {plugin!r} failed to load: {error}")
    print()
    if not registry.specs:
        print("no backend is installed yet: install one, e.g. pip install -e plugins/hf_torch")
        return 0
    try:
        selection = select_backend(settings, registry)
    except GemmaserveError as exc:
        print(f"selection: none ({exc})")
        return 2  # these settings cannot start a server (an unusable BACKEND, or nothing runs on DEVICE)
    print(f"selected: {selection.spec.name} on {selection.device} ({selection.reason})")
    for name, why in sorted(selection.rejected.items()):
        print(f"  rejected {name}: {why}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout, then a line with tokens/s and cached tokens."""
    from gemmaserve.api import LLM

    settings = settings_from_args(args)
    _setup_logging(settings)
    params = sampling_from_args(args)
    prompt: str | list[int] = _parse_token_ids(args.prompt) if args.token_ids else args.prompt
    if not prompt:  # before loading the model (seconds), not after
        from gemmaserve.errors import InvalidRequestError

        raise InvalidRequestError("the prompt is empty; give the text to continue, e.g. gemmaserve generate "
                                  "'The capital of France is'")
    with LLM(settings=settings) as llm:
        start = time.perf_counter()
        final = None
        for chunk in llm.stream(prompt, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk.output if chunk.finished else final
        elapsed = time.perf_counter() - start
        print()
        if final is None:
            return 1
        if final.error:
            print(f"error: {final.error}", file=sys.stderr)
            return 1
        rate = len(final.token_ids) / elapsed if elapsed > 0 else 0.0
        print(
            f"[{len(final.token_ids)} tokens in {elapsed:.2f} s = {rate:.1f} tok/s; "
            f"cached tokens: {final.cached_tokens}; finish: {final.finish_reason}]"
        )
    return 0


def _parse_token_ids(text: str) -> list[int]:
    """``"2,651,6037"``, ``"2 651 6037"`` or ``"[2, 651, 6037]"`` -> IDs; InvalidRequestError otherwise."""
    from gemmaserve.errors import InvalidRequestError

    parts = text.strip().strip("[]").replace(",", " ").split()
    if not parts or not all(part.isascii() and part.isdigit() for part in parts):  # '²'.isdigit(), int('²') fails
        raise InvalidRequestError(
            f"--token-ids expects non-negative integers written with the digits 0-9, separated by commas or spaces "
            f"(e.g. '2,651,6037'), got {text!r}"
        )
    return [int(part) for part in parts]


def demo_quantization(settings: CoreSettings) -> str | None:
    """QUANTIZATION for the demo on the default model: int8 when nothing was asked for, the device is a CPU
    without bfloat16 matmul instructions (there int8 weights and activations decode ~2x faster than float32,
    docs/benchmarks.md) and the backend asked for (or, under BACKEND=auto, some installed CPU backend) declares
    int8; None otherwise (the setting stands)."""
    if "quantization" in settings.model_fields_set:
        return None
    from gemmaserve.hardware import cpu_has_native_bfloat16, detect_devices
    from gemmaserve.plugins import load_registry

    device = settings.device if settings.device != "auto" else detect_devices().best
    if device != "cpu" or cpu_has_native_bfloat16():
        return None
    registry = load_registry()
    specs = registry.specs.values() if settings.backend == "auto" else [registry.get(settings.backend)]
    runs_int8 = any(spec is not None and "int8" in spec.quantization and "cpu" in spec.devices for spec in specs)
    return "int8" if runs_int8 else None


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: two prompts sharing a prefix through the scheduler, on the default model."""
    from gemmaserve.api import LLM

    settings = settings_from_args(args)
    _setup_logging(settings)
    chosen = None
    if settings.model is None:
        from gemmaserve.models.default_model import ensure_default_model

        chosen = demo_quantization(settings)
        settings = settings.model_copy(update={"model": str(ensure_default_model(progress=True)),
                                               "quantization": chosen or settings.quantization})
    params = sampling_from_args(args)
    with LLM(settings=settings) as llm:
        info = llm.engine.backend.model_info
        print(f"model: {info.name} ({info.architecture}, {info.dtype}) from {settings.model}")
        print(f"backend: {llm.engine.backend_name} on {info.device}")
        if chosen is not None:
            print("quantization: int8 (the demo's default on a CPU without bfloat16 matmuls: about twice float32's "
                  "tok/s; QUANTIZATION=none keeps float32)")
        print()
        for prompt in DEMO_PROMPTS:
            start = time.perf_counter()
            (out,) = llm.generate([prompt], params)
            elapsed = time.perf_counter() - start
            rate = len(out.token_ids) / elapsed if elapsed > 0 else 0.0
            print(f"prompt: {prompt!r}")
            print(f"output: {out.text!r}")
            print(
                f"  {len(out.token_ids)} tokens in {elapsed:.2f} s ({rate:.1f} tok/s), "
                f"prompt {len(out.prompt_token_ids)} tokens, cached tokens: {out.cached_tokens}\n"
            )
    return 0


def cmd_pull_default(args: argparse.Namespace) -> int:
    """Prepare the embedded default model (Gemma 3 270M) in the cache directory."""
    from gemmaserve.models.default_model import ensure_default_model

    path = ensure_default_model(progress=True)
    print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible HTTP server until interrupted: one process, or with ``--data-parallel-size N``
    N of them behind vllm-router (gemmaserve.server.data_parallel)."""
    from gemmaserve.server.serve import serve

    _check_vllm_serve_flags(args)
    args.api_key = _one_api_key(args.api_key)
    args.model = _model_argument(args.model_tag, args.model)
    args.allowed_origins, args.allowed_headers, args.allowed_methods = (
        _comma_list(flag, value) for flag, value in (("--allowed-origins", args.allowed_origins),
                                                     ("--allowed-headers", args.allowed_headers),
                                                     ("--allowed-methods", args.allowed_methods)))
    _apply_trust_remote_code(args)
    data_parallel = args.data_parallel_size > 1
    if args.router_policy is not None and not data_parallel:
        raise ConfigurationError(f"--router-policy {args.router_policy} chooses how the router spreads requests over "
                                 "replicas: it needs --data-parallel-size 2 or more")
    if data_parallel:
        from gemmaserve.server.data_parallel import require_router

        require_router()  # before the settings are read: the missing package is the first thing to fix
    settings = load_settings(
        model=args.model, backend=args.backend, device=args.device, dtype=args.dtype,
        max_batch_size=args.max_batch_size, max_active_kv_tokens=args.max_active_kv_tokens,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        quantization=args.quantization, log_level=args.log_level, host=args.host, port=args.port, api_key=args.api_key,
        allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins, allowed_headers=args.allowed_headers,
        allowed_methods=args.allowed_methods, allow_credentials=args.allow_credentials,
        max_buffered_body_bytes=args.max_buffered_body_bytes, stream_stall_timeout_s=args.stream_stall_timeout_s,
        enable_debug_endpoints=args.enable_debug_endpoints, timeout_keep_alive=args.timeout_keep_alive,
        client_header_timeout=args.client_header_timeout, client_body_timeout=args.client_body_timeout,
        limit_concurrency=args.limit_concurrency, shutdown_timeout=args.shutdown_timeout,
        default_max_tokens=args.default_max_tokens, served_model_name=_served_names(args.served_model_name),
        chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, kv_events_config=args.kv_events_config,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )
    settings = _comma_lists(settings)
    if args.enable_prefix_caching:
        from gemmaserve.api import check_prefix_caching

        check_prefix_caching(settings, "--enable-prefix-caching", "PREFIX_CACHE_BLOCKS")
    _setup_logging(settings)
    if data_parallel and settings.tensor_parallel_size > 1:
        raise ConfigurationError(f"--data-parallel-size {args.data_parallel_size} with --tensor-parallel-size "
                                 f"{settings.tensor_parallel_size}: each replica gets one GPU, so replicas cannot be "
                                 "tensor parallel yet; use one of the two")
    if data_parallel and settings.enable_expert_parallel:
        raise ConfigurationError(f"--data-parallel-size {args.data_parallel_size} with --enable-expert-parallel: "
                                 "experts are split over the tensor-parallel ranks of one engine, and data-parallel "
                                 "replicas do not share experts (vLLM's DP x EP is not implemented); drop one")
    if data_parallel:
        from gemmaserve.server.data_parallel import serve_data_parallel

        return serve_data_parallel(settings, args.data_parallel_size, args.router_policy or "cache_aware",
                                   _replica_flags(args), api_key=args.api_key)
    serve(settings)
    return 0


_LAUNCHER_ONLY = frozenset({"host", "port", "api_key", "allowed_origins", "allowed_headers", "allowed_methods",
                            "allow_credentials", "data_parallel_size", "router_policy"})
"""``serve`` flags the launcher answers for itself instead of passing them to every replica: the public address
and CORS are the router's (with its own header, method and credential rules: the replicas answer no CORS), the
API key reaches the replicas through their env (not their command line)."""


def _replica_flags(args: argparse.Namespace) -> list[str]:
    """The ``serve`` flags given on this command line, as each data-parallel replica gets them (flags left unset
    are left to the env / .env, which the replicas inherit)."""
    flags: list[str] = []
    for action in args.serve_parser._actions:
        if (not action.option_strings or action.dest in _LAUNCHER_ONLY or action.dest in _VLLM_SERVE_FLAGS
                or action.dest == "help"):
            continue
        value = getattr(args, action.dest, None)
        if value is None:
            continue
        flag = next(option for option in action.option_strings if option.startswith("--"))
        if isinstance(action, argparse._StoreTrueAction):
            flags += [flag] if value else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags.append(f"{flag}={value}")  # one token: a value starting with '-' stays a value
    return flags


def _served_names(names: Sequence[str] | None) -> str | None:
    """``--served-model-name a b`` as the setting's comma-separated form; names must be non-empty, without commas."""
    if names is None:
        return None
    for name in names:
        if not name.strip() or "," in name:
            raise ConfigurationError(
                f"--served-model-name: each name must be non-empty and contain no comma, got {name!r}; "
                "give several names separated by spaces")
    return ",".join(name.strip() for name in names)


_PREFIX_CACHE_REASON = ("prefix caching is always on with the custom backends; PREFIX_CACHE_BLOCKS=0 turns the core "
                        "prefix cache off for the hf and mlx backends")
_VLLM_SERVE_FLAGS: dict[str, tuple[str, dict[str, Any], tuple[Any, ...], str]] = {
    "enable_prefix_caching": ("--enable-prefix-caching", {"action": argparse.BooleanOptionalAction}, (True,),
                              _PREFIX_CACHE_REASON),
    "enable_auto_tool_choice": ("--enable-auto-tool-choice", {"action": "store_true"}, (True,),
                                "tool calls are always parsed when a request sends tools (docs/api.md#tool-calling)"),
    "generation_config": ("--generation-config", {"metavar": "auto|vllm|FOLDER"}, ("vllm",),
                          "generation_config.json's sampling defaults are not applied (only its EOS ids are read): "
                          "requests get the API's defaults, as with vLLM's value vllm"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", {"type": float, "metavar": "FRACTION"}, (),
                               "KV memory is sized by --max-active-kv-tokens (MAX_ACTIVE_KV_TOKENS), or "
                               "CUSTOM_BACKEND_KV_MEMORY_GB on the custom backends"),
    "seed": ("--seed", {"type": int}, (), "there is no engine-wide seed: send `seed` in each request to make its "
             "sampling reproducible"),
    "enforce_eager": ("--enforce-eager", {"action": "store_true"}, (),
                      "CUDA graphs are a custom-cuda setting: CUSTOM_BACKEND_CUDA_GRAPH=0 runs eager"),
    "tokenizer": ("--tokenizer", {}, (), "the tokenizer is the checkpoint's own: point --model at a folder "
                  "holding both"),
    "kv_cache_dtype": ("--kv-cache-dtype", {}, ("auto",), "the KV cache is kept in the model's dtype"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", {"type": int, "metavar": "N"}, (1,),
                               "pipeline parallelism is not implemented: use --tensor-parallel-size N"),
}
"""``vllm serve`` flags gemmaserve has no setting for: dest -> (flag, argparse keywords, the values accepted because
they mean what gemmaserve does anyway, why anything else is refused and what to use instead). As ``LLM(...)``'s
VLLM_OPTIONS_NOT_IMPLEMENTED: accepted values change nothing, others are a ConfigurationError, never ignored."""


def _check_vllm_serve_flags(args: argparse.Namespace) -> None:
    """Raise ConfigurationError for a ``vllm serve`` flag of _VLLM_SERVE_FLAGS given at a value gemmaserve does not
    implement, naming the reason and the gemmaserve equivalent."""
    for dest, (flag, _, accepted, reason) in _VLLM_SERVE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None or value in accepted:
            continue
        if value is False:  # --no-enable-prefix-caching
            given = "--no-" + flag[2:]
        else:
            given = flag if value is True else f"{flag} {value}"
        allowed = f" (accepted: {', '.join(map(str, accepted))}, which changes nothing)" if accepted else ""
        raise ConfigurationError(f"{given}: vLLM's flag is not implemented: {reason}{allowed}")


def _comma_lists(settings: CoreSettings) -> CoreSettings:
    """``settings`` with ALLOWED_HOSTS / ALLOWED_ORIGINS / ALLOWED_HEADERS / ALLOWED_METHODS from the env given as
    vLLM's JSON lists rewritten comma-separated, the form the data-parallel router's launcher reads."""
    from gemmaserve.settings import split_list

    names = ("allowed_hosts", "allowed_origins", "allowed_headers", "allowed_methods")
    return settings.model_copy(update={name: ",".join(split_list(getattr(settings, name), name.upper()))
                                       for name in names})


def _one_api_key(keys: Sequence[str] | None) -> str | None:
    """``--api-key KEY`` (vLLM's flag takes ``KEY [KEY ...]``): the one key, None when the flag is not given. More
    than one is a ConfigurationError (the server checks a single key), saying what a model path after the flag
    becomes."""
    if keys is None:
        return None
    if len(keys) > 1:
        raise ConfigurationError(
            f"--api-key got {len(keys)} keys; gemmaserve's server checks one key (vLLM's --api-key takes several): "
            f"give one. --api-key takes every word after it up to the next flag, so a model path given after it "
            f"({keys[1]!r} here?) is read as a key: put the model first (serve MODEL --api-key KEY) or use --model")
    return keys[0]


def _model_argument(positional: str | None, flag: str | None) -> str | None:
    """The model of ``serve MODEL`` (vLLM's form) or ``--model``; both naming different models is refused."""
    if positional is not None and flag is not None and positional != flag:
        raise ConfigurationError(f"serve {positional} and --model {flag} name two models: give one of them")
    return positional if positional is not None else flag


def _comma_list(flag: str, value: str | None) -> str | None:
    """A CORS list flag given as vLLM's JSON list (``'["https://a.com"]'``) or comma-separated, in the setting's
    comma-separated form (ConfigurationError naming ``flag`` for a malformed JSON list)."""
    if value is None:
        return None
    from gemmaserve.settings import split_list

    return ",".join(split_list(value, flag))


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, as `vllm serve MODEL` takes it (same as --model)")
    g = p.add_argument_group("server (override env settings)")
    _env_flag(g, "--host", "bind address")
    _env_flag(g, "--port", "port", type=int)
    g.add_argument("--api-key", nargs="+", default=None, metavar="KEY", help="require 'Authorization: Bearer <key>' "
                   "on every endpoint but /health and /metrics (env API_KEY or VLLM_API_KEY; default: unset, no key). "
                   "vLLM's flag takes several keys; gemmaserve's server checks one, so one is accepted")
    _env_flag(g, "--allowed-hosts", "comma-separated Host names accepted besides the loopback ones; empty: on "
              "loopback only those, elsewhere any")
    _env_flag(g, "--allowed-origins", "CORS origins, comma-separated or a JSON list as vLLM's ('*' = any); empty = "
              "CORS off")
    _env_flag(g, "--allowed-headers", "request headers CORS allows, comma-separated or a JSON list ('*' = any, "
              "vLLM's default)")
    _env_flag(g, "--allowed-methods", "methods CORS allows, comma-separated or a JSON list ('*' = any)")
    _env_flag(g, "--allow-credentials", "CORS lets pages send cookies and HTTP auth; refused with "
              "--allowed-origins '*'", action="store_true", default=None)
    _env_flag(g, "--enable-debug-endpoints", "serve /debug/kv, /docs and /redoc", action="store_true", default=None)
    _env_flag(g, "--served-model-name", "model names to serve under (comma-separated in the env): /v1/models lists "
              "them, requests may name any, responses name the first; empty = the checkpoint folder's name",
              nargs="+", default=None, metavar="NAME")
    _env_flag(g, "--chat-template", "chat template replacing the checkpoint's: a Jinja file, or the template "
              "itself (vLLM's flag); unset = the checkpoint's own, or Gemma's turn format for a Gemma tokenizer",
              metavar="FILE")
    _env_flag(g, "--tool-call-parser", "how tool calls are read from chat replies (vLLM's flag): gemma4, json, or "
              "auto (gemma4 when the tokenizer has Gemma 4's <|tool_call> token)", choices=["auto", "gemma4", "json"])
    _env_flag(g, "--exclude-tools-when-tool-choice-none", "with tool_choice \"none\" the chat template gets no tools "
              "(vLLM's flag); unset: it gets them and the reply is plain content", action="store_true", default=None)
    _env_flag(g, "--reasoning-parser", "gemma4: Gemma 4's reasoning channel goes to message.reasoning "
              "(vLLM's flag); unset = off", choices=["", "gemma4"])
    _env_flag(g, "--kv-events-config", "KV-cache events for KV-aware routers (vLLM's flag): a JSON object of vLLM's "
              "KVEventsConfig keys, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}'; see "
              "docs/kv-events.md", metavar="JSON")
    _env_flag(g, "--default-max-tokens", "max_tokens of a chat request that sends none, within the rest of the "
              "context; 0 = the rest of the context", type=int)
    _env_flag(g, "--timeout-keep-alive", "seconds a connection may stay silent before or between requests",
              type=float)
    _env_flag(g, "--client-header-timeout", "seconds a request may take to send its headers; 408 and close after",
              type=float)
    _env_flag(g, "--client-body-timeout", "seconds a request may take to send its body after its headers; 408 and "
              "close after", type=float)
    _env_flag(g, "--limit-concurrency", "most connections served at once; requests on others get 503", type=int)
    _env_flag(g, "--max-buffered-body-bytes", "request-body bytes all connections may be receiving at once; "
              "bodies beyond get 503", type=int, metavar="BYTES")
    _env_flag(g, "--stream-stall-timeout-s", "seconds a stream may wait on a client that reads nothing; then the "
              "request is cancelled and the connection closed", type=float, metavar="S")
    _env_flag(g, "--shutdown-timeout", "on SIGTERM/SIGINT, seconds running requests get to finish while new ones "
              "are refused; then the rest are cancelled", type=float)
    _add_engine_flags(p)
    from gemmaserve.server.data_parallel import ROUTER_POLICIES

    vllm = p.add_argument_group("vLLM flags without a gemmaserve setting: accepted at the value that changes "
                                "nothing, refused otherwise with the reason")
    for dest, (flag, kwargs, accepted, reason) in _VLLM_SERVE_FLAGS.items():
        shown = f"only {', '.join(map(str, accepted))}" if accepted else "refused"
        vllm.add_argument(flag, dest=dest, default=None, help=f"{shown}: {reason} (default: unset)", **kwargs)
    dp = p.add_argument_group("data parallel: replicas behind vllm-router (pip install 'gemmaserve[router]'; "
                              "docs/scaling.md)")
    dp.add_argument("--data-parallel-size", "-dp", type=_data_parallel_size, default=1, metavar="N",
                    help="engine replicas (vLLM's flag): N > 1 starts N `gemmaserve serve` processes on loopback "
                    "ports, one GPU each (CUDA_VISIBLE_DEVICES) or sharing the CPU, behind vllm-router on --host / "
                    "--port; a replica that dies is restarted (default: 1, one process, no router)")
    dp.add_argument("--router-policy", choices=ROUTER_POLICIES, default=None,
                    help="how the router picks a replica: cache_aware (the one whose prompt-prefix tree matches "
                    "best, load permitting) or round_robin (default: cache_aware; only with --data-parallel-size)")
    p.set_defaults(func=cmd_serve, serve_parser=p)


def _data_parallel_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (1 = one process), got {value!r}")
    return size


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    from gemmaserve.bench.serving import add_bench_command

    add_bench_command(sub)


EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_serve_command, _add_bench_command]


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose "unrecognized arguments" error names the closest flag of the command given."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._command_parser(getattr(parsed, "command", None)).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _command_parser(self, command: str | None) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
        return self

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:") and "did you mean" not in message:
            message = _unrecognized(message.split(":", 1)[1].split(), self)
        super().error(message)


def _unrecognized(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" message, with the closest flag of ``parser`` for each unknown one."""
    options = [option for action in parser._actions for option in action.option_strings]
    hints = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.7) if name.startswith("--") else []
        hints.append(f"{extra} (did you mean {close[0]}?)" if close else extra)
    return f"unrecognized arguments: {' '.join(hints)}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gemmaserve", description="Serve Gemma models fast.")
    parser.add_argument("--version", action="version", version=f"gemmaserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("backends", help="list backends, their availability and the automatic choice")
    _add_engine_flags(p)
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("generate", help="stream a completion for one prompt")
    p.add_argument("prompt", help="prompt text (or token IDs with --token-ids)")
    p.add_argument("--token-ids", action="store_true", help="the prompt is a list of token IDs, e.g. '2,651,6037'")
    _add_engine_flags(p)
    _add_sampling_flags(p, default_max_tokens=64)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the main job: two prompts that share a prefix, on the default model")
    _add_engine_flags(p)
    _add_sampling_flags(p, default_max_tokens=24)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("pull-default", help="prepare the embedded default model (Gemma 3 270M) once")
    p.set_defaults(func=cmd_pull_default)

    for add in EXTRA_COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except GemmaserveError as exc:
        print(f"gemmaserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
