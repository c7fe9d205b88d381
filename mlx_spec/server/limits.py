"""What a slow, stalled or hostile client may hold of the server: time to
send its headers and its body, time a write to it may stay blocked, and how
far its stream may fall behind its generation.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but
waits forever for a request whose headers or body never finish, and for a
client that never reads what it is sent: each holds a connection, and a
stream's generation would run on into an ever longer queue. So:

- **Headers** (:class:`LimitedH11Protocol`): a request's headers must be
  complete within ``header_seconds`` of the connection opening, or of the
  previous response's end; else the connection is closed (h11 has no
  request to answer yet). A connection that sends nothing is closed too.
- **Body** (``body_seconds``, applied where the body is read,
  :func:`mlx_spec.server.wire.read_body`): the whole body must arrive within
  that time of the headers; else a 408 in the endpoint's error shape, and
  the connection closes.
- **Writes**: the kernel buffers at most ``send_buffer`` bytes a connection
  has not delivered (its ``SO_SNDBUF``, fixed: Linux would grow it to 4 MiB
  for a client that reads nothing), uvicorn 64 KiB more, then it stops a
  handler's writes (flow control) until the buffer drains; a write blocked
  for ``write_seconds`` aborts the connection, which ends its request as a
  disconnect does.
- **A stream's backlog** (``stream_backlog``, :class:`~.bridge.Generation`):
  a handler blocked writing takes no events from its queue; once more than
  that many tokens wait there, the generation is ended.
"""

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("mlx_spec.server")

HEADER_SECONDS = 30.0
BODY_SECONDS = 60.0
WRITE_SECONDS = 60.0
SEND_BUFFER = 256 << 10  # bytes
STREAM_BACKLOG = 1024  # tokens


@dataclass(frozen=True)
class ClientLimits:
    """The limits one client connection is held to (see the module)."""

    header_seconds: float = HEADER_SECONDS
    body_seconds: float = BODY_SECONDS
    write_seconds: float = WRITE_SECONDS
    send_buffer: int = SEND_BUFFER
    stream_backlog: int = STREAM_BACKLOG

    def __post_init__(self):
        for name in ("header_seconds", "body_seconds", "write_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.send_buffer < 4096:
            raise ValueError(f"send_buffer must be >= 4096, got {self.send_buffer}")
        if self.stream_backlog < 1:
            raise ValueError(f"stream_backlog must be >= 1, got {self.stream_backlog}")


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a time limit on a request's headers and
    on a blocked write, and a fixed send buffer (``limits``: a subclass made
    by :func:`h11_protocol` sets them)."""

    limits = ClientLimits()

    def connection_made(self, transport):
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._write_timer: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer
            )
        self._await_headers()

    def connection_lost(self, exc):
        self._stop("_header_timer")
        self._stop("_write_timer")
        super().connection_lost(exc)

    # -- headers -------------------------------------------------------------
    def _await_headers(self):
        """The next request's headers are due within ``header_seconds``."""
        self._stop("_header_timer")
        self._header_timer = self.loop.call_later(
            self.limits.header_seconds, self._headers_late
        )

    def handle_events(self):
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers came
            self._stop("_header_timer")

    def on_response_complete(self):
        super().on_response_complete()  # may parse a pipelined request
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_headers()

    def _headers_late(self):
        self._header_timer = None
        if not self.transport.is_closing():
            log.info(
                "closed a connection whose request headers did not arrive "
                "within %g s",
                self.limits.header_seconds,
            )
            self.transport.close()

    # -- writes --------------------------------------------------------------
    def pause_writing(self):
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.limits.write_seconds, self._write_stalled
            )

    def resume_writing(self):
        super().resume_writing()
        self._stop("_write_timer")

    def _write_stalled(self):
        self._write_timer = None
        log.info(
            "closed a connection that read nothing of its response for %g s",
            self.limits.write_seconds,
        )
        self.transport.abort()  # close() would wait for the buffer to drain

    def _stop(self, timer: str):
        handle = getattr(self, timer, None)
        if handle is not None:
            handle.cancel()
            setattr(self, timer, None)


def h11_protocol(limits: ClientLimits) -> type:
    """The protocol class uvicorn serves with, held to ``limits``."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})
