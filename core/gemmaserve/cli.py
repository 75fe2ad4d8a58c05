"""The ``gemmaserve`` command line (also ``python -m gemmaserve``).

Settings come from env / ``.env``; flags given here override them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence

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


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (override env settings)")
    group.add_argument("--model", help="checkpoint directory (env MODEL); default: the embedded Gemma 3 270M")
    group.add_argument("--backend", help="backend name or 'auto' (env BACKEND); see `gemmaserve backends`")
    group.add_argument("--device", help="auto, cpu, cuda or mps (env DEVICE)")
    group.add_argument("--dtype", help="auto, float32, bfloat16 or float16 (env DTYPE)")
    group.add_argument("--max-batch-size", type=int, help="max concurrent decoding rows (env MAX_BATCH_SIZE)")
    group.add_argument("--max-active-kv-tokens", type=int, help="KV token budget (env MAX_ACTIVE_KV_TOKENS)")
    group.add_argument("--max-model-len", type=int, help="max prompt+output tokens per request (env MAX_MODEL_LEN)")
    group.add_argument("--max-num-batched-tokens", type=int,
                       help="token budget of one scheduler tick, decode rows first (env MAX_NUM_BATCHED_TOKENS)")
    group.add_argument("--log-level", help="debug, info, warning or error (env LOG_LEVEL)")


def _add_sampling_flags(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def settings_from_args(args: argparse.Namespace) -> CoreSettings:
    return load_settings(
        model=args.model,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_active_kv_tokens=args.max_active_kv_tokens,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        log_level=args.log_level,
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def _setup_logging(settings: CoreSettings) -> None:
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


# -- commands -----------------------------------------------------------------------------------
def cmd_backends(args: argparse.Namespace) -> int:
    """Print the backend registry and the backend `auto` would pick, with reasons."""
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
        return 2 if settings.backend != "auto" else 0  # a BACKEND that cannot be used is an error
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
    if not parts or not all(part.isdigit() for part in parts):
        raise InvalidRequestError(
            f"--token-ids expects non-negative integers separated by commas or spaces (e.g. '2,651,6037'), got {text!r}"
        )
    return [int(part) for part in parts]


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: two prompts sharing a prefix through the scheduler, on the default model."""
    from gemmaserve.api import LLM

    settings = settings_from_args(args)
    _setup_logging(settings)
    if settings.model is None:
        from gemmaserve.models.default_model import ensure_default_model

        settings = settings.model_copy(update={"model": str(ensure_default_model(progress=True))})
    params = sampling_from_args(args)
    with LLM(settings=settings) as llm:
        info = llm.engine.backend.model_info
        print(f"model: {info.name} ({info.architecture}, {info.dtype}) from {settings.model}")
        print(f"backend: {llm.engine.backend_name} on {info.device}\n")
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
    """Run the OpenAI-compatible HTTP server until interrupted."""
    from gemmaserve.server.serve import serve

    settings = load_settings(
        model=args.model, backend=args.backend, device=args.device, dtype=args.dtype,
        max_batch_size=args.max_batch_size, max_active_kv_tokens=args.max_active_kv_tokens,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        log_level=args.log_level, host=args.host, port=args.port, api_key=args.api_key,
        allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
        enable_debug_endpoints=args.enable_debug_endpoints, timeout_keep_alive=args.timeout_keep_alive,
        client_header_timeout=args.client_header_timeout, client_body_timeout=args.client_body_timeout,
        limit_concurrency=args.limit_concurrency, shutdown_timeout=args.shutdown_timeout,
        default_max_tokens=args.default_max_tokens, served_model_name=_served_names(args.served_model_name),
    )
    _setup_logging(settings)
    serve(settings)
    return 0


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


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("--host", default=None, help="bind address (env HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (env PORT; default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' (env API_KEY or VLLM_API_KEY; /health, /metrics open)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names accepted besides the loopback ones (env ALLOWED_HOSTS)")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated CORS origins ('*' = any; env ALLOWED_ORIGINS); default: CORS off")
    p.add_argument("--enable-debug-endpoints", action="store_true", default=None,
                   help="serve /debug/kv, /docs and /redoc (env ENABLE_DEBUG_ENDPOINTS)")
    p.add_argument("--timeout-keep-alive", type=float, default=None,
                   help="seconds a connection may stay silent before or between requests (env TIMEOUT_KEEP_ALIVE; "
                   "default 5)")
    p.add_argument("--client-header-timeout", type=float, default=None,
                   help="seconds a request may take to send its headers; 408 and close after "
                   "(env CLIENT_HEADER_TIMEOUT; default 10)")
    p.add_argument("--client-body-timeout", type=float, default=None,
                   help="seconds a request may take to send its body after its headers; 408 and close after "
                   "(env CLIENT_BODY_TIMEOUT; default 60)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model names to serve under (env SERVED_MODEL_NAME, comma-separated): /v1/models lists them, "
                   "requests may name any, responses name the first; default: the checkpoint folder's name")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of a chat request that sends none, within the rest of the context; 0 = the rest "
                   "of the context (env DEFAULT_MAX_TOKENS; default 2048)")
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="on SIGTERM/SIGINT, seconds running requests get to finish while new ones are refused; "
                   "then the rest are cancelled (env SHUTDOWN_TIMEOUT; default 10)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="most connections served at once; requests on others get 503 (env LIMIT_CONCURRENCY; "
                   "default 2048)")
    _add_engine_flags(p)
    p.set_defaults(func=cmd_serve)


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    from gemmaserve.bench.serving import add_bench_command

    add_bench_command(sub)


EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_serve_command, _add_bench_command]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemmaserve", description="Serve Gemma models fast.")
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
