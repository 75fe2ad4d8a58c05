"""``gemmaserve serve``: build the engine, wrap it in the app, run uvicorn until interrupted."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gemmaserve.errors import ConfigurationError
from gemmaserve.server.connections import (
    AcceptErrorFilter,
    ConnectionLimits,
    effective_connection_limit,
    guarded_protocol_class,
    raise_fd_limit,
)
from gemmaserve.settings import CoreSettings, split_list

__all__ = ["serve", "served_model_name", "model_names", "model_aliases", "bind_listeners"]

logger = logging.getLogger(__name__)

CANCEL_GRACE_S = 3.0
"""After ``--shutdown-timeout`` the engine is stopped, so the requests still running end with the clean
"shutting down" error (503, or an in-band error and ``[DONE]`` on a stream); uvicorn waits this much longer
for their handlers to send it before it cancels them."""


def served_model_name(settings: CoreSettings, fallback: str) -> str:
    """The name clients put in ``model``: the checkpoint folder's name (or the backend's name)."""
    if settings.model:
        return Path(settings.model).resolve().name
    return fallback


def model_names(settings: CoreSettings, fallback: str) -> list[str]:
    """The names ``/v1/models`` lists (responses use the first): ``SERVED_MODEL_NAME`` (``--served-model-name``)
    when given, as vLLM's; else the checkpoint folder's name."""
    return _served_names(settings) or [served_model_name(settings, fallback)]


def _served_names(settings: CoreSettings) -> list[str]:
    """``SERVED_MODEL_NAME`` split at commas ([] when unset); raises ConfigurationError for an empty name
    (``"a,,b"``, ``","``), which ``--served-model-name`` refuses too, instead of dropping it."""
    if settings.served_model_name == "":
        return []
    names = [part.strip() for part in settings.served_model_name.split(",")]
    if not all(names):
        raise ConfigurationError(f"SERVED_MODEL_NAME={settings.served_model_name!r}: each comma-separated name "
                                 "must be non-empty; e.g. SERVED_MODEL_NAME=gemma,gemma-3")
    return names


def model_aliases(settings: CoreSettings) -> list[str]:
    """Other accepted spellings of the model: MODEL as given and as an absolute path."""
    if not settings.model:
        return []
    return [settings.model, str(Path(settings.model).resolve())]


def _draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On the first SIGINT/SIGTERM: uvicorn stops accepting connections and closes idle ones; the app refuses
        new generation requests (503 ``server_shutting_down``, ``/health`` 503); running requests and streams go
        on. After ``shutdown_timeout`` seconds the engine is stopped (off the event loop), so what still runs
        ends as cancelled with the clean errors; a second signal stops the engine at once."""

        def __init__(self, config: uvicorn.Config, engine: Any, drain: Any, shutdown_timeout: float) -> None:
            super().__init__(config)
            self._engine = engine
            self._drain = drain
            self._shutdown_timeout = shutdown_timeout
            self._timer: threading.Timer | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                self._drain.active = True
                logger.info("shutting down: draining running requests for up to %g s", self._shutdown_timeout)
                self._timer = threading.Timer(self._shutdown_timeout, self._stop_engine)
                self._timer.daemon = True
                self._timer.start()
            else:
                self._stop_engine()
            super().handle_exit(sig, frame)

        def _stop_engine(self) -> None:
            if self._engine.is_alive():
                logger.info("shutdown timeout: cancelling the requests still running")
            threading.Thread(target=self._engine.shutdown, name="engine-shutdown", daemon=True).start()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            """uvicorn re-raises the signal once it has shut down, which kills the process before the engine and
            backend are closed (SIGTERM's default action): a drained server returns normally instead (exit 0)."""
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

        async def serve(self, sockets: list[Any] | None = None) -> None:
            # out of file descriptors, asyncio logs a traceback per pending connection: summarize them
            asyncio.get_running_loop().set_exception_handler(AcceptErrorFilter())
            try:
                await super().serve(sockets)
            finally:
                if self._timer is not None:
                    self._timer.cancel()

    return DrainingServer


def _draining_server(config: Any, engine: Any, drain: Any, shutdown_timeout: float) -> Any:
    """A uvicorn server for ``config`` that drains ``engine``'s requests on shutdown (see DrainingServer)."""
    return _draining_server_class()(config, engine, drain, shutdown_timeout)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def _cors_lists(settings: CoreSettings) -> dict[str, list[str]]:
    """``allowed_origins``, ``allowed_headers`` and ``allowed_methods`` of ``settings`` as lists
    (:func:`~gemmaserve.settings.split_list`; ConfigurationError naming the setting for a malformed JSON list)."""
    return {name: split_list(getattr(settings, name), name.upper())
            for name in ("allowed_origins", "allowed_headers", "allowed_methods")}


