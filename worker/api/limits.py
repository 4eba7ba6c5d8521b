"""What a request may ask for, checked before any work is done.

Everything a client controls that costs memory or time per token or per step has a bound here:
the body's size and nesting, stop strings, logit_bias, tools, top_k, the output length. Each bound
is a worker setting (`--max-stop`, `--max-tools`, ...; see config.py) with a default no agent
reaches, and a request past one gets a 400 naming the field and the limit, never a slow answer.

The body limit follows the context: `auto` is the JSON that a context's worth of text can take
(each token stands for at most the vocabulary's longest piece, each byte of text for at most six
bytes of JSON, as in `\\u0001`), plus room for the request's own structure. Anything larger
could not fit the context, so it is refused (413) before it is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from .errors import ApiError, bad_request

JSON_ESCAPE_FACTOR = 6  # bytes of JSON per byte of text at worst (a control character as \u0001)
BODY_STRUCTURE_BYTES = 1 << 20  # what a request carries besides its text: keys, tool schemas' framing
LOGIT_BIAS_RANGE = 100.0  # OpenAI's range for a logit_bias value


@dataclass(frozen=True)
class RequestLimits:
    max_output_tokens: int = 0  # 0: no cap beyond the context's room
    max_body: int | None = None  # None: auto, from the context
    max_stop: int = 16
    max_stop_chars: int = 512
    max_logit_bias: int = 1024
    max_tools: int = 256
    max_tool_schema_bytes: int = 64 * 1024
    max_top_k: int = 1024
    max_json_depth: int = 64

    @classmethod
    def from_config(cls, cfg: Any) -> RequestLimits:
        from ..config import parse_size

        return cls(max_output_tokens=cfg.max_output_tokens,
                   max_body=None if cfg.max_body == "auto" else parse_size(cfg.max_body, "max_body"),
                   max_stop=cfg.max_stop, max_stop_chars=cfg.max_stop_chars, max_logit_bias=cfg.max_logit_bias,
                   max_tools=cfg.max_tools, max_tool_schema_bytes=cfg.max_tool_schema_bytes,
                   max_top_k=cfg.max_top_k, max_json_depth=cfg.max_json_depth)

    # -- the body ------------------------------------------------------------------------------------------

    def body_bytes(self, context: int, longest_token_bytes: int | None) -> int:
        """The largest body worth reading for a context of `context` tokens."""
        if self.max_body is not None:
            return self.max_body
        per_token = longest_token_bytes or 64
        return context * per_token * JSON_ESCAPE_FACTOR + BODY_STRUCTURE_BYTES

    def check_depth(self, body: bytes) -> None:
        depth = json_depth(body, self.max_json_depth)
        if depth > self.max_json_depth:
            raise bad_request(f"the request body's JSON is nested deeper than {self.max_json_depth} levels "
                              "(--max-json-depth)", code="invalid_json")

    # -- fields --------------------------------------------------------------------------------------------

    def stop(self, stop: str | list[str] | None, param: str) -> list[str]:
        """The non-empty stop strings, within --max-stop and --max-stop-chars."""
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if len(items) > self.max_stop:
            raise bad_request(f"{param} holds {len(items)} strings; at most {self.max_stop} are allowed "
                              "(--max-stop)", param=param, code="invalid_value")
        for i, s in enumerate(items):
            if len(s) > self.max_stop_chars:
                where = param if isinstance(stop, str) else f"{param}[{i}]"
                raise bad_request(f"{where} is {len(s)} characters long; at most {self.max_stop_chars} are allowed "
                                  "(--max-stop-chars)", param=where, code="invalid_value")
        return [s for s in items if s]

    def tools(self, tools: list[Any] | None, param: str = "tools") -> None:
        if not tools:
            return
        if len(tools) > self.max_tools:
            raise bad_request(f"{param} holds {len(tools)} tools; at most {self.max_tools} are allowed "
                              "(--max-tools)", param=param, code="invalid_value")
        for i, tool in enumerate(tools):
            size = len(msgspec.json.encode(tool))
            if size > self.max_tool_schema_bytes:
                raise bad_request(f"{param}[{i}] is {size} bytes of JSON; at most {self.max_tool_schema_bytes} "
                                  "are allowed per tool (--max-tool-schema-bytes)", param=f"{param}[{i}]",
                                  code="invalid_value")

    def top_k(self, top_k: int | None) -> None:
        if top_k is not None and top_k > self.max_top_k:
            raise bad_request(f"top_k is {top_k}; at most {self.max_top_k} is allowed (--max-top-k)", param="top_k",
                              code="invalid_value")

    def logit_bias(self, bias: dict[str, float] | None, vocab_size: int, param: str = "logit_bias"
                   ) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} as sorted (id, bias) pairs; a 400 naming the entry that is wrong."""
        if not bias:
            return ()
        if len(bias) > self.max_logit_bias:
            raise bad_request(f"{param} holds {len(bias)} entries; at most {self.max_logit_bias} are allowed "
                              "(--max-logit-bias)", param=param, code="invalid_value")
        out = []
        for key, value in bias.items():
            where = f"{param}.{key}"
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"{where}: the keys of {param} are token ids (got {key!r})", param=where,
                                  code="invalid_value") from None
            if not 0 <= token < vocab_size:
                raise bad_request(f"{where}: token id {token} is not in the vocabulary (0..{vocab_size - 1})",
                                  param=where, code="invalid_value")
            if not (isinstance(value, (int, float)) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
                raise bad_request(f"{where}: a bias must be a number from -100 to 100 (got {value!r})", param=where,
                                  code="invalid_value")
            out.append((token, float(value)))
        return tuple(sorted(out))

    def output_cap(self, room: int) -> int:
        """What --max-output-tokens leaves of `room` tokens."""
        return min(room, self.max_output_tokens) if self.max_output_tokens else room


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes, more than this worker's context can use "
                         "(--max-body)", code="request_too_large")


# JSON strings, with their escapes: removed before counting brackets (a "[" inside a string nests nothing).
# Only run on text msgspec has already decoded: in valid JSON every quote outside a string opens one,
# so the scan is linear (on broken JSON a quote inside a string could make it quadratic).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(body: bytes, enough: int = 0) -> int:
    """How deep valid JSON text nests (0 for a scalar). Fewer brackets than `enough` in all cannot
    nest deeper, so that common case costs two counts."""
    opened = body.count(b"[") + body.count(b"{")
    if opened <= enough:
        return opened
    a = np.frombuffer(_STRING.sub(b'""', body), np.uint8)
    step = np.isin(a, _OPEN).astype(np.int32) - np.isin(a, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def finite(value: float | None, param: str) -> None:
    if value is not None and not math.isfinite(value):
        raise bad_request(f"{param} must be a finite number", param=param, code="invalid_value")
