"""Read timeouts for the worker's HTTP connections, where nginx and Apache keep theirs: in the server.

uvicorn times out only an idle kept-alive connection; a client that sends its request a byte at a
time, or opens a connection and says nothing, holds it forever. This protocol (uvicorn's h11 one,
subclassed) gives every request, from its first byte or the connection's opening:
- `read_header_seconds` to deliver its request line and headers (Apache's RequestReadTimeout
  header=20, nginx's client_header_timeout);
- `read_body_seconds` for its body, plus a second for every `read_body_min_rate` bytes that arrive
  (mod_reqtimeout's body=20,MinRate=500), so a large body on a slow link is fine and a trickle is not.
  While the app is not reading (uvicorn paused the socket) the clock does not run out;
and at most `max_slow_connections` connections may be in the middle of sending a request at once:
past that, the one that has been at it longest is closed (a legitimate client sends its request in
milliseconds, so the oldest is the slowest). A timed-out request gets 408 and the connection is
closed; each close is one `slow_client` info line and counts in ember_http_slow_clients_total.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..logs import log

SCOPE_KEY = "ember.read_timeout"  # set in a request's ASGI scope when its body timed out (app.py reads it)


@dataclass(frozen=True)
class ReadLimits:
    header_seconds: float = 20.0
    body_seconds: float = 20.0
    body_min_rate: int = 500  # bytes a second that earn the body another second
    max_slow: int = 128


class Guarded(H11Protocol):
    """uvicorn's h11 protocol with read timeouts. protocol_class makes a subclass of it with its limits,
    its `on_closed` callback and the connections of that subclass in the middle of a request (oldest first)."""

    limits: ClassVar[ReadLimits]
    sending: ClassVar[collections.OrderedDict[Guarded, None]]
    on_closed: ClassVar[Callable[[str], None]]

    _phase: str | None = None  # head | body: the request is still arriving
    _since = 0.0
    _bytes = 0
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._begin("head")

    def data_received(self, data: bytes) -> None:
        if self._phase is None and self.conn.their_state is h11.IDLE:
            self._begin("head")  # the next request on a kept-alive connection
        elif self._phase == "body":
            self._bytes += len(data)
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()
        super().connection_lost(exc)

    # -- where the request is ---------------------------------------------------------------------

    def _follow(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._begin("body")
        elif state is not h11.IDLE:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing more to wait for
            self._end()

    def _begin(self, phase: str) -> None:
        self._phase, self._since, self._bytes = phase, time.monotonic(), 0
        if phase == "head":
            self.sending[self] = None
            while len(self.sending) > self.limits.max_slow:
                oldest = next(iter(self.sending))
                oldest._close("evicted", f"more than {self.limits.max_slow} connections were sending a request "
                                         "at once (--max-slow-connections); this one longest")
        self._arm(self._deadline() - self._since)

    def _end(self) -> None:
        self._phase = None
        self.sending.pop(self, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deadline(self) -> float:
        if self._phase == "head":
            return self._since + self.limits.header_seconds
        return self._since + self.limits.body_seconds + self._bytes / self.limits.body_min_rate

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(max(delay, 0.05), self._check)

    def _check(self) -> None:
        self._timer = None
        if self._phase is None or self.transport.is_closing():
            return
        left = self._deadline() - time.monotonic()
        if left > 0 or (self._phase == "body" and self.flow.read_paused):  # earned more, or we are slow
            self._arm(max(left, 1.0))
            return
        what = "request line and headers" if self._phase == "head" else "body"
        self._close(self._phase, f"the {what} did not arrive in time")

    def _close(self, phase: str, why: str) -> None:
        """408 where the protocol still allows an answer, then close; the app sees a disconnect."""
        seconds = round(time.monotonic() - self._since, 1)
        got = self._bytes
        self._end()
        if self.cycle is not None and not self.cycle.response_complete:
            self.scope[SCOPE_KEY] = phase  # type: ignore[literal-required]
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        try:
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
                out = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
                out = (out or b"") + (self.conn.send(h11.Data(data=b"request timeout\n")) or b"")
                out += self.conn.send(h11.EndOfMessage()) or b""
                self.transport.write(out)
        except h11.LocalProtocolError:
            pass
        self.transport.close()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else None
        log("slow_client", phase=phase, client=client, seconds=seconds, body_bytes=got or None, reason=why)
        type(self).on_closed(phase)  # (a plain function, not a method: called through the class)


def protocol_class(limits: ReadLimits, closed: Callable[[str], None] = lambda phase: None) -> type[H11Protocol]:
    """An h11 protocol class with `limits` (uvicorn.Config(http=...)); `closed(phase)` is called for
    every connection closed for slowness (phase: head, body or evicted)."""
    return type("Guarded", (Guarded,), {"limits": limits, "sending": collections.OrderedDict(),
                                        "on_closed": staticmethod(closed)})
