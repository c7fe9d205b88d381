"""The speculative decode loop of one sequence: mlx-lm's ``generate_step``, speculating.

The sequence is a batch of one (:meth:`BatchDecoder.alone`): each pass the
engine drafts, runs the target once over the pending token and the draft,
and verifies; this loop yields what it emitted and commits what the caller
read. The decoder comes opened (:class:`mlx_spec.Session` builds it, and
tells its drafter how drafts will be sampled before the prompt is fed).
"""

from dataclasses import dataclass, field
from typing import Callable, Generator, List, Optional, Tuple

import mlx.core as mx

from .batch import BatchDecoder, RowOptions
from .policy_tuning import DEFAULT_TUNING, PolicyTuning
from .sequence import SpeculativeDecoder
from .stats import PhaseClock

__all__ = ["LoopOptions", "SpeculativeDecoder", "decode_steps"]


@dataclass(frozen=True)
class LoopOptions:
    """How the loop of one sequence runs, beside what its row decodes:
    ``should_stop`` is asked after every pass (true: the loop ends after
    that pass); ``progress(n, total)`` hears the prompt's prefill; ``flush``
    processes the last token at the end, as mlx-lm does (the caches then
    hold every token); ``timing`` fills ``decoder.stats.phases`` (at the
    cost of extra syncs); ``tuning``: the constants of ``auto``."""

    should_stop: Callable[[], bool] = field(default=lambda: False)
    progress: Optional[Callable[[int, int], None]] = None
    flush: bool = False
    timing: bool = False
    tuning: PolicyTuning = DEFAULT_TUNING


def decode_steps(
    decoder: SpeculativeDecoder,
    tokens: List[int],
    row: RowOptions,
    loop: LoopOptions = LoopOptions(),
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Feed ``tokens`` ([N] ids: a prompt, or a later turn's) to ``decoder``
    and yield ``(token, logprobs [V], from_draft)`` like mlx-lm's
    ``generate_step``, the row decoding as ``row`` says.

    Each iteration drafts (``row.num_draft_tokens``: a number, or ``"auto"``,
    chosen per pass by :mod:`.draft_lengths`), verifies ``[last, *draft]`` in
    one target pass, yields the longest prefix the target agrees with plus
    the target's own next token, and rolls every cache back to what was
    yielded (also when the caller stops early). Generation stops after a
    ``row.stop_tokens`` token or ``row.max_tokens`` tokens, or after the pass
    during which ``loop.should_stop()`` became true.
    """
    tuning, flush, timing = loop.tuning, loop.flush, loop.timing
    should_stop = loop.should_stop
    engine = BatchDecoder.alone(decoder, tuning)
    progress = loop.progress or (lambda *_: None)
    progress(0, len(tokens))
    decoder.feed(tokens, lambda n: progress(n, len(tokens)))
    seq = engine.add(decoder, row)
    engine.clock = PhaseClock(decoder.stats, timing)  # the passes, not the prefill
    try:  # a caller that stops early closes us at a yield: GeneratorExit
        first, done = True, False
        while not done:
            engine.clock.lap("host")
            # Plain passes are queued ahead as mlx-lm queues its steps, unless
            # timing syncs each phase (a pipeline never queues: its ranks
            # agree on every pass).
            out = engine.verify(queue_ahead=not timing)
            if seq not in out:
                raise engine.error(seq)
            emitted, logprobs = out[seq]
            n = engine.accepted(seq)
            if first:
                progress(len(tokens), len(tokens))
                first = False
            if should_stop():
                engine.finish(seq)
            done = seq not in engine.active
            read = 0
            try:
                for i, token in enumerate(emitted):
                    read = i + 1
                    yield token, logprobs[i], i < n
            finally:  # also when the caller stops early: keep what it read
                engine.commit({seq: read})
    except GeneratorExit:
        _leave(engine, seq, flush)
        raise
    _leave(engine, seq, flush)


def _leave(engine: BatchDecoder, seq: int, flush: bool):
    """The sequence out of its batch of one, its caches holding its history
    (``flush``: the last token too, as mlx-lm leaves them)."""
    engine.settle()
    decoder = engine.take(seq)
    if flush:
        decoder.flush()
