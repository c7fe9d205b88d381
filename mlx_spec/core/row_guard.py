"""A batch row's own sampler and logits processors, whose failures stay in
that row.

Every row of a :class:`~mlx_spec.core.batch.BatchDecoder` brings its own
sampler and logits processors (a request's sampling fields). One that raises
must end that row only: the pass goes on for the others, whose tokens are
those they get alone, and nothing shared is left broken. A :class:`RowGuard`
wraps a row's callables: the first exception one of them raises is kept as
the row's ``error`` (and every later call raises at once), the process-wide
random state is put back as it was before the call (see
:func:`~mlx_spec.mlx_lm_compat.keeps_random_state`), and the caller gets a
:class:`RowFailed`, which only this row's part of a pass catches. A draft
chooser never raises: a failed row's draft is the drafter's argmax, never
verified (the row leaves at the end of the pass).
"""

from typing import Callable, List, Optional

import mlx.core as mx

from ..mlx_lm_compat import keeps_random_state
from .sampling import Sampler


class RowFailed(Exception):
    """A row's own sampler or logits processor raised ``error``."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class RowGuard:
    """One row's callables, wrapped; ``error``: the first one that raised."""

    def __init__(self):
        self.error: Optional[Exception] = None

    def _guarded(self, fn: Callable) -> Callable:
        keeping = keeps_random_state(fn)

        def call(*args):
            if self.error is not None:
                raise RowFailed(self.error)
            try:
                return keeping(*args)
            except Exception as e:
                self.error = e
                raise RowFailed(e) from e

        return call

    def sampler(self, sampler) -> "GuardedSampler":
        """``sampler`` guarded, with its distribution's ``logits`` (what
        rejection sampling and sampled drafts read) where it is a
        :class:`~.sampling.Sampler`."""
        logits = sampler.logits if isinstance(sampler, Sampler) else None
        return GuardedSampler(
            self._guarded(sampler), None if logits is None else self._guarded(logits)
        )

    def processors(self, processors) -> List[Callable]:
        return [self._guarded(p) for p in processors or ()]

    def chooser(self, choose: Optional[Callable]) -> Optional[Callable]:
        """A drafter's ``choose(logits, drafted)`` that falls back to the
        argmax (q None) once the row failed, rather than raising in the
        middle of a draft the batch's other rows share."""
        if choose is None:
            return None

        def safe_choose(logits: mx.array, drafted):
            if self.error is None:
                try:
                    return choose(logits, drafted)
                except RowFailed:
                    pass  # the error is kept
                except Exception as e:  # the row's processing of its logits
                    self.error = e
            return mx.argmax(logits), None

        safe_choose.samples = choose.samples  # see contract.DraftChooser
        return safe_choose


class GuardedSampler:
    """A row's sampler and its distribution's logits, each guarded."""

    def __init__(self, sample: Callable, logits: Optional[Callable]):
        self._sample, self._logits = sample, logits

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._sample(logprobs)

    def logits(self, logprobs: mx.array) -> mx.array:
        if self._logits is None:
            raise TypeError("this sampler's distribution is not known")
        return self._logits(logprobs)
