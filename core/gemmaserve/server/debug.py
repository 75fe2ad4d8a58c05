"""``GET /debug/kv``: KV bookkeeping snapshot plus integrity checks (engine, scheduler, backend).

Blocking (takes the engine's step lock and the backend lock): call it from a worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemmaserve.engine.engine import Engine

__all__ = ["kv_report"]


def kv_report(engine: Engine) -> dict[str, Any]:
    """Snapshot: running/waiting requests, finish reasons, the backend's ``kv_stats()``, the core
    prefix-cache stats, live row KVs (where the backend counts them), and ``integrity``: ``"ok"``
    or the first inconsistency found by ``Engine.check_integrity`` / ``backend.check_integrity``."""
    backend = engine.backend
    integrity = "ok"
    try:
        engine.check_integrity()
        with backend.lock:
            backend.check_integrity()
    except Exception as exc:  # report, do not crash: this endpoint exists to show such problems
        integrity = f"{type(exc).__name__}: {exc}"
    stats = engine.stats()
    with backend.lock:
        live_rows = getattr(backend, "num_live_rows", None)
    if live_rows is None:
        live_rows = stats.kv.get("live_rows")
    cache = stats.cache
    return {
        "backend": engine.backend_name,
        "running": stats.running,
        "waiting": stats.waiting,
        "finished": stats.finished,
        "live_rows": live_rows,
        "kv": stats.kv,
        "prefix_cache": None if cache is None else {
            "num_blocks": cache.num_blocks,
            "block_size": cache.block_size,
            "used_blocks": cache.used_blocks,
            "free_blocks": cache.free_blocks,
            "evictable_blocks": cache.evictable_blocks,
            "pinned_blocks": cache.pinned_blocks,
        },
        "integrity": integrity,
    }
