"""A constraint that waits for a trigger token (llama.cpp's lazy grammars): what ``tools[].function.strict`` needs
under ``tool_choice: "auto"``, where the model may write text or call a function, and a call it makes must follow
the function's schema.

The output is free until the trigger token is generated; that token is the grammar's first, and from it every
token follows the grammar until the grammar is complete; then the output is free again, and the next trigger
starts the grammar afresh. The request is never ended by the constraint (EOS, stop tokens, stop strings and
``max_tokens`` end it). While free, the mask allows every token of the vocabulary, so a free step samples what an
unconstrained one would.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from gemmaserve.sampling_params import all_tokens_mask

from .grammar import ConstraintError, TokenConstraint

__all__ = ["TriggeredConstraint"]

_UNDO_DEPTH = 8
"""How many advances :meth:`TriggeredConstraint.rollback` can undo (the engine undoes at most one)."""


class TriggeredConstraint(TokenConstraint):
    """One request's position: free (waiting for ``trigger_id``) or inside a grammar started by it. ``template``
    is the compiled grammar at its start (shared, never advanced: each trigger copies it). Not thread-safe (the
    engine thread owns it)."""

    def __init__(self, template: Any, trigger_id: int, what: str, mask_bytes: int, vocab_size: int) -> None:
        super().__init__(None, what, mask_bytes)
        self._template = template
        self._trigger_id = trigger_id
        self._vocab_size = vocab_size
        assert len(all_tokens_mask(vocab_size)) == mask_bytes, "the vocabulary and the masks' width disagree"
        self._inside: TokenConstraint | None = None
        """The grammar the trigger started (None: free)."""
        self._undo: deque[tuple[str, TokenConstraint | None]] = deque(maxlen=_UNDO_DEPTH)
        """Per advance, newest last: ("free", None), ("open", None), ("inside", None) or ("close", the grammar
        that completed)."""

    @property
    def is_triggered(self) -> bool:
        """True while the output is inside the grammar (the trigger came and the grammar is not complete)."""
        return self._inside is not None

    def _mask_matcher(self) -> Any:
        return self._inside._matcher if self._inside is not None else None

    def _unconstrained(self) -> bytes:
        return all_tokens_mask(self._vocab_size)

    def advance_if_valid(self, token_id: int) -> bool | ConstraintError:
        inside = self._inside
        if inside is None:
            if token_id != self._trigger_id:
                self._undo.append(("free", None))
                return False
            inside = TokenConstraint(self._template.deep_copy(), self._what, self.mask_bytes)
            result = inside.advance_if_valid(token_id)
            if isinstance(result, ConstraintError):
                return result
            if result:  # a grammar of the trigger alone: complete at once, free again
                self._undo.append(("free", None))
                return False
            self._inside = inside
            self._undo.append(("open", None))
            return False
        result = inside.advance_if_valid(token_id)
        if isinstance(result, ConstraintError):
            return result
        if result:
            self._inside = None
            self._undo.append(("close", inside))
        else:
            self._undo.append(("inside", None))
        return False

    def rollback(self) -> None:
        if not self._undo:
            raise RuntimeError(f"could not roll the {self._what} constraint back one token (no advance recorded)")
        kind, grammar = self._undo.pop()
        if kind == "open":
            self._inside = None
        elif kind == "inside":
            assert self._inside is not None
            self._inside.rollback()
        elif kind == "close":
            assert grammar is not None
            grammar.rollback()
            self._inside = grammar

    def copy(self) -> TriggeredConstraint:
        """An independent constraint at the same position, its advances undoable as this one's are."""
        twin = TriggeredConstraint(self._template, self._trigger_id, self._what, self.mask_bytes, self._vocab_size)
        twin._inside = self._inside.copy() if self._inside is not None else None
        twin._undo.extend((kind, grammar.copy() if grammar is not None else None) for kind, grammar in self._undo)
        return twin

    @property
    def is_complete(self) -> bool:
        return False
