"""The hand-over from the engine's worker thread to the async handlers: a
pass's rows wake the event loop once, in order; a closed loop takes posts
without raising; a handler waiting on a worker that has stopped gets an
error from the server's watchdog, and the watchdog ends with the last open
request. No model: an engine stand-in whose health a test sets."""

import asyncio
import threading

import pytest

from mlx_spec.server import bridge
from mlx_spec.server.bridge import Generation, Generations, Mailbox
from mlx_spec.server.events import GenerationParams, Token

WAIT_S = 30.0  # cap of every wait here; none should come near it


class _Engine:
    """What a :class:`Generation` asks of the engine: ``submit`` and
    ``healthy`` (set by the test)."""

    def __init__(self):
        self.healthy, self.jobs = True, []

    def submit(self, job):
        self.jobs.append(job)
        return job


async def _never_disconnects():
    await asyncio.Event().wait()


def _job_args():
    return ([1, 2, 3], GenerationParams(max_tokens=8), "normal")


def test_a_burst_of_posts_wakes_the_loop_once_and_keeps_their_order():
    async def main():
        mailbox = Mailbox(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(4)]

        def one_pass(n):  # the engine's rows of pass n, on its own thread
            for row, queue in enumerate(queues):
                mailbox.post(queue, [n, row])
            mailbox.post(queues[0], [n, "last"])

        for n in range(3):
            # the loop is blocked in join(): every post of the pass is made
            # before it can deliver, as while the engine holds the interpreter
            thread = threading.Thread(target=one_pass, args=(n,))
            thread.start()
            thread.join()
            assert mailbox.deliveries == n
            got = [await asyncio.wait_for(q.get(), WAIT_S) for q in queues]
            assert got == [[n, row] for row in range(4)]
            assert await asyncio.wait_for(queues[0].get(), WAIT_S) == [n, "last"]
            assert mailbox.deliveries == n + 1
        assert mailbox.posted == 15

    asyncio.run(main())


def test_posting_to_a_closed_loop_is_dropped_quietly():
    """Nothing raises and nothing piles up, even where the loop closed with a
    delivery scheduled that never ran."""
    loop = asyncio.new_event_loop()
    mailbox = Mailbox(loop)
    mailbox.post(asyncio.Queue(), ["scheduled"])
    assert mailbox.pending == 1
    loop.close()
    for n in range(100):  # the handler is gone: no error
        mailbox.post(asyncio.Queue(), [n])
    assert mailbox.pending == 0 and mailbox.deliveries == 0


def test_a_stopped_worker_ends_the_waiting_requests(monkeypatch):
    monkeypatch.setattr(bridge, "HEALTH_CHECK_SECONDS", 0.01)

    async def main():
        engine, registry = _Engine(), Generations()
        first = Generation(engine, registry, _never_disconnects, _job_args())
        second = Generation(engine, registry, _never_disconnects, _job_args())
        token = Token(7, None, [])
        threading.Thread(target=engine.jobs[0].put, args=(token,)).start()
        assert await asyncio.wait_for(first.next_batch(), WAIT_S) == [token]
        assert registry._watchdog is not None and not registry._watchdog.done()
        engine.healthy = False
        for generation in (first, second):
            with pytest.raises(RuntimeError, match="worker has stopped"):
                await asyncio.wait_for(generation.next_batch(), WAIT_S)
            generation.close()
        assert engine.jobs[0].cancelled and engine.jobs[1].cancelled
        await asyncio.wait_for(registry._watchdog, WAIT_S)  # none open: it ends
        assert not registry.open

    asyncio.run(main())


def test_the_watchdog_starts_again_for_a_later_request(monkeypatch):
    monkeypatch.setattr(bridge, "HEALTH_CHECK_SECONDS", 0.01)

    async def main():
        engine, registry = _Engine(), Generations()
        Generation(engine, registry, _never_disconnects, _job_args()).close()
        await asyncio.wait_for(registry._watchdog, WAIT_S)
        later = Generation(engine, registry, _never_disconnects, _job_args())
        engine.healthy = False
        with pytest.raises(RuntimeError, match="worker has stopped"):
            await asyncio.wait_for(later.next_batch(), WAIT_S)
        later.close()

    asyncio.run(main())
