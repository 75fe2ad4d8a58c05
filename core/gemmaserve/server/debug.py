"""``GET /debug/kv``: KV bookkeeping snapshot plus integrity checks (engine, scheduler, backend).

Blocking (takes the engine's step lock and the backend lock): call it from a worker thread. The server answers
through :class:`KVReportCache`, so a flood of requests takes those locks at most once per interval.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemmaserve.engine.engine import Engine

__all__ = ["KVReportCache", "kv_report"]

REPORT_INTERVAL_S = 0.1
"""A ``/debug/kv`` report is reused for this long: the checks take the engine's locks, which stalls generation."""


class KVReportCache:
    """:func:`kv_report` of ``engine``, computed at most once per ``interval_s``: callers in between (and callers
    waiting while one is computed) get that report, with ``age_s`` saying how old it is. Thread-safe."""

    def __init__(self, engine: Engine, interval_s: float = REPORT_INTERVAL_S) -> None:
        self._engine = engine
        self._interval = interval_s
        self._lock = threading.Lock()
        self._report: dict[str, Any] | None = None
        self._at = 0.0

    def get(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if self._report is None or now - self._at >= self._interval:
                self._report, self._at = kv_report(self._engine), time.monotonic()
            return {**self._report, "age_s": round(time.monotonic() - self._at, 3)}


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
