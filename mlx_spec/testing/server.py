"""Start an HTTP server process (or an in-process one on a thread) for a test
or a benchmark, and always stop it; read the events of a job given to the
server's engine directly; an engine whose passes a test can hold and count."""

import collections
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Iterator, List, Optional

from ..server.engine import Engine
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


def completion(port: int, prompt: str, max_tokens: int = 16) -> str:
    """The greedy text an OpenAI-style server on 127.0.0.1:``port`` (mlx-lm's
    or mlx-spec's) completes ``prompt`` with."""
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())["choices"][0]["text"]


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


@contextlib.contextmanager
def served_checkpoint(tmp_path_factory, write, name: str, family: str, *extra: str):
    """``mlx_spec server`` on a checkpoint that ``write(dir, family)`` makes
    in a fresh folder (its log beside it): yields ``(model_path, port)``."""
    path = write(tmp_path_factory.mktemp("srv") / name, family)
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "server.log"
    argv = mlx_spec_server(path, port, *extra)
    with running_server(argv, port, log=str(log)):
        yield path, port


def job_events(job, timeout: float = 300.0) -> list:
    """The events of an engine ``Job`` up to its ``Finished`` (or an exception,
    raised), each waited for at most ``timeout`` seconds."""
    events = []
    while not events or not isinstance(events[-1], (Finished, Exception)):
        events += job.get(timeout)
    if isinstance(events[-1], Exception):
        raise events[-1]
    return events


class GatedEngine(Engine):
    """A server engine whose verify passes run only while ``gate`` is set
    (``held`` is set while one waits there), and which counts the passes
    each submitted job's row took part in (``passes[id(job)]``)."""

    def __init__(self, *args, **kwargs):
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()
        self.jobs: List = []
        self.passes: collections.Counter = collections.Counter()
        super().__init__(*args, **kwargs)

    def submit(self, job):
        self.jobs.append(job)
        return super().submit(job)

    def _step(self, batch):
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait()
            self.held.clear()
        for output in list(self._live.values()):
            self.passes[id(output.job)] += 1
        super()._step(batch)

    def decoding(self, job) -> bool:
        """Whether ``job``'s row is in the batch."""
        return any(o.job is job for o in list(self._live.values()))


@contextlib.contextmanager
def serving(app, timeout: float = 60.0) -> Iterator[int]:
    """Serve the ASGI ``app`` with uvicorn on a thread, on a free port of
    127.0.0.1 (yielded); stopped when the block ends, whatever happened."""
    import uvicorn

    from ..server.http import bind, uvicorn_config

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(app, "warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.daemon = True
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def request_context(tokenizer, model_id: str, max_tokens: int = 16, **extra):
    """What an in-process app's request parsing knows of the server: greedy
    defaults, ``max_tokens`` replies, a 4096-token context and the tiny
    checkpoints' vocabulary."""
    from ..server.requests import ServerContext

    defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    return ServerContext(
        tokenizer,
        model_id=model_id,
        defaults={**defaults, "max_tokens": max_tokens},
        context_length=4096,
        vocab_size=512,
        **extra,
    )


@contextlib.contextmanager
def gated_engine(model_dir) -> Iterator["GatedEngine"]:
    """A :class:`GatedEngine` over the model in ``model_dir`` (its default
    drafter, 3 drafts a pass), always released and closed."""
    from ..drafters import default_draft
    from ..loading import load

    model, tokenizer = load(model_dir)
    engine = GatedEngine(model, tokenizer, default_draft(model), 3)
    try:
        yield engine
    finally:
        engine.gate.set()
        engine.close()


WAIT_STEPS = 2400  # cap of every polling loop (iterations of 0.05 s)


def wait_until(condition, what: str):
    """Poll ``condition`` until it holds (bounded: an error naming ``what``)."""
    for _ in range(WAIT_STEPS):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


def leaves_after_disconnect(
    engine: "GatedEngine", port: int, request: bytes, stream: bool
) -> int:
    """Send ``request`` (whole HTTP bytes) to the server on ``port`` over
    ``engine``, let its row decode, hold the engine before a pass, hang up,
    and wait for the job to be cancelled and its row to leave the batch:
    the passes its row took part in after the client left."""
    jobs = len(engine.jobs)
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        sock.sendall(request)
        wait_until(lambda: len(engine.jobs) > jobs, "the job is submitted")
        job = engine.jobs[-1]
        wait_until(lambda: engine.passes[id(job)] >= 3, "the row decodes")
        if stream:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        engine.gate.clear()
        wait_until(engine.held.is_set, "the engine waits before a pass")
        before = engine.passes[id(job)]
    finally:
        sock.close()
    try:
        wait_until(lambda: job.cancelled, "the server notices the disconnect")
    finally:
        engine.gate.set()
    wait_until(lambda: not engine.decoding(job), "the row leaves the batch")
    return engine.passes[id(job)] - before
