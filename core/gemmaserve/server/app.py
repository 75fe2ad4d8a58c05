"""FastAPI application: OpenAI-compatible completions and chat over one running :class:`Engine`.

Each HTTP request submits token ids to the engine (its scheduler thread batches all requests
together) and reads events back through :class:`~gemmaserve.server.generation.Generation`.
Validation and engine admission errors are answered synchronously with 4xx. Streaming responses
start once the first token exists, so failures before it still get a proper status code. A client
that disconnects (while waiting, or mid-stream) cancels its request, which frees its KV.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gemmaserve import __version__
from gemmaserve.errors import GemmaserveError, InvalidRequestError
from gemmaserve.hf_tokenizer import HFTokenizerAdapter
from gemmaserve.render_pool import RenderPool
from gemmaserve.server.connections import ABORT_KEY, OVER_LIMIT_KEY, TIMED_OUT_KEY, UNSENT_KEY
from gemmaserve.server.debug import KVReportCache
from gemmaserve.server.errors import CLIENT_CLOSED, APIError, ClientDisconnected, constraint_error, from_engine_error
from gemmaserve.server.generation import Generation, Prepared, Step, Timing
from gemmaserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gemmaserve.server.metrics import ServerMetrics
from gemmaserve.server.openapi import install_openapi
from gemmaserve.server.prepare import prepare_chat, prepare_completion, render_chat, tokenize_text
from gemmaserve.tools.parsers import PARSERS, Gemma4ReasoningParser, ParsedText, ToolParser
from gemmaserve.server.protocol import (
    MAX_REQUEST_ID_CHARS,
    BodyBudget,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
    read_body,
)
from gemmaserve.server.responses import SSE_DONE, ResponseMeta, chat_logprobs, completion_logprobs, json_bytes, sse

if TYPE_CHECKING:
    from gemmaserve.engine.engine import Engine

__all__ = ["create_app", "Drain"]

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OFFLOAD_BODY_BYTES = 1024
"""Bodies larger than this are parsed, rendered with the chat template and tokenized on a worker thread (the
tokenizers release the GIL), so prompts cannot freeze the event loop that streams everyone else's tokens
(200 concurrent 30 KB chat bodies stalled an open stream for 2.5 s when only bodies over 32 KiB went there)."""
OFFLOAD_RESPONSE_UNITS = 2048
"""A non-streamed generation body of more units than this is built and encoded on a preparation thread (a unit: a
generated token, and with logprobs each of its reported log-probabilities too; n=16 choices of 4,000 tokens with
20 alternatives each held the event loop, and every other stream, for 1.8 s). Building costs ~0.7-1 µs per
log-probability entry (2-core CI box, Hugging Face tokenizer), so the bound keeps ~1-2 ms on the loop; handing the
work to a thread costs ~30 µs there (more under load, and it may queue behind prompt preparation), which would
be most of a small body's cost: small bodies are built inline."""
PREPARE_THREADS = 2
"""Threads that prepare large bodies; more would take the GIL from the event loop more often (the rendering is
Python) without preparing faster. With a render pool there are as many as it has processes, if more: they hand
the rendering to the workers and wait."""

METRICS_STATS_TIMEOUT_S = 1.0
"""How long a ``/metrics`` scrape waits for the engine's tick to let it take a snapshot; past it the scrape shows
the last snapshot (a stuck backend call must not hang scrapers, nor pile them up on the worker threads)."""
DEBUG_KV_TIMEOUT_S = 10.0
"""How long ``/debug/kv`` waits for its report (it takes the engine's step lock) before answering 503."""


def server_setting(engine: Engine, name: str) -> Any:
    """``engine.settings.<name>``, or CoreSettings' default where the engine's settings lack it."""
    from gemmaserve.settings import CoreSettings

    return getattr(engine.settings, name, CoreSettings.model_fields[name].default)


