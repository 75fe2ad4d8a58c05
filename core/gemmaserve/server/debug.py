"""``GET /debug/kv``: KV bookkeeping snapshot plus integrity checks (engine, scheduler, backend).

Blocking (takes the engine's step lock and the backend lock): call it from a worker thread. The server answers
through :class:`KVReportCache`, so a flood of requests takes those locks at most 1/REPORT_INTERVAL_S times a
second, while every caller still gets a report computed after it asked.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemmaserve.engine.engine import Engine

__all__ = ["KVReportCache", "kv_report"]

REPORT_INTERVAL_S = 0.1
"""Reports start at least this far apart: the checks take the engine's locks, which stalls generation."""


class KVReportCache:
    """:func:`kv_report` of ``engine`` for many callers. Every caller gets a report whose computation started
    after it arrived (never a stale one); callers arriving while one is computed share the next one, and
    computations start at least ``interval_s`` apart, so a flood takes the engine's locks at most 1/interval
    times a second. Thread-safe (callers wait on worker threads)."""

    def __init__(self, engine: Engine, interval_s: float = REPORT_INTERVAL_S) -> None:
        self._engine = engine
        self._interval = interval_s
        self._cond = threading.Condition()
        self._busy = False
        self._report: dict[str, Any] | None = None
        self._started = float("-inf")  # when the computation of ``_report`` started
        self._last_start = float("-inf")

    def get(self) -> dict[str, Any]:
        arrival = time.monotonic()
        with self._cond:
            while True:
                if self._report is not None and self._started >= arrival:
                    return dict(self._report)
                if not self._busy:
                    break
                self._cond.wait()
            self._busy = True
            delay = self._interval - (time.monotonic() - self._last_start)
        try:
            if delay > 0:
                time.sleep(delay)
            started = time.monotonic()
            report = kv_report(self._engine)
        except BaseException:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._report, self._started, self._last_start = report, started, started
            self._busy = False
            self._cond.notify_all()
        return dict(report)


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
