"""Plain passes queued a pass ahead, as mlx-lm decodes.

When a pass drafts nothing (``T == 1``) and the next one will draft nothing
either, each row's token of this pass is sampled at once, this pass is
committed, and the next pass's forward over those tokens is started before
the host waits: the device computes it while the host does this pass's
bookkeeping. :class:`QueueAhead` wraps an engine
(:class:`~mlx_spec.core.batch.BatchDecoder`) to do so; the engine's pass
takes the queued forward as its own, and rows that join, leave or stop
before it is read roll it back (:meth:`QueueAhead.unqueue`).
"""

import weakref
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from .pass_plan import Forward, PassPlan
from .row_guard import RowFailed
from .target import queue_after


class QueueAhead:
    """The plain pass queued ahead of an engine's next pass, if any."""

    def __init__(self, engine):
        # The engine holds its queue-ahead: a strong reference back would
        # make a cycle that keeps a finished engine's caches until the
        # garbage collector runs (a generation's worth each).
        self.engine = weakref.proxy(engine)
        self.forward: Optional[Forward] = None  # logits, hidden of the next pass

    @property
    def queued(self) -> bool:
        return self.forward is not None

    def take(self) -> Optional[Forward]:
        """The queued forward, for the pass about to run (None: none)."""
        forward, self.forward = self.forward, None
        return forward

    def pays(self, plan: PassPlan, active: List[int]) -> bool:
        """Whether the pass after ``plan`` (a plain one) drafts nothing
        either: every row decodes on and none drafts or probes next (the
        policy says so before choosing), so it may be queued now. Never in
        a pipeline, whose ranks agree on every pass."""
        e = self.engine
        if plan.T > 1 or len(active) < len(e.rows) or e.group is not None:
            return False
        for row in e.rows:
            if row.remaining <= 1 or row.processors:
                return False  # it finishes with this pass, or needs its history
            if row.decoder.drafter is None or row.max_draft == 0:
                continue
            if row.acceptance is None:
                return False  # a fixed draft length
        return e.scheduler.next_is_plain()

    def queue(self, logprobs: mx.array) -> Optional[Dict[int, int]]:
        """Each row's token of this plain pass (logprobs: [B, 1, V]). This
        pass is committed and the next one, over these tokens, queued before
        the host waits for them. None (nothing queued) when a row's sampler
        fails."""
        e = self.engine
        choices = sample_rows(e.rows, range(len(e.rows)), logprobs)
        if choices is None:  # that row fails in the pass, which queues nothing
            return None
        self.forward = queue_after(choices, logprobs, lambda: self._start(choices))
        return dict(enumerate(choices.tolist()))

    def _start(self, choices: mx.array) -> Forward:
        """This plain pass committed, the next one's forward over ``choices``
        [B], capturing (a row may join, leave or stop before it is read)."""
        e = self.engine
        e.row_caches.commit([1] * len(e.rows), 1)
        e.row_caches.begin(None, 1)
        return e.target.forward_rows(choices[:, None])

    def unqueue(self):
        """Roll a queued pass back (rows join, leave or stop): no row keeps a
        token it was not given. A sequence's own caches took it as a plain
        decoding step, which does not roll back: it is kept (:meth:`settle`)."""
        if self.forward is None:
            return
        if not self.engine.row_caches.shared:
            self.settle()
        else:
            self.forward = None
            self.engine.row_caches.commit([0] * len(self.engine.rows), 1)

    def settle(self):
        """A pass queued ahead that will not be verified processed each
        row's last token: keep it, so the caches hold every row's whole
        history (as mlx-lm's do after its decoding; a row's drafter never
        saw that token's hidden row, as after a stop token)."""
        if self.forward is None:
            return
        (_, hidden), self.forward = self.forward, None
        e = self.engine
        e.row_caches.commit([1] * len(e.rows), 1)
        for b, row in enumerate(e.rows):
            row.decoder.processed = len(row.decoder.history)
            if hidden is not None:
                row.decoder.last_hidden = hidden[b]


def sample_rows(rows, indices: Sequence[int], logprobs: mx.array) -> Optional[mx.array]:
    """The tokens [len(indices)] the rows ``indices`` of ``rows`` sample from
    a plain pass's ``logprobs`` [B, 1, V], lazily, as ``verify_draft``
    samples a row's plain pass: read with one wait for them all instead of
    one a row. None when a row's sampler fails (each row then verifies
    alone, and the failing one stops)."""
    try:
        return mx.concatenate([rows[b].sampler(logprobs[b]) for b in indices])
    except RowFailed:
        return None


def plain_tokens(
    rows, active: List[int], logprobs: mx.array
) -> Optional[Dict[int, int]]:
    """Row index -> its token, for the ``active`` rows of a plain pass that
    is not queued ahead (see :func:`sample_rows`); None where a row has
    logits processors (they see the row's host history) or a sampler
    fails."""
    if any(rows[b].processors for b in active):
        return None
    choices = sample_rows(rows, active, logprobs)
    return None if choices is None else dict(zip(active, choices.tolist()))
