"""The route table: every generation API the worker serves, as its protocol adapter (adapter.py).
app.py serves each with one handler; openapi.py describes each from the same entries."""

from __future__ import annotations

from .adapter import ProtocolAdapter
from .anthropic_messages import Messages
from .openai_chat import ChatCompletions
from .openai_completions import Completions
from .openai_responses import Responses

ROUTES: tuple[ProtocolAdapter, ...] = (ChatCompletions(), Completions(), Responses(), Messages())