def allowed_hosts(settings: CoreSettings) -> list[str] | None:
    """Host names the server answers: on a loopback address only the loopback names plus ``ALLOWED_HOSTS`` (a
    web page's rebinding of its own name to 127.0.0.1 is refused); elsewhere ``ALLOWED_HOSTS``, or any (None)."""
    extra = split_list(settings.allowed_hosts, "ALLOWED_HOSTS")
    if settings.host in LOOPBACK_HOSTS or settings.host.startswith("127."):
        return [*LOOPBACK_HOSTS, settings.host, *extra]
    return extra or None


def connection_limits(settings: CoreSettings) -> ConnectionLimits:
    """The connection timeouts and bound of ``settings``; raises the soft file-descriptor limit to the hard one
    and keeps the connection bound below it."""
    return ConnectionLimits(
        timeout_keep_alive=settings.timeout_keep_alive,
        header_timeout=settings.client_header_timeout,
        body_timeout=settings.client_body_timeout,
        limit_concurrency=effective_connection_limit(settings.limit_concurrency, raise_fd_limit()),
    )


def _warm_grammars(engine: Any) -> None:
    """Structured output's vocabulary, built while the server starts taking requests (logged, never fatal)."""
    try:
        if engine.scheduler.warm_grammars():
            logger.info("structured output ready (vocabulary of %d tokens)", engine.backend.model_info.vocab_size)
    except Exception:
        logger.warning("could not prepare structured output; constrained requests will try again", exc_info=True)


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Sockets bound (not yet listening) to every address ``host`` resolves to, as asyncio's ``create_server``
    (what uvicorn calls) would bind them; ``host`` empty = every interface. Raises ConfigurationError
    ``cannot listen on HOST:PORT: reason`` (port in use, an address not of this machine, a name that does not
    resolve), with nothing left open."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):  # duplicates dropped, order kept
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this machine lacks (IPv6 off): asyncio skips it too
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        if not sockets:
            raise OSError(errno.EAFNOSUPPORT, "no address of a supported family")
    except OSError as exc:
        for sock in sockets:
            sock.close()
        hint = {errno.EADDRINUSE: "; another process listens there: stop it or pick another --port",
                errno.EADDRNOTAVAIL: "; --host must be an address of this machine"}.get(exc.errno or 0, "")
        raise ConfigurationError(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from None
    return sockets


def serve(settings: CoreSettings) -> None:
    """Blocking: serve HTTP on settings.host:settings.port; shuts the engine (and its KV-event publisher) down
    on exit. The address is bound before the model loads: one that cannot be bound raises ConfigurationError
    (:func:`bind_listeners`) at once. Raises what ``build_engine`` raises (ConfigurationError,
    BackendUnavailableError, ModelLoadError)."""
    from gemmaserve.hf_tokenizer import read_chat_template

    _served_names(settings)  # before the load, as everything below
    _cors_lists(settings)  # a malformed JSON list (vLLM's form) is refused before the load too
    allowed_hosts(settings)
    template = read_chat_template(settings.chat_template) if settings.chat_template else None
    listeners = bind_listeners(settings.host, settings.port)  # the load takes seconds to minutes
    try:
        _serve_on(settings, listeners, template)
    finally:
        for sock in listeners:
            sock.close()


def _serve_on(settings: CoreSettings, listeners: list[socket.socket], template: str | None) -> None:
    """:func:`serve` on the bound ``listeners``."""
    import uvicorn

    from gemmaserve.engine.factory import build_engine
    from gemmaserve.hf_tokenizer import configure_chat_template
    from gemmaserve.server.app import create_app

    engine = build_engine(settings)
    try:
        if template is not None:
            configure_chat_template(engine.backend.tokenizer, template)
    except BaseException:
        engine.shutdown()
        raise
    engine.start()
    threading.Thread(target=_warm_grammars, args=(engine,), name="gemmaserve-grammar-warmup", daemon=True).start()
    try:
        names = model_names(settings, engine.backend.model_info.name)
        name = names[0]
        app = create_app(engine, name, extra_model_names=names[1:],
                         model_aliases=[] if settings.served_model_name else model_aliases(settings),
                         api_key=settings.api_key,
                         allowed_hosts=allowed_hosts(settings), **_cors_lists(settings),
                         allow_credentials=settings.allow_credentials,
                         debug_endpoints=settings.enable_debug_endpoints)
        port = listeners[0].getsockname()[1] if listeners else settings.port  # the port bound for PORT=0
        logger.info("serving %s (backend %s) on http://%s:%d", name, engine.backend_name, settings.host, port)
        limits = connection_limits(settings)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            http=guarded_protocol_class(limits),
            ws="none",  # no WebSocket routes (and see GuardedH11Protocol._should_upgrade)
            timeout_keep_alive=limits.timeout_keep_alive,  # type: ignore[arg-type]  # a float works
            timeout_graceful_shutdown=settings.shutdown_timeout + CANCEL_GRACE_S,  # type: ignore[arg-type]
        )
        _draining_server(config, engine, app.state.drain, settings.shutdown_timeout).run(sockets=listeners)
    finally:
        engine.shutdown()  # closes the KV-event publisher after the backend: the cache's last changes go out first
