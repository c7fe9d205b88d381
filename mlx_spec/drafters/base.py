"""What the drafters share: the caps on draft lengths, judging first drafts
in hindsight (:class:`OneDraftWalk`), a base for drafters that draft on the
host (:class:`HostDrafter`), and the adapter of a user's drafter object
(:func:`as_drafter`). The contracts themselves are in :mod:`.contract`.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .contract import Drafter, Proposal, host_proposal

# The caps on tokens drafted per verify pass (``num_draft_tokens``):
MAX_DRAFT_TOKENS = 16  # a number given by the caller, any drafter
MAX_MTP_DRAFT_TOKENS = 8  # the MTP head: one layer reused per step
# "auto": contract.MAX_AUTO_DRAFT_TOKENS, unless the drafter declares its own
# ceiling (contract.DraftsLong)


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
        if counted:
            self.trials += 1
            self.hits += 1 if hit else 0
        self._skip = bool(counted and hit)

    def take(self) -> Tuple[int, int]:
        """(hits, trials) counted since the last call."""
        counts, self.hits, self.trials = (self.hits, self.trials), 0, 0
        return counts


class HostDrafter:
    """A convenient base for a drafter that drafts on the host: implement
    ``reset``, ``draft`` (host ints) and ``accept``; :meth:`propose` makes
    the engine's :class:`~.contract.Proposal` of ``draft``'s tokens. It
    implements the core :class:`~.contract.Drafter` contract and nothing
    optional."""

    name = "custom"
    needs_hidden = False

    def reset(self, prompt: Sequence[int], hidden: Optional[mx.array]):
        raise NotImplementedError

    def draft(self, k: int) -> List[int]:
        """Up to ``k`` tokens after the pending token, as host ints."""
        raise NotImplementedError

    def propose(self, k: int) -> Proposal:
        return host_proposal(self.draft(k))

    def accept(self, tokens: Sequence[int], hidden: Optional[mx.array]):
        raise NotImplementedError


class _ForeignDrafter(HostDrafter):
    """A user's object with ``reset``/``draft``/``accept`` (a
    :class:`~.contract.UserDrafter`) as a core drafter."""

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
    """True for a core :class:`~.contract.Drafter` (it proposes) or any
    object with the three methods of a :class:`~.contract.UserDrafter`."""
    if _proposes(obj):
        methods = ("reset", "propose", "accept")
    else:
        methods = ("reset", "draft", "accept")
    return all(callable(getattr(obj, m, None)) for m in methods)


def _proposes(obj) -> bool:
    return callable(getattr(obj, "propose", None)) and isinstance(
        getattr(obj, "name", None), str
    )


def as_drafter(obj) -> Optional[Drafter]:
    """``obj`` as a core :class:`~.contract.Drafter` (None stays None: plain
    decoding): a drafter as it is, a user's object adapted."""
    if obj is None:
        return None
    if not is_drafter(obj):
        raise ValueError(
            f"{obj!r} is not a drafter: it needs reset, draft and accept methods"
        )
    return obj if _proposes(obj) else _ForeignDrafter(obj)
