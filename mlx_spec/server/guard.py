"""Who may use the server: ASGI middleware checking the Host header (for a
loopback bind), the Origin of browser requests, and an optional API key.

A web page the user visits can send requests to ``127.0.0.1`` (a plain
``text/plain`` POST needs no CORS preflight) and, by DNS rebinding, under a
name of its own, which would let it read the replies. So a server bound to a
loopback address answers only requests addressed to a loopback name
(:class:`HostCheck`), and a request from a browser page (an ``Origin``
header) is served only when ``--allow-origin`` names that origin
(:class:`AccessCheck`; Starlette's CORS middleware answers the preflights
and adds the CORS headers). ``--api-key`` makes every route but ``/health``
require the key, compared in constant time.
"""

import hmac
import ipaddress
from typing import Collection, Optional

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from .wire import error_response

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health", "/v1/health")  # served without the API key


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> Optional[str]:
    """The name of a Host header without its port (``[::1]:8080``: ``::1``);
    None when it is not ``name``, ``name:port``, ``[v6]`` or ``[v6]:port``."""
    value = header.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or rest and not rest.startswith(":"):
            return None
    else:
        name, colon, rest = value.partition(":")
        rest = colon + rest
    port = rest[1:]
    if rest and not port.isdecimal() or not name:
        return None
    return name


class HostCheck:
    """Refuse requests whose Host header is not one of ``names`` (400)."""

    def __init__(self, app, names: Collection[str]):
        self.app, self.names = app, {n.lower().strip("[]") for n in names}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host")
            if header is not None and host_name(header) not in self.names:
                allowed = ", ".join(sorted(self.names))
                message = (
                    f"Host {header[:100]!r} is not served here (this server "
                    f"answers to {allowed})"
                )
                response = error_response(scope["path"], 400, message)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class AccessCheck:
    """Refuse browser requests from origins not allowed (403) and, with an
    ``api_key``, requests that do not carry it (401)."""

    def __init__(self, app, origins: Collection[str], api_key: Optional[str]):
        self.app, self.origins = app, set(origins)
        self.key = api_key.encode() if api_key else None

    def _has_key(self, headers: Headers) -> bool:
        given = [headers.get("x-api-key", "")]
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given.append(token.strip())
        # every candidate compared, in constant time, whatever matches
        matches = [hmac.compare_digest(g.encode(), self.key) for g in given]
        return any(matches)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, path = Headers(scope=scope), scope["path"]
        origin = headers.get("origin")
        status = message = None
        if (
            origin is not None
            and "*" not in self.origins
            and origin not in self.origins
        ):
            status = 403
            message = (
                f"requests from the web origin {origin[:100]!r} are not allowed "
                "(the server's --allow-origin)"
            )
        elif self.key is not None and path not in OPEN_PATHS:
            if not self._has_key(headers):
                status = 401
                message = (
                    "a valid API key is required (an 'Authorization: Bearer' "
                    "or 'x-api-key' header)"
                )
        if status is not None:
            response = error_response(path, status, message)
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def guard_middleware(
    host: str, origins: Collection[str], api_key: Optional[str]
) -> list:
    """The middleware stack, outermost first, for a server bound to ``host``."""
    stack = []
    if is_loopback(host):
        stack.append(Middleware(HostCheck, names=(*LOOPBACK_NAMES, host)))
    if origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["*"],
            )
        )
    stack.append(Middleware(AccessCheck, origins=origins, api_key=api_key))
    return stack
