"""A constraint that holds an output only if it opens in a given way (``StructuredOutputs(opening=...)``): what
``tools[].function.strict`` needs under ``tool_choice: "auto"`` with the json tool parser, whose calls have no
opening token (the parser takes a reply that starts with ``{``, ``[{`` or a code fence around them for calls).

While the text so far can still begin with a match of the opening, the grammar's masks hold every token (its
grammar must also accept the text that rules the opening out), and special tokens that the text does not show may
come too (an end-of-turn token ends an empty reply; they are not fed to the grammar), as may special tokens whose
shown text rules the opening out (Gemma's ``<b>``: the output is then free). Once the text cannot begin with a
match, the output is free: every token is allowed, as without a constraint. Once it does begin with one, the grammar
holds the rest, and its completion ends the request.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from gemmaserve.sampling_params import all_tokens_mask

from .grammar import ConstraintError, TokenConstraint, _grammar_step

__all__ = ["OpeningConstraint"]

_UNDO_DEPTH = 8
"""How many advances :meth:`OpeningConstraint.rollback` can undo (the engine undoes at most one)."""

_OPEN, _HELD, _FREE = "open", "held", "free"
"""The phases: the opening is undecided; the output opened with a match (the grammar holds it); it cannot (free)."""


class OpeningConstraint(TokenConstraint):
    """One request's position. ``matcher``: the grammar (llguidance) at the output's start; ``opening``: a matcher
    of ``(?:opening)(?s:.*)``, accepting once the text begins with a match and in error once it cannot;
    ``invisible``: the special tokens the text does not show, ``shown``: those it shows as text that rules the
    opening out (bit i: token i; both allowed while the opening is undecided). Not thread-safe (the engine thread
    owns it)."""

    _widens = True

    def __init__(self, matcher: Any, opening: Any, invisible: int, shown: int, what: str, mask_bytes: int,
                 vocab_size: int) -> None:
        super().__init__(matcher, what, mask_bytes)
        self._opening = opening
        self._invisible_bits, self._shown_bits = invisible, shown
        self._special_bits = invisible | shown
        self._vocab_size = vocab_size
        self._phase = _OPEN
        self._undo: deque[tuple[str, bool]] = deque(maxlen=_UNDO_DEPTH)
        """Per advance, newest last: the phase before it and whether the matchers took the token."""

    @property
    def phase(self) -> str:
        """``"open"`` (undecided), ``"held"`` (the grammar holds the output) or ``"free"``."""
        return self._phase

    def _mask_matcher(self) -> Any:
        return None if self._phase == _FREE else self._matcher

    def _unconstrained(self) -> bytes:
        return all_tokens_mask(self._vocab_size)

    def _widen(self, mask: Any) -> None:
        """While undecided, the special tokens join the grammar's ``mask`` (written in place)."""
        if self._phase == _OPEN and self._special_bits:
            bits = int.from_bytes(mask, "little") | self._special_bits
            mask[:] = bits.to_bytes(self.mask_bytes, "little")

    def _cannot_continue(self, mask: bytes | memoryview) -> bool:
        return self._phase != _FREE and super()._cannot_continue(mask)

    def advance_if_valid(self, token_id: int) -> bool | ConstraintError:
        phase = self._phase
        if phase == _FREE:
            self._undo.append((phase, False))
            return False
        if phase == _OPEN and self._special_bits >> token_id & 1:
            if self._shown_bits >> token_id & 1:
                self._phase = _FREE  # text that rules the opening out
            self._undo.append((phase, False))  # else not text: the opening is still undecided
            return False
        result = _grammar_step(self._matcher, self._what, token_id)
        if isinstance(result, ConstraintError):
            return result
        if phase == _OPEN:
            if self._opening.try_consume_tokens([token_id]) != 1:
                self._phase = _FREE  # the text cannot begin with a match any more
            elif self._opening.is_accepting():
                self._phase = _HELD
        self._undo.append((phase, True))
        return result and self._phase == _HELD

    def rollback(self) -> None:
        if not self._undo:
            raise RuntimeError(f"could not roll the {self._what} constraint back one token (no advance recorded)")
        phase, fed = self._undo.pop()
        if fed:
            super().rollback()
            if phase == _OPEN and self._phase != _FREE:  # a token the opening matcher refused left it as it was
                self._opening.rollback(1)
        self._phase = phase

    def copy(self) -> OpeningConstraint:
        """An independent constraint at the same position, its advances undoable as this one's are."""
        twin = OpeningConstraint(self._matcher.deep_copy(), self._opening.deep_copy(), self._invisible_bits,
                                 self._shown_bits, self._what, self.mask_bytes, self._vocab_size)
        twin._phase = self._phase
        twin._undo.extend(self._undo)
        return twin

    @property
    def is_complete(self) -> bool:
        return self._phase == _HELD and bool(self._matcher.is_stopped())
