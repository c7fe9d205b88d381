"""One request's exchange, per API (OpenAI's completions, Anthropic's
Messages, OpenAI's Responses): its body checked into a prompt and parameters,
and its answer as one JSON object or as server-sent events
(:class:`EventStream`, the ASGI response of a streamed request)."""

import logging

from . import anthropic, openai
from .bridge import Generation
from .events import CutShort
from .kept_responses import KeptResponses
from .openai import completion_echo, openai_request
from .requests import ServerContext, field
from .response_output import ResponseOutput
from .responses import responses_request
from .wire import ClientGone, sse

log = logging.getLogger("mlx_spec.server")


STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies must not hold events back
]


class _Exchange:
    """What every API's exchange does with its response object: add a
    generation's events to it, and its JSON body."""

    response = None  # the API's response object, set by each exchange

    def add(self, events):
        for event in events:
            self.response.add(event)

    def body(self) -> dict:
        return self.response.body()


class OpenAIExchange(_Exchange):
    """One ``/v1/chat/completions`` or ``/v1/completions`` request: its
    prompt and parameters, and its response as JSON or events."""

    def __init__(self, path: str, body: dict, ctx: ServerContext):
        chat = path.endswith("chat/completions")
        self.stream = field(body, "stream", "bool", False)
        options = field(body, "stream_options", "dict", {})
        self.include_usage = options.get("include_usage") is True
        echo = "" if chat else completion_echo(body)
        self.prompt, self.state, params = openai_request(path, body, ctx)
        self.response = openai.OpenAIResponse(
            chat, ctx.model_id, params, ctx.tokenizer, echo=echo
        )
        self.params = params

    def events(self, events) -> bytes:
        return b"".join(sse(chunk) for chunk in self.response.stream(events))

    def tail(self) -> bytes:
        usage = sse(self.response.usage_chunk()) if self.include_usage else b""
        return usage + sse("[DONE]")

    def failure(self, message: str) -> bytes:
        return sse({"error": {"message": message, "type": "server_error"}})


class MessagesExchange(_Exchange):
    """One ``/v1/messages`` request (Anthropic's Messages API)."""

    def __init__(self, path: str, body: dict, ctx: ServerContext):
        self.stream = field(body, "stream", "bool", False)
        self.prompt, self.state, self.params = anthropic.messages_request(body, ctx)
        self.response = anthropic.MessageResponse(ctx.model_id)

    def events(self, events) -> bytes:
        return b"".join(sse(d, event=n) for n, d in self.response.stream(events))

    def tail(self) -> bytes:
        return b""  # message_stop came with the finish

    def failure(self, message: str) -> bytes:
        return sse(anthropic.error_body(message, 500), event="error")


class ResponsesExchange(_Exchange):
    """One ``/v1/responses`` request (OpenAI's Responses API); a stored
    response's conversation is kept in ``kept`` once it has finished."""

    def __init__(self, path: str, body: dict, ctx: ServerContext, kept: KeptResponses):
        request = responses_request(body, ctx, kept)
        self.stream, self.kept, self.was_kept = request.stream, kept, False
        self.prompt, self.state = request.prompt, request.initial_state
        self.params = request.params
        self.response = ResponseOutput(ctx.model_id, request)

    def add(self, events):
        super().add(events)
        self._keep()

    def events(self, events) -> bytes:
        out = self.response.stream(events)
        self._keep()
        return b"".join(sse(e, event=e["type"]) for e in out)

    def tail(self) -> bytes:
        return b""  # response.completed (or its like) came with the finish

    def failure(self, message: str) -> bytes:
        return b"".join(sse(e, event=e["type"]) for e in self.response.failed(message))

    def _keep(self):
        conversation = None if self.was_kept else self.response.kept()
        if conversation is not None:
            self.kept.put(self.response.id, conversation)
            self.was_kept = True


class EventStream:
    """The ASGI response of a streamed request: the events of the batches
    the job hands over, then the exchange's tail (``[DONE]``). A stream the
    server cuts short (a shutdown, a client too far behind) ends with a
    ``cancelled`` finish carrying the counters so far; a client gone ends it
    silently."""

    def __init__(self, exchange, generation: Generation, first: list, scrub):
        self.exchange, self.generation, self.first = exchange, generation, first
        self.scrub = scrub  # a message as a client may see it

    async def __call__(self, scope, receive, send):
        async def write(data: bytes, more: bool = True):
            await send({"type": "http.response.body", "body": data, "more_body": more})

        x, generation = self.exchange, self.generation
        await send(
            {"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS}
        )
        try:
            await write(x.events(self.first))
            try:
                async for events in generation.batches():
                    await write(x.events(events))
            except CutShort as cut:
                await write(x.events([generation.cut_short(cut)]))
            await write(x.tail(), more=False)
        except ClientGone:
            log.info("client went away mid-stream")
        except Exception as e:  # a failed generation: this stream only
            log.exception("stream failed")
            message = self.scrub(f"generation failed: {type(e).__name__}: {e}")
            await write(x.failure(message), more=False)
        finally:
            generation.close()
