"""mlx-stream's KV reuse: an LRU of finished streams' mlx_lm prompt caches, keyed by session id.

An entry holds the tokens whose KV its cache holds (prompt + every token the stream yielded). A new
stream takes the entry sharing the longest prefix with its prompt (its own session's on a tie),
trims it back to that prefix when the prompt diverges (if every layer's cache can be trimmed) and
runs only the rest of the prompt. The scheduler passes each request's id as ``session_id``, so a
follow-up request (chat turn) reuses its predecessor's KV whatever its id.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

__all__ = ["SessionEntry", "SessionCache"]


@dataclass(slots=True)
class SessionEntry:
    """``cache`` (an mlx_lm prompt cache, one per KV layer) holds the KV of ``tokens`` in order."""

    tokens: list[int]
    cache: list[Any]

    def is_consistent(self) -> bool:
        return all(getattr(c, "offset", len(self.tokens)) == len(self.tokens) for c in self.cache)

    def reusable_prefix(self, prompt: tuple[int, ...]) -> int:
        """How many leading prompt tokens this entry could serve (at least one prompt token is
        always left to run, so the stream gets logits)."""
        common = 0
        for cached, wanted in zip(self.tokens, prompt, strict=False):
            if cached != wanted:
                break
            common += 1
        keep = min(common, len(prompt) - 1)
        if keep <= 0 or (keep < len(self.tokens) and not can_trim_prompt_cache(self.cache)):
            return 0
        return keep

    def trim_to(self, keep: int) -> None:
        """Drop the KV of every token after the first ``keep`` (mutates ``cache`` and ``tokens``)."""
        excess = len(self.tokens) - keep
        if excess > 0:
            trimmed = trim_prompt_cache(self.cache, excess)
            assert trimmed == excess, (trimmed, excess)
            del self.tokens[keep:]


class SessionCache:
    """At most ``capacity`` entries, least recently used evicted first. Guarded by the backend lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def take_longest(self, prompt: tuple[int, ...], session_id: str | None) -> tuple[SessionEntry | None, int]:
        """Remove and return the entry serving the most of ``prompt``, trimmed to that prefix, and
        the prefix length; ``(None, 0)`` if none serves any. The caller owns the entry until
        :meth:`put`. The session's own stale entry is dropped either way."""
        best_key, best = None, 0
        for key, entry in self._entries.items():
            served = entry.reusable_prefix(prompt)
            if served > best or (served == best and served > 0 and key == session_id):
                best_key, best = key, served
        taken = self._entries.pop(best_key) if best_key is not None else None
        if session_id is not None:
            self._entries.pop(session_id, None)
        if taken is None:
            return None, 0
        taken.trim_to(best)
        return taken, best

    def put(self, session_id: str, entry: SessionEntry) -> None:
        """File ``entry`` as the session's latest KV (dropped if inconsistent or capacity is 0)."""
        if self.capacity == 0 or not entry.is_consistent():
            return
        self._entries[session_id] = entry
        self._entries.move_to_end(session_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def check_integrity(self) -> None:
        """Raise RuntimeError if over capacity or an entry's cache disagrees with its tokens."""
        if len(self._entries) > self.capacity:
            raise RuntimeError(f"SessionCache: {len(self._entries)} entries > capacity {self.capacity}")
        for session_id, entry in self._entries.items():
            if not entry.is_consistent():
                raise RuntimeError(f"SessionCache: session {session_id!r} cache offsets != {len(entry.tokens)} tokens")
