"""Lark snippets for the forced-call grammars the formats write (llguidance's Lark dialect)."""

from __future__ import annotations

import json
from collections.abc import Callable

Term = Callable[[str], str]  # a markup string -> its Lark term (a special-token reference or a literal)


def lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
