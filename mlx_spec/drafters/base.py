"""The drafter contract: what the decode loop asks of a drafter, in one place.

A drafter proposes tokens after the pending token; the target verifies them
in one pass and the drafter is told what was kept. Three methods are
required; the rest have defaults that a simple drafter never touches:

- ``reset(prompt, hidden)``: a new history. hidden: [N-1, H] post-norm target
  states of ``prompt[:-1]`` when ``needs_hidden``, else None.
- ``draft(k) -> list[int]``: up to ``k`` tokens after the pending token.
- ``accept(tokens, hidden)``: the tokens a verify pass kept (accepted drafts
  and the target's own next token); hidden: [len(tokens), H] for the inputs
  that produced them (``needs_hidden``), else None.
- ``needs_hidden``: whether ``reset``/``accept`` need the hidden states.
- ``set_sampling(choose)``: the target samples or processes its logits;
  ``choose(logits, drafted)`` returns ``(token, q)`` (q None: a deterministic
  choice) for a drafter that drafts from logits. Default: drafts stay as the
  drafter makes them.
- ``draft_probs``: [m, V] the distributions the last draft was sampled from
  (rejection sampling needs them); None for a deterministic draft.
- ``draft_tokens(k)``: optional, ``draft`` without a host synchronisation: the
  tokens as a lazy ``mx.array`` [m] that the verify pass evaluates together
  with its own outputs (one synchronisation per pass), or a list.
- ``can_draft()``: False when the next draft is known to be empty without
  running anything (an n-gram index with no match); True by default. A batch
  counts such a row as one token, not as the draft its acceptance promises.
- ``draft_source(k, look)``: the name of the source that drafts next (``mtp``:
  the MTP head, ``ngram``: a copy; ``mtp+ngram`` switches between them);
  ``auto`` keeps a draft-length policy per source.
- ``hindsight()``: per source (None: a one-source drafter's), ``(hits,
  trials)``: first drafts judged without being verified (what the drafter
  would have drafted against the token the target then chose), since the
  last call, at the positions where passes drafting one token would have
  started (``OneDraftWalk``); ``auto`` learns from them, and they count as
  its probes.
- ``set_source_paying(source, paying)``: ``auto`` says whether drafting from
  ``source`` pays now, so a drafter need not run that source just to choose
  between its sources.
- ``catch_up()``: deferred work (e.g. head forwards over accepted rows) done
  now, so that timing the next ``draft`` measures drafting alone.
- ``state`` / ``restore(history, arrays)``: arrays saved with a chat session
  and how to rebuild from them (``state`` runs deferred work first).
- ``take_deferred()`` / ``put_deferred(rows)``: deferred work handed over and
  back, so that a state kept in memory carries it instead of running it.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

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


def as_list(drafter, tokens) -> List[int]:
    """``drafter``'s draft from its ``draft_tokens`` as a list: a lazy one
    evaluated together with the logits and q it came with."""
    if isinstance(tokens, list):
        return tokens
    mx.eval(tokens, drafter.last_draft_logits, drafter.draft_probs)
    return tokens.tolist()


class Drafter:
    """Base class of the drafters; see the module docstring for the contract."""

    name = "custom"
    needs_hidden = False
    draft_probs: Optional[mx.array] = None

    def reset(self, prompt: Sequence[int], hidden: Optional[mx.array]):
        raise NotImplementedError

    def draft(self, k: int) -> List[int]:
        raise NotImplementedError

    def accept(self, tokens: Sequence[int], hidden: Optional[mx.array]):
        raise NotImplementedError

    def rows_read(self, n: int) -> int:
        """Of the hidden states of ``n`` rows given at once (a prompt), how
        many, the last ones, it reads; the others may be anything. All by
        default."""
        return n

    def set_sampling(self, choose):
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

    def hindsight(self) -> Dict[Optional[str], Tuple[int, int]]:
        """No first drafts judged in hindsight by default."""
        return {}

    def set_source_paying(self, source: str, paying: bool):
        """Whether drafting from ``source`` pays now; one source: nothing to do."""

    @property
    def state(self) -> List[mx.array]:
        return []

    def take_deferred(self) -> list:
        """The deferred work, handed over (the drafter no longer holds it);
        none by default."""
        return []

    def put_deferred(self, rows: list):
        """Hold ``rows`` (from :meth:`take_deferred`) as deferred work again."""
        if rows:
            raise ValueError(f"drafter {self.name!r} defers no work")

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]):
        raise NotImplementedError(f"drafter {self.name!r} cannot restore a session")


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
    """True for a :class:`Drafter` or any object with the three required methods."""
    return isinstance(obj, Drafter) or all(
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
