"""Who may call the API: what keeps a web page in the user's browser from driving a local worker.

A browser lets any page send requests to 127.0.0.1, so a worker that only checks "is this loopback"
is open to every site its user visits. The rules follow Ollama's:

- DNS rebinding: while bound to loopback, the `Host` header must name this machine (localhost,
  *.localhost, a loopback address, or the machine's own hostname). A rebinding attack reaches the
  worker under the attacker's domain name, which is refused.
- Cross-site requests: a request with an `Origin` header must come from a loopback page or an
  origin allowed with --allowed-origins (`*` allows all). CORS headers (Litestar's CORS config) are
  sent for exactly those; other origins get a 403 before any work.
- A POST must say its body is JSON (`Content-Type: application/json`, or a `+json` type): a page
  can send text/plain or form bodies without a CORS preflight, never application/json. 415 otherwise.
- The API key (--api-key) is compared in constant time; /health/* stays public, and /metrics and
  /v1/stats unless --metrics-auth.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import ApiError

# A page served from this machine, any port: the user's own tools (Open WebUI on localhost, a notebook).
LOOPBACK_ORIGIN = r"https?://(localhost|[a-z0-9.-]+\.localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"


@dataclass(frozen=True)
class Guard:
    api_key: str | None = None
    loopback_only: bool = True  # bound to a loopback address: check Host against DNS rebinding
    allowed_origins: tuple[str, ...] = ()  # besides loopback pages; "*" = any
    metrics_auth: bool = False
    hostnames: frozenset[str] = field(default_factory=lambda: _own_hostnames())

    @property
    def any_origin(self) -> bool:
        return "*" in self.allowed_origins

    # -- the checks, in the order a request meets them -------------------------------------------------

    def check_host(self, host: str | None) -> None:
        if not self.loopback_only or not host:
            return
        name = _host_name(host)
        if name is None or not self._local_name(name):
            raise ApiError(403, f"the Host header {host!r} does not name this machine; this worker listens on "
                                "loopback only and refuses other names (DNS rebinding)", code="forbidden_host")

    def check_origin(self, origin: str | None) -> None:
        if origin is None or self.origin_allowed(origin):
            return
        raise ApiError(403, f"requests from the web origin {origin!r} are not allowed; start the worker with "
                            "--allowed-origins to allow it", code="forbidden_origin")

    def origin_allowed(self, origin: str) -> bool:
        o = origin.strip().rstrip("/").lower()
        return self.any_origin or o in self.allowed_origins or re.fullmatch(LOOPBACK_ORIGIN, o) is not None

    @staticmethod
    def check_content_type(method: str, content_type: str | None) -> None:
        if method != "POST":
            return
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
            return
        got = f"got {media!r}" if media else "it names none"
        raise ApiError(415, f"the request body must be JSON: send Content-Type: application/json ({got})",
                       code="unsupported_media_type")

    def check_key(self, headers: Mapping[str, str], public: bool) -> None:
        if self.api_key is None or public:
            return
        get = headers.get
        supplied = [get("x-api-key")]
        auth = get("authorization") or ""
        if auth[:7].lower() == "bearer ":
            supplied.append(auth[7:].strip())
        key = self.api_key.encode()
        given = [s for s in supplied if s is not None]
        if any(hmac.compare_digest(s.encode(), key) for s in given):
            return
        msg = "invalid API key" if given else "an API key is required (Authorization: Bearer KEY or x-api-key)"
        raise ApiError(401, msg, code="invalid_api_key")

    def _local_name(self, name: str) -> bool:
        if name == "localhost" or name.endswith(".localhost") or name in self.hostnames:
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


def _host_name(host: str) -> str | None:
    """The name part of a Host header (no port, no IPv6 brackets), lower case; None if malformed."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name, _, port = host.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None


def _own_hostnames() -> frozenset[str]:
    """The machine's own name (no DNS lookup: a resolver that does not answer must not delay a start)."""
    name = socket.gethostname().lower()
    return frozenset({name, name.split(".", 1)[0]} - {""})
