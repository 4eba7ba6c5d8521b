"""POST /tokenize and /detokenize (llama-server's and vLLM's helpers), always off the event loop.

/tokenize takes `content` (or `prompt`) text, or chat `messages` rendered through the template,
and answers the ids (with `with_pieces`, each id's text), their count and the context limit. It
counts past the context too: knowing how far over a text is, is the point. /detokenize takes
`tokens` and answers their text.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from . import common, openai_chat
from .common import ApiContext, bad_request


class TokenizeRequest(msgspec.Struct, kw_only=True):
    content: str | None = None
    prompt: str | None = None
    messages: list[openai_chat.ChatMessageIn] | None = None
    add_special: bool | None = None
    with_pieces: bool = False


class TokenPiece(msgspec.Struct):
    id: int
    piece: str


class TokenizeResponse(msgspec.Struct):
    tokens: list[int] | list[TokenPiece]
    count: int
    max_model_len: int


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    content: str
    prompt: str


async def tokenize(ctx: ApiContext, body: TokenizeRequest) -> TokenizeResponse:
    if body.messages is not None:
        msgs = openai_chat.template_messages(body.messages)
        _, ids = await common.render_prompt(ctx, msgs, None, "messages", bounded=False)
    else:
        text = body.content if body.content is not None else body.prompt
        if text is None:
            raise bad_request("send `content` (text) or `messages`", param="content")
        tok = ctx.tokenizer
        ids = await asyncio.to_thread(tok.encode, text, add_special=bool(body.add_special), parse_special=True)
    tokens: Any = ids
    if body.with_pieces:
        tokens = await asyncio.to_thread(lambda: [TokenPiece(i, common.token_str(ctx, i)) for i in ids])
    return TokenizeResponse(tokens, len(ids), ctx.context_limit)


async def detokenize(ctx: ApiContext, body: DetokenizeRequest) -> DetokenizeResponse:
    n = ctx.tokenizer.vocab_size

    def run() -> str:
        for i, t in enumerate(body.tokens):
            if not 0 <= t < n:
                raise bad_request(f"token id {t} at tokens[{i}] is not in the vocabulary (0..{n - 1})",
                                  param="tokens", code="invalid_value")
        return ctx.tokenizer.decode(body.tokens)

    text = await asyncio.to_thread(run)
    return DetokenizeResponse(text, text)
