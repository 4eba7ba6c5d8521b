"""A generation API as one protocol adapter; app.py serves every adapter in its route table with
one handler.

The handler decodes the body (`body_type`), checks the worker takes work, has `to_generation`
turn the protocol's fields into a GenerationRequest (a prompt past the context is counted as a
refusal), submits it, then streams with `renderer` or collects the whole result and answers with
`response`. An adapter holds no state: what one request needs travels in `Submitted`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..engine.requests import GenerationRequest
from .common import ApiContext, Collected
from .sse import Renderer


@dataclass
class Submitted:
    """A request the engine took: what its renderer or response needs."""

    ctx: ApiContext
    body: Any
    request_id: str
    created: int
    req: GenerationRequest
    notes: Any = None  # the adapter's own (completions: the prompt to echo, logprobs)


class ProtocolAdapter:
    path: ClassVar[str]
    summary: ClassVar[str]  # for the OpenAPI document
    body_type: ClassVar[type]
    id_prefix: ClassVar[str]
    protocol: ClassVar[str]  # for logs and metrics
    prompt_param: ClassVar[str]  # the field a refusal at submission names (the prompt is too long)
    reads_probe: ClassVar[bool] = False  # honours x-ember-probe: 1 (the daemon's readiness probe)

    def headers(self, request_id: str) -> dict[str, str]:
        return {"x-request-id": request_id}

    async def to_generation(self, ctx: ApiContext, body: Any, request_id: str) -> tuple[GenerationRequest, Any]:
        """The request for the engine, and notes for rendering its result (or None)."""
        raise NotImplementedError

    def renderer(self, s: Submitted) -> Renderer:
        raise NotImplementedError

    def response(self, s: Submitted, result: Collected) -> Any:
        raise NotImplementedError