def create_app(
    engine: Engine, model_name: str, *, model_aliases: Sequence[str] = (), api_key: str | None = None,
    allowed_hosts: Sequence[str] | None = None, allowed_origins: Sequence[str] = (), debug_endpoints: bool = True,
    extra_model_names: Sequence[str] = (), allowed_headers: Sequence[str] = ("*",),
    allowed_methods: Sequence[str] = ("GET", "POST"), allow_credentials: bool = False,
) -> FastAPI:
    """The app around ``engine`` (started, or started on first request). The caller owns the
    engine's lifetime. ``model`` in requests must be ``model_name``, one of ``extra_model_names`` (listed by
    ``/v1/models`` after it, as vLLM's ``--served-model-name``), one of ``model_aliases`` (accepted, not
    listed), or absent; anything else is a 404. Responses name ``model_name``. ``api_key``: every endpoint but ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <api_key>`` (401 otherwise, OpenAI's error body). ``allowed_hosts``: the Host
    header names accepted (None = any; 400 ``invalid_host`` otherwise). ``allowed_origins``: CORS origins
    (none = no CORS headers); ``allowed_headers``, ``allowed_methods``, ``allow_credentials``: what CORS allows them
    (vLLM's ``--allowed-headers``, ``--allowed-methods``, ``--allow-credentials``; ``*`` = any); a refused
    preflight gets a JSON 400 ``cors_refused``. ``debug_endpoints``: serve ``/debug/kv``, ``/docs`` and ``/redoc``.
    ``engine.settings`` gives ``ENGINE_ITERATION_TIMEOUT_S`` (``/health``), ``MAX_BUFFERED_BODY_BYTES`` (request
    bodies) and ``STREAM_STALL_TIMEOUT_S`` (streams), CoreSettings' defaults where it lacks them.

    The app owns its chat-template render pool (``RENDER_PROCESSES`` worker processes, for a Hugging Face
    tokenizer): its lifespan spawns the workers at start-up and stops them at shutdown (served without the
    lifespan, the pool starts on first use and its workers end with the process). Only chats and prompts of
    ``RENDER_POOL_MIN_CHARS`` (4096) characters or more go there: their bodies exceed ``OFFLOAD_BODY_BYTES``, so
    they are prepared on a preparation thread, which waits for the worker; the event loop never does."""
    docs = {} if debug_endpoints else {"docs_url": None, "redoc_url": None}
    _JSONCORSMiddleware = _cors_middleware_class()
    metrics = ServerMetrics(model_name, engine.settings.data_parallel_rank or 0)
    metrics.bind_engine(functools.partial(engine.stats, timeout=METRICS_STATS_TIMEOUT_S))
    listed = (model_name, *(name for name in extra_model_names if name != model_name))
    server = _Server(engine, model_name, frozenset({*listed, *model_aliases}), metrics, listed)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if server.render_pool is not None:
            server.render_pool.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.close)

    app = FastAPI(title="gemmaserve", version=__version__, description="OpenAI-compatible Gemma inference server",
                  lifespan=lifespan, redirect_slashes=False, **docs)  # /v1/completions/ is a JSON 404, not a 307
    app.state.render_pool = server.render_pool
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = drain = Drain()
    _add_error_handlers(app)
    _add_guards(app, api_key, allowed_hosts, drain)
    if allowed_origins:
        app.add_middleware(_JSONCORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=list(allowed_methods), allow_headers=list(allowed_headers),
                           allow_credentials=allow_credentials)
    install_openapi(app, server.context_limit)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await server.handle(request, "completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, "chat")

    @app.post("/tokenize", response_model=None)
    async def tokenize(request: Request) -> Response:
        return server.json_response(request, await server.run_json(request, server.tokenize), "tokenize")

    @app.post("/detokenize", response_model=None)
    async def detokenize(request: Request) -> Response:
        return server.json_response(request, await server.run_json(request, server.detokenize), "detokenize")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card(name) for name in server.listed]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return server.model_card(model_id if model_id in server.listed else server.model_name)

    iteration_timeout = float(server_setting(engine, "engine_iteration_timeout_s"))

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if drain.active:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if not engine.is_alive():
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")
        failure = engine.backend.failure()
        if failure is not None:
            raise APIError(503, f"the backend cannot serve: {failure}", code="engine_unavailable")
        busy = engine.busy_for()
        if busy > iteration_timeout:
            raise APIError(503, f"the engine has been in one step for {busy:.0f} s, longer than "
                           f"ENGINE_ITERATION_TIMEOUT_S={iteration_timeout:g} s: a backend call looks hung",
                           code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_model=None)
    def prometheus_metrics() -> Response:  # sync: engine.stats() waits up to METRICS_STATS_TIMEOUT_S for a tick
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    if debug_endpoints:
        reports = KVReportCache(engine)
        report_thread = _DaemonWorker("gemmaserve-debug-kv")  # a stuck engine holds it, not anyio's shared pool

        @app.get("/debug/kv", response_model=None)
        async def debug_kv() -> Response:  # the report takes the engine and backend locks (once per interval)
            try:
                report = await asyncio.wait_for(asyncio.wrap_future(report_thread.submit(reports.get)),
                                                DEBUG_KV_TIMEOUT_S)
            except TimeoutError:
                raise APIError(503, f"no KV report within {DEBUG_KV_TIMEOUT_S:g} s: the engine has been in one step "
                               f"for {engine.busy_for():.0f} s; retry later", code="engine_unavailable") from None
            return JSONResponse(report, status_code=200 if report["integrity"] == "ok" else 500)

    return app


_OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Endpoints an API key does not guard (load balancers and scrapers call them, as with vLLM)."""
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_JSON_BODY_PATHS = _GENERATION_PATHS | {"/tokenize", "/detokenize"}


def _host_name(header: str) -> str:
    """The name part of a Host header (``[::1]:8000`` -> ``::1``, ``Example.COM:80`` -> ``example.com``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _bearer_token(header: str) -> bytes:
    """The credentials of an ``Authorization: Bearer <token>`` header (the scheme is case-insensitive, RFC 7235;
    b"" for any other scheme or none)."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


class _DaemonWorker:
    """Runs submitted calls one at a time on one daemon thread (started on first use): a call that never returns
    holds that thread only, and does not keep the process from exiting. A call cancelled before it starts is
    skipped."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, call))
        return future

    def _run(self) -> None:
        while True:
            future, call = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)


def _cors_middleware_class() -> type:
    from starlette.datastructures import Headers
    from starlette.middleware.cors import CORSMiddleware

    class JSONCORSMiddleware(CORSMiddleware):  # type: ignore[misc]
        """Starlette's CORS, with a refused preflight answered in OpenAI's error JSON instead of plain text."""

        def preflight_response(self, request_headers: Headers) -> Response:
            response = super().preflight_response(request_headers)
            if response.status_code != 400:
                return response
            refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")
            error = APIError(400, f"CORS preflight refused (not allowed: {refused}); the server allows the origins, "
                             "methods and headers of --allowed-origins, --allowed-methods and --allowed-headers",
                             code="cors_refused")
            headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
            return JSONResponse(error.body(), status_code=400, headers=headers)

    return JSONCORSMiddleware


def _sent_by_a_web_page(request: Request) -> bool:
    """A browser sent it for a page: it has an ``Origin`` header, or ``Sec-Fetch-Site`` says another site. A page
    on another site can POST a Blob body without a Content-Type and without a CORS preflight, so such a body must
    declare itself JSON; clients that are not browsers (curl, SDKs, http.client) send neither header."""
    site = request.headers.get("sec-fetch-site", "").strip().lower()
    return "origin" in request.headers or site in ("cross-site", "same-site")


