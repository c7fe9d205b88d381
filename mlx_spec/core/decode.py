"""The speculative decode loop of one sequence: mlx-lm's ``generate_step``, speculating.

The sequence is a batch of one (:meth:`BatchDecoder.alone`): each pass the
engine drafts, runs the target once over the pending token and the draft,
and verifies; this loop yields what it emitted and commits what the caller
read. The decoder comes opened (:class:`mlx_spec.Session` builds it, and
tells its drafter how drafts will be sampled before the prompt is fed).
"""

from typing import Callable, Collection, Generator, List, Optional, Tuple, Union

import mlx.core as mx

from .batch import BatchDecoder, RowOptions
from .policy_tuning import DEFAULT_TUNING, PolicyTuning
from .sequence import SpeculativeDecoder
from .stats import PhaseClock

__all__ = ["SpeculativeDecoder", "decode_steps"]


def decode_steps(
    decoder: SpeculativeDecoder,
    tokens: List[int],
    *,
    num_draft_tokens: Union[int, str] = 3,
    verify_costs: Optional[List[float]] = None,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable]] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stop_tokens: Collection[int] = (),
    should_stop: Callable[[], bool] = lambda: False,
    flush: bool = False,
    timing: bool = False,
    tuning: PolicyTuning = DEFAULT_TUNING,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Feed ``tokens`` ([N] ids: a prompt, or a later turn's) to ``decoder``
    and yield ``(token, logprobs [V], from_draft)`` like mlx-lm's ``generate_step``.

    Each iteration drafts up to ``num_draft_tokens`` tokens (``"auto"``:
    chosen per pass by :mod:`.draft_lengths` from ``verify_costs``, else
    the measured profiles), verifies ``[last, *draft]`` in one target pass,
    yields the longest prefix the target agrees with plus the target's own
    next token, and rolls every cache back to what was yielded (also when
    the caller stops early). Generation stops after a ``stop_tokens`` token
    or ``max_tokens`` tokens, or after the pass during which ``should_stop()``
    became true. ``flush`` processes the last token at the end, as mlx-lm
    does (the caches then hold every token); ``timing`` fills
    ``decoder.stats.phases`` (at the cost of extra syncs); ``tuning``: the
    constants of ``auto`` (an experiment's variant).
    """
    engine = BatchDecoder.alone(decoder, tuning)
    progress = prompt_progress_callback or (lambda *_: None)
    progress(0, len(tokens))
    decoder.feed(tokens, lambda n: progress(n, len(tokens)))
    options = RowOptions(
        max_tokens,
        sampler,
        num_draft_tokens,
        verify_costs,
        stop_tokens,
        logits_processors,
        seen=tokens,  # processors see this call's tokens, as mlx-lm's do
    )
    row = engine.add(decoder, options)
    engine.clock = PhaseClock(decoder.stats, timing)  # the passes, not the prefill
    try:  # a caller that stops early closes us at a yield: GeneratorExit
        first, done = True, False
        while not done:
            engine.clock.lap("host")
            # Plain passes are queued ahead as mlx-lm queues its steps, unless
            # timing syncs each phase (a pipeline never queues: its ranks
            # agree on every pass).
            out = engine.verify(queue_ahead=not timing)
            if row not in out:
                raise engine.error(row)
            emitted, logprobs = out[row]
            n = engine.accepted(row)
            if first:
                progress(len(tokens), len(tokens))
                first = False
            if should_stop():
                engine.finish(row)
            done = row not in engine.active
            read = 0
            try:
                for i, token in enumerate(emitted):
                    read = i + 1
                    yield token, logprobs[i], i < n
            finally:  # also when the caller stops early: keep what it read
                engine.commit({row: read})
    except GeneratorExit:
        _leave(engine, row, flush)
        raise
    _leave(engine, row, flush)


def _leave(engine: BatchDecoder, row: int, flush: bool):
    """The sequence out of its batch of one, its caches holding its history
    (``flush``: the last token too, as mlx-lm leaves them)."""
    engine.settle()
    decoder = engine.take(row)
    if flush:
        decoder.flush()
