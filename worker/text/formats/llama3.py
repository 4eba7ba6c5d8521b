"""Llama 3.x tool calls: {"name": ..., "parameters": {...}} as the whole output, optionally after
<|python_tag|>; several calls may be separated by ';' or whitespace."""

from __future__ import annotations

from .events import Event
from .lark import Term
from .scan import JsonScan
from .tool_format import ToolFormat
from .tool_stream import ToolCallStreamParser, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolCallStreamParser):
    opener = PYTHON_TAG

    def _may_open_bare(self) -> bool:
        """A bare JSON call may start here: at the start of the output, or right after a call."""
        return not self._seen_non_ws or self._after_call

    def _content_prelude(self, out: list[Event], final: bool) -> bool | None:
        if not self._may_open_bare():
            return None
        buf = self.buf
        stripped = buf.lstrip()
        lead = len(buf) - len(stripped)
        if self._after_call:  # separators between calls: whitespace and ';'
            j = 0
            while j < len(buf) and (buf[j].isspace() or buf[j] == ";"):
                j += 1
            stripped, lead = buf[j:], j
        if not stripped:
            if self._after_call and final:
                self.buf = ""
            return False  # wait (only whitespace so far)
        if stripped[0] in "{[":
            # whitespace / ';' before a bare JSON call belongs to the call's markup (dropped if it
            # parses, kept as content if not)
            self._drop_held_ws()
            self._enter_call(body_start=lead, scan=JsonScan(lead))
            return True
        return None

    def _wait_undecided(self, buf: str, final: bool) -> bool:
        return self._may_open_bare() and not final and not buf.replace(";", " ").strip()

    def _step_call(self, out: list[Event], final: bool) -> bool:
        j = skip_space(self.buf, self._body_start)
        if j >= len(self.buf):
            return False
        return self._json_value_call(out, final, j)

    def _not_a_call(self) -> None:
        self._seen_non_ws = True  # a non-call JSON answer: the rest is plain content


class Llama3(ToolFormat):
    name = "llama3"
    signals = (PYTHON_TAG, "ipython")
    markers = (PYTHON_TAG,)
    args_key = "parameters"
    parser_class = Llama3Parser

    def calls_lark(self, term: Term, more: int) -> tuple[list[str], str]:
        return [], f'obj ("\\n" obj){{0,{more}}}' if more else "obj"
