"""Mistral tool calls: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], and the newer
[TOOL_CALLS]name[ARGS]{...} form (optionally [CALL_ID]id before [ARGS]). Call ids are 9
alphanumeric characters, in the output and in the history the template is given."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .events import Event, mistral_call_id
from .lark import Term
from .scan import JsonScan, loads
from .tool_format import ToolFormat
from .tool_stream import ToolCallStreamParser, skip_space

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
NAME_SCAN_LIMIT = 256  # characters after [TOOL_CALLS] without [ARGS]: not a call


class MistralParser(ToolCallStreamParser):
    opener = TOOL_CALLS

    def _step_call(self, out: list[Event], final: bool) -> bool:
        buf = self.buf
        j = skip_space(buf, self._body_start)
        if j >= len(buf):
            return False
        if buf[j] in "{[":
            return self._json_value_call(out, final, j)
        # [TOOL_CALLS]name[ARGS]{...}   (optionally [CALL_ID]id before [ARGS])
        a = buf.find(ARGS, j)
        if a < 0:
            if len(buf) - j > NAME_SCAN_LIMIT:  # not a call
                self._close_call(out, buf, None, True)
                return True
            return False
        k = skip_space(buf, a + len(ARGS))
        if k >= len(buf):
            return False
        if self._scan is None or self._scan.pos < k:
            self._scan = JsonScan(k)
        end = self._scan.advance(buf)
        if end is None:
            return False
        name = buf[j:a].split(CALL_ID)[0].strip()
        ok, args = loads(buf[k:end])
        body = json.dumps({"name": name, "arguments": args}) if ok else None
        self._close_call(out, buf[:end], body, final)
        return True

    def _cut_body(self) -> str | None:
        body = self.buf[self._body_start:]
        return body if body.lstrip().startswith(("{", "[")) else None


def mistral_history_id(call_id: Any) -> str:
    """Mistral templates insist on 9-character alphanumeric ids; map others onto such ids stably."""
    s = str(call_id or "")
    if len(s) == 9 and s.isalnum():
        return s
    return hashlib.sha1(s.encode()).hexdigest()[:9]


class Mistral(ToolFormat):
    name = "mistral"
    signals = (TOOL_CALLS,)
    markers = (TOOL_CALLS, ARGS, CALL_ID)
    parser_class = MistralParser

    def new_call_id(self) -> str:
        return mistral_call_id()

    def calls_lark(self, term: Term, more: int) -> tuple[list[str], str]:
        if more:
            return [], f'{term(TOOL_CALLS)} "[" obj (", " obj){{0,{more}}} "]"'
        return [], f'{term(TOOL_CALLS)} "[" obj "]"'

    def history_message(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("tool_calls"):
            message["tool_calls"] = [{**c, "id": mistral_history_id(c.get("id"))} for c in message["tool_calls"]]
        if message.get("role") == "tool":
            message["tool_call_id"] = mistral_history_id(message.get("tool_call_id"))
        return message
