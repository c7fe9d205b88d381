"""The engine's synchronous worker thread and the asynchronous HTTP handlers,
joined without blocking the event loop.

A :class:`Generation` is one request's job as a handler sees it: the engine
thread hands its events over through the loop's :class:`Mailbox` into an
asyncio queue, and the same queue receives four other signals the handler
must act on at once, whatever the engine is doing: the client disconnected (a
task waits on the ASGI ``receive`` channel for ``http.disconnect``), the
server is shutting down, the engine's worker has stopped (both from
:class:`Generations`), and the client has fallen too far behind (its queue
holds more tokens than the stream's backlog: a handler blocked writing to a
client that does not read takes nothing from it). A disconnect cancels the
job, so the row leaves the batch after the pass it is in; so does a backlog
overflow, after which the stream ends once the client has read what was
queued before it (or the connection's write timeout closes it).

The loop thread shares the interpreter and, on a small CPU, the cores with
the engine's worker, so the hand-over costs it as little as it can: the rows
of one pass wake the loop once (not once a row), and a handler waits on its
queue alone (one watchdog a server checks the worker, not a timer a wait).
"""

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable, Dict, List, Optional, Set, Tuple

from .engine import Engine
from .events import CutShort, Finished, GenerationParams, Job, Progress, Token
from .limits import STREAM_BACKLOG
from .wire import ClientGone

log = logging.getLogger("mlx_spec.server")

HEALTH_CHECK_SECONDS = 1.0  # how often the watchdog checks the worker is alive

_DISCONNECTED, _SHUTDOWN, _WORKER_STOPPED = "disconnected", "shutdown", "stopped"
_BEHIND = "behind"


class ShuttingDown(CutShort):
    """The server is stopping: the request ends now."""

    status = 503

    def __init__(self):
        super().__init__("the server is shutting down")


class FellBehind(CutShort):
    """The client read too little of its stream: its generation was ended."""

    def __init__(self, backlog: int):
        super().__init__(
            f"the client did not read its stream: {backlog} tokens were waiting "
            "to be sent"
        )


class Inbox(asyncio.Queue):
    """A generation's queue, which counts the tokens waiting in it (items are
    lists of events, or signals): once more than ``backlog`` wait,
    ``overflow`` is called, once."""

    def __init__(self, backlog: int, overflow: Callable[[], None]):
        super().__init__()
        self.backlog, self.overflow = backlog, overflow
        self.waiting, self.overflowed = 0, False

    def put_nowait(self, item):
        super().put_nowait(item)
        if isinstance(item, list):
            self.waiting += _tokens(item)
            if self.waiting > self.backlog and not self.overflowed:
                self.overflowed = True
                self.overflow()

    def taken(self, item):
        """``item``, got from the queue, is no longer waiting."""
        if isinstance(item, list):
            self.waiting -= _tokens(item)


def _tokens(events: list) -> int:
    return sum(isinstance(e, Token) for e in events)


class Mailbox:
    """Items other threads post to asyncio queues of one event loop, delivered
    in bursts: the first item posted schedules one delivery on the loop and
    the items posted before it runs go with it. The engine posts a pass's rows
    one after the other while it holds the interpreter, so they mostly wake the
    loop once (at 8 clients: 3 to 5 posts a delivery, measured)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: List[Tuple[asyncio.Queue, object]] = []
        self.posted = self.deliveries = 0  # counts, for tests and profiles

    @property
    def pending(self) -> int:
        """Items posted and not yet delivered."""
        return len(self._items)

    def post(self, queue: asyncio.Queue, item):
        """Put ``item`` in ``queue`` on the loop's thread, soon (any thread).
        Dropped once the loop is closed: nobody is waiting any more."""
        if self.loop.is_closed():  # a delivery it had scheduled never runs
            with self._lock:
                self._items.clear()
            return
        with self._lock:
            self._items.append((queue, item))
            self.posted += 1
            if len(self._items) > 1:
                return  # a delivery is scheduled already
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            with self._lock:
                self._items.clear()

    def _deliver(self):
        with self._lock:
            items, self._items = self._items, []
            self.deliveries += 1
        for queue, item in items:
            queue.put_nowait(item)


class AsyncJob(Job):
    """A :class:`Job` whose events go to an asyncio queue through a
    :class:`Mailbox` of the queue's loop."""

    def __init__(self, prompt, params: GenerationParams, initial, mailbox, queue):
        super().__init__(prompt, params, initial)
        self._mailbox, self._queue = mailbox, queue

    def put(self, *events):
        self._mailbox.post(self._queue, list(events))

    def get(self, timeout: float) -> list:
        raise TypeError("an AsyncJob's events are read from its asyncio queue")


