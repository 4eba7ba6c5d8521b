"""Tool-call and reasoning formats, one class each, resolved once per model (registry.py).

A tool format (tool_format.py; hermes, llama3, mistral, dsml, fenced) owns its markers, its streaming
parser, the grammar that forces a call in it, and how prior calls and results are written into a
prompt. A reasoning format (reasoning.py) owns its markers, its splitter and the grammar for
reasoning before a forced call. Harmony (harmony.py, gpt-oss) owns the whole turn: it renders the
prompt through openai_harmony and parses reasoning, answer and calls from its channels
(`ModelFormats.channels`). The API layer asks the registry for a model's ModelFormats and never
branches on a format's name.
"""

from .events import ContentDelta, ParseResult, ToolCall, ToolCallArgsDelta, ToolCallStart, collect
from .reasoning import ReasoningConfigError, ReasoningFormat, parse_override
from .registry import TOOL_FORMATS, ModelFormats, detect_tool_format, resolve, tool_format
from .tool_format import ToolFormat

__all__ = ["TOOL_FORMATS", "ContentDelta", "ModelFormats", "ParseResult", "ReasoningConfigError", "ReasoningFormat",
           "ToolCall", "ToolCallArgsDelta", "ToolCallStart", "ToolFormat", "collect", "detect_tool_format",
           "parse_override", "resolve", "tool_format"]
