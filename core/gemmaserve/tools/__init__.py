"""Tool calling: parsing calls out of the model's text (:mod:`.parsers`) and forcing one
(:mod:`.constraints`, for ``tool_choice`` ``required`` or a named function, and for ``strict`` functions under
``"auto"``)."""

from .constraints import strict_calls_constraint, tool_call_constraint
from .parsers import PARSERS, Gemma4ToolParser, JsonToolParser, ParsedText, ToolCall, ToolParser

__all__ = ["PARSERS", "Gemma4ToolParser", "JsonToolParser", "ParsedText", "ToolCall", "ToolParser",
           "strict_calls_constraint", "tool_call_constraint"]
