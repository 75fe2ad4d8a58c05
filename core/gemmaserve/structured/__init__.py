"""Structured output: constraints on the generated text (JSON schema, regex, choice, grammar).

:class:`StructuredOutputs` says what a request wants; :class:`GrammarCompiler` (llguidance, imported only when a
constraint is compiled) turns it into a per-request :class:`TokenConstraint`, whose mask of allowed tokens the
scheduler hands to the backend's sampling every step (``RowSampling.allowed``)."""

from .grammar import ConstraintError, GrammarCompiler, TokenConstraint
from .spec import MAX_CHOICES, MAX_CONSTRAINT_CHARS, StructuredOutputs, from_response_format

__all__ = ["ConstraintError", "GrammarCompiler", "MAX_CHOICES", "MAX_CONSTRAINT_CHARS", "StructuredOutputs",
           "TokenConstraint", "from_response_format"]
