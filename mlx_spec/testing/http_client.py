"""Plain HTTP requests to a test server on 127.0.0.1 (no client library in
between, so a test sees exactly the status, headers and body sent)."""

import http.client
import json
from typing import Any, List, Optional, Tuple


def post_json(port: int, path: str, body: Any, timeout: float = 120.0) -> Tuple:
    """``(status, parsed JSON body)`` of a POST of ``body`` as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: Optional[dict] = None,
    raw: Optional[str] = None,
) -> Tuple:
    """``(status, headers, parsed JSON or text)`` of one request: ``body`` sent
    as JSON, or ``raw`` as it is."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    conn.request(
        method, path, data, {"Content-Type": "application/json", **(headers or {})}
    )
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    is_json = r.getheader("Content-Type", "").startswith("application/json")
    return r.status, dict(r.getheaders()), json.loads(text) if is_json else text


def get_health(port: int, timeout: float = 30.0) -> Any:
    """The parsed body of ``GET /health``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def post_stream(port: int, path: str, body: Any, timeout: float = 120.0) -> List:
    """The JSON objects of the ``data:`` lines of a streamed POST (up to
    ``[DONE]``), after checking the status is 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        text = r.read().decode()
        if r.status != 200:
            raise AssertionError(f"status {r.status}: {text[:400]}")
    finally:
        conn.close()
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def http_request(path: str, body: bytes, headers=(), method: str = "POST") -> bytes:
    """The bytes of an HTTP/1.1 request to 127.0.0.1 (``headers``: lines
    such as ``"Content-Length: 5"``), for a test to send on a raw socket,
    whole or in part."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def json_request(path: str, body: Any) -> bytes:
    """:func:`http_request` of ``body`` as JSON."""
    data = json.dumps(body).encode()
    headers = ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    return http_request(path, data, headers)


def read_until_closed(sock, limit: int = 64 << 20) -> bytes:
    """Everything ``sock`` receives until the peer closes the connection
    (or resets it); a ``socket.timeout`` (the socket's own timeout) if it
    never does, an ``AssertionError`` past ``limit`` bytes."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
        assert len(received) <= limit, "the server sent more than expected"
