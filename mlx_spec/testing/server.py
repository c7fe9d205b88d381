"""Start an HTTP server process for a test or a benchmark, and always stop
it; read the events of a job given to the server's engine directly."""

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import time
from typing import Iterator, List, Optional

from ..server.events import Finished


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int, tries: int = 50) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1 now (a ring of
    ``n`` local ranks listens on one each)."""
    for _ in range(tries):
        first = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(first + 1, first + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {n} consecutive free ports in {tries} tries")


def _answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def wait_until_answers(port: int, proc: subprocess.Popen, timeout: float = 120.0):
    """Poll ``/health`` on 127.0.0.1:``port`` until it answers; an error if
    ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not _answers(port):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.args}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"server did not answer within {timeout} s: {proc.args}")
        time.sleep(0.1)


@contextlib.contextmanager
def running_server(
    argv: List[str], port: int, timeout: float = 120.0, log: Optional[str] = None
) -> Iterator[subprocess.Popen]:
    """Run ``argv`` (a server on 127.0.0.1:``port``) until its ``/health``
    answers; stop it (terminate, then kill) when the block ends, whatever
    happened. Its output goes to ``log`` (a file path) or is discarded."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)
    )
    try:
        wait_until_answers(port, proc, timeout)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        if log:
            out.close()


def mlx_spec_server(model, port: int, *extra: str) -> List[str]:
    """The command line of ``mlx_spec server`` in this Python."""
    return [
        sys.executable,
        "-m",
        "mlx_spec",
        "server",
        "--model",
        str(model),
        "--port",
        str(port),
        *extra,
    ]


def job_events(job, timeout: float = 300.0) -> list:
    """The events of an engine ``Job`` up to its ``Finished`` (or an exception,
    raised), each waited for at most ``timeout`` seconds."""
    events = []
    while not events or not isinstance(events[-1], (Finished, Exception)):
        events += job.get(timeout)
    if isinstance(events[-1], Exception):
        raise events[-1]
    return events
