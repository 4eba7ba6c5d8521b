"""Tool-call parsing for the formats real chat templates use.

Formats (chosen from the chat template by `detect_format`):
  hermes  - Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated for
            parallel calls.
  llama3  - Llama 3.x JSON: {"name": ..., "parameters": {...}} as the whole output, optionally
            after <|python_tag|>; several calls may be separated by ';' or whitespace.
  mistral - [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  (also the newer
            [TOOL_CALLS]name[ARGS]{...} form).
  fenced  - templates without a convention: ```json {"tool": name, "arguments": {...}} ```.

One implementation: `ToolCallStreamParser` is incremental; `parse_tool_calls` runs it over the
whole text, so streaming and non-streaming results agree by construction.

Guarantees: never raises on model output; a call that does not parse stays in the content text
verbatim (markup included); partial markup is held back, never leaked into content; a stream cut
mid-call is flushed by `finish()` (parsed if what arrived is a complete call, else as content).

Stream events: ContentDelta(text); ToolCallStart(index, id, name) once per call, then
ToolCallArgsDelta(index, text) pieces whose concatenation is the call's arguments JSON string.
A call's events are emitted once the call has been validated (so nothing emitted is retracted).
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Callable, Iterable

FORMATS = ("hermes", "llama3", "mistral", "fenced")
_CALL_LANGS = ("", "json", "jsonc", "tool", "tool_call", "tool_code")  # fence languages that may hold a call


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParseResult:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArgsDelta:
    index: int
    text: str


Event = ContentDelta | ToolCallStart | ToolCallArgsDelta


# ----------------------------------------------------------------------------- format detection

def detect_format(chat_template_source: str | None) -> str:
    t = chat_template_source or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "fenced"


# ----------------------------------------------------------------------------- ids

_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """Mistral templates require 9 alphanumeric characters."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


# ----------------------------------------------------------------------------- call validation

def _call_from_obj(obj, name_keys=("name",), args_keys=("arguments", "parameters")):
    """(name, arguments_json) from a decoded call object, or None if it is not a call."""
    if not isinstance(obj, dict):
        return None
    name = None
    for k in name_keys:
        v = obj.get(k)
        if isinstance(v, str) and v.strip():
            name = v.strip()
            break
    if name is None and isinstance(obj.get("function"), dict):  # {"function": {"name", "arguments"}}
        return _call_from_obj(obj["function"], name_keys, args_keys)
    if name is None:
        return None
    args = None
    present = False
    for k in args_keys:
        if k in obj:
            args, present = obj[k], True
            break
    if not present or args is None:
        args = {}
    if isinstance(args, str):  # arguments given as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _loads(text: str):
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def _calls_from_json(text: str, name_keys=("name",), args_keys=("arguments", "parameters")):
    """List of (name, args) if text is one call object or a non-empty list of them; else None."""
    ok, val = _loads(text.strip())
    if not ok:
        return None
    items = val if isinstance(val, list) else [val]
    if not items:
        return None
    out = []
    for it in items:
        c = _call_from_obj(it, name_keys, args_keys)
        if c is None:
            return None
        out.append(c)
    return out


# ----------------------------------------------------------------------------- JSON extent scanner

class _JsonScan:
    """Finds where one JSON value (object or array) that starts at text[start] ends,
    incrementally and string-aware.  end is the index just past it, or None while open."""

    def __init__(self, start: int):
        self.pos = start
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        if self.end is not None:
            return self.end
        i, n = self.pos, len(text)
        depth, in_str, esc = self.depth, self.in_str, self.esc
        while i < n:
            c = text[i]
            i += 1
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    self.end = i
                    break
        self.pos, self.depth, self.in_str, self.esc = i, depth, in_str, esc
        return self.end


# ----------------------------------------------------------------------------- stream parser

