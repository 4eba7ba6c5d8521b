"""Chat templates: the GGUF's Jinja template (or a built-in one), rendered the way HF does.

`tokenizer.chat_template` in a GGUF is the model's HuggingFace chat template. It is rendered in
jinja2's ImmutableSandboxedEnvironment with the environment HF's ``apply_chat_template`` sets up:
``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension, a no-op ``{% generation %}``
block, ``raise_exception(msg)``, ``strftime_now(fmt)``, a ``tojson`` filter with HF's semantics
(``json.dumps``, no HTML escaping, ``ensure_ascii=False``, optional ``indent``/``separators``/
``sort_keys``), a ``from_json`` filter (llama.cpp's, which DeepSeek V3.2/V4 templates use to read string
arguments) and the variables ``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``/``eos_token`` (plus ``pad_token``/``unk_token`` when the vocabulary has them) and any
extra keyword arguments (``enable_thinking``, ``reasoning_effort``...).

A GGUF without a template (the embedded Gemma 3 270M has none) gets a built-in one: the one whose
turn tokens its vocabulary has, ``gemma`` (``<start_of_turn>``), ``llama3`` (header format),
``chatml`` (``<|im_start|>``, Qwen 2/3) or ``deepseek`` (``<｜Assistant｜>``, DeepSeek V4 with DSML tool
calls), else the one its family's recipe declares (``Formats.chat``, which the loader passes in).
They live in ``templates/*.jinja``.

Every template failure (syntax error, ``raise_exception``, a sandbox violation, a type error
inside the template) raises ``ChatTemplateError`` with a one-line message.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from importlib import resources
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.worker.model.gguf_file import GGUFFile
from ember.worker.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "BUILTIN_TEMPLATES", "message_starts"]

BUILTIN_TEMPLATES = ("gemma", "llama3", "chatml", "deepseek")

# Limits against templates that try to exhaust memory or CPU (the sandbox already caps range()).
_MAX_REPEAT = 1 << 22  # characters or items a single `*` may produce
_MAX_POW_EXPONENT = 4096


_EFFORT_TEST = re.compile(r"""reasoning_effort\s*==\s*["']([A-Za-z_-]+)["']""")


class ChatTemplateError(Exception):
    """A chat template that cannot be compiled or rendered; str() is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()) or "chat template error")


def _raise_exception(message: Any = "") -> None:
    raise ChatTemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's tojson: plain json.dumps, no HTML escaping (jinja's own filter escapes <, >, &, ')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """HF's {% generation %}...{% endgeneration %} (marks assistant text for training masks): a no-op here."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja returns an Undefined that only raises when used; printing it would silently give "".
        # Refuse at the access instead, so a probing template fails loudly.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT:
                    raise ChatTemplateError(f"chat template tried to build a sequence of {len(seq) * n} items")
        elif operator == "**" and isinstance(right, int) and abs(right) > _MAX_POW_EXPONENT:
            raise ChatTemplateError(f"chat template tried to compute a power with exponent {right}")
        return super().call_binop(context, operator, left, right)


def _environment() -> jinja2.Environment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads  # a ValueError on bad JSON is a ChatTemplateError (render)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(e: BaseException) -> str:
    if isinstance(e, jinja2.TemplateSyntaxError):
        where = f" at line {e.lineno}" if e.lineno else ""
        return f"chat template syntax error{where}: {e.message}"
    if isinstance(e, SecurityError):
        return f"chat template refused by the sandbox: {e}"
    if isinstance(e, jinja2.UndefinedError):
        return f"chat template error: {e}"
    return f"chat template failed: {type(e).__name__}: {e}"


def builtin_source(name: str) -> str:
    """The text of a built-in template (gemma, llama3, chatml, deepseek)."""
    if name not in BUILTIN_TEMPLATES:
        raise ChatTemplateError(f"no built-in chat template named {name!r} (have: {', '.join(BUILTIN_TEMPLATES)})")
    return (resources.files("ember.worker.text") / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def pick_builtin(tokenizer: Tokenizer | None, default: str | None = None) -> str | None:
    """The built-in template for a model without one: by the turn tokens its vocabulary has, else
    `default` (its family's, from the recipe)."""
    if tokenizer is not None:
        turns = (("<start_of_turn>", "gemma"), ("<|start_header_id|>", "llama3"), ("<|im_start|>", "chatml"),
                 ("<｜Assistant｜>", "deepseek"))
        for token, name in turns:
            if tokenizer.id_of(token) is not None:
                return name
    return default


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 extra_tokens: dict[str, str] | None = None, name: str = "custom",
                 tokenizer: Tokenizer | None = None):
        self.source = source
        # the reasoning_effort levels the template compares with (DeepSeek V4's: "max"); api/tool_plan.py
        # names the APIs' top level as the template does
        self.effort_levels = frozenset(_EFFORT_TEST.findall(source))
        self.name = name  # "gguf" for the model's own template, else the built-in's name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.tokenizer = tokenizer
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token, **(extra_tokens or {})}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(_one_line(e)) from None
        except (RecursionError, MemoryError, ValueError) as e:
            raise ChatTemplateError(_one_line(e)) from None
        # Templates that never read `tools` cannot show tools to the model: the API layer then
        # describes them in a system message itself (FencedJson.describe in worker/text/formats/fenced.py).
        try:
            self.variables = frozenset(meta.find_undeclared_variables(_environment().parse(source)))
        except jinja2.TemplateError:  # pragma: no cover - from_string already parsed it
            self.variables = frozenset()

    @property
    def supports_tools(self) -> bool:
        return "tools" in self.variables

    @classmethod
    def from_gguf(cls, g: GGUFFile, tokenizer: Tokenizer, default: str | None = None) -> ChatTemplate:
        """The model's `tokenizer.chat_template`, or the built-in one for its vocabulary, else `default`
        (the built-in its family's recipe declares: Formats.chat)."""
        tokens = _special_token_strings(tokenizer)
        source = g.metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, name="gguf", tokenizer=tokenizer, **tokens)
        arch = g.metadata.get("general.architecture")
        name = pick_builtin(tokenizer, default)
        if name is None:
            raise ChatTemplateError(f"{g.path}: the model has no chat template and there is no built-in one "
                                    f"for architecture {arch!r}")
        return cls(builtin_source(name), name=name, tokenizer=tokenizer, **tokens)

    @classmethod
    def builtin(cls, name: str, tokenizer: Tokenizer | None = None) -> ChatTemplate:
        tokens = _special_token_strings(tokenizer) if tokenizer is not None else {}
        return cls(builtin_source(name), name=name, tokenizer=tokenizer, **tokens)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **kwargs: Any) -> str:
        """The prompt text for `messages` (each a dict with "role" and "content": a string, None or a
        list of parts such as {"type": "text", "text": ...}); tokenize it with parse_special=True."""
        if not isinstance(messages, (list, tuple)):
            raise ChatTemplateError(f"messages must be a list, not {type(messages).__name__}")
        msgs = [dict(m) if isinstance(m, dict) else m for m in messages]
        context = {**self._tokens, **kwargs, "messages": msgs, "tools": tools,
                   "add_generation_prompt": bool(add_generation_prompt)}
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(_one_line(e)) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as e:
            raise ChatTemplateError(_one_line(e)) from None

    def encode(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **kwargs: Any) -> list[int]:
        """render() then tokenize with parse_special=True, with exactly one BOS when the model wants one.

        Templates usually print {{ bos_token }} themselves and llama.cpp would then add a second BOS;
        like llama-server's Jinja path we drop the printed one and let the tokenizer add it.
        """
        return self.render_encode(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)[1]

    def render_encode(self, messages: list[dict], *, add_generation_prompt: bool = True,
                      tools: list[dict] | None = None, limit: int | None = None,
                      **kwargs: Any) -> tuple[str, list[int]]:
        """(prompt text, token ids): encode() that also returns the rendered text (the reasoning
        parser looks at how the prompt ends). limit: raise TooManyTokens past that many tokens,
        before tokenizing when the text alone shows it."""
        if self.tokenizer is None:
            raise ChatTemplateError("this chat template has no tokenizer to encode with")
        text = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        tok = self.tokenizer
        if tok.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text, tok.encode(text, add_special=True, parse_special=True, limit=limit)


