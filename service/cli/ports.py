"""Taking the port a server listens on before anything slow starts: its sockets bound
(handed to uvicorn later), or one line naming a free port near it."""

from __future__ import annotations

import errno
import socket

from service.cli.console import CliError


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address of host:port, bound the way asyncio binds them
    (SO_REUSEADDR, v6-only); OSError (socket.gaierror included) if one cannot be bound.

    The caller keeps them and hands them to uvicorn: no other process can take the port
    between this check and the server's start (Ray's start-up takes seconds in between)."""
    addresses = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
    except OSError:
        for sock in bound:
            sock.close()
        raise
    return bound


def _free(host: str, port: int) -> bool:
    try:
        for sock in bind_listeners(host, port):
            sock.close()
    except OSError:
        return False
    return True


def check_port(host: str, port: int, how: str) -> list[socket.socket]:
    """The listening sockets of host:port, or one line and exit 1 if it cannot be listened on,
    before anything heavy starts.

    `how` says how to pick another port; {port} in it becomes a free one near `port`.
    """
    try:
        return bind_listeners(host, port)
    except OSError as problem:
        if problem.errno != errno.EADDRINUSE:
            reason = problem.strerror or str(problem)
            raise CliError(
                f"cannot listen on {host}:{port}: {reason}; {how.format(port='PORT')}"
            ) from problem
    free = next((p for p in range(port + 1, min(port + 50, 65536)) if _free(host, p)), None)
    raise CliError(
        f"port {port} on {host} is in use (another ringlab or server is listening there); "
        + how.format(port=free or "PORT")
    )


def browser_url(host: str, port: int) -> str:
    """The address a browser on this machine uses for a server bound to host:port."""
    shown = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
