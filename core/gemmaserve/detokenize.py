"""Incremental detokenization with stop strings.

Turning tokens into text one at a time is not ``decode(token)`` per token: byte-level tokens can
split a UTF-8 character, and tokenizers merge spaces. :class:`IncrementalDetokenizer` decodes a
small sliding window of recent tokens (optionally seeded with the prompt's last tokens, so a
leading space of the first output token survives) and appends only the new, stable text; a
trailing U+FFFD (an unfinished character) waits for the next token, the text before it does not.
Cost per token is constant: a run of more than ``_MAX_PENDING_TOKENS`` tokens that decode to nothing leaves the
window, and a longer run ending in U+FFFD (invalid bytes) is taken as it decodes.

With stop strings it holds back any tail that could still become a stop string, so a stop string
is never emitted (unless ``include_stop_str``: then it is, and nothing is held back); the earliest match over all
stop strings wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gemmaserve.backend import Tokenizer

if TYPE_CHECKING:
    from gemmaserve.engine.request import RequestOutput
    from gemmaserve.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "DetokenizedDelta", "StopPrefixMatcher", "detokenize", "hides_stop_token"]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5
_MAX_PENDING_TOKENS = 16
"""Tokens the window waits on before their text is taken as it decodes: a UTF-8 character is at most 4 bytes, so a
longer run that decodes to nothing (skipped special tokens) or ends in U+FFFD at every step (bytes no character can
finish) would otherwise grow the window, and the cost of every later token with it (quadratic: a client could ask
for thousands of one byte token through ``logit_bias``)."""


def hides_stop_token(output: RequestOutput | None, params: SamplingParams) -> bool:
    """True when ``output`` (a final one; None while the request runs) ends with an EOS or ``stop_token_ids``
    token whose text is left out of the output text: always, unless ``include_stop_str_in_output`` (vLLM's rule;
    the token itself stays in ``token_ids``). The one definition the offline API and the HTTP server use."""
    return output is not None and output.stop_token_id is not None and not params.include_stop_str_in_output


@dataclass(slots=True)
class DetokenizedDelta:
    """Text that became final with this step; ``stopped`` is set once a stop string matched
    (the text up to, not including, the stop string has then been emitted in full)."""

    text: str
    stopped: bool = False
    stop_string: str | None = None


class StopPrefixMatcher:
    """Knuth-Morris-Pratt over a text stream for one stop string: :meth:`feed` takes the stream's next characters
    and returns the matcher's state, the length of the longest prefix of ``stop`` that is a suffix of the text fed
    so far (``len(stop)``: it ends with the whole stop string). Amortized O(1) per character, the border table
    built lazily (only as far as a match has reached), so a long stop string costs nothing until the text matches
    it, and a text that keeps matching a long prefix costs no more than a short one (the detokenizer's held-back
    search was quadratic in the held-back text)."""

    __slots__ = ("stop", "state", "_borders")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        self._borders = [0]  # _borders[i]: the longest proper border of stop[:i + 1], computed up to a match's reach

    def feed(self, text: str, state: int | None = None) -> int:
        """The state after ``text``, starting from ``state`` (default: the saved one; the saved one is updated
        only when ``state`` is None)."""
        stop, borders = self.stop, self._borders
        current = self.state if state is None else state
        for char in text:
            if current == len(stop):
                current = borders[current - 1]
            while current and stop[current] != char:
                current = borders[current - 1]
            if stop[current] == char:
                current += 1
                if current < len(stop) and len(borders) <= current:
                    self._extend(current)
        if state is None:
            self.state = current
        return current

    def border(self, size: int) -> int:
        """The longest proper border of ``stop[:size]`` (size >= 1)."""
        return self._borders[size - 1]

    def _extend(self, upto: int) -> None:
        stop, borders = self.stop, self._borders
        while len(borders) <= upto:
            index, border = len(borders), borders[-1]
            while border and stop[index] != stop[border]:
                border = borders[border - 1]
            borders.append(border + 1 if stop[index] == stop[border] else 0)


def detokenize(tokenizer: Tokenizer, token_ids: Sequence[int], *, prompt_ids: Sequence[int] | None = None,
               skip_special_tokens: bool = True) -> str:
    """The final text of ``token_ids`` exactly as :class:`IncrementalDetokenizer` streams it (the prompt's last
    tokens as context; an unfinished last character as one U+FFFD, where a byte-fallback ``decode`` writes one per
    byte): what a non-streamed result shows, so it equals the streamed text of the same tokens."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    detok.add(token_ids)
    detok.flush()
    return detok.text


