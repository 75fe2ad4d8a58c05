"""``build_engine``: settings -> selected backend -> loaded model -> prefix cache -> Engine.

Imports nothing heavy itself: the backend factory (a dotted path in its BackendSpec) and the
default-model helper are imported only when called.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gemmaserve.engine.engine import Engine
from gemmaserve.errors import BackendUnavailableError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.registry import resolve_dotted
from gemmaserve.selection import select_backend
from gemmaserve.settings import CoreSettings, load_settings

if TYPE_CHECKING:
    from gemmaserve.registry import BackendRegistry

__all__ = ["build_engine"]

logger = logging.getLogger(__name__)


def build_engine(settings: CoreSettings | None = None, registry: BackendRegistry | None = None) -> Engine:
    """Select the backend for ``settings`` (env/.env when None), load the model (``settings.model``
    or the embedded default model), attach a core prefix cache of ``PREFIX_CACHE_BLOCKS`` blocks when
    the backend uses one, and return a not-yet-started Engine that owns (and will close) the backend.

    Raises ConfigurationError / BackendUnavailableError from selection, BackendUnavailableError if
    the backend's factory cannot be imported, and whatever the factory raises (ModelLoadError...).
    """
    settings = settings or load_settings()
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
    backend = factory(model_path or "", selection.device, settings)
    cache = None
    if backend.capabilities.uses_core_cache_manager and settings.prefix_cache_blocks > 0:
        cache = CacheManager(settings.prefix_cache_blocks, settings.kv_block_size)
        backend.set_cache_adapter(cache)
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
    return Engine(backend, settings, cache, owns_backend=True, backend_name=spec.name)
