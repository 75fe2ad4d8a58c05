"""User-facing exception types.

Every error a user can trigger is one of these, with text that names what was wrong and what is
accepted. ``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

__all__ = [
    "GemmaserveError",
    "ConfigurationError",
    "BackendUnavailableError",
    "ModelLoadError",
    "InvalidRequestError",
    "PromptTooLongError",
    "KVCapacityError",
    "EngineOverloadedError",
    "RequestCancelledError",
    "BackendStepError",
    "LLMClosedError",
    "WINDOW_OF_ONE",
]

WINDOW_OF_ONE = ("transformers' generate keeps the whole cache for a window of 1 (its sliding cache keeps the last "
                 "sliding_window - 1 tokens, a slice that takes all of them), so its generate and its forward disagree "
                 "and no backend can match both; use sliding_window >= 2")
"""Why every backend refuses a sliding window of 1 (the reason its ModelLoadError gives)."""


class GemmaserveError(Exception):
    """Base class of every error gemmaserve raises on purpose."""


class ConfigurationError(GemmaserveError, ValueError):
    """A setting or flag has a value that is not accepted."""


class BackendUnavailableError(GemmaserveError):
    """The requested backend exists but cannot run here (extra missing, no CUDA, ...)."""


class ModelLoadError(GemmaserveError):
    """A model directory cannot be loaded (missing files, unsupported architecture, bad dtype)."""


class InvalidRequestError(GemmaserveError, ValueError):
    """A request's prompt or sampling parameters are invalid."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus ``max_tokens``) can never fit the model context or the KV pool."""


class KVCapacityError(InvalidRequestError):
    """The request needs more KV memory than the engine has in total."""


class EngineOverloadedError(GemmaserveError):
    """The engine cannot take more work right now; retry later (HTTP 429/503)."""


class RequestCancelledError(GemmaserveError):
    """The request was cancelled before it finished."""


class BackendStepError(GemmaserveError):
    """The backend raised while processing this request; other requests are unaffected."""


class LLMClosedError(GemmaserveError, RuntimeError):
    """The :class:`gemmaserve.LLM` was closed (``close()`` or the end of its ``with`` block): it generates nothing
    more."""