class IncrementalDetokenizer:
    """Feeds on output token ids, emits text deltas. Not thread-safe (one request, one consumer).

    ``text`` is everything emitted so far: the decoded output, minus a matched stop string and
    what follows it, minus (until :meth:`flush`) a held-back tail."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        *,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        shown_special_ids: frozenset[int] = frozenset(),
        min_tokens: int = 0,
        include_stop_str: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.shown_special_ids = shown_special_ids
        """Special tokens shown although ``skip_special_tokens`` hides the others: the markers a tool-call or
        reasoning parser reads out of the text (Gemma 4's ``<|tool_call>``, ``<|"|>``, ``<|channel>``)."""
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str = include_stop_str
        """vLLM's ``include_stop_str_in_output``: a matched stop string stays in the text (what follows it in
        the same token is still cut), and nothing is held back (vLLM's rule)."""
        self.min_tokens = min_tokens
        """Stop strings are looked for only once more than this many tokens were fed (vLLM V1's ``min_tokens``):
        one that ends within the first ``min_tokens`` tokens' text does not stop the request; one that ends in a
        later token does."""
        self.skip_special_tokens = skip_special_tokens
        self.emitted = ""
        self.stopped = False
        self.stop_string: str | None = None
        self._ids: list[int] = self._context(prompt_ids)
        self._num_context = len(self._ids)
        self._window = list(self._ids)  # the tokens decoded together: _ids less runs that decoded to nothing
        self._prefix_offset = 0  # the window starts here...
        self._read_offset = len(self._window)  # ...and its text up to here is already in _decoded
        self._decoded = ""  # output text up to _read_offset (may still contain a stop string)
        self._partial = ""  # text after _read_offset that precedes an unfinished character
        self._min_floor = 0  # the text of the first min_tokens output tokens: a stop string must end past it
        self._matchers = [StopPrefixMatcher(stop) for stop in self.stop]  # their saved states cover _decoded
        self._matched_upto = 0  # ...up to here

    @property
    def text(self) -> str:
        return self.emitted

    @property
    def token_ids(self) -> list[int]:
        """The output token ids fed so far (prompt context excluded)."""
        return self._ids[self._num_context :]

    def add(self, new_token_ids: Sequence[int]) -> DetokenizedDelta:
        """Append tokens and return the newly final text. After a stop match, adds nothing. With stop strings the
        tokens are taken one at a time (the first stop string to complete wins, however the tokens are grouped;
        the call's tokens after it are dropped)."""
        if self.stopped:
            return DetokenizedDelta("", True, self.stop_string)
        if len(new_token_ids) > 1 and self.stop:  # the first stop string to complete wins, however tokens arrive
            return self._add_each(new_token_ids)[1]
        self._ids.extend(new_token_ids)
        self._window.extend(new_token_ids)
        self._decode_window(final=False)
        if len(self._ids) - self._num_context <= self.min_tokens:
            self._min_floor = len(self._decoded) + len(self._partial)  # a stop string must end after this
        return self._release(final=False)

    def add_until_stop(self, new_token_ids: Sequence[int]) -> tuple[int, DetokenizedDelta]:
        """Like :meth:`add`, but token by token so a stop string ends the feed: returns how many tokens
        were consumed (all of them, or up to and including the one that completed the match; 0 once
        stopped) and the text they made final."""
        if self.stopped:
            return 0, DetokenizedDelta("", True, self.stop_string)
        if not self.stop:
            return len(new_token_ids), self.add(new_token_ids)
        return self._add_each(new_token_ids)

    def _add_each(self, new_token_ids: Sequence[int]) -> tuple[int, DetokenizedDelta]:
        text = ""
        for count, token in enumerate(new_token_ids, 1):
            delta = self.add([token])
            text += delta.text
            if delta.stopped:
                return count, DetokenizedDelta(text, True, delta.stop_string)
        return len(new_token_ids), DetokenizedDelta(text)

    def flush(self) -> str:
        """At the end of the request: release held-back text (it did not become a stop string),
        including an unfinished character as U+FFFD. A stop string is still cut off."""
        if self.stopped:
            return ""
        self._decode_window(final=True)
        return self._release(final=True).text

    # -- internals -------------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        shown = self.shown_special_ids
        if not (self.skip_special_tokens and shown) or shown.isdisjoint(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        parts, start = [], 0  # the runs between shown tokens without their special tokens, the shown ones as text
        for index, token in enumerate(ids):
            if token in shown:
                if start < index:
                    parts.append(self.tokenizer.decode(ids[start:index], skip_special_tokens=True))
                parts.append(self.tokenizer.decode([token], skip_special_tokens=False))
                start = index + 1
        if start < len(ids):
            parts.append(self.tokenizer.decode(ids[start:], skip_special_tokens=True))
        return "".join(parts)

    def _context(self, prompt_ids: Sequence[int] | None) -> list[int]:
        """The prompt's last few tokens, unless they end inside a character (then no context)."""
        if not prompt_ids:
            return []
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        return [] if self._decode(context).endswith(_REPLACEMENT) else context

    def _decode_window(self, *, final: bool) -> None:
        window = self._window
        prefix_text = self._decode(window[self._prefix_offset : self._read_offset])
        new_text = self._decode(window[self._prefix_offset :])
        new = new_text[len(prefix_text) :]
        if new.endswith(_REPLACEMENT) and len(window) - self._read_offset > (4 if final else _MAX_PENDING_TOKENS):
            self._drop_silent_pending(new_text)  # hidden tokens among an unfinished character's bytes
        if final and new.endswith(_REPLACEMENT):
            # the whole characters before an unfinished one, then one U+FFFD for it (a byte-fallback decoder turns
            # the bytes of a run that ends unfinished into one U+FFFD per byte, whole characters included); the
            # character is at most 4 bytes, so it began in one of the last 4 tokens
            for end in range(len(window) - 1, max(self._read_offset, len(window) - 4) - 1, -1):
                whole = self._decode(window[self._prefix_offset : end])
                if not whole.endswith(_REPLACEMENT):
                    break
            new = whole[len(prefix_text) :] + _REPLACEMENT
        pending = len(window) - self._read_offset
        if new and (final or not new.endswith(_REPLACEMENT)):
            self._advance(new, len(window))
            self._partial = ""
        elif pending > _MAX_PENDING_TOKENS and new:
            # many tokens, every step ending inside a character: the text up to the last character boundary among
            # the last 4 tokens is final (valid UTF-8 has one there); with none (invalid bytes) the text before the
            # last 4 tokens, where a character that could still finish began, is taken as it decodes
            for cut in range(len(window) - 1, len(window) - 5, -1):
                cut_text = self._decode(window[self._prefix_offset : cut])
                if not cut_text.endswith(_REPLACEMENT):
                    break
            self._advance(cut_text[len(prefix_text) :], cut)
            self._partial = new_text[len(cut_text) :].rstrip(_REPLACEMENT)
        elif pending > _MAX_PENDING_TOKENS:  # nothing to show (skipped special tokens): out of the window
            del window[self._read_offset :]
            self._partial = ""
        else:  # more bytes only finish the trailing character: the text before it is final
            self._partial = new.rstrip(_REPLACEMENT)

    def _drop_silent_pending(self, new_text: str) -> None:
        """Take out of the window's pending tokens those that decode to nothing (hidden special tokens) when the
        window decodes to ``new_text`` without them too: the unfinished character's bytes then lie in its last 4
        tokens again, as the cuts above assume."""
        window = self._window
        kept = [token for token in window[self._read_offset :] if self._decode([token])]
        if len(kept) < len(window) - self._read_offset and self._decode(
                window[self._prefix_offset : self._read_offset] + kept) == new_text:
            del window[self._read_offset :]
            window.extend(kept)

    def _advance(self, text: str, read_offset: int) -> None:
        """``text`` (the window's tokens up to ``read_offset``) is final: the window moves on past it."""
        self._decoded += text
        self._prefix_offset = self._read_offset
        self._read_offset = read_offset

    def _release(self, *, final: bool) -> DetokenizedDelta:
        full = self._decoded + self._partial
        start = len(self.emitted)  # a stop string ends in text not emitted yet (begins there, unless included)
        best: tuple[int, str] | None = None
        matching = not self.min_tokens or len(self._ids) - self._num_context > self.min_tokens
        for stop in self.stop if matching else ():
            floor = max(self._min_floor, start) if self.include_stop_str else self._min_floor
            index = full.find(stop, max(0, start - len(stop) + 1) if self.include_stop_str else start)
            while index != -1 and index + len(stop) <= floor:  # ends within the first min_tokens tokens (or emitted)
                index = full.find(stop, index + 1)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            delta = full[start : best[0] + (len(best[1]) if self.include_stop_str else 0)]
            self.emitted += delta
            self.stopped, self.stop_string = True, best[1]
            return DetokenizedDelta(delta, True, best[1])
        end = len(full) if final else len(full) - self._held_back(full, start)
        delta = full[start:end] if end > start else ""
        self.emitted += delta
        return DetokenizedDelta(delta)

    def _held_back(self, full: str, start: int) -> int:
        """Length of the longest suffix of ``full[start:]`` that is a proper prefix of a stop string (0 with
        ``include_stop_str``: the text goes out as it comes). ``full`` is ``_decoded + _partial``: the matchers'
        saved states advance over the new final text, then run on over the tentative ``_partial`` unsaved."""
        if self.include_stop_str:
            return 0
        new, self._matched_upto = self._decoded[self._matched_upto:], len(self._decoded)
        unemitted, longest = len(full) - start, 0
        for matcher in self._matchers:
            size = matcher.feed(self._partial, matcher.feed(new))
            while size and (size == len(matcher.stop) or size > unemitted):  # proper prefixes, in the new text
                size = matcher.border(size)
            longest = max(longest, size)
        return longest
