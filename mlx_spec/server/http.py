"""The HTTP front: a Starlette application served by uvicorn.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``
(also ``/chat/completions``), ``POST /v1/completions``, ``POST /v1/responses``
and ``POST /v1/messages``. A handler reads its request, parses and checks it off the
event loop (a large body, a long prompt to tokenize take a while), hands a job to the engine and
writes what the job produces, as one JSON object or as server-sent events
(:mod:`.bridge` carries the engine thread's events to the handler). A
malformed body, a bad field or a failed generation is a JSON error for that
client only, in the endpoint's API's shape; the connection then closes, so no
unread byte of that request is ever taken for another. uvicorn (with h11)
does the HTTP/1.1 framing.
"""

import asyncio
import logging
import signal
import socket
import time
from typing import Callable, Collection, Optional

import uvicorn

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .bridge import Generation, Generations, ShuttingDown
from .engine import Engine
from .exchanges import EventStream, MessagesExchange, OpenAIExchange, ResponsesExchange
from .events import CutShort
from .guard import guard_middleware
from .kept_responses import KeptResponses
from .limits import ClientLimits, h11_protocol
from .requests import RequestError, ServerContext
from .wire import MAX_BODY_BYTES, ClientGone, error_response, json_response
from .wire import parse_json_object, read_body

log = logging.getLogger("mlx_spec.server")

SHUTDOWN_GRACE_SECONDS = 30  # the longest a stop waits for open connections


class Server:
    """The application's state: the engine, what requests need to know, the
    open requests; ``hidden`` are strings (the model's path) no message to a
    client may show, replaced by the model's id."""

    def __init__(
        self,
        engine: Engine,
        ctx: ServerContext,
        hidden: Collection[str],
        max_body_bytes: int = MAX_BODY_BYTES,
        limits: ClientLimits = ClientLimits(),
    ):
        self.engine, self.ctx, self.max_body_bytes = engine, ctx, max_body_bytes
        self.limits = limits
        self.hidden = sorted((h for h in hidden if h), key=len, reverse=True)
        self.generations = Generations()
        self.kept_responses = KeptResponses()
        self.started = time.time()

    def scrub(self, message: str) -> str:
        for text in self.hidden:
            message = message.replace(text, self.ctx.model_id)
        return message

    def error(self, path: str, status: int, message: str, param=None) -> Response:
        return error_response(path, status, self.scrub(message), param)

    # -- routes --------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        engine = self.engine
        status = {"status": "ok" if engine.healthy else "error", **engine.status()}
        return json_response(200 if engine.healthy else 503, status)

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.ctx.model_id,
            "object": "model",
            "created": int(self.started),
            "owned_by": "mlx_spec",
        }
        return json_response(200, {"object": "list", "data": [model]})

    async def openai(self, request: Request) -> Response:
        return await self._answer(request, OpenAIExchange)

    async def messages(self, request: Request) -> Response:
        return await self._answer(request, MessagesExchange)

    async def responses(self, request: Request) -> Response:
        def exchange(path: str, body: dict, ctx: ServerContext):
            return ResponsesExchange(path, body, ctx, self.kept_responses)

        return await self._answer(request, exchange)

    async def _answer(self, request: Request, exchange_class):
        path = request.url.path
        try:
            limits = self.limits
            raw = await read_body(request, self.max_body_bytes, limits.body_seconds)
            exchange = await run_in_threadpool(
                self._exchange, exchange_class, raw, path
            )
            job = (exchange.prompt, exchange.params, exchange.state)
            generation = Generation(
                self.engine,
                self.generations,
                request.receive,
                job,
                backlog=limits.stream_backlog,
            )
        except RequestError as e:
            return self.error(path, e.status, str(e), e.param)
        except ClientGone:
            return Response(status_code=400)  # nobody reads it
        except ShuttingDown as e:
            return self.error(path, e.status, str(e))
        handed_over = False  # to the stream, which closes it
        try:
            if not exchange.stream:
                async for events in generation.batches():
                    exchange.add(events)
                return json_response(200, exchange.body())
            first = await generation.next_batch()  # an error here is a status
            handed_over = True
            return EventStream(exchange, generation, first, self.scrub)
        except ClientGone:
            log.info("client went away")
            return Response(status_code=400)  # nobody reads it
        except CutShort as e:
            return self.error(path, e.status, str(e))
        except ValueError as e:  # options the engine refused (e.g. no MTP head)
            return self.error(path, 400, str(e))
        except Exception as e:  # a failed generation: this request only
            log.exception("request failed")
            message = f"generation failed: {type(e).__name__}: {e}"
            return self.error(path, 500, message)
        finally:
            if not handed_over:
                generation.close()

    def _exchange(self, exchange_class, raw: bytes, path: str):
        """The request parsed and checked (on a worker thread: parsing a
        large body, rendering the chat template and tokenizing take time)."""
        return exchange_class(path, parse_json_object(raw), self.ctx)

    async def no_route(self, request: Request, exc: HTTPException) -> Response:
        path = request.url.path
        if exc.status_code == 405:
            return self.error(path, 405, f"{request.method} is not allowed on {path}")
        if exc.status_code == 404:
            return self.error(path, 404, f"no route {request.method} {path}")
        return self.error(path, exc.status_code, str(exc.detail))

    async def failed(self, request: Request, exc: Exception) -> Response:
        log.error("request failed", exc_info=exc)
        return self.error(request.url.path, 500, f"{type(exc).__name__}: {exc}")


