"""Hermes / Qwen tool calls: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated for
parallel calls."""

from __future__ import annotations

from .events import Event
from .lark import Term
from .scan import JsonScan, partial_suffix
from .tool_format import ToolFormat
from .tool_stream import ToolCallStreamParser, skip_space

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallStreamParser):
    opener = OPEN

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._plain_close = False  # the JSON did not end at the closing tag: find the tag as text

    def _step_call(self, out: list[Event], final: bool) -> bool:
        buf, b = self.buf, self._body_start
        j = skip_space(buf, b)
        if j >= len(buf):
            return False
        if buf[j] in "{[" and not self._plain_close:
            # find the JSON's end string-aware, so "</tool_call>" inside an argument is data
            if self._scan is None or self._scan.pos < j:
                self._scan = JsonScan(j)
            end = self._scan.advance(buf)
            if end is None:
                return False  # still open (a malformed call is released by finish())
            k = skip_space(buf, end)
            rest = buf[k:k + len(CLOSE)]
            if rest == CLOSE:
                self._close_call(out, buf[: k + len(CLOSE)], buf[j:end], final)
                return True
            if CLOSE.startswith(rest):
                return False  # wait for the rest of the closing tag
            self._plain_close = True  # something else after the JSON: plain search below
        end = buf.find(CLOSE, b)
        if end < 0:
            return False
        self._close_call(out, buf[: end + len(CLOSE)], buf[b:end], final)
        return True

    def _close_call(self, out: list[Event], raw: str, body: str | None, final: bool) -> None:
        self._plain_close = False
        super()._close_call(out, raw, body, final)

    def _cut_body(self) -> str | None:
        body = self.buf[self._body_start:].rstrip()
        cut = partial_suffix(body, (CLOSE,))  # cut inside the closing tag: drop the partial tag
        return body[: len(body) - cut]


class Hermes(ToolFormat):
    name = "hermes"
    signals = (OPEN,)
    markers = (OPEN, CLOSE)
    parser_class = HermesParser

    def calls_lark(self, term: Term, more: int) -> tuple[list[str], str]:
        rules = [f"call: {term(OPEN)} \"\\n\" obj \"\\n\" {term(CLOSE)}"]
        return rules, f'call ("\\n" call){{0,{more}}}' if more else "call"