class Generations:
    """The requests being answered, so that shutdown can end them all, and a
    stopped worker too (a watchdog runs while any is open); whether new ones
    are still taken; the mailbox of each event loop serving them."""

    def __init__(self):
        self.open: Set["Generation"] = set()
        self.closing = False
        self._mailboxes: Dict[asyncio.AbstractEventLoop, Mailbox] = {}
        self._watchdog: Optional[asyncio.Task] = None

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        if loop not in self._mailboxes:
            self._mailboxes[loop] = Mailbox(loop)
        return self._mailboxes[loop]

    def add(self, generation: "Generation", engine: Engine):
        """Track ``generation``; the watchdog runs while any is open (call
        on the event loop's thread)."""
        self.open.add(generation)
        if self._watchdog is None or self._watchdog.done():
            loop = asyncio.get_running_loop()
            self._watchdog = loop.create_task(self._watch(engine))

    async def _watch(self, engine: Engine):
        """Every ``HEALTH_CHECK_SECONDS`` while requests are open: if the
        worker has stopped, end them (their handlers raise)."""
        while self.open:
            await asyncio.sleep(HEALTH_CHECK_SECONDS)
            if not engine.healthy:
                for generation in list(self.open):
                    generation.signal(_WORKER_STOPPED)

    def shut_down(self):
        """End every open request (call on the event loop's thread)."""
        self.closing = True
        for generation in list(self.open):
            generation.job.cancel()  # even if its handler never runs again
            generation.signal(_SHUTDOWN)


class Generation:
    """One request's job, submitted to ``engine``, and its events. Call
    :meth:`close` when done with it: it cancels a job not finished and stops
    watching the connection. ``backlog``: the most tokens that may wait for
    the handler (one that writes to a client not reading takes none); past
    it the job is cancelled and the handler gets :class:`FellBehind` after
    the events queued before."""

    def __init__(
        self,
        engine: Engine,
        registry: Generations,
        receive,
        job_args,
        backlog: int = STREAM_BACKLOG,
    ):
        if registry.closing:
            raise ShuttingDown()
        loop = asyncio.get_running_loop()
        self.engine, self.registry = engine, registry
        self.queue = Inbox(backlog, self._fell_behind)
        mailbox = registry.mailbox(loop)
        self.job = AsyncJob(*job_args, mailbox=mailbox, queue=self.queue)
        self.finished = False
        self.tokens = 0  # tokens seen so far
        self.speculation: Dict = {}  # the row's counters, as of the last pass seen
        engine.submit(self.job)
        registry.add(self, engine)
        self._watcher: Optional[asyncio.Task] = loop.create_task(self._watch(receive))

    async def _watch(self, receive):
        """Put ``_DISCONNECTED`` in the queue once the client is gone (the body
        was read already, so the next ASGI message is the disconnect)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.signal(_DISCONNECTED)
                return

    def _fell_behind(self):
        """The backlog overflowed (on the loop's thread, as the queue is
        filled): the row leaves the batch after its pass."""
        log.info("a client fell %d tokens behind its stream", self.queue.waiting)
        self.job.cancel()
        self.signal(_BEHIND)

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
        :class:`ClientGone`, :class:`ShuttingDown` or :class:`FellBehind`
        (the job then cancelled) or ``RuntimeError`` (the worker has
        stopped)."""
        item = await self.queue.get()
        self.queue.taken(item)
        if item == _DISCONNECTED:
            self.job.cancel()
            raise ClientGone()
        if item == _SHUTDOWN:
            self.job.cancel()
            raise ShuttingDown()
        if item == _BEHIND:
            raise FellBehind(self.queue.backlog)
        if item == _WORKER_STOPPED:
            raise RuntimeError("the generation worker has stopped")
        events = []
        for event in item:
            if isinstance(event, Exception):
                self.finished = True  # the engine let go of it
                raise event
            if isinstance(event, Progress):
                self.speculation = event.speculation
                continue
            if isinstance(event, Finished):
                self.finished = True
            events.append(event)
        self.tokens += _tokens(events)
        return events

    def cut_short(self, why: CutShort) -> Finished:
        """The ``Finished`` of a request the server ended (``why``): the
        tokens seen so far and the row's counters as of its last pass."""
        return Finished("cancelled", self.tokens, self.speculation, cut=why)
