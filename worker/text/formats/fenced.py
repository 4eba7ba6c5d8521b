"""Fenced JSON tool calls, for templates without a convention of their own:
```json {"name": ..., "arguments": {...}} ``` (also "tool" for the name and other fence languages).

It is also how tools reach a model whose template never reads `tools`: `describe` puts the tools
and this convention in a system message and rewrites prior calls and results to match.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from .events import Event
from .lark import Term
from .scan import calls_from_json, partial_suffix
from .tool_format import ToolFormat, call_names
from .tool_stream import ToolCallStreamParser, skip_space

FENCE = "```"
CALL_LANGS = ("", "json", "jsonc", "tool", "tool_call", "tool_code")  # fence languages that may hold a call
NAME_KEYS = ("tool", "name")
ARGS_KEYS = ("arguments", "parameters", "args", "input")


class FencedParser(ToolCallStreamParser):
    opener = FENCE

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._in_foreign = False  # inside a code block that is not a tool call

    def _content_prelude(self, out: list[Event], final: bool) -> bool | None:
        if not self._in_foreign:
            return None
        buf = self.buf  # inside a fenced block that is not a call: stream it, find its close
        end = buf.find(FENCE)
        if end >= 0:
            self._emit_content(out, buf[: end + 3])
            self.buf = buf[end + 3:]
            self._in_foreign = False
            return True
        keep = 0 if final else partial_suffix(buf, (FENCE,))
        self._emit_content(out, buf[: len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False

    def _step_call(self, out: list[Event], final: bool) -> bool:
        buf, b = self.buf, self._body_start
        nl = buf.find("\n", b)
        if nl < 0:
            head = buf[b:].strip()
            if head.startswith("{"):  # ```{"tool":...}``` on one line is also accepted
                return self._close_at_fence(out, final, b, b)
            if head and not any(x.startswith(head.lower()) for x in CALL_LANGS if x):
                return self._foreign(out, b)  # ```python ...: stream it as content
            return False
        lang = buf[b:nl].strip().lower()
        if lang.startswith("{"):  # ```{"tool": ...}\n...```
            return self._close_at_fence(out, final, b, b)
        if lang not in CALL_LANGS:
            return self._foreign(out, b)
        k = skip_space(buf, nl + 1)
        if k >= len(buf):
            return False
        if buf[k] not in "{[":
            return self._foreign(out, b)
        return self._close_at_fence(out, final, nl, nl + 1)

    def _close_at_fence(self, out: list[Event], final: bool, search_from: int, body_from: int) -> bool:
        end = self.buf.find(FENCE, search_from)
        if end < 0:
            return False
        self._close_call(out, self.buf[: end + 3], self.buf[body_from:end], final)
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
        nl = body.find("\n")
        if nl < 0:
            return body
        lang = body[:nl].strip().lower()
        return body[nl + 1:] if not lang.startswith("{") else body

    def _parse_body(self, body: str):
        return calls_from_json(body, NAME_KEYS, ARGS_KEYS)


def text_of(content: Any) -> str:
    """A message's content as plain text (parts joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)


def fenced_call(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: written as the string it is
            arguments = json.loads(arguments)
    return "```json\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n```"


def tools_system_text(tools: list[dict]) -> str:
    """The tools (template dicts) and the fenced-JSON calling convention, for templates without tool support."""
    lines = ["# Tools", "", "You can call these functions (JSON schemas):"]
    for t in tools:
        lines.append(json.dumps(t["function"], ensure_ascii=False))
    lines += ["", "To call a function, answer with a JSON object in a fenced block, one block per call:",
              "```json", '{"name": "<function name>", "arguments": {<arguments>}}', "```",
              "Results come back in a message that starts with \"Tool result\"."]
    return "\n".join(lines)


def call_now_text(forced: str | None, required: bool) -> str | None:
    """What a forced tool choice asks of the model in words (the grammar holds it to that anyway)."""
    if forced:
        return f"Call the function {forced} now."
    return "Call at least one function now." if required else None


class FencedJson(ToolFormat):
    name = "fenced"
    parser_class = FencedParser

    @classmethod
    def detects(cls, template_source: str) -> bool:
        return True  # the fallback: any template

    def calls_lark(self, term: Term, more: int) -> tuple[list[str], str]:
        rules = ['call: "```json\\n" obj "\\n```"']
        return rules, f'call ("\\n" call){{0,{more}}}' if more else "call"

    def describe(self, messages: list[dict], tools: list[dict], forced: str | None = None,
                 required: bool = False) -> list[dict]:
        """Messages for a template that never reads `tools`: the tools in the system message, calls
        in the history as fenced JSON, results as "Tool result" user turns."""
        names = call_names(messages)
        out: list[dict] = []
        for m in messages:
            role = m.get("role")
            if role == "assistant" and m.get("tool_calls"):
                calls = [fenced_call((c.get("function") or {}).get("name", ""),
                                     (c.get("function") or {}).get("arguments")) for c in m["tool_calls"]]
                text = text_of(m.get("content"))
                out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + calls)})
            elif role == "tool":
                cid = str(m.get("tool_call_id") or "")
                label = names.get(cid) or m.get("name") or "tool"
                piece = f"Tool result ({label}, call {cid}):\n{text_of(m.get('content'))}" if cid else \
                    f"Tool result ({label}):\n{text_of(m.get('content'))}"
                if out and out[-1].get("_tool_results"):
                    out[-1]["content"] += "\n\n" + piece
                else:
                    out.append({"role": "user", "content": piece, "_tool_results": True})
            else:
                out.append(dict(m))
        for m in out:
            m.pop("_tool_results", None)
        if tools:
            text = tools_system_text(tools)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": text_of(out[0].get("content")) + "\n\n" + text}
            else:
                out.insert(0, {"role": "system", "content": text})
        now = call_now_text(forced, required) if tools else None
        if now:
            # at the end of the last user turn, not in the tools block: a forced request and the next one
            # (tool choice auto) then share the whole prompt up to that turn, and the prefix cache holds
            # (in the tools block, every later turn re-prefilled from the head of the conversation)
            if out[-1].get("role") == "user":
                c = out[-1].get("content")
                c = [*c, {"type": "text", "text": now}] if isinstance(c, list) else text_of(c) + "\n\n" + now
                out[-1] = {**out[-1], "content": c}
            else:
                out[0] = {**out[0], "content": text_of(out[0].get("content")) + "\n" + now}
        return out
