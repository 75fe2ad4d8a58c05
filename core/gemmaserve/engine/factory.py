"""``build_engine``: settings -> selected backend -> loaded model -> prefix cache -> KV events -> Engine.

Imports nothing heavy itself: the backend factory (a dotted path in its BackendSpec), the default-model
helper and the KV-event publisher's zmq are imported only when called.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gemmaserve.backend import InferenceBackend
from gemmaserve.engine.engine import Engine
from gemmaserve.errors import BackendUnavailableError, ConfigurationError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.kv.events import KVEventSource, ZmqEventPublisher
from gemmaserve.plugins import load_registry
from gemmaserve.registry import resolve_dotted
from gemmaserve.selection import select_backend
from gemmaserve.settings import CoreSettings, check_gemmaserve_variables, load_settings

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings

    from gemmaserve.registry import BackendRegistry

__all__ = ["build_engine", "capability_problem"]

logger = logging.getLogger(__name__)


def _settings_classes(registry: BackendRegistry) -> list[type[BaseSettings]] | None:
    """The core's settings class and each registered backend's declared one (``BackendSpec.settings``); None when
    one fails to import (its names are unknown, so no ``GEMMASERVE_*`` variable can be called a misspelling; the
    backend's own selection reports its plugin's import error)."""
    classes: list[type[BaseSettings]] = [CoreSettings]
    for path in sorted({spec.settings for spec in registry.specs.values() if spec.settings}):
        try:
            classes.append(resolve_dotted(path))
        except ImportError as exc:
            logger.warning("settings class %s cannot be imported (%s): GEMMASERVE_* variables are not checked", path,
                           exc)
            return None
    return classes


def capability_problem(backend: object) -> str | None:
    """Why ``backend`` (what a factory returned) cannot be served as it declares itself, or None: not an
    InferenceBackend; ``mixed_step`` without its own ``forward_step``; a streaming-only backend claiming
    ``mixed_step``, ``logprobs`` or ``top_logprobs`` (a stream yields token ids only)."""
    if not isinstance(backend, InferenceBackend):
        return f"the factory returned a {type(backend).__name__}, not a gemmaserve.backend.InferenceBackend"
    caps = backend.capabilities
    if caps.mixed_step and type(backend).forward_step is InferenceBackend.forward_step:
        return "capabilities.mixed_step is set but the class does not implement forward_step"
    if not caps.continuous_batching:
        claimed = [name for name in ("mixed_step", "logprobs", "top_logprobs") if getattr(caps, name)]
        if claimed:
            return (f"a streaming-only backend (continuous_batching=False) cannot declare {', '.join(claimed)}: "
                    "generate_stream yields token ids only")
    return None


def build_engine(settings: CoreSettings | None = None, registry: BackendRegistry | None = None) -> Engine:
    """Select the backend for ``settings`` (env/.env when None), load the model (``settings.model``
    or the embedded default model), attach a core prefix cache of ``PREFIX_CACHE_BLOCKS`` blocks when
    the backend uses one, and return a not-yet-started Engine that owns (and will close) the backend.

    With ``KV_EVENTS_CONFIG`` enabling events, the prefix cache's changes are published in vLLM's format
    (``gemmaserve.kv.events``) by ``engine.kv_events``, which the engine closes at shutdown.

    Raises ConfigurationError for a ``GEMMASERVE_*`` variable no settings class reads (a misspelling),
    ConfigurationError / BackendUnavailableError from selection (which passes over, or refuses when named, a
    backend that does not declare the ``QUANTIZATION``, tensor parallel or expert parallel asked for),
    BackendUnavailableError if
    the backend's factory cannot be imported, whatever the factory raises (ModelLoadError...), and
    ConfigurationError (the backend closed again) if KV events are enabled for a backend without a prefix cache
    or their sockets cannot be opened.
    """
    settings = settings or load_settings()
    registry = registry or load_registry()
    classes = _settings_classes(registry)
    if classes is not None:
        check_gemmaserve_variables(classes)
    selection = select_backend(settings, registry)
    spec = selection.spec
    model_path = settings.model
    if model_path is None and spec.requires_model:
        from gemmaserve.models.default_model import ensure_default_model

        model_path = str(ensure_default_model())
    try:
        factory = resolve_dotted(spec.factory)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend {spec.name!r} failed to import its factory {spec.factory!r}: {exc}"
        ) from exc
    try:
        backend = factory(model_path or "", selection.device, settings)
    except TypeError as exc:
        if "abstract" not in str(exc):
            raise
        raise BackendUnavailableError(
            f"backend {spec.name!r} (factory {spec.factory!r}) cannot be built: {exc}; a backend class implements "
            "every abstract method of gemmaserve.backend.InferenceBackend (a streaming-only one can subclass "
            "gemmaserve.backend.StreamingBackend; docs/writing-a-backend.md)") from exc
    problem = capability_problem(backend)
    if problem is not None:
        close = getattr(backend, "close", None)
        if callable(close):
            close()
        raise BackendUnavailableError(f"backend {spec.name!r} (factory {spec.factory!r}): {problem} "
                                      "(docs/writing-a-backend.md)")
    cache = None
    try:
        if backend.capabilities.uses_core_cache_manager and settings.prefix_cache_blocks > 0:
            cache = CacheManager(settings.prefix_cache_blocks, settings.kv_block_size)
            backend.set_cache_adapter(cache)
        publisher = _kv_events(settings, spec.name, backend, cache)
    except BaseException:
        backend.close()
        raise
    logger.info(
        "engine: backend %s on %s (%s), model %s, prefix cache %s, max_batch_size=%d, max_active_kv_tokens=%d",
        spec.name,
        selection.device,
        selection.reason,
        model_path,
        f"{settings.prefix_cache_blocks} x {settings.kv_block_size} tokens" if cache else "off (or backend-internal)",
        settings.max_batch_size,
        settings.max_active_kv_tokens,
    )
    try:
        return Engine(backend, settings, cache, owns_backend=True, backend_name=spec.name, kv_events=publisher)
    except BaseException:
        if publisher is not None:
            publisher.close()
        backend.close()
        raise


def _event_source(backend: InferenceBackend, cache: CacheManager | None) -> KVEventSource | None:
    """The prefix cache whose blocks KV events report: the core cache, else the backend's own if it has one
    that reports its blocks (the backend itself, or its ``prefix_cache``: custom_torch's)."""
    if cache is not None:
        return cache
    if backend.capabilities.uses_core_cache_manager:
        return None
    for candidate in (backend, getattr(backend, "prefix_cache", None)):
        if isinstance(candidate, KVEventSource):
            return candidate
    return None


def _kv_events(
    settings: CoreSettings, backend_name: str, backend: InferenceBackend, cache: CacheManager | None
) -> ZmqEventPublisher | None:
    """The publisher of the prefix cache's changes ``KV_EVENTS_CONFIG`` asks for, attached (None: events off or
    the null publisher). Refuses events for a backend without a prefix cache rather than publish nothing."""
    config = settings.kv_events_config
    if config is None or not config.enable_kv_cache_events:
        if config is not None and config.resolved_publisher == "zmq":
            logger.info("KV events: off (KV_EVENTS_CONFIG has enable_kv_cache_events false)")
        return None
    source = _event_source(backend, cache)
    if source is None:
        why = (
            "PREFIX_CACHE_BLOCKS=0 turns its prefix cache off"
            if backend.capabilities.uses_core_cache_manager
            else "it keeps no prefix cache that reports its blocks"
        )
        raise ConfigurationError(
            f"KV_EVENTS_CONFIG enables KV-cache events, but backend {backend_name!r} has no prefix cache to report "
            f"({why}); use a backend with one (hf, custom-*, mlx) or drop enable_kv_cache_events"
        )
    if config.resolved_publisher == "null":
        logger.info("KV events: enabled with the null publisher, so nothing is published")
        return None
    publisher = ZmqEventPublisher(config, data_parallel_rank=settings.data_parallel_rank)
    publisher.attach(source)
    return publisher