def _partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolCallStreamParser:
    """Feed decoded text deltas; get Events back.  Call finish() at the end of the stream."""

    def __init__(self, fmt: str = "hermes", id_factory: Callable[[], str] | None = None,
                 args_chunk: int = 0, forced: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt = fmt
        # forced: a grammar allowed nothing but calls, so text left undecided at the end is a call
        # the output cap cut short; it is dropped, never shown as the answer
        self.forced = forced
        self.id_factory = id_factory or (mistral_call_id if fmt == "mistral" else openai_call_id)
        self.args_chunk = args_chunk  # >0: split each call's arguments into deltas of this size
        self.buf = ""  # text not yet decided
        self.state = "content"  # or "call"
        self.calls: list[ToolCall] = []
        self._seen_non_ws = False  # any non-whitespace content emitted so far
        self._after_call = False  # the last thing decided was a tool call
        self._held_ws = ""  # whitespace after a call, dropped if another call or the end follows
        self._body_start = 0
        self._in_foreign = False  # fenced: inside a code block that is not a tool call
        self._scan: _JsonScan | None = None
        self._call_start = 0  # within buf, where the current call's markup starts
        self.finished = False
        if fmt == "hermes":
            self._markers = ("<tool_call>",)
        elif fmt == "mistral":
            self._markers = ("[TOOL_CALLS]",)
        elif fmt == "llama3":
            self._markers = ("<|python_tag|>",)
        else:
            self._markers = ("```",)

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
        return _merge(out)

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
        return _merge(out)

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
            else:
                if not self._step_call(out, final):
                    return

    def _step_content(self, out: list[Event], final: bool) -> bool:
        """Consume content from buf; True if progress and a call started."""
        buf = self.buf
        if self._in_foreign:  # inside a fenced block that is not a call: stream it, find its close
            end = buf.find("```")
            if end >= 0:
                self._emit_content(out, buf[: end + 3])
                self.buf = buf[end + 3:]
                self._in_foreign = False
                return True
            keep = 0 if final else _partial_suffix(buf, ("```",))
            self._emit_content(out, buf[: len(buf) - keep])
            self.buf = buf[len(buf) - keep:]
            return False
        # llama3: a bare JSON call at the start of the output (or right after a call)
        if self.fmt == "llama3" and (not self._seen_non_ws or self._after_call):
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
                # whitespace / ';' before a bare JSON call belongs to the call's markup (dropped
                # if it parses, kept as content if not)
                self._drop_held_ws()
                self.state = "call"
                self._call_start = 0
                self._body_start = lead
                self._scan = _JsonScan(lead)
                return True
        idx, marker = -1, None
        for m in self._markers:
            i = buf.find(m)
            if i >= 0 and (idx < 0 or i < idx):
                idx, marker = i, m
        if marker is not None:
            self._emit_content(out, buf[:idx])
            self._drop_held_ws()
            self.buf = buf[idx:]
            self.state = "call"
            self._call_start = 0
            self._body_start = len(marker)
            self._scan = None
            return True
        keep = 0 if final else _partial_suffix(buf, self._markers)
        if (self.fmt == "llama3" and (not self._seen_non_ws or self._after_call) and not final
                and not buf.replace(";", " ").strip()):
            return False
        self._emit_content(out, buf[: len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False

    def _step_call(self, out: list[Event], final: bool) -> bool:
        buf = self.buf
        b = self._body_start
        if self.fmt == "hermes":
            close = "</tool_call>"
            j = b
            while j < len(buf) and buf[j].isspace():
                j += 1
            if j >= len(buf):
                return False
            if buf[j] in "{[" and not getattr(self, "_plain_close", False):
                # find the JSON's end string-aware, so "</tool_call>" inside an argument is data
                if self._scan is None or self._scan.pos < j:
                    self._scan = _JsonScan(j)
                end = self._scan.advance(buf)
                if end is None:
                    return False  # still open (a malformed call is released by finish())
                k = end
                while k < len(buf) and buf[k].isspace():
                    k += 1
                rest = buf[k:k + len(close)]
                if rest == close:
                    self._close_call(out, buf[: k + len(close)], buf[j:end], final)
                    return True
                if close.startswith(rest):
                    return False  # wait for the rest of the closing tag
                self._plain_close = True  # something else after the JSON: plain search below
            end = buf.find(close, b)
            if end < 0:
                return False
            self._plain_close = False
            self._close_call(out, buf[: end + len(close)], buf[b:end], final)
            return True
        if self.fmt == "fenced":
            nl = buf.find("\n", b)
            if nl < 0:
                head = buf[b:].strip()
                if head.startswith("{"):  # ```{"tool":...}``` on one line is also accepted
                    end = buf.find("```", b)
                    if end < 0:
                        return False
                    self._close_call(out, buf[: end + 3], buf[b:end], final)
                    return True
                if head and not any(x.startswith(head.lower()) for x in _CALL_LANGS if x):
                    return self._foreign(out, b)  # ```python ...: stream it as content
                return False
            lang = buf[b:nl].strip().lower()
            if lang.startswith("{"):  # ```{"tool": ...}\n...```
                end = buf.find("```", b)
                if end < 0:
                    return False
                self._close_call(out, buf[: end + 3], buf[b:end], final)
                return True
            if lang not in _CALL_LANGS:
                return self._foreign(out, b)
            k = nl + 1
            while k < len(buf) and buf[k].isspace():
                k += 1
            if k >= len(buf):
                return False
            if buf[k] not in "{[":
                return self._foreign(out, b)
            end = buf.find("```", nl)
            if end < 0:
                return False
            self._close_call(out, buf[: end + 3], buf[nl + 1:end], final)
            return True
        # llama3 / mistral: JSON value(s) after the marker
        j = b
        while j < len(buf) and buf[j].isspace():
            j += 1
        if j >= len(buf):
            return False
        if self.fmt == "mistral" and buf[j] not in "{[":
            # [TOOL_CALLS]name[ARGS]{...}   (optionally [CALL_ID]id before [ARGS])
            a = buf.find("[ARGS]", j)
            if a < 0:
                if len(buf) - j > 256:  # not a call
                    self._close_call(out, buf, None, True)
                    return True
                return False
            k = a + len("[ARGS]")
            while k < len(buf) and buf[k].isspace():
                k += 1
            if k >= len(buf):
                return False
            if self._scan is None or self._scan.pos < k:
                self._scan = _JsonScan(k)
            end = self._scan.advance(buf)
            if end is None:
                return False
            name = buf[j:a].split("[CALL_ID]")[0].strip()
            body = json.dumps({"name": name, "arguments": _loads(buf[k:end])[1]}) \
                if _loads(buf[k:end])[0] else None
            self._close_call(out, buf[:end], body, final)
            return True
        if self._scan is None or self._scan.pos < j:
            self._scan = _JsonScan(j)
        end = self._scan.advance(buf)
        if end is None:
            return False
        self._close_call(out, buf[:end], buf[j:end], final)
        return True

    def _foreign(self, out: list[Event], upto: int) -> bool:
        """The fence opened at buf[0] is not a tool call: emit its opening as content and stream
        the block's body as content until its closing fence."""
        self._emit_content(out, self.buf[:upto])
        self.buf = self.buf[upto:]
        self.state = "content"
        self._in_foreign = True
        return True

    def _cut_body(self) -> str | None:
        body = self.buf[self._body_start:]
        if self.fmt == "fenced":
            nl = body.find("\n")
            if nl < 0:
                return body
            lang = body[:nl].strip().lower()
            return body[nl + 1:] if not lang.startswith("{") else body
        if self.fmt == "mistral" and not body.lstrip().startswith(("{", "[")):
            return None
        if self.fmt == "hermes":  # cut inside the closing tag: drop the partial tag
            body = body.rstrip()
            cut = _partial_suffix(body, ("</tool_call>",))
            body = body[: len(body) - cut]
        return body

    def _close_call(self, out: list[Event], raw: str, body: str | None, final: bool) -> None:
        """raw: the whole markup (consumed from buf); body: the JSON text to parse."""
        self.buf = self.buf[len(raw):]
        self.state = "content"
        self._scan = None
        self._plain_close = False
        parsed = None
        if body is not None:
            if self.fmt == "fenced":
                parsed = _calls_from_json(body, name_keys=("tool", "name"),
                                          args_keys=("arguments", "parameters", "args", "input"))
            else:
                parsed = _calls_from_json(body)
        if not parsed:
            if not (final and self.forced):  # a forced call cut short is dropped, not shown (see __init__)
                self._emit_content(out, raw)
            if self.fmt == "llama3":
                self._seen_non_ws = True  # a non-call JSON answer: the rest is plain content
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


def _merge(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if isinstance(e, ContentDelta):
            if not e.text:
                continue
            if out and isinstance(out[-1], ContentDelta):
                out[-1] = ContentDelta(out[-1].text + e.text)
                continue
        out.append(e)
    return out


def collect(events: Iterable[Event]) -> ParseResult:
    """Fold stream events into a ParseResult."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append(ToolCall(e.id, e.name, ""))
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index].arguments += e.text
    return ParseResult("".join(content), calls)


def parse_tool_calls(text: str, fmt: str = "hermes",
                     id_factory: Callable[[], str] | None = None) -> ParseResult:
    """Non-streaming parse: (content text, tool calls).  Never raises on model output."""
    p = ToolCallStreamParser(fmt, id_factory)
    return collect(p.feed(text or "") + p.finish())