_NEEDLE = 256  # characters of a message's content searched for


def message_starts(text: str, messages: list[dict]) -> list[int]:
    """Where each message's content begins in its rendered prompt `text` (characters), in order. A
    message is found by its text (trimmed, as templates often print it; the first text part of a
    list); one whose content is not there verbatim (none, a tool call, a template that rewrites it)
    starts where the previous one's content ended. Template markup between two contents counts as
    the earlier message's. For naming the message a position falls in (a cache miss's), not for
    cutting the text."""
    starts, pos = [], 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
            content = parts[0] if parts else None
        needle = content.strip() if isinstance(content, str) else ""
        at = text.find(needle[:_NEEDLE], pos) if needle else -1
        if at < 0:
            starts.append(pos)
            continue
        starts.append(at)
        pos = at + (len(needle) if text.startswith(needle, at) else min(len(needle), _NEEDLE))
    return starts


def _special_token_strings(tokenizer: Tokenizer) -> dict[str, Any]:
    def text(i: int | None) -> str:
        return tokenizer.token_text(i) if i is not None else ""

    ids = tokenizer.meta.get("ids", {})
    extra = {}
    for name in ("pad", "unk"):
        if ids.get(name) is not None:
            extra[f"{name}_token"] = text(ids[name])
    return {"bos_token": text(tokenizer.bos_id), "eos_token": text(tokenizer.eos_id), "extra_tokens": extra}
