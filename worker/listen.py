"""The worker's listening sockets, bound before the model loads and handed to the HTTP server.

A port that another process holds is known at once, before a minute of model loading: the worker
logs `port_busy` and exits with ExitCode.PORT_BUSY, which the daemon retries with its backoff (the
holder may let go: a worker of an earlier daemon, a server started by hand for a moment). An
address this machine does not have, or a port this user may not bind, is a configuration error.
Who holds the port is the daemon's to find out (daemon/procs.py), not the worker's.
"""

from __future__ import annotations

import errno
import socket

from .config import ConfigError


class PortBusy(Exception):
    """Another process listens on the worker's address; str() is one line."""


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address `host` resolves to (both families for `localhost`),
    with SO_REUSEADDR as servers bind on POSIX. Raises PortBusy or ConfigError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"host: {host!r} is not an address of this machine ({e.strerror})") from None
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and len(infos) > 1:  # the IPv4 address gets a socket of its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                where = f"{addr[0]}:{port}" if family == socket.AF_INET else f"[{addr[0]}]:{port}"
                if e.errno == errno.EADDRINUSE:
                    raise PortBusy(f"port {port} on {host} is already in use ({where}): another process listens "
                                   "there") from None
                raise ConfigError(f"host/port: cannot listen on {where}: {e.strerror}") from None
            sock.set_inheritable(False)
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets
