"""``gemmaserve serve``: build the engine, wrap it in the app, run uvicorn until interrupted."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

from gemmaserve.server.connections import (
    AcceptErrorFilter,
    ConnectionLimits,
    effective_connection_limit,
    guarded_protocol_class,
    raise_fd_limit,
)
from gemmaserve.settings import CoreSettings

__all__ = ["serve", "served_model_name", "model_aliases"]

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
"""On SIGINT/SIGTERM, open streams get this long before they are cut and their requests cancelled."""


def served_model_name(settings: CoreSettings, fallback: str) -> str:
    """The name clients put in ``model``: the checkpoint folder's name (or the backend's name)."""
    if settings.model:
        return Path(settings.model).resolve().name
    return fallback


def model_aliases(settings: CoreSettings) -> list[str]:
    """Other accepted spellings of the model: MODEL as given and as an absolute path."""
    if not settings.model:
        return []
    return [settings.model, str(Path(settings.model).resolve())]


def _engine_stopping_server_class() -> type:
    import uvicorn

    class EngineStoppingServer(uvicorn.Server):
        """On SIGINT/SIGTERM, stop the engine first (off the event loop): in-flight requests finish as
        cancelled, so their handlers answer 503 / an in-band error + ``[DONE]`` within the grace period
        instead of being cut off when uvicorn gives up on them."""

        def __init__(self, config: uvicorn.Config, engine: object) -> None:
            super().__init__(config)
            self._engine = engine

        def handle_exit(self, sig: int, frame: object) -> None:
            if not self.should_exit:
                threading.Thread(target=self._engine.shutdown, name="engine-shutdown", daemon=True).start()
            super().handle_exit(sig, frame)

        async def serve(self, sockets: list[Any] | None = None) -> None:
            # out of file descriptors, asyncio logs a traceback per pending connection: summarize them
            asyncio.get_running_loop().set_exception_handler(AcceptErrorFilter())
            await super().serve(sockets)

    return EngineStoppingServer


def _engine_stopping_server(config: object, engine: object) -> object:
    """A uvicorn server for ``config`` that stops ``engine`` as soon as shutdown begins."""
    return _engine_stopping_server_class()(config, engine)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def allowed_hosts(settings: CoreSettings) -> list[str] | None:
    """Host names the server answers: on a loopback address only the loopback names plus ``ALLOWED_HOSTS`` (a
    web page's rebinding of its own name to 127.0.0.1 is refused); elsewhere ``ALLOWED_HOSTS``, or any (None)."""
    extra = _split(settings.allowed_hosts)
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


def serve(settings: CoreSettings) -> None:
    """Blocking: serve HTTP on settings.host:settings.port; shuts the engine down on exit.
    Raises what ``build_engine`` raises (ConfigurationError, BackendUnavailableError, ModelLoadError)."""
    import uvicorn

    from gemmaserve.engine.factory import build_engine
    from gemmaserve.server.app import create_app

    engine = build_engine(settings)
    engine.start()
    try:
        name = served_model_name(settings, engine.backend.model_info.name)
        app = create_app(engine, name, model_aliases=model_aliases(settings), api_key=settings.api_key,
                         allowed_hosts=allowed_hosts(settings), allowed_origins=_split(settings.allowed_origins),
                         debug_endpoints=settings.enable_debug_endpoints)
        logger.info("serving %s (backend %s) on http://%s:%d", name, engine.backend_name, settings.host, settings.port)
        limits = connection_limits(settings)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            http=guarded_protocol_class(limits),
            timeout_keep_alive=limits.timeout_keep_alive,  # type: ignore[arg-type]  # a float works
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        _engine_stopping_server(config, engine).run()
    finally:
        engine.shutdown()
