"""``gemmaserve serve``: build the engine, wrap it in the app, run uvicorn until interrupted."""

from __future__ import annotations

import logging
from pathlib import Path

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
        app = create_app(engine, name, model_aliases=model_aliases(settings))
        logger.info("serving %s (backend %s) on http://%s:%d", name, engine.backend_name, settings.host, settings.port)
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    finally:
        engine.shutdown()
