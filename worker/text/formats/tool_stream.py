"""The incremental tool-call parser every tool format builds on.

Feed decoded text deltas, get events back (events.py); `finish()` at the end of the stream. The
base class streams content, holds back what may be the start of the format's opening markup, and
validates and emits calls; each format's subclass says where a call's markup ends (`_step_call`)
and, where the format needs it, what precedes the generic content scan (`_content_prelude`).

Guarantees: never raises on model output; a call that does not parse stays in the content text
verbatim (markup included); partial markup is held back, never leaked into content; a stream cut
mid-call is flushed by `finish()` (parsed if what arrived is a complete call, else as content). A
call's events are emitted once the call has been validated, so nothing emitted is retracted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from .events import ContentDelta, Event, ToolCall, ToolCallArgsDelta, ToolCallStart, merge_text
from .scan import JsonScan, calls_from_json, partial_suffix


class ToolCallStreamParser:
    """Feed decoded text deltas; get Events back.  Call finish() at the end of the stream."""

    opener: ClassVar[str]  # the markup that opens a call

    def __init__(self, id_factory: Callable[[], str], args_chunk: int = 0, forced: bool = False):
        # forced: a grammar allowed nothing but calls, so text left undecided at the end is a call
        # the output cap cut short; it is dropped, never shown as the answer
        self.forced = forced
        self.id_factory = id_factory
        self.args_chunk = args_chunk  # >0: split each call's arguments into deltas of this size
        self.buf = ""  # text not yet decided
        self.state = "content"  # or "call"
        self.calls: list[ToolCall] = []
        self._seen_non_ws = False  # any non-whitespace content emitted so far
        self._after_call = False  # the last thing decided was a tool call
        self._held_ws = ""  # whitespace after a call, dropped if another call or the end follows
        self._body_start = 0
        self._scan: JsonScan | None = None
        self.finished = False

    # -- public

    def feed(self, text: str) -> list[Event]:
        if self.finished or not text:
            return []
        self.buf += text
        out: list[Event] = []
        try:
            self._run(out, final=False)
        except Exception:  # never raise on model output: release everything as content
            out.append(ContentDelta(self.buf))
            self.buf, self.state = "", "content"
        return merge_text(out)

    def finish(self) -> list[Event]:
        if self.finished:
            return []
        self.finished = True
        out: list[Event] = []
        try:
            self._run(out, final=True)
            if self.state == "call":  # cut mid-call: a complete call without its closing markup
                self._close_call(out, self.buf, self._cut_body(), final=True)  # still counts
            if self.buf and not self.forced:
                self._emit_content(out, self.buf, final=True)
            self.buf = ""
        except Exception:
            if self.buf and not self.forced:
                out.append(ContentDelta(self.buf))
            self.buf = ""
        return merge_text(out)

    # -- what a format may override

    def _content_prelude(self, out: list[Event], final: bool) -> bool | None:
        """A format's own step before the scan for its opener: True or False as `_step_content`
        answers, None to go on with the scan."""
        return None

    def _wait_undecided(self, buf: str, final: bool) -> bool:
        """True to hold `buf` back although it holds no opener (it may still become a call)."""
        return False

    def _step_call(self, out: list[Event], final: bool) -> bool:
        """Inside a call's markup (buf[0] is where it starts): close it once its end is known.
        True when a call was closed, False to wait for more text."""
        raise NotImplementedError

    def _cut_body(self) -> str | None:
        """The JSON of a call the stream cut before its closing markup, or None if there is none."""
        return self.buf[self._body_start:]

    def _parse_body(self, body: str):
        """[(name, arguments JSON)] from a call's body, or None if it is not a call."""
        return calls_from_json(body)

    def _not_a_call(self) -> None:
        """Markup whose body did not parse was released as content."""

    # -- machinery

    def _emit_content(self, out: list[Event], text: str, final: bool = False) -> None:
        if not text:
            return
        if self._after_call and not text.strip():
            # whitespace between/after tool calls is not content; hold it until we know
            if not final:
                self._held_ws += text
            return
        text, self._held_ws = self._held_ws + text, ""
        if text.strip():
            self._seen_non_ws = True
            self._after_call = False
        out.append(ContentDelta(text))

    def _drop_held_ws(self) -> None:
        self._held_ws = ""

    def _run(self, out: list[Event], final: bool) -> None:
        while self.buf:
            if self.state == "content":
                if not self._step_content(out, final):
                    return
            elif not self._step_call(out, final):
                return

    def _step_content(self, out: list[Event], final: bool) -> bool:
        """Consume content from buf; True if progress and a call started."""
        step = self._content_prelude(out, final)
        if step is not None:
            return step
        buf = self.buf
        idx = buf.find(self.opener)
        if idx >= 0:
            self._emit_content(out, buf[:idx])
            self._drop_held_ws()
            self.buf = buf[idx:]
            self._enter_call(body_start=len(self.opener))
            return True
        keep = 0 if final else partial_suffix(buf, (self.opener,))
        if self._wait_undecided(buf, final):
            return False
        self._emit_content(out, buf[: len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False

    def _enter_call(self, body_start: int, scan: JsonScan | None = None) -> None:
        self.state = "call"
        self._body_start = body_start
        self._scan = scan

    def _json_value_call(self, out: list[Event], final: bool, j: int) -> bool:
        """A call that is one JSON value starting at buf[j]: closed where the value ends."""
        buf = self.buf
        if self._scan is None or self._scan.pos < j:
            self._scan = JsonScan(j)
        end = self._scan.advance(buf)
        if end is None:
            return False
        self._close_call(out, buf[:end], buf[j:end], final)
        return True

    def _close_call(self, out: list[Event], raw: str, body: str | None, final: bool) -> None:
        """raw: the whole markup (consumed from buf); body: the JSON text to parse."""
        self.buf = self.buf[len(raw):]
        self.state = "content"
        self._scan = None
        parsed = self._parse_body(body) if body is not None else None
        if not parsed:
            if not (final and self.forced):  # a forced call cut short is dropped, not shown (see __init__)
                self._emit_content(out, raw)
            self._not_a_call()
            return
        self._after_call = True
        for name, args in parsed:
            idx = len(self.calls)
            call = ToolCall(self.id_factory(), name, args)
            self.calls.append(call)
            out.append(ToolCallStart(idx, call.id, name))
            step = self.args_chunk if self.args_chunk > 0 else len(args) or 1
            for p in range(0, len(args), step):
                out.append(ToolCallArgsDelta(idx, args[p:p + step]))


def skip_space(buf: str, j: int) -> int:
    """The first index at or after j that is not whitespace (len(buf) if none)."""
    while j < len(buf) and buf[j].isspace():
        j += 1
    return j
