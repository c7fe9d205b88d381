"""The HTTP front: routes, request bodies, JSON and server-sent events.

Every handler thread parses and checks its request, hands a job to the
engine and writes what the job produces. A malformed body, a bad field or a
failed generation is a JSON error for that client only (OpenAI's shape, or
Anthropic's on ``/v1/messages``); the server keeps serving.
"""

import json
import logging
import queue
import select
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator

from . import anthropic, openai
from .engine import Engine
from .events import Finished, Job
from .requests import RequestError, ServerContext, field, openai_request

log = logging.getLogger("mlx_spec.server")

MAX_BODY_BYTES = 16 << 20
POLL_SECONDS = 0.25


class SpecServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, engine: Engine, ctx: ServerContext):
        self.engine, self.ctx = engine, ctx
        super().__init__(address, Handler)


class Handler(BaseHTTPRequestHandler):
    server: SpecServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        log.info("%s %s", self.address_string(), fmt % args)

    # -- plumbing ------------------------------------------------------------
    def _send_json(self, status: int, body: dict):
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param=None):
        if self.path.startswith("/v1/messages"):
            body = anthropic.error_body(message, status)
        else:
            body = openai.error_body(message, status, param)
        try:
            self._send_json(status, body)
        except OSError:
            pass  # the client is gone

    def _start_stream(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, data, event=None):
        head = f"event: {event}\n" if event else ""
        payload = (
            data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        )
        self.wfile.write(f"{head}data: {payload}\n\n".encode())
        self.wfile.flush()

    def _client_alive(self) -> bool:
        """False once the client closed its side of the connection."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return True
            return self.connection.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False

    def _read_body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("a Content-Length header is required", status=411)
        try:
            length = int(length)
        except ValueError:
            raise RequestError(f"invalid Content-Length {length!r}") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise RequestError(f"the body must be at most {MAX_BODY_BYTES} bytes", 413)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def _batches(self, job: Job, alive: Callable[[], bool]) -> Iterator[list]:
        """The job's events, as handed over (a pass's together), until
        ``Finished``; cancels it when ``alive()`` turns false (then keeps
        draining until the engine lets go)."""
        engine = self.server.engine
        while True:
            try:
                events = job.get(POLL_SECONDS)
            except queue.Empty:
                if not engine.healthy:
                    raise RuntimeError("the generation worker has stopped") from None
                if not job.cancelled and not alive():
                    job.cancel()
                continue
            for event in events:
                if isinstance(event, Exception):
                    raise event
            yield events
            if any(isinstance(event, Finished) for event in events):
                return

    def _events(self, job: Job, alive: Callable[[], bool]) -> Iterator:
        """The job's events one by one (see :meth:`_batches`)."""
        for events in self._batches(job, alive):
            yield from events

    # -- routes --------------------------------------------------------------
    def do_GET(self):
        ctx = self.server.ctx
        if self.path in ("/health", "/v1/health"):
            engine = self.server.engine
            status = {"status": "ok" if engine.healthy else "error", **engine.status()}
            self._send_json(200 if engine.healthy else 503, status)
        elif self.path == "/v1/models":
            model = {
                "id": ctx.model_id,
                "object": "model",
                "created": int(self.server.started),
                "owned_by": "mlx_spec",
            }
            self._send_json(200, {"object": "list", "data": [model]})
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self):
        routes = {
            "/v1/chat/completions": self._openai,
            "/chat/completions": self._openai,
            "/v1/completions": self._openai,
            "/v1/messages": self._messages,
        }
        route = routes.get(self.path.split("?")[0])
        try:
            if route is None:
                raise RequestError(f"no route POST {self.path}", status=404)
            body = self._read_body()
            route(body)
        except RequestError as e:
            self._error(e.status, str(e), e.param)
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away")
        except ValueError as e:  # options the engine refused (e.g. no MTP head)
            self._error(400, str(e))
        except Exception as e:  # a failed generation: this request only
            log.exception("request failed")
            self._error(500, f"generation failed: {type(e).__name__}: {e}")

    def _openai(self, body):
        ctx, engine = self.server.ctx, self.server.engine
        stream = field(body, "stream", "bool", False)
        options = field(body, "stream_options", "dict", {})
        prompt, state, params = openai_request(self.path, body, ctx)
        chat = "chat" in self.path
        job = engine.submit(Job(prompt, params, state))
        response = openai.OpenAIResponse(chat, ctx.model_id, params, ctx.tokenizer)
        if not stream:
            for event in self._events(job, self._client_alive):
                response.add(event)
            return self._send_json(200, response.body())
        self._stream(job, response, options.get("include_usage", False))

    def _stream(self, job, response, include_usage):
        started = False
        try:
            for events in self._batches(job, lambda: True):
                if not started:  # headers once the prompt is accepted
                    self._start_stream()
                    started = True
                for chunk in response.stream(events):
                    self._sse(chunk)
            if include_usage:
                self._sse(response.usage_chunk())
            self._sse("[DONE]")
        except OSError:
            job.cancel()  # the client went away mid-stream
            raise
        except Exception as e:
            if not started:
                raise
            self._sse({"error": {"message": str(e), "type": "server_error"}})

    def _messages(self, body):
        ctx, engine = self.server.ctx, self.server.engine
        stream = field(body, "stream", "bool", False)
        prompt, state, params = anthropic.messages_request(body, ctx)
        job = engine.submit(Job(prompt, params, state))
        response = anthropic.MessageResponse(ctx.model_id)
        if not stream:
            for event in self._events(job, self._client_alive):
                response.add(event)
            return self._send_json(200, response.body())
        started = False
        try:
            for events in self._batches(job, lambda: True):
                if not started:
                    self._start_stream()
                    started = True
                for name, data in response.stream(events):
                    self._sse(data, event=name)
        except OSError:
            job.cancel()
            raise
        except Exception as e:
            if not started:
                raise
            self._sse(anthropic.error_body(str(e), 500), event="error")


def make_server(host: str, port: int, engine: Engine, ctx: ServerContext) -> SpecServer:
    server = SpecServer((host, port), engine, ctx)
    server.started = time.time()
    return server
