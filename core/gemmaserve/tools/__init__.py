"""Tool calling: parsing calls out of the model's text (:mod:`.parsers`) and forcing one
(:mod:`.constraints`, for ``tool_choice`` ``required`` or a named function)."""

from .constraints import tool_call_constraint
from .parsers import PARSERS, Gemma4ToolParser, JsonToolParser, ParsedText, ToolCall, ToolParser

__all__ = ["PARSERS", "Gemma4ToolParser", "JsonToolParser", "ParsedText", "ToolCall", "ToolParser",
           "tool_call_constraint"]
