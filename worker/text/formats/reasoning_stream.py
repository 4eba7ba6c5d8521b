"""Splitting a thinking model's output into reasoning text and answer text, incrementally.

The block is recognised only at the very start of the output (after leading whitespace), so an
answer that merely mentions the start marker is left alone; when the prompt already opened the
block (DeepSeek R1, Qwen 3 thinking templates end the generation prompt with ``<think>\\n``) the
splitter starts inside it. Everything after the end marker is answer text, whatever it contains
(so tool-call markup inside reasoning is never a tool call: the caller parses only the answer).
Partial markers are held back, never leaked into either side; `finish()` flushes a stream cut at
any point (reasoning left open is reported by `open`).
"""

from __future__ import annotations

from typing import Protocol

from .scan import partial_suffix


class Markers(Protocol):
    @property
    def start(self) -> str: ...

    @property
    def end(self) -> str: ...


REASONING = "reasoning"
CONTENT = "content"


class ReasoningSplitter:
    """Feed output text; get (kind, text) pieces back, kind REASONING or CONTENT."""

    def __init__(self, fmt: Markers | None, *, inside: bool = False):
        self.fmt = fmt
        self.buf = ""
        if fmt is None:
            self.state = CONTENT
        else:
            self.state = REASONING if inside else "start"
        self.had_reasoning = self.state == REASONING  # a reasoning block was (or is) open
        self._lead = self.state == REASONING  # strip whitespace at the start of reasoning
        self._after_close = False  # strip whitespace between the end marker and the answer
        self.finished = False

    @property
    def open(self) -> bool:
        """Inside a reasoning block (at the end: the stream was cut before the block closed)."""
        return self.state == REASONING

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.finished or not text:
            return []
        self.buf += text
        out: list[tuple[str, str]] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[tuple[str, str]]:
        if self.finished:
            return []
        out: list[tuple[str, str]] = []
        self._run(out, final=True)
        if self.buf:
            kind = REASONING if self.state == REASONING else CONTENT
            if kind == CONTENT and self._after_close:
                self.buf = self.buf.lstrip()
            if kind == REASONING:
                self.buf = self.buf.rstrip()
            if self.buf:
                out.append((kind, self.buf))
            self.buf = ""
        self.finished = True
        return out

    def _run(self, out: list[tuple[str, str]], final: bool) -> None:
        """Split the buffer, state by state, while there is something to split now. Each state's
        step returns False where it waits for more text (or for finish())."""
        while self.buf:
            if self.state == "start":
                go_on = self._at_start(final)
            elif self.state == REASONING:
                go_on = self._in_reasoning(out, final)
            else:
                go_on = self._in_content(out, final)
            if not go_on:
                return

    def _at_start(self, final: bool) -> bool:
        fmt = self.fmt
        assert fmt is not None
        s = self.buf.lstrip()
        if s.startswith(fmt.start):
            self.buf = s[len(fmt.start):]
            self.state, self.had_reasoning, self._lead = REASONING, True, True
            return True
        if not final and fmt.start.startswith(s):
            return False  # whitespace or a partial start marker: wait
        self.state = CONTENT
        return True

    def _in_reasoning(self, out: list[tuple[str, str]], final: bool) -> bool:
        fmt = self.fmt
        assert fmt is not None
        if self._lead:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self._lead = False
        j = self.buf.find(fmt.end)
        if j >= 0:
            text = self.buf[:j].rstrip()
            if text:
                out.append((REASONING, text))
            self.buf = self.buf[j + len(fmt.end):]
            self.state, self._after_close = CONTENT, True
            return True
        if final:
            return False  # finish() flushes what is left
        keep = partial_suffix(self.buf, (fmt.end,))
        body = self.buf[:len(self.buf) - keep]
        ws = len(body) - len(body.rstrip())  # trailing whitespace may precede the end marker
        emit = body[:len(body) - ws]
        if emit:
            out.append((REASONING, emit))
        self.buf = self.buf[len(emit):]
        return False

    def _in_content(self, out: list[tuple[str, str]], final: bool) -> bool:
        fmt = self.fmt
        if self._after_close:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self._after_close = False
        if fmt is not None and self.had_reasoning:
            # once a block has closed, the markers are markup, never answer text: a second block
            # (a small model's, or one opened after the budget ran out) is reasoning too, and a
            # stray end marker is dropped. Before any block, a marker in running text is text.
            js, je = self.buf.find(fmt.start), self.buf.find(fmt.end)
            if js >= 0 and (je < 0 or js < je):
                if self.buf[:js].rstrip():
                    out.append((CONTENT, self.buf[:js].rstrip()))
                self.buf = self.buf[js + len(fmt.start):]
                self.state, self._lead = REASONING, True
                return True
            if je >= 0:
                if self.buf[:je]:
                    out.append((CONTENT, self.buf[:je]))
                self.buf = self.buf[je + len(fmt.end):]
                return True
            keep = 0 if final else partial_suffix(self.buf, (fmt.start, fmt.end))
            if keep < len(self.buf):
                out.append((CONTENT, self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        out.append((CONTENT, self.buf))
        self.buf = ""
        return False
