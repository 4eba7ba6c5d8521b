"""Text scanning the formats are built from: where a JSON value ends in a growing text, whether a
decoded value is a tool call, and how much of a text's end may be the start of a marker."""

from __future__ import annotations

import json
from collections.abc import Iterable

NAME_KEYS = ("name",)
ARGS_KEYS = ("arguments", "parameters")


def loads(text: str):
    """(True, value) when text is JSON, else (False, None)."""
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def call_from_obj(obj, name_keys=NAME_KEYS, args_keys=ARGS_KEYS):
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
        return call_from_obj(obj["function"], name_keys, args_keys)
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


def calls_from_json(text: str, name_keys=NAME_KEYS, args_keys=ARGS_KEYS):
    """List of (name, args) if text is one call object or a non-empty list of them; else None."""
    ok, val = loads(text.strip())
    if not ok:
        return None
    items = val if isinstance(val, list) else [val]
    if not items:
        return None
    out = []
    for it in items:
        c = call_from_obj(it, name_keys, args_keys)
        if c is None:
            return None
        out.append(c)
    return out


class JsonScan:
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


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best
