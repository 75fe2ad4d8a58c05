"""Incremental detokenization with stop strings.

Turning tokens into text one at a time is not ``decode(token)`` per token: byte-level tokens can
split a UTF-8 character, and tokenizers merge spaces. :class:`IncrementalDetokenizer` decodes the
whole output so far and emits only the new, stable suffix. With stop strings it holds back any
tail that could still become a stop string, so a stop string is never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gemmaserve.backend import Tokenizer

__all__ = ["IncrementalDetokenizer", "DetokenizedDelta"]

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class DetokenizedDelta:
    """Text that became final with this step; ``stopped`` is set once a stop string matched
    (the text up to, not including, the stop string has then been emitted in full)."""

    text: str
    stopped: bool = False
    stop_string: str | None = None


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Feeds on token IDs, emits text deltas. Mutates its own buffers only."""

    tokenizer: Tokenizer
    stop: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    emitted: str = ""
    stopped: bool = False

    def __post_init__(self) -> None:
        self.stop = tuple(s for s in self.stop if s)

    @property
    def text(self) -> str:
        """Everything emitted so far (excludes a matched stop string and anything after it)."""
        return self.emitted

    def add(self, new_token_ids: Sequence[int]) -> DetokenizedDelta:
        """Append tokens and return the newly final text. After a stop match, adds nothing."""
        if self.stopped:
            return DetokenizedDelta("", True)
        self.token_ids.extend(new_token_ids)
        full = self.tokenizer.decode(self.token_ids)
        if full.endswith(_REPLACEMENT):  # an unfinished multi-byte character: wait for more tokens
            full = full.rstrip(_REPLACEMENT)
        if not full.startswith(self.emitted):  # tokenizer re-merged earlier text; keep what was sent
            full = self.emitted + full[len(self.emitted) :]
        for stop in self.stop:
            index = full.find(stop, max(0, len(self.emitted) - len(stop) + 1))
            if index != -1:
                cut = full[:index]
                delta = cut[len(self.emitted) :] if len(cut) > len(self.emitted) else ""
                self.emitted += delta
                self.stopped = True
                return DetokenizedDelta(delta, True, stop)
        stable_end = len(full) - self._held_back(full)
        delta = full[len(self.emitted) : stable_end] if stable_end > len(self.emitted) else ""
        self.emitted += delta
        return DetokenizedDelta(delta)

    def flush(self) -> str:
        """At the end of the request: release any held-back text (it did not become a stop string)."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.token_ids)
        delta = full[len(self.emitted) :] if full.startswith(self.emitted) else ""
        self.emitted += delta
        return delta

    def _held_back(self, full: str) -> int:
        """Length of the longest suffix of ``full`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(full)), longest, -1):
                if full.endswith(stop[:size]):
                    longest = size
                    break
        return longest
