"""The engine's synchronous worker thread and the asynchronous HTTP handlers,
joined without blocking the event loop.

A :class:`Generation` is one request's job as a handler sees it: the engine
thread hands its events over with ``loop.call_soon_threadsafe`` into an
asyncio queue, and the same queue receives two other signals the handler must
act on at once, whatever the engine is doing: the client disconnected (a
task waits on the ASGI ``receive`` channel for ``http.disconnect``) and the
server is shutting down (:class:`Generations`). A disconnect cancels the job,
so the row leaves the batch after the pass it is in.
"""

import asyncio
import logging
from typing import AsyncIterator, Optional, Set

from .engine import Engine
from .events import Finished, GenerationParams, Job, Token
from .wire import ClientGone

log = logging.getLogger("mlx_spec.server")

HEALTH_CHECK_SECONDS = 1.0  # how often a waiting handler checks the worker is alive

_DISCONNECTED, _SHUTDOWN = "disconnected", "shutdown"


class ShuttingDown(Exception):
    """The server is stopping: the request ends now."""


class AsyncJob(Job):
    """A :class:`Job` whose events go to an asyncio queue on ``loop``."""

    def __init__(self, prompt, params: GenerationParams, initial, loop, queue):
        super().__init__(prompt, params, initial)
        self._loop, self._queue = loop, queue

    def put(self, *events):
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, list(events))
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def get(self, timeout: float) -> list:
        raise TypeError("an AsyncJob's events are read from its asyncio queue")


class Generations:
    """The requests being answered, so that shutdown can end them all; and
    whether new ones are still taken."""

    def __init__(self):
        self.open: Set["Generation"] = set()
        self.closing = False

    def shut_down(self):
        """End every open request (call on the event loop's thread)."""
        self.closing = True
        for generation in list(self.open):
            generation.job.cancel()  # even if its handler never runs again
            generation.signal(_SHUTDOWN)


class Generation:
    """One request's job, submitted to ``engine``, and its events. Call
    :meth:`close` when done with it: it cancels a job not finished and stops
    watching the connection."""

    def __init__(self, engine: Engine, registry: Generations, receive, job_args):
        if registry.closing:
            raise ShuttingDown()
        loop = asyncio.get_running_loop()
        self.engine, self.registry = engine, registry
        self.queue: asyncio.Queue = asyncio.Queue()
        self.job = AsyncJob(*job_args, loop=loop, queue=self.queue)
        self.finished = False
        self.tokens = 0  # tokens seen so far
        engine.submit(self.job)
        registry.open.add(self)
        self._watcher: Optional[asyncio.Task] = loop.create_task(self._watch(receive))

    async def _watch(self, receive):
        """Put ``_DISCONNECTED`` in the queue once the client is gone (the body
        was read already, so the next ASGI message is the disconnect)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.signal(_DISCONNECTED)
                return

    def signal(self, what: str):
        self.queue.put_nowait(what)

    def close(self):
        if not self.finished:
            self.job.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        self.registry.open.discard(self)

    async def batches(self) -> AsyncIterator[list]:
        """The job's events as the engine hands them over (a pass's
        together), up to ``Finished`` (see :meth:`next_batch`)."""
        while not self.finished:
            yield await self.next_batch()

    async def next_batch(self) -> list:
        """The next events the engine hands over. Raises the job's error,
        :class:`ClientGone` or :class:`ShuttingDown` (the job then cancelled)."""
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), HEALTH_CHECK_SECONDS)
            except asyncio.TimeoutError:
                if not self.engine.healthy:
                    raise RuntimeError("the generation worker has stopped") from None
                continue
            if item == _DISCONNECTED:
                self.job.cancel()
                raise ClientGone()
            if item == _SHUTDOWN:
                self.job.cancel()
                raise ShuttingDown()
            for event in item:
                if isinstance(event, Exception):
                    self.finished = True  # the engine let go of it
                    raise event
                if isinstance(event, Finished):
                    self.finished = True
            self.tokens += sum(isinstance(e, Token) for e in item)
            return item

    def cut_short(self) -> Finished:
        """The ``Finished`` of a request the server ended (shutdown)."""
        return Finished("cancelled", self.tokens, {})
