"""The engine layer: requests, the continuous-batching scheduler, and the threaded Engine.

Pure Python; talks to backends only through ``gemmaserve.backend.InferenceBackend``.
"""

from __future__ import annotations

from gemmaserve.engine.engine import Engine, EngineStats
from gemmaserve.engine.factory import build_engine
from gemmaserve.engine.handles import EventCallback, RequestHandle, RequestStream
from gemmaserve.engine.request import FinishReason, Request, RequestEvent, RequestMetrics, RequestOutput, RequestState
from gemmaserve.engine.scheduler import ContinuousBatchScheduler, SchedulerStats

__all__ = [
    "Engine",
    "EngineStats",
    "build_engine",
    "RequestHandle",
    "RequestStream",
    "EventCallback",
    "Request",
    "RequestState",
    "FinishReason",
    "RequestMetrics",
    "RequestOutput",
    "RequestEvent",
    "ContinuousBatchScheduler",
    "SchedulerStats",
]
