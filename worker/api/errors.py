"""Errors in each protocol's own shape.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}

Handlers raise ApiError; app.py renders it in the shape of the endpoint's protocol. Nothing here
ever puts a Python traceback in a body.
"""

from __future__ import annotations

import re

import msgspec

# HTTP status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("invalid_request_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("invalid_request_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    499: ("canceled", "api_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.type = type

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(msgspec.Struct):
    error: OpenAIErrorDetail


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct):
    error: AnthropicErrorDetail
    type: str = "error"


def openai_error(e: ApiError) -> OpenAIErrorBody:
    kind = e.type or _TYPES.get(e.status, ("server_error", "api_error"))[0]
    return OpenAIErrorBody(OpenAIErrorDetail(e.message, kind, e.param, e.code))


def anthropic_error(e: ApiError) -> AnthropicErrorBody:
    kind = _TYPES.get(e.status, ("server_error", "api_error"))[1]
    message = f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message
    return AnthropicErrorBody(AnthropicErrorDetail(kind, message))


_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def from_validation(e: msgspec.ValidationError | msgspec.DecodeError, prefix: str = "") -> ApiError:
    """A msgspec decode failure as a 400 naming the field (`temperature`, `messages[0].role`)."""
    text = str(e)
    param = None
    m = _AT.search(text)
    if m:
        param = m.group(1)
    mm = _MISSING.search(text)
    if mm:
        param = f"{param}.{mm.group(1)}" if param else mm.group(1)
    if param:
        param = prefix + param
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        return ApiError(400, f"the request body is not valid JSON: {text}", code="invalid_json")
    message = _AT.sub("", text).rstrip(" -")
    if param and param not in message:
        message = f"{param}: {message}"
    return ApiError(400, message, param=param, code="invalid_value")
