"""DeepSeek's DSML tool calls (DeepSeek V3.2, V4): one block of invokes, each parameter an element.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A string parameter is written as it is (string="true"); any other value is JSON (string="false").
V4 names the block tool_calls, V3.2 function_calls; both are read, the V4 name is the one forced and
rendered. The block follows the answer text after a blank line, which belongs to the markup. In a
prompt, prior calls are rendered by the chat template (the family's built-in one is
templates/deepseek.jinja); results go back as <tool_result> elements of one user turn, in the order
of the calls they answer (as DeepSeek's reference encoder orders them). The reasoning is ThinkTags
(<think>...</think>): DeepSeek's template opens the block at the end of the prompt when thinking is
on and closes it there when it is off.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .lark import Term, lark_literal
from .scan import loads, partial_suffix
from .tool_format import ToolFormat
from .tool_stream import ToolCallStreamParser, skip_space

DSML = "｜DSML｜"  # fullwidth bars: the V3.2/V4 vocabularies may hold it as one token
OPEN = "<" + DSML  # every DSML element starts so; outside a call block it is text
BLOCKS = ("tool_calls", "function_calls")  # V4, V3.2
BLOCK = BLOCKS[0]
INVOKE_END = f"</{DSML}invoke>"
PARAM_END = f"</{DSML}parameter>"
_INVOKE = re.compile(f'<{DSML}invoke name="([^"<>]+)">')
_PARAM = re.compile(f'<{DSML}parameter name="([^"<>]+)" string="(true|false)">')
GENERIC_PARAMS = 16  # parameters a forced call may pass to a tool whose schema declares none
# a forced call's parameters may come in any order up to this many (a rule per set of those written: 2^n);
# a tool with more keeps them in the schema's order, required ones first
ANY_ORDER_PARAMS = 8


def parse_invokes(body: str) -> tuple[list[tuple[str, str]], int]:
    """The complete invokes at the start of a block's body: ([(name, arguments JSON)], the index just
    past the last of them). Parsing stops at the first thing that is not a complete invoke; the caller
    decides what the rest may be. A string="false" value that is not JSON is kept as the string it is."""
    calls: list[tuple[str, str]] = []
    pos = 0
    while True:
        m = _INVOKE.match(body, skip_space(body, pos))
        if m is None:
            return calls, pos
        args: dict[str, Any] = {}
        k = skip_space(body, m.end())
        while not body.startswith(INVOKE_END, k):
            p = _PARAM.match(body, k)
            end = body.find(PARAM_END, p.end()) if p is not None else -1
            if p is None or end < 0:
                return calls, pos
            value = body[p.end():end]
            ok, parsed = loads(value) if p.group(2) == "false" else (False, None)
            args[p.group(1)] = parsed if ok else value
            k = skip_space(body, end + len(PARAM_END))
        calls.append((m.group(1), json.dumps(args, ensure_ascii=False)))
        pos = k + len(INVOKE_END)


class DsmlParser(ToolCallStreamParser):
    opener = OPEN

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._close = ""  # the open block's closing tag, once its name is known
        self._ws = ""  # whitespace before the open markup: the block's if it is one, else text

    def _step_content(self, out, final: bool) -> bool:
        # as the base, but whitespace before a block is the block's (held back until that is known)
        buf = self.buf
        idx = buf.find(OPEN)
        if idx >= 0:
            text = buf[:idx].rstrip()
            self._emit_content(out, text)
            self._ws = buf[len(text):idx]
            self._drop_held_ws()
            self.buf = buf[idx:]
            self._enter_call(body_start=len(OPEN))
            return True
        cut = len(buf) if final else len(buf) - partial_suffix(buf, (OPEN,))
        if not final:
            cut = len(buf[:cut].rstrip())
        self._emit_content(out, buf[:cut], final)
        self.buf = buf[cut:]
        return False

    def _step_call(self, out, final: bool) -> bool:
        buf = self.buf
        if not self._close:
            rest = buf[len(OPEN):]
            name = next((b for b in BLOCKS if rest.startswith(b + ">")), None)
            if name is None:
                if any((b + ">").startswith(rest) for b in BLOCKS):
                    return False  # the block's name is still arriving
                self._close_call(out, OPEN, None, final)  # a DSML element outside a block: text
                return True
            self._close = f"</{DSML}{name}>"
            self._body_start = len(OPEN) + len(name) + 1
        end = buf.find(self._close, self._body_start)
        if end < 0:
            return False
        self._close_call(out, buf[:end + len(self._close)], buf[self._body_start:end], final)
        return True

    def _close_call(self, out, raw: str, body: str | None, final: bool) -> None:
        self._close = ""
        ws, self._ws = self._ws, ""
        if ws and (body is None or not self._parse_body(body)) and not (final and self.forced):
            self._emit_content(out, ws)  # not a block after all: the whitespace was text
        super()._close_call(out, raw, body, final)

    def _cut_body(self) -> str | None:
        if not self._close:
            return None
        body = self.buf[self._body_start:]
        calls, end = parse_invokes(body)
        rest = body[end:].strip()
        return body[:end] if calls and (not rest or self._close.startswith(rest)) else None

    def _parse_body(self, body: str):
        calls, end = parse_invokes(body)
        return calls if calls and not body[end:].strip() else None


def _spell(term: Term, text: str) -> str:
    """DSML markup in Lark: the DSML token by reference where it is a special token, the rest literal."""
    ref = term(DSML)
    if not ref.startswith("<["):
        return lark_literal(text)
    pieces: list[str] = []
    for n, part in enumerate(text.split(DSML)):
        pieces += ([ref] if n else []) + ([lark_literal(part)] if part else [])
    return " ".join(pieces)


class Dsml(ToolFormat):
    name = "dsml"
    signals = (DSML,)
    markers = (DSML,)
    parser_class = DsmlParser

    def calls_lark(self, term: Term, more: int) -> tuple[list[str], str]:
        block = (f'{_spell(term, f"<{DSML}{BLOCK}>")} "\\n" (obj "\\n"){{1,{more + 1}}} '
                 f'{_spell(term, f"</{DSML}{BLOCK}>")}')
        return [f"calls: {block}"], "calls"

    def call_rules(self, schemas: list[tuple[str, str]], term: Term) -> list[str]:
        rules: list[str] = []
        for i, (name, schema_text) in enumerate(schemas):
            schema = json.loads(schema_text)
            params = self._param_rules(f"t{i}", schema, term, rules)
            head = _spell(term, f'<{DSML}invoke name="{name}">') + ' "\\n"'
            rules.append(f'inv{i}: {head} {params} {_spell(term, INVOKE_END)}')
        rules.append("obj: " + " | ".join(f"inv{i}" for i in range(len(schemas))))
        return rules

    def _param_rules(self, tag: str, schema: dict, term: Term, rules: list[str]) -> str:
        """Rules for one tool's parameters, in any order as the model may write them: each at most once,
        every required one present. The expression for all of them, or for the blank line of a call
        without any."""
        props = p if isinstance(p := schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required") or [] if k in props]
        shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        keys = [*required, *(k for k in props if k not in required)]
        params = []
        for n, key in enumerate(keys):
            rule = f"{tag}p{n}"
            rules.append(f"{rule}: {self._param(rule, key, props[key], shared, term, rules)}")
            params.append(rule)
        if not props and schema.get("additionalProperties", True) is not False:
            rule = f"{tag}any"
            rules.append(f'{rule}: {_spell(term, f"<{DSML}parameter name=")} "\\"" /[A-Za-z0-9_.-]{{1,64}}/ '
                         f'"\\" string=\\"true\\">" {rule}v "\\n"')
            rules.append(f'{rule}v[stop={lark_literal(PARAM_END)}]: /(.|\\n){{0,256}}/')
            return f'({rule}{{1,{GENERIC_PARAMS}}} | "\\n")'
        if not params:
            return '"\\n"'
        if len(params) <= ANY_ORDER_PARAMS:
            expr = _any_order(tag, params, len(required), rules)
        else:  # past the bound: required ones in order, then each optional one at most once, in order
            expr = " ".join(rule if n < len(required) else f"{rule}?" for n, rule in enumerate(params))
        return f'({expr} | "\\n")' if not required else expr

    def _param(self, rule: str, key: str, sub: Any, shared: dict, term: Term, rules: list[str]) -> str:
        head = f'<{DSML}parameter name="{key}" string='
        sub = sub if isinstance(sub, dict) else {}
        if _plain_string(sub):  # written as it is, up to the closing tag
            limit = sub.get("maxLength", 256)
            low = sub.get("minLength", 0)
            rules.append(f"{rule}v[stop={lark_literal(PARAM_END)}]: /(.|\\n){{{low},{limit}}}/")
            return f'{_spell(term, head)} "\\"true\\">" {rule}v "\\n"'
        if isinstance(sub.get("enum"), list) and sub["enum"] and all(isinstance(v, str) for v in sub["enum"]):
            choices = " | ".join(lark_literal(v) for v in sub["enum"])
            return f'{_spell(term, head)} "\\"true\\">" ({choices}) {_spell(term, PARAM_END)} "\\n"'
        schema = json.dumps({**shared, **sub, "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False,
                            separators=(",", ":"))
        rules.append(f"{rule}v: %json{schema}")
        return f'{_spell(term, head)} "\\"false\\">" {rule}v {_spell(term, PARAM_END)} "\\n"'

    def history(self, messages: list[dict]) -> list[dict]:
        return super().history(in_call_order(messages))


def _any_order(tag: str, params: list[str], n_required: int, rules: list[str]) -> str:
    """The parameter rules `params` (the first n_required of them required) in any order, each at most
    once: one rule per set of those already written (a bit mask), which offers each one not yet written
    and may end once every required one is in. A call's first parameter is never optional here: a call
    without any is its blank line."""
    full, need = (1 << len(params)) - 1, (1 << n_required) - 1

    def after(mask: int) -> str:
        return f"{tag}s{mask}"

    for mask in range(full):  # the full set offers nothing more: the last parameter written ends it
        alts = [params[i] + ("" if mask | 1 << i == full else f" {after(mask | 1 << i)}")
                for i in range(len(params)) if not mask & 1 << i]
        body = " | ".join(alts)
        rules.append(f"{after(mask)}: ({body})?" if mask and mask & need == need else f"{after(mask)}: {body}")
    return after(0)


def _plain_string(schema: dict) -> bool:
    """A string the grammar can leave free up to its length (no pattern, format, enum or const to hold)."""
    return schema.get("type") == "string" and not ({"pattern", "format", "enum", "const"} & schema.keys())


def in_call_order(messages: list[dict]) -> list[dict]:
    """The messages with each run of tool results (user messages may sit between them) ordered as the
    calls of the assistant turn before them, in the run's tool slots; a result whose call id is not one
    of those calls sorts as the first call's (as llama.cpp orders them)."""
    out = list(messages)
    order: dict[str, int] = {}
    i = 0
    while i < len(out):
        m = out[i]
        if m.get("role") == "assistant":
            order = {str(c.get("id")): n for n, c in enumerate(m.get("tool_calls") or []) if c.get("id")}
            i += 1
            continue
        if m.get("role") not in ("user", "tool"):
            i += 1
            continue
        j = i
        while j < len(out) and out[j].get("role") in ("user", "tool"):
            j += 1
        spots = [k for k in range(i, j) if out[k].get("role") == "tool"]
        results = sorted((out[k] for k in spots), key=lambda r: order.get(str(r.get("tool_call_id")), 0))
        for k, r in zip(spots, results, strict=True):
            out[k] = r
        i = j
    return out
