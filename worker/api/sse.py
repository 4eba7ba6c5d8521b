"""Server-sent events for one request: frames from a protocol renderer, keepalives while nothing
else is sent, and cancellation of the request when the client goes away.

Disconnects: Litestar's streaming response listens on ASGI `receive()` for `http.disconnect`
concurrently with sending and cancels the sending task when it arrives, so a client that closes
or resets while its request is queued, in prefill or decoding is noticed at once, not at the next
send. The cancellation lands in `stream()` below (awaiting the next event or a send), whose
`finally` calls `handle.cancel()`; the engine drops the sequence at its next step.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from ..engine.requests import Event, Failed, Finished, Keepalive, RequestHandle
from ..logs import log

KEEPALIVE_SECONDS = 2.0
KEEPALIVE_COMMENT = b": keepalive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encoder = msgspec.json.Encoder()


def frame(data: object, event: str | None = None) -> bytes:
    """One SSE frame; `data` is a Struct/dict (JSON-encoded) or bytes sent as they are."""
    body = data if isinstance(data, bytes) else _encoder.encode(data)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + body + b"\n\n"


class Renderer(Protocol):
    def open(self) -> list[bytes]:
        """Frames to send as soon as the stream starts."""

    def on_event(self, event: Event) -> list[bytes]:
        """Frames for one engine event (the last one is Finished or Failed)."""

    def keepalive(self) -> bytes:
        """What to send when nothing else was sent for a while."""

    def internal_error(self, message: str) -> list[bytes]:
        """Frames that end the stream when rendering itself failed."""


async def stream(handle: RequestHandle, renderer: Renderer, keepalive_seconds: float = KEEPALIVE_SECONDS
                 ) -> AsyncIterator[bytes]:
    settled = False
    getter: asyncio.Future | None = None
    last_sent = time.monotonic()
    try:
        for f in renderer.open():
            yield f
        while True:
            if getter is None:
                getter = asyncio.ensure_future(handle.queue.get())
            wait = max(0.0, last_sent + keepalive_seconds - time.monotonic())
            done, _ = await asyncio.wait({getter}, timeout=wait)
            if not done:
                yield renderer.keepalive()
                last_sent = time.monotonic()
                continue
            event = getter.result()
            getter = None
            if isinstance(event, Keepalive):
                continue  # the timer above already keeps the stream alive
            final = isinstance(event, (Finished, Failed))
            try:
                frames = renderer.on_event(event)
            except Exception as e:  # a rendering bug ends this stream alone, with the protocol's error event
                log("api_error", level="error", request_id=handle.request.request_id,
                    error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                for f in renderer.internal_error(f"internal error while streaming: {type(e).__name__}"):
                    yield f
                return
            if final:
                settled = True
            for f in frames:
                yield f
            if frames:
                last_sent = time.monotonic()
            if final:
                return
    finally:
        if getter is not None:
            getter.cancel()
        if not settled:
            handle.cancel()