def _closing(send: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``send`` with ``Connection: close`` added to the response's headers."""
    async def closing_send(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return closing_send


class Drain:
    """Set (``active``) once shutdown began: new generation requests get 503 ``server_shutting_down`` while
    the running ones finish (``gemmaserve serve``'s ``--shutdown-timeout``)."""

    def __init__(self) -> None:
        self.active = False


def _add_guards(app: FastAPI, api_key: str | None, allowed_hosts: Sequence[str] | None = None,
                drain: Drain | None = None) -> None:
    """Host allow-list (DNS rebinding), API-key check (when set) and JSON-only generation bodies: a browser page
    can POST ``text/plain`` or a form to localhost without a CORS preflight, so anything but JSON is refused
    with 415 before it runs."""
    expected = api_key.encode() if api_key else None
    hosts = None if allowed_hosts is None else frozenset(_host_name(h) for h in allowed_hosts)
    app.add_middleware(_Guard, expected=expected, hosts=hosts, drain=drain)


class _Guard:
    """The checks of :func:`_add_guards` as a plain ASGI middleware: a refused request gets its JSON error, any
    other passes through untouched (Starlette's ``BaseHTTPMiddleware`` would relay every streamed chunk through a
    memory stream and a task switch: about a third of the event loop's time per token with 256 streams,
    ``benchmarks/server_overhead.py``)."""

    def __init__(self, app: Any, *, expected: bytes | None, hosts: frozenset[str] | None,
                 drain: Drain | None) -> None:
        self.app, self.expected, self.hosts, self.drain = app, expected, hosts, drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(Request(scope))
        if scope.get("state", {}).get(OVER_LIMIT_KEY):  # past the bound: whatever the answer, the connection closes
            send = _closing(send)
        await (refusal or self.app)(scope, receive, send)

    def _refusal(self, request: Request) -> Response | None:
        path = request.url.path
        # /health and /metrics are answered past the connection bound (a liveness probe must not fail because the
        # server is busy), on a connection then closed
        if request.scope.get("state", {}).get(OVER_LIMIT_KEY) and path not in _OPEN_PATHS:
            error = APIError(503, "too many connections are open (LIMIT_CONCURRENCY); retry later",
                             code="too_many_connections", headers={"Connection": "close"})
            return JSONResponse(error.body(), status_code=503, headers=error.headers)
        if self.hosts is not None and _host_name(request.headers.get("host", "")) not in self.hosts:
            error = APIError(400, f"Host {request.headers.get('host', '')!r} is not served here; add it with "
                             "--allowed-hosts (ALLOWED_HOSTS)", code="invalid_host")
            return JSONResponse(error.body(), status_code=400)
        if self.expected is not None and path not in _OPEN_PATHS:
            if not hmac.compare_digest(_bearer_token(request.headers.get("authorization", "")), self.expected):
                error = APIError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with the "
                                 "server's --api-key", code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        if self.drain is not None and self.drain.active and path in _GENERATION_PATHS:
            error = APIError(503, "the server is shutting down and takes no new requests; retry on another "
                             "server or later", code="server_shutting_down", headers={"Connection": "close"})
            return JSONResponse(error.body(), status_code=503, headers=error.headers)
        if request.method == "POST" and path in _JSON_BODY_PATHS:
            kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind and kind != "application/json":
                error = APIError(415, f"the body must be JSON (Content-Type: application/json), got {kind!r}",
                                 code="unsupported_media_type")
                return JSONResponse(error.body(), status_code=415)
            if not kind and _sent_by_a_web_page(request):
                error = APIError(415, "a request from a web page (it has an Origin or a cross-site Sec-Fetch-Site "
                                 "header) must declare its JSON body: send Content-Type: application/json",
                                 code="unsupported_media_type")
                return JSONResponse(error.body(), status_code=415)
        return None


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        error = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
        return JSONResponse(error.body(), status_code=500)


class _Server:
    """Request handling shared by both generation endpoints."""

    def __init__(self, engine: Engine, model_name: str, accepted: frozenset[str], metrics: ServerMetrics,
                 listed: Sequence[str] = ()) -> None:
        self.engine = engine
        self.model_name = model_name
        self.accepted = accepted
        self.listed = tuple(listed) or (model_name,)
        self.metrics = metrics
        self.created = int(time.time())
        self.body_budget = BodyBudget(int(server_setting(engine, "max_buffered_body_bytes")))
        self.stream_stall_s = float(server_setting(engine, "stream_stall_timeout_s"))
        self.tokenizer = engine.backend.tokenizer
        self.info = engine.backend.model_info
        processes = getattr(engine.settings, "render_processes", -1)
        self.render_pool = RenderPool.for_tokenizer(self.tokenizer, processes) \
            if isinstance(self.tokenizer, HFTokenizerAdapter) else None
        threads = max(PREPARE_THREADS, self.render_pool.processes if self.render_pool is not None else 0)
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="gemmaserve-prepare")

    def close(self) -> None:
        """Stop the render pool's workers (the app's lifespan, at shutdown; its start-up starts them again)."""
        if self.render_pool is not None:
            self.render_pool.close()

    @property
    def context_limit(self) -> int:
        """Most prompt + output tokens one request may hold (the scheduler's ``request_token_limit``)."""
        return self.engine.scheduler.request_token_limit

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """One ``/v1/models`` entry in vLLM's shape (``root``: the model as the server was given it, ``created``: when
        this server started), plus ``vocab_size`` and ``backend``."""
        model_id = name or self.model_name
        return {
            "id": model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "gemmaserve",
            "root": getattr(self.engine.settings, "model", None) or self.model_name,
            "parent": None,
            "max_model_len": self.context_limit,
            "permission": [{
                "id": f"modelperm-{model_id}", "object": "model_permission", "created": self.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False,
            }],
            "vocab_size": self.info.vocab_size,
            "backend": self.engine.backend_name,
        }

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is a served name or alias, absent or empty (vLLM's rule: the served model)."""
        if name and name not in self.accepted:
            served = " or ".join(repr(n) for n in self.listed)
            shown = repr(name) if len(name) <= 200 else repr(name[:200]) + f"... ({len(name)} characters)"
            raise APIError(
                404, f"model {shown} does not exist; this server serves {served} (see GET /v1/models)",
                param="model", code="model_not_found",
            )

    def check_n(self, n: int | None, prompts: int = 1) -> None:
        """400 for ``n`` × ``prompts`` above MAX_WAITING_REQUESTS: the choices are queued together, so such a
        request could never be admitted (a 429 would tell the client to retry something that cannot succeed)."""
        bound = self.engine.settings.max_waiting_requests
        if (n or 1) * prompts > bound:
            what = f"n={n or 1} choices for each of {prompts} prompts" if prompts > 1 else f"n={n}"
            raise APIError(400, f"{what} exceed the engine's queue bound MAX_WAITING_REQUESTS={bound}: each choice is "
                           "a queued request, so this request could never be admitted; send "
                           + (f"n <= {bound}" if prompts == 1 else f"at most {bound} choices in all (n x prompts)"),
                           param="n" if prompts == 1 else "prompt", code="invalid_value")

    def json_response(self, request: Request, payload: Any, what: str) -> Response:
        """``payload`` as a JSON response, sent under the STREAM_STALL_TIMEOUT_S rule (:class:`_SendGuard`)."""
        return _GuardedBody(json_bytes(payload), _SendGuard(request, self.stream_stall_s, what), None)

    # -- /tokenize, /detokenize ----------------------------------------------------------------------------
    async def run_json(self, request: Request, work: Callable[[bytes], dict[str, Any]]) -> dict[str, Any]:
        """Read the body and run ``work`` on it: on a worker thread for large bodies (tokenizing)."""
        raw = await read_body(request, budget=self.body_budget)
        if len(raw) > OFFLOAD_BODY_BYTES:
            return await self.offload(work, raw)
        return work(raw)

    async def offload(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` on the prompt-preparation threads (PREPARE_THREADS of them: few, so queued prompt work
        cannot crowd the event loop out of the GIL)."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, functools.partial(work, *args))

    def tokenize(self, raw: bytes) -> dict[str, Any]:
        """vLLM's /tokenize: ``{count, max_model_len, tokens, token_strs}``."""
        body = parse_body(TokenizeRequest, raw, max_messages=self.context_limit)
        self.check_model(body.model)
        if body.prompt is not None:
            add_special = body.add_special_tokens is not False
            ids = tokenize_text(body.prompt, self.tokenizer, self.context_limit, add_special_tokens=add_special,
                                pool=self.render_pool)
            param = "prompt"
        else:
            assert body.messages is not None
            body.check_generation_prompt()
            ids = render_chat([m.as_template_dict() for m in body.messages], self.tokenizer, self.context_limit,
                              body.template_options, self.render_pool)
            param = "messages"
        if len(ids) > self.context_limit:
            what = "the prompt is" if param == "prompt" else "the messages are"
            raise APIError(400, f"{what} {len(ids)} tokens; this model's context holds {self.context_limit}",
                           param=param, code="context_length_exceeded")
        strings = None
        if body.return_token_strs:
            convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
            if convert is None:
                raise APIError(400, "return_token_strs needs a tokenizer with a vocabulary of token strings, which "
                               f"this backend's ({self.engine.backend_name}) does not expose; use /detokenize to "
                               "read tokens back", param="return_token_strs", code="invalid_value")
            strings = convert(ids)
        return {"count": len(ids), "max_model_len": self.context_limit, "tokens": ids, "token_strs": strings}

    def detokenize(self, raw: bytes) -> dict[str, Any]:
        """vLLM's /detokenize: ``{prompt}``, special tokens included (the text the ids stand for)."""
        body = parse_body(DetokenizeRequest, raw)
        self.check_model(body.model)
        if len(body.tokens) > self.context_limit:
            raise APIError(400, f"at most {self.context_limit} tokens (the context) are accepted, got "
                           f"{len(body.tokens)}", param="tokens", code="invalid_value")
        bad = next((t for t in body.tokens if t >= self.info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (ids are 0..{self.info.vocab_size - 1})",
                           param="tokens", code="invalid_value")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # -- one request ---------------------------------------------------------------------------------
    async def handle(self, request: Request, endpoint: str) -> Response:
        timing = Timing()
        try:
            response = await self._handle(request, endpoint, timing)
        except APIError as exc:
            self.metrics.record_request(endpoint, exc.status)
            raise
        except (ClientDisconnected, ClientDisconnect):  # nobody is left to read a response
            timed_out = request.scope.get(TIMED_OUT_KEY, False)  # the connection answered 408 and closed
            self.metrics.record_request(endpoint, 408 if timed_out else CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        if not isinstance(response, (StreamingResponse, _GuardedBody)):  # those record their status once sent
            self.metrics.record_request(endpoint, response.status_code)
        return response

    async def _handle(self, request: Request, endpoint: str, timing: Timing) -> Response:
        header_id = _request_id_header(request)
        reply, prepared = await self._read(request, endpoint)
        if header_id is not None:  # vLLM's order: the header wins over the body's request_id
            reply = dataclasses.replace(reply, request_id=header_id)
        spec = prepared[0].params.structured_outputs
        if spec is not None:  # compiled here, off the event loop; the engine's submit then only copies it
            try:
                await self.offload(self.engine.compile_constraint, spec)
            except InvalidRequestError as exc:
                raise constraint_error(str(exc), prepared[0].constraint_field) from None
            except GemmaserveError as exc:
                raise from_engine_error(exc, engine_alive=self.engine.is_alive(), prompt_param=prepared[0].prompt_param,
                                        prompt_fits=True) from None
        return await self._handle_choices(request, endpoint, reply, prepared, timing)

    async def _read(self, request: Request, endpoint: str) -> tuple[_Reply, list[Prepared]]:
        """Read and prepare the body. Its bytes and the parsed body are dropped when this returns, once they have
        left MAX_BUFFERED_BODY_BYTES' count: the request keeps only what it runs with (no reference to them may
        outlive this call)."""
        raw = await read_body(request, budget=self.body_budget)
        if len(raw) > OFFLOAD_BODY_BYTES:  # tokenizing a long prompt must not stall every other stream
            return await self.offload(self._prepare, raw, endpoint)
        return self._prepare(raw, endpoint)

    def _prepare(self, raw: bytes, endpoint: str) -> tuple[_Reply, list[Prepared]]:
        """Parse, check the model, tokenize: one Prepared per prompt (a chat has one). Pure CPU work: runs on the
        loop or a worker thread."""
        if endpoint == "chat":
            chat = parse_body(ChatCompletionRequest, raw, max_messages=self.context_limit)
            self.check_model(chat.model)
            self.check_n(chat.n)
            prepared = prepare_chat(chat, self.tokenizer, self.context_limit, self.engine.settings.default_max_tokens,
                                    self.engine.settings.tool_call_parser, self.engine.settings.reasoning_parser,
                                    self.render_pool, self.info.eos_token_ids,
                                    self.engine.settings.exclude_tools_when_tool_choice_none)
            return _Reply.of(chat, [chat.echo_text]), [prepared]
        completion = parse_body(CompletionRequest, raw)
        self.check_model(completion.model)
        self.check_n(completion.n, len(completion.prompt))
        self._check_token_prompts(completion.prompt)
        prompts = [prepare_completion(completion, self.tokenizer, self.context_limit, self.render_pool, index)
                   for index in range(len(completion.prompt))]
        echoes = [("" if not completion.echo else prompt if isinstance(prompt, str)  # token ids: all of them shown,
                   else self.tokenizer.decode(prompt, skip_special_tokens=False))  # as a text prompt echoes <bos>
                  for prompt in completion.prompt]
        return _Reply.of(completion, echoes), prompts

    def _check_token_prompts(self, prompts: Sequence[str | list[int]]) -> None:
        """A 400 naming the first token id outside the vocabulary, and its prompt's place in a batch (the engine's
        check names only the position in the prompt)."""
        vocab_size = self.info.vocab_size
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str) or not prompt or max(prompt) < vocab_size:  # ids are >= 0 (the schema's)
                continue
            position, token = next((i, t) for i, t in enumerate(prompt) if t >= vocab_size)
            where = f"prompt {index} of the batch" if len(prompts) > 1 else "the prompt"
            raise APIError(400, f"{where}: token {token} at position {position} is not a valid token id; token ids "
                           f"are integers in [0, {vocab_size})", param="prompt", code="invalid_value")

    def _submit(self, prepared: Sequence[Prepared], timings: Sequence[Timing]) -> list[Generation]:
        """The choices' generations, queued together (all or none)."""
        try:
            return Generation.submit_many(self.engine, self.tokenizer, prepared, timings)
        except GemmaserveError as exc:
            fits = all(len(p.prompt_ids) < self.context_limit for p in prepared)
            alive = self.engine.is_alive()
            param = prepared[0].prompt_param
            raise from_engine_error(exc, engine_alive=alive, prompt_param=param, prompt_fits=fits) from None

    async def _handle_choices(self, request: Request, endpoint: str, reply: _Reply, prompts: list[Prepared],
                              timing: Timing) -> Response:
        """One engine request per choice (``n`` per prompt, default 1; choice ``j`` samples with ``seed + j`` when a
        seed is given), answered as one response whose ``choices`` carry their ``index`` (``i * n + j`` for prompt
        ``i``'s ``j``-th, vLLM's order); usage counts each prompt once. Streamed, the choices' chunks interleave as
        their tokens arrive. Either way the response is sent under the STREAM_STALL_TIMEOUT_S no-progress rule
        (:class:`_SendGuard`)."""
        n = reply.n
        choices = []
        for prepared in prompts:
            every = dataclasses.replace(prepared.params, n=n)
            choices += [dataclasses.replace(prepared, params=every.for_sample(j)) for j in range(n)]
        generations = self._submit(choices, [timing, *(Timing(start=timing.start) for _ in choices[1:])])
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        meta = ResponseMeta.new(prefix, reply.request_id or generations[0].request_id, self.model_name)  # one id
        views = [_View(reply, generation, self, meta, k // n) for k, generation in enumerate(generations)]
        group = _Choices(generations)
        pending: dict[asyncio.Future[Step | None], int] = {}
        try:
            async with _cancel_on_disconnect(request, group):
                if reply.stream:  # headers once one choice has its first step (a failure then is an HTTP error);
                    firsts, pending = await _first_steps(generations)  # the others stream as they come
                else:
                    firsts = list(await asyncio.gather(*(g.next_step() for g in generations)))
                    await asyncio.gather(*(_drain(g) for g in generations))
        except BaseException:
            for task in pending:
                task.cancel()
            group.close()
            for generation in generations:  # what it reached counts: a first token, its gaps (vLLM's)
                self._observe(generation)
            raise
        guard = _SendGuard(request, self.stream_stall_s, meta.id)
        if not reply.stream:
            for generation in generations:
                self._observe(generation)
            if sum(view.size() for view in views) > OFFLOAD_RESPONSE_UNITS:  # see OFFLOAD_RESPONSE_UNITS
                content = await self.offload(_full_response, views)
            else:
                content = _full_response(views)
            return _GuardedBody(content, guard, functools.partial(self.metrics.record_request, endpoint))
        return _GuardedStream(self._stream_choices(views, generations, firsts, pending, endpoint), guard,
                              media_type="text/event-stream", headers=_SSE_HEADERS)

    async def _stream_choices(self, views: list[_View], generations: list[Generation], firsts: list[Step | None],
                              pending: dict[asyncio.Future[Step | None], int], endpoint: str) -> AsyncIterator[bytes]:
        """The SSE chunks of ``generations``: their opening chunks, the ``firsts`` steps already taken, then every
        step as it comes (``pending``: choices' first steps still awaited, each owned by its task)."""
        status = CLIENT_CLOSED
        waiting = dict(pending)
        try:
            for index, view in enumerate(views):
                for chunk in view.opening_chunks():
                    yield sse(_indexed(chunk, index))
            for index, (view, step) in enumerate(zip(views, firsts)):
                if step is not None and (chunk := view.chunk(step)) is not None:
                    yield sse(_indexed(chunk, index))
            if len(generations) == 1:  # one choice: read it directly (no task and no wait per step)
                while not generations[0].done and (step := await generations[0].next_step()) is not None:
                    if (chunk := views[0].chunk(step)) is not None:
                        yield sse(_indexed(chunk, 0))
            awaited = set(waiting.values())
            waiting.update({asyncio.ensure_future(g.next_step()): i for i, g in enumerate(generations)
                            if not g.done and i not in awaited})
            try:
                while waiting:
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        index = waiting.pop(task)
                        step = task.result()
                        if step is None:
                            continue
                        if (chunk := views[index].chunk(step)) is not None:
                            yield sse(_indexed(chunk, index))
                        if not generations[index].done:
                            waiting[asyncio.ensure_future(generations[index].next_step())] = index
            finally:
                for task in waiting:
                    task.cancel()
            if views[0].include_usage:
                yield sse(_usage_chunk(views))
            status = 200
            yield SSE_DONE
        except APIError as exc:  # one choice failed mid-stream: report it in-band, end them all
            status = exc.status
            yield sse(exc.body())
            yield SSE_DONE
        except ClientDisconnected:
            pass
        except Exception as exc:  # a bug while formatting: the client still learns the stream ended, and why
            logger.exception("unhandled error while streaming %s", endpoint)
            error = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
            status = error.status
            yield sse(error.body())
            yield SSE_DONE
        finally:
            for task in waiting:  # a stream closed before it read them
                task.cancel()
            for generation in generations:
                generation.close()
                self._observe(generation)
            self.metrics.record_request(endpoint, status)

    def _observe(self, generation: Generation) -> None:
        """Record ``generation``'s latencies, however it ended (as vLLM records a first token and the gaps between
        tokens when they happen: a request cancelled or failed later still counts them; the end-to-end latency only
        when it reached its end). Each generation comes here once: on its response's success path, or when the
        request fails before one exists, or when its stream ends."""
        timing = generation.timing
        self.metrics.observe(timing.ttft, timing.tpot(len(generation.token_ids)), timing.e2e, timing.gaps)


async def _first_steps(generations: list[Generation]) -> tuple[list[Step | None],
                                                            dict[asyncio.Future[Step | None], int]]:
    """Wait until at least one of ``generations`` has its first step (or ended): the steps taken (None where not
    yet) and the tasks still awaiting the others' (owned by the caller: cancel them if it does not stream). A
    choice beyond the batch's room starts only when an earlier one ends, so waiting for every first step held a
    stream with ``n`` over ``MAX_BATCH_SIZE`` back until whole choices had finished. A failed first step raises
    (the response is then an HTTP error)."""
    tasks = {asyncio.ensure_future(g.next_step()): i for i, g in enumerate(generations)}
    firsts: list[Step | None] = [None] * len(generations)
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            firsts[tasks.pop(task)] = task.result()
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    return firsts, tasks


class _Stalled(Exception):
    """Sending to a client made no progress for STREAM_STALL_TIMEOUT_S."""


class _SendGuard:
    """The STREAM_STALL_TIMEOUT_S rule of one response, streamed or not: a send that has waited ``stall_s`` seconds
    with no byte taken by the client (the connection guards' :data:`UNSENT_KEY` count did not shrink; without it,
    any wait that long counts) raises :class:`_Stalled` out of :meth:`bounded`'s ``send``, and so does the last
    message while what it left in the write buffer is not taken (a body written whole into the buffer completes its
    send at once: a client that never reads would hold the connection, and the body, for ever). :meth:`give_up`
    then logs it and drops the connection (:data:`ABORT_KEY`; without it the response just ends). A slow reader that
    keeps taking bytes is never cut. ``what`` names the response in the log."""

    def __init__(self, request: Request, stall_s: float, what: str) -> None:
        state = request.scope.get("state", {})
        self.abort: Callable[[], None] | None = state.get(ABORT_KEY)
        self.unsent: Callable[[], int] | None = state.get(UNSENT_KEY)
        self.stall_s, self.what = stall_s, what

    def bounded(self, send: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``send`` under the rule: raises :class:`_Stalled` once it has made no progress for ``stall_s`` seconds;
        the response's last message returns once the client took every byte (known only with ``unsent``)."""
        loop = asyncio.get_running_loop()
        unsent, stall_s = self.unsent, self.stall_s

        async def bounded_send(message: Any) -> None:
            left = [unsent() if unsent is not None else 0]
            try:
                async with asyncio.timeout(None) as deadline:

                    def check() -> None:  # every stall_s while the send waits: progress re-arms, none fires
                        now = unsent() if unsent is not None else left[0]
                        if now < left[0]:
                            left[0] = now
                            timer[0] = loop.call_later(stall_s, check)
                        else:
                            deadline.reschedule(loop.time())

                    timer = [loop.call_later(stall_s, check)]
                    try:
                        await send(message)
                    finally:
                        timer[0].cancel()
            except TimeoutError:
                raise _Stalled from None
            if message.get("type") == "http.response.body" and not message.get("more_body", False):
                await self._drained()

        return bounded_send

    async def _drained(self) -> None:
        """Return once the write buffer is empty; :class:`_Stalled` once it has not shrunk for ``stall_s``."""
        unsent = self.unsent
        if unsent is None:
            return
        loop = asyncio.get_running_loop()
        left, since = unsent(), loop.time()
        while left:
            await asyncio.sleep(min(self.stall_s, _DRAIN_POLL_S))
            now = unsent()
            if now < left:
                left, since = now, loop.time()
            elif loop.time() - since >= self.stall_s:
                raise _Stalled

    def give_up(self) -> None:
        logger.warning("response %s: the client took no byte for %g s (STREAM_STALL_TIMEOUT_S); closing the "
                       "connection", self.what, self.stall_s)
        if self.abort is not None:
            self.abort()


_DRAIN_POLL_S = 0.1
"""How often a response's end checks that its client keeps taking what the write buffer holds (only while it holds
some: a client that reads has usually taken the last bytes by the time they are written)."""


class _GuardedStream(StreamingResponse):
    """An SSE response under ``guard``'s rule: a stalled client's body iterator is closed (its generations' engine
    requests are cancelled, their KV freed; counted as status 499 by the iterator), then the connection dropped."""

    def __init__(self, content: AsyncIterator[bytes], guard: _SendGuard, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.guard = guard

    async def stream_response(self, send: Callable[[Any], Any]) -> None:
        try:
            await super().stream_response(self.guard.bounded(send))
        except _Stalled:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                await body.aclose()
            self.guard.give_up()


class _GuardedBody(Response):
    """A complete JSON body sent under ``guard``'s rule (a client that never reads it cannot hold its connection
    and this handler). ``on_end(status)``: called once it is sent (its status) or not (499: given up on, or the
    client went away)."""

    media_type = "application/json"

    def __init__(self, content: bytes, guard: _SendGuard, on_end: Callable[[int], None] | None = None) -> None:
        super().__init__(content)
        self.guard, self.on_end = guard, on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        status = CLIENT_CLOSED
        try:
            await super().__call__(scope, receive, self.guard.bounded(send))
            status = self.status_code
        except _Stalled:
            self.guard.give_up()
        finally:
            if self.on_end is not None:
                self.on_end(status)


def _request_id_header(request: Request) -> str | None:
    """The caller's ``X-Request-Id`` header (vLLM reads it ahead of the body's ``request_id``), or None; a 400 when
    it is empty or longer than ``request_id`` may be."""
    value = request.headers.get("x-request-id")
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_REQUEST_ID_CHARS:
        raise APIError(400, f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} characters (the response's "
                       f"id is <prefix>-<it>), got {len(value)}", param="X-Request-Id", code="invalid_value")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    """What the response needs of a generation request's body (the body itself is dropped once prepared)."""

    chat: bool
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    request_id: str | None
    """The caller's id (the ``X-Request-Id`` header, else the body's ``request_id``, as vLLM), or None for the
    engine's."""
    echoes: tuple[str, ...]
    """Per prompt (a chat has one), the text prepended to each of its choices (``echo``), or empty."""

    @classmethod
    def of(cls, body: CompletionRequest | ChatCompletionRequest, echoes: Sequence[str]) -> _Reply:
        return cls(isinstance(body, ChatCompletionRequest), body.n or 1, bool(body.stream), body.include_usage,
                   body.continuous_usage, bool(body.return_token_ids), body.request_id, tuple(echoes))


def _full_response(views: list[_View]) -> bytes:
    """The encoded non-streamed response of ``views``' generations (all finished)."""
    return json_bytes(_merge_bodies([view.full_body() for view in views], [view.prompt_index for view in views]))


class _View:
    """Formats one generation as a completions or chat response (full body or SSE chunks)."""

    def __init__(self, reply: _Reply, generation: Generation, server: _Server, meta: ResponseMeta,
                 prompt_index: int = 0) -> None:
        chat = self.chat = reply.chat
        self.generation = generation
        self.prompt_index = prompt_index  # which prompt of the request (a batch of completion prompts) it answers
        self.include_usage = reply.include_usage
        self.reply = reply
        self._streamed = 0  # tokens of this choice sent so far (continuous usage)
        self._sent_prompt_ids = False
        self.tokenizer = server.tokenizer
        self.meta = meta  # the response's id and time, shared by its choices
        self.echo = reply.echoes[prompt_index]
        self._offset = len(self.echo)
        parser = generation.prepared.tool_parser if chat else None
        self.tools: ToolParser | None = PARSERS[parser]() if parser else None
        self._num_calls = 0  # tool calls streamed so far
        reasoning = generation.prepared.reasoning_parser if chat else None
        self.reasoning = Gemma4ReasoningParser() if reasoning == "gemma4" else None
        self.show_reasoning = generation.prepared.include_reasoning  # False: parsed out, then left out

    def size(self) -> int:
        """The work :meth:`full_body` does, in :data:`OFFLOAD_RESPONSE_UNITS`' units."""
        gen = self.generation
        alternatives = gen.prepared.params.logprobs or 0
        return len(gen.token_ids) * (2 + alternatives if gen.prepared.want_logprobs else 1)

    def full_body(self) -> dict[str, Any]:
        """The non-streamed response of the finished generation (with vLLM's ``return_token_ids``: the prompt's and
        the reply's token ids). Touches nothing but this view and its generation (it may run on a preparation
        thread)."""
        body = self._full_body()
        if self.reply.return_token_ids:
            self._with_prompt_ids(body)
            body["choices"][0]["token_ids"] = list(self.generation.token_ids)
        return body

    def _with_prompt_ids(self, body: dict[str, Any]) -> None:
        """Put the prompt's ids where vLLM does (mutates ``body``): a completion choice's ``prompt_token_ids`` (a
        batch has several prompts), a chat response's top-level one."""
        (body if self.chat else body["choices"][0])["prompt_token_ids"] = list(self.generation.prepared.prompt_ids)

    def _full_body(self) -> dict[str, Any]:
        gen = self.generation
        assert gen.finish_reason is not None
        logprobs = (self._logprobs(gen.token_ids, gen.logprobs, len(self.echo), gen.top_logprobs)
                    if gen.prepared.want_logprobs else None)
        if self.chat and (self.tools is not None or self.reasoning is not None):
            thought, parsed = self._parse(gen.text, final=True)
            calls = [call.to_openai() for call in parsed.calls]
            return self.meta.chat(self.echo + parsed.content, self._finish_reason(gen.finish_reason), logprobs,
                                  gen.usage(), calls,
                                  reasoning=thought if self.reasoning is not None and self.show_reasoning else None,
                                  stop_reason=gen.stop_reason)
        if self.chat:
            return self.meta.chat(self.echo + gen.text, gen.finish_reason, logprobs, gen.usage(),
                                  stop_reason=gen.stop_reason)
        return self.meta.completion(self.echo + gen.text, gen.finish_reason, logprobs, gen.usage(), gen.stop_reason)

    def opening_chunks(self) -> list[dict[str, Any]]:
        if self.chat:
            role = self.meta.chat_chunk(None, None, role=True)
            chunks = [role, self.meta.chat_chunk(self.echo, None)] if self.echo else [role]
        else:
            chunks = [self.meta.completion_chunk(self.echo, None)] if self.echo else []
        if chunks and self.reply.return_token_ids:
            self._sent_prompt_ids = True
            self._with_prompt_ids(chunks[0])
            for chunk in chunks:
                chunk["choices"][0]["token_ids"] = []
        return [self._with_usage(chunk) for chunk in chunks]

    def chunk(self, step: Step) -> dict[str, Any] | None:
        """The SSE chunk of ``step`` (with the choice's running usage under ``continuous_usage_stats``; with
        ``return_token_ids`` its token ids, and the prompt's on the choice's first chunk), or None when it has
        nothing to show (tokens a tool-call or reasoning parser holds back, no logprobs or ids to report)."""
        self._streamed += len(step.token_ids)
        body = self._chunk(step)
        if body is None:
            return None
        chunk = self._with_usage(body)
        if self.reply.return_token_ids:
            chunk["choices"][0]["token_ids"] = list(step.token_ids)
            if not self._sent_prompt_ids:
                self._sent_prompt_ids = True
                self._with_prompt_ids(chunk)
        return chunk

    def _with_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self.reply.continuous_usage:
            prompt = self.generation.num_prompt_tokens
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": self._streamed,
                              "total_tokens": prompt + self._streamed}
        return chunk

    def _chunk(self, step: Step) -> dict[str, Any] | None:
        logprobs = None
        if step.logprobs is not None:
            logprobs = self._logprobs(step.token_ids, step.logprobs, self._offset, step.top_logprobs)
        self._offset += len(step.text)
        if self.chat and (self.tools is not None or self.reasoning is not None):
            first = self._num_calls
            thought, parsed = self._parse(step.text, final=step.finish_reason is not None)
            calls = [call.to_openai(first + i) for i, call in enumerate(parsed.calls)]
            shown = thought if self.show_reasoning else None
            if not (parsed.content or calls or shown or step.finish_reason or logprobs or self.reply.return_token_ids):
                return None  # held back by the parsers: vLLM sends no chunk for it either
            return self.meta.chat_chunk(parsed.content, self._finish_reason(step.finish_reason), logprobs,
                                        tool_calls=calls, reasoning=shown,
                                        stop_reason=step.stop_reason)
        if self.chat:
            return self.meta.chat_chunk(step.text, step.finish_reason, logprobs, stop_reason=step.stop_reason)
        return self.meta.completion_chunk(step.text, step.finish_reason, logprobs, step.stop_reason)

    def _parse(self, text: str, *, final: bool) -> tuple[str, ParsedText]:
        """``text`` through the reasoning parser, then its content through the tool-call parser (both flushed at
        the end): (reasoning, content and calls). Counts the calls."""
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if final:
                more, rest = self.reasoning.finish()
                thought, text = thought + more, text + rest
        if self.tools is None:
            return thought, ParsedText(text)
        parsed = self.tools.feed(text)
        if final:
            rest_calls = self.tools.finish()
            parsed = ParsedText(parsed.content + rest_calls.content, parsed.calls + rest_calls.calls)
        if not self.generation.prepared.parallel_tool_calls:  # at most one call: later ones are dropped
            parsed.calls = parsed.calls[: max(0, 1 - self._num_calls)]
        self._num_calls += len(parsed.calls)
        return thought, parsed

    def _finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` for a reply that ended on its own after making calls (``stop`` when
        ``tool_choice`` named the function, as OpenAI and vLLM answer)."""
        named = self.generation.prepared.named_tool_choice
        return "tool_calls" if reason == "stop" and self._num_calls and not named else reason

    def usage_chunk(self) -> dict[str, Any]:
        usage = self.generation.usage()
        return self.meta.chat_usage_chunk(usage) if self.chat else self.meta.completion_usage_chunk(usage)

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float], offset: int,
                  top: Sequence[Sequence[tuple[int, float]]] | None) -> dict[str, Any]:
        if self.chat:
            return chat_logprobs(self.tokenizer, token_ids, logprobs, top)
        return completion_logprobs(self.tokenizer, token_ids, logprobs, offset, top,
                                   skip_special_tokens=self.generation.prepared.params.skip_special_tokens)


class _Choices:
    """The generations of one ``n`` > 1 request, cancelled and closed together."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations

    def client_gone(self) -> None:
        for generation in self.generations:
            generation.client_gone()

    def close(self) -> None:
        for generation in self.generations:
            generation.close()


async def _drain(generation: Generation) -> None:
    while await generation.next_step() is not None:
        pass


def _indexed(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    for choice in chunk.get("choices", ()):
        choice["index"] = index
    return chunk


def _merge_bodies(bodies: list[dict[str, Any]], prompt_indexes: Sequence[int]) -> dict[str, Any]:
    """One response of the choices' bodies: their ``choices`` in order (``index`` set), usage summed over the
    completions, each prompt counted once."""
    merged = dict(bodies[0])
    merged["choices"] = [_indexed(body, i)["choices"][0] for i, body in enumerate(bodies)]
    merged["usage"] = _summed_usage([body["usage"] for body in bodies], prompt_indexes)
    return merged


def _summed_usage(usages: list[dict[str, Any]], prompt_indexes: Sequence[int]) -> dict[str, Any]:
    """The choices' usages as one: completion tokens summed, each prompt's tokens (and cached tokens) counted once
    (``prompt_indexes[k]``: the prompt choice ``k`` answers)."""
    firsts = [usages[k] for k, index in enumerate(prompt_indexes) if k == 0 or index != prompt_indexes[k - 1]]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
    return {**usages[0], "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {**usages[0]["prompt_tokens_details"], "cached_tokens": cached}}


def _usage_chunk(views: list[_View]) -> dict[str, Any]:
    chunk = views[0].usage_chunk()
    chunk["usage"] = _summed_usage([view.generation.usage() for view in views], [view.prompt_index for view in views])
    return chunk


@asynccontextmanager
async def _cancel_on_disconnect(request: Request, generation: Generation | _Choices) -> AsyncIterator[None]:
    """While the body is open, watch the connection; a disconnect cancels ``generation``."""

    async def watch(receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                generation.client_gone()
                return

    watcher = asyncio.create_task(watch(request.receive))
    try:
        yield
    finally:
        watcher.cancel()