def make_app(
    engine: Engine,
    ctx: ServerContext,
    host: str = "127.0.0.1",
    allow_origins: Collection[str] = (),
    api_key: Optional[str] = None,
    hidden: Collection[str] = (),
    max_body_bytes: int = MAX_BODY_BYTES,
    limits: ClientLimits = ClientLimits(),
) -> Starlette:
    """The ASGI application serving ``engine`` (``app.state.server``: its
    :class:`Server`); ``host``: the address bound (a loopback one turns the
    Host check on); ``hidden``: see :class:`Server`; ``limits``: what one
    client may hold (:mod:`.limits`; served by :func:`uvicorn_config`)."""
    server = Server(engine, ctx, hidden, max_body_bytes, limits)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/chat/completions", server.openai, methods=["POST"]),
        Route("/chat/completions", server.openai, methods=["POST"]),
        Route("/v1/completions", server.openai, methods=["POST"]),
        Route("/v1/messages", server.messages, methods=["POST"]),
        Route("/v1/responses", server.responses, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=guard_middleware(host, allow_origins, api_key),
        exception_handlers={HTTPException: server.no_route, Exception: server.failed},
    )
    app.state.server = server
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a free port); ``OSError``
    naming the address when that fails."""
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server; a signal to stop also ends the open requests at once
    (streams get their last event), so that uvicorn's wait for open
    connections is short."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self.on_exit, self.loop = on_exit, None

    async def startup(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame):
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_exit)
        super().handle_exit(sig, frame)


def uvicorn_config(app: Starlette, log_level: str = "info") -> uvicorn.Config:
    """uvicorn serving ``app`` over HTTP/1.1 with h11 (the same parser
    whichever optional packages are installed), held to the app's client
    limits, logging through the root logger."""
    return uvicorn.Config(
        app,
        http=h11_protocol(app.state.server.limits),
        ws="none",
        lifespan="off",
        log_config=None,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )


def serve(app: Starlette, sock: socket.socket, log_level: str = "info"):
    """Serve ``app`` on ``sock`` until SIGTERM or SIGINT (in the main thread)."""
    generations = app.state.server.generations
    server = _Uvicorn(uvicorn_config(app, log_level), generations.shut_down)
    # uvicorn raises the signal again once it has stopped: it must find a
    # handler that lets the caller close the engine and exit cleanly
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
