"""What goes over the wire: request bodies read and parsed within a size
limit, JSON written as standard JSON only, server-sent events, and error
responses in the shape of the endpoint's API (Anthropic's on
``/v1/messages``, OpenAI's elsewhere)."""

import asyncio
import json
from typing import Optional

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from . import anthropic, openai
from .requests import RequestError

MAX_BODY_BYTES = 16 << 20


class ClientGone(Exception):
    """The client closed its connection before its answer was written."""


def json_bytes(body) -> bytes:
    """``body`` as standard JSON in UTF-8: ``NaN`` and ``Infinity`` are
    refused (``ValueError``), never written; text UTF-8 cannot hold (a lone
    surrogate a client sent) is written as ``\\u`` escapes."""
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body, allow_nan=False).encode()


def json_response(status: int, body, close: bool = False) -> Response:
    """A JSON response; ``close``: the connection closes after it."""
    headers = {"Connection": "close"} if close else None
    return Response(
        json_bytes(body), status, headers=headers, media_type="application/json"
    )


def error_body(path: str, status: int, message: str, param=None) -> dict:
    if path.startswith("/v1/messages"):
        return anthropic.error_body(message, status)
    return openai.error_body(message, status, param)


def error_response(path: str, status: int, message: str, param=None) -> Response:
    """An error in the endpoint's shape. The connection closes after it, so
    that whatever the client sent past the point of failure is never read as
    another request."""
    return json_response(status, error_body(path, status, message, param), True)


def sse(data, event: Optional[str] = None) -> bytes:
    """One server-sent event (``data`` a string, or an object as JSON)."""
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json_bytes(data).decode()
    return f"{head}data: {payload}\n\n".encode()


async def read_body(
    request: Request, limit: int = MAX_BODY_BYTES, timeout: Optional[float] = None
) -> bytes:
    """The request's body; a :class:`RequestError` past ``limit`` bytes (413,
    refused from a declared length before any byte is read), or when it has
    not all arrived within ``timeout`` seconds (408; None: no limit)."""
    declared = request.headers.get("content-length")
    too_big = f"the body must be at most {limit} bytes"
    if declared is not None and declared.isdecimal() and int(declared) > limit:
        raise RequestError(too_big, status=413)

    async def chunks() -> bytes:
        read, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(too_big, status=413)
            read.append(chunk)
        return b"".join(read)

    try:
        return await asyncio.wait_for(chunks(), timeout)
    except ClientDisconnect:
        raise ClientGone() from None
    except asyncio.TimeoutError:
        raise RequestError(
            f"the request's body did not arrive within {timeout:g} s", status=408
        ) from None


def parse_json_object(raw: bytes) -> dict:
    """``raw`` as a JSON object; a :class:`RequestError` (400) for anything
    else, a structure nested too deeply to parse included."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    except ValueError:  # Python reads integers of at most 4300 digits
        raise RequestError(
            "the body is not valid JSON: a number has too many digits to read"
        ) from None
    except RecursionError:
        raise RequestError("the body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body
