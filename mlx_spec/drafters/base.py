"""The drafters' base class and the adapter of a user's drafter object.

The contracts are in :mod:`.contract`: :class:`Drafter` implements
:class:`~.contract.CoreDrafter` (a subclass implements ``reset``, ``draft``
and ``accept``; the rest have defaults a simple drafter never touches) and
:class:`~.contract.SelfJudging` for one unnamed source that judges nothing
(``auto``'s per-source policies ask every drafter). :func:`as_drafter` adapts
an object with ``reset``/``draft``/``accept`` (:class:`~.contract.UserDrafter`).
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .contract import DeferredPass, DraftChooser, Hindsight, UserDrafter

# The caps on tokens drafted per verify pass (``num_draft_tokens``):
MAX_DRAFT_TOKENS = 16  # a number given by the caller, any drafter
MAX_MTP_DRAFT_TOKENS = 8  # the MTP head: one layer reused per step
MAX_AUTO_DRAFT_TOKENS = 8  # "auto": the verify-cost profile covers T = 1..9


class OneDraftWalk:
    """Counts first drafts judged in hindsight, position by position, only
    where passes drafting one token each would have started: after a miss
    the next position, after a hit the one after (that pass also emitted the
    target's next token). Judging every position instead counts positions
    inside runs of hits, which a pass only reaches after an accepted draft:
    where hits and misses cluster or alternate, a pass's first draft is
    accepted far less often than a position's (traced with the MTP head on
    free text: 0.38 against 0.52)."""

    def __init__(self):
        self.hits = self.trials = 0
        self._skip = False  # the last position was a hit: this one is its bonus

    def see(self, hit: bool, start: bool = True):
        """The next position: the first draft there was right (``hit``).
        ``start`` False: the position did not begin its pass (it was
        drafted, or followed a draft), so it is no sample of a pass's first
        draft and is not counted."""
        counted = start and not self._skip
        self.hits += counted and bool(hit)
        self.trials += counted
        self._skip = counted and bool(hit)

    def take(self) -> Tuple[int, int]:
        """(hits, trials) counted since the last call."""
        counts, self.hits, self.trials = (self.hits, self.trials), 0, 0
        return counts


def as_list(drafter, tokens: mx.array) -> List[int]:
    """``drafter``'s draft from its ``draft_tokens`` ([m]) as a list, a lazy
    one evaluated together with the logits and q it came with."""
    mx.eval(tokens, drafter.last_draft_logits, drafter.draft_probs)
    return tokens.tolist()


def host_draft(tokens: Sequence[int]) -> mx.array:
    """A draft made on the host (a list of ints) as the engine's draft type:
    [m] uint32."""
    return mx.array(list(tokens), mx.uint32)


class Drafter:
    """Base class of the drafters (see :mod:`.contract`)."""

    name = "custom"
    needs_hidden = False
    draft_probs: Optional[mx.array] = None
    last_draft_logits: Optional[mx.array] = None  # [m, V] a head's, if any
    drafted_on_device = False  # host drafts by default

    def reset(self, prompt: Sequence[int], hidden: Optional[mx.array]):
        raise NotImplementedError

    def draft(self, k: int) -> List[int]:
        """Up to ``k`` tokens after the pending token, as host ints."""
        raise NotImplementedError

    def draft_tokens(self, k: int) -> mx.array:
        """:meth:`draft` as the engine takes it: [m] uint32."""
        return host_draft(self.draft(k))

    def accept(self, tokens: Sequence[int], hidden: Optional[mx.array]):
        raise NotImplementedError

    def rows_read(self, n: int) -> int:
        """Of the hidden states of ``n`` rows given at once (a prompt), how
        many, the last ones, it reads; the others may be anything. All by
        default."""
        return n

    def set_sampling(self, choose: Optional[DraftChooser]):
        """Deterministic drafts by default: the verifier treats q as one-hot."""

    def catch_up(self):
        """No deferred work by default."""

    def can_draft(self) -> bool:
        """Whether a draft now may hold a token (unknown: True)."""
        return True

    def draft_source(self, k: int, look: bool = True) -> Optional[str]:
        """Which source would draft ``k`` tokens next (``look``: it may run
        deferred work to answer exactly); None by default (an unnamed one)."""
        return None

    def hindsight(self) -> Hindsight:
        """No first drafts judged in hindsight by default."""
        return {}

    def set_source_paying(self, source: str, paying: bool):
        """Whether drafting from ``source`` pays now; one source: nothing to do."""

    @property
    def state(self) -> List[mx.array]:
        return []

    def take_deferred(self) -> List[DeferredPass]:
        """The deferred work, handed over (the drafter no longer holds it);
        none by default."""
        return []

    def put_deferred(self, rows: List[DeferredPass]):
        """Hold ``rows`` (from :meth:`take_deferred`) as deferred work again."""
        if rows:
            raise ValueError(f"drafter {self.name!r} defers no work")

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]):
        raise NotImplementedError(f"drafter {self.name!r} cannot restore a session")

    def check_state(self, arrays: Sequence[mx.array], deferred: List[DeferredPass]):
        """``ValueError`` unless ``arrays`` (as :attr:`state` gives them) and
        ``deferred`` (as :meth:`take_deferred`) are what this drafter could
        have saved: a drafter keeping no arrays keeps none."""
        if arrays or deferred:
            raise ValueError(f"drafter {self.name!r} keeps no arrays, the state has")


class _ForeignDrafter(Drafter):
    """A user's object with ``reset``/``draft``/``accept``, given the defaults."""

    def __init__(self, inner):
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.needs_hidden = bool(getattr(inner, "needs_hidden", False))

    def reset(self, prompt, hidden):
        self.inner.reset(prompt, hidden)

    def draft(self, k):
        return [int(t) for t in self.inner.draft(k)]

    def accept(self, tokens, hidden):
        self.inner.accept(tokens, hidden)


def is_drafter(obj) -> bool:
    """True for a :class:`Drafter` or any object with the three required
    methods (a :class:`~.contract.UserDrafter`)."""
    return isinstance(obj, (Drafter, UserDrafter)) and all(
        callable(getattr(obj, m, None)) for m in ("reset", "draft", "accept")
    )


def as_drafter(obj) -> Optional[Drafter]:
    """``obj`` as a :class:`Drafter` (None stays None: plain decoding)."""
    if obj is None or isinstance(obj, Drafter):
        return obj
    if not is_drafter(obj):
        raise ValueError(
            f"{obj!r} is not a drafter: it needs reset, draft and accept methods"
        )
    return _ForeignDrafter(obj)
